"""CUDA C++ source templates (data, filled by ``fuser.codegen`` with strict substitution).

Every kernel takes one by-value struct ``FzArgs`` (mirrored by a ctypes Structure in ``fuser.cuda.launch``):
the element count, the compressed map sizes, the strides of each strided input and then of each strided
output (``codegen.strided_operands``), a flag saying the 16-byte vector path may run, the data pointers
(inputs then outputs) and the float arguments.

NVRTC compiles these without any header: integer types, half/bfloat16 conversions (PTX ``cvt``) and the
helpers are defined here. The prelude is a template whose only device-specific pieces, the float16
conversions written in PTX and an optimization barrier written as an empty asm, are filled in below; ``fuser.cuda.host_prelude`` fills the same template with
host C++ so that the CI's CPU runs the rest of this text as it is (``fuser.cuda.emulate``).
"""
from string import Template

from ..c_helpers import HELPERS
from ..rng import PHILOX

MAX_DIMS = 8  # compressed map dims; more falls back


PRELUDE_TEMPLATE = Template(r"""
#define FZ_FN __device__ __forceinline__
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

struct __align__(2) fz_half { uint16_t x; };
struct __align__(2) fz_bf16 { uint16_t x; };

${half_load}__device__ __forceinline__ float fz_ld(fz_bf16 h) { return __int_as_float(((int)h.x) << 16); }
template <class T> __device__ __forceinline__ T fz_ld(T v) { return v; }

template <class S, class C> __device__ __forceinline__ S fz_st(C v) { return (S)v; }
${half_store}template <> __device__ __forceinline__ fz_bf16 fz_st<fz_bf16, float>(float f) {
  fz_bf16 h;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.x) : "f"(f));  // one instruction from Ampere on
#else
  unsigned int x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) { h.x = (uint16_t)((x >> 16) | 0x40u); return h; }
  h.x = (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
#endif
  return h;
}
// a bfloat16 element of a 32-bit word that holds two (the first in memory in the low half), widened by one shift or
// one mask: from the word's 16-bit halves sm_90 took two instructions for a high element
__device__ __forceinline__ float fz_word_bf16(unsigned int w, int hi) {
  return __uint_as_float(hi ? w & 0xffff0000u : w << 16);
}
// two floats rounded to float16 / bfloat16 into one 32-bit word, lo first in memory: one cvt.rn.{f16,bf16}x2.f32 from
// sm_80 on (its first operand goes to the high half), the same rounding as fz_st's two
template <class S> __device__ __forceinline__ unsigned int fz_pack2(float lo, float hi) {
  return (unsigned int)fz_st<S, float>(lo).x | ((unsigned int)fz_st<S, float>(hi).x << 16);
}
// the element of such a word: its low half (hi == 0) or its high half
template <class S> __device__ __forceinline__ S fz_word_half(unsigned int w, int hi) {
  S h; h.x = (uint16_t)(hi ? w >> 16 : w); return h;
}
#if __CUDA_ARCH__ >= 800
template <> __device__ __forceinline__ unsigned int fz_pack2<fz_bf16>(float lo, float hi) {
  unsigned int r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
template <> __device__ __forceinline__ unsigned int fz_pack2<fz_half>(float lo, float hi) {
  unsigned int r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
#endif

${fast_math}
${helpers}// CUDA eager's max/min of floats (clamp, relu, hardtanh too): of two zeros, max is +0 and min is -0, whatever
// their order (CPU eager keeps the first); NaN propagates
// (every case computed, then selected: no branches in a row kernel's accumulation)
__device__ __forceinline__ float fz_max(float a, float b) {
  const float m = a > b ? a : b, z = __float_as_uint(a) >> 31 ? b : a, r = a == b ? z : m;
  return (a != a || b != b) ? a + b : r;
}
__device__ __forceinline__ float fz_min(float a, float b) {
  const float m = a < b ? a : b, z = __float_as_uint(a) >> 31 ? a : b, r = a == b ? z : m;
  return (a != a || b != b) ? a + b : r;
}
__device__ __forceinline__ double fz_max(double a, double b) {
  return (a != a || b != b) ? a + b : a != b ? (a > b ? a : b) : (__double_as_longlong(a) < 0 ? b : a);
}
__device__ __forceinline__ double fz_min(double a, double b) {
  return (a != a || b != b) ? a + b : a != b ? (a < b ? a : b) : (__double_as_longlong(a) < 0 ? a : b);
}
// a reduction's max/min (fuser/rows/templates.py row_prelude): NaN propagates. One instruction from sm_80 on
// (max.NaN.f32) where fz_max takes seven with a select chain: the max of softmax's row was the longest step of its
// kernel's first pass. PTX defines max.NaN to order -0 below +0 and to give the canonical NaN, which is what fz_max
// gives on the GPU; the tests hold it to eager's values and NaNs only (eager's reductions' order decides a zero's
// sign). Other types and devices take fz_max/fz_min
template <class T> __device__ __forceinline__ T fz_max_nan(T a, T b) { return fz_max(a, b); }
template <class T> __device__ __forceinline__ T fz_min_nan(T a, T b) { return fz_min(a, b); }
#if __CUDA_ARCH__ >= 800
template <> __device__ __forceinline__ float fz_max_nan<float>(float a, float b) {
  float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
template <> __device__ __forceinline__ float fz_min_nan<float>(float a, float b) {
  float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
#endif
// CUDA eager's clamp with Scalar bounds (clamp, clamp_min, clamp_max, hardtanh): both bounds given and one NaN
// fills the result with NaN; otherwise a NaN input stays NaN and a NaN bound is ignored (fmaxf/fminf)
template <class T> __device__ __forceinline__ T fz_clamp_scalar(T x, T lo, T hi, bool has_lo, bool has_hi) {
  if (has_lo && has_hi && (lo != lo || hi != hi)) return lo != lo ? lo : hi;
  if (x != x) return x;
  if (has_lo && lo == lo) x = fz_max(x, lo);
  if (has_hi && hi == hi) x = fz_min(x, hi);
  return x;
}
// e^x where the result only meets 1 + e^x (the fast sigmoid, silu, tanh and GELU): x * log2(e) rounded as
// __expf rounds it, then one MUFU instruction (fz_ex2_ftz); a result below 2^-126 flushes to 0, which 1 + e^x
// cannot tell from its value
__device__ __forceinline__ float fz_exp_1p(float x) { return fz_ex2_ftz(x * 1.44269502f); }
// a / d for d >= 1 (or inf, NaN): both scaled by 1/16, so that the reciprocal of any finite d is a normal float
// and a quotient below 2^-126 keeps its value (sigmoid(-88) is 6e-39, which bfloat16 holds, and lgamma of it is
// 88, not inf: the CUDA fuzzer). Three instructions, no select: __fdividef's non-ftz form wraps its reciprocal
// in checks for subnormals, and gives 0 for divisors above 2^126
__device__ __forceinline__ float fz_div_ge1(float a, float d) { return (a * 0.0625f) * fz_rcp_ftz(d * 0.0625f); }
// tanh for results stored as float16/bfloat16: branch-free (a branch diverges on mixed-sign data), absolute
// error near 1e-7 like tanhf's, so 1 + tanh(x) keeps its accuracy where it cancels (GELU's negative tail)
__device__ __forceinline__ float fz_tanh_fast(float x) {
  const float ax = fabsf(x);
  // e >= 1; an overflow gives 1, and a reciprocal flushed below 2^-126 leaves 1 too; NaN stays NaN
  // (2 * ax * log2(e) and 1 - 2 * r written as one instruction each: 2 * ax and 2 * r are exact, so the values
  // are those of the plain expressions)
  const float big = fmaf(-2.f, fz_rcp_ftz(fz_ex2_ftz(ax * (2.f * 1.44269502f)) + 1.f), 1.f);
  const float small = ax * fmaf(-0.333333333f * ax, ax, 1.f);          // |x| < 1/16: relative error < 3e-6
  return copysignf(ax < 0.0625f ? small : big, x);
}
// fz_tanh_fast without its small-|x| form, where the result is only added to a constant of magnitude 1/2 or more
// (ops.OpDef.fast_offset): for |x| < 1/16 its error, near 1e-7, is absolute, which such a sum cannot tell from its
// own rounding; the same value as fz_tanh_fast elsewhere, in 6 instructions instead of 11
__device__ __forceinline__ float fz_tanh_offset(float x) {
  return copysignf(fmaf(-2.f, fz_rcp_ftz(fz_ex2_ftz(fabsf(x) * (2.f * 1.44269502f)) + 1.f), 1.f), x);
}
// n / d for 0 <= n < 2^31 from a magic number and shift computed on the host (fuser.cuda.launch.divider)
__device__ __forceinline__ int fz_div(int n, unsigned int magic, unsigned int shift) {
  return (int)((__umulhi((unsigned int)n, magic) + (unsigned int)n) >> shift);
}
__device__ __forceinline__ long long fz_div(long long n, unsigned int, unsigned int) { return n; }
// fz_div's magic number and shift for a divisor 1 <= d < 2^31, on the device (as fuser.cuda.launch.divider computes
// them on the host): the tiled path's tile counts, divided once per tile and known only in the kernel
__device__ __forceinline__ void fz_divider(unsigned int d, unsigned int& magic, unsigned int& shift) {
  shift = d > 1 ? 32 - __clz(d - 1) : 0;
  magic = (unsigned int)((((1ull << shift) - d) << 32) / d + 1);
}
template <class T> struct fz_limits;
template <> struct fz_limits<float> { static __device__ __forceinline__ float lowest() { return -__int_as_float(0x7f800000); } static __device__ __forceinline__ float highest() { return __int_as_float(0x7f800000); } };
template <> struct fz_limits<double> { static __device__ __forceinline__ double lowest() { return -__longlong_as_double(0x7ff0000000000000ll); } static __device__ __forceinline__ double highest() { return __longlong_as_double(0x7ff0000000000000ll); } };
template <> struct fz_limits<bool> { static __device__ __forceinline__ bool lowest() { return false; } static __device__ __forceinline__ bool highest() { return true; } };
template <> struct fz_limits<int8_t> { static __device__ __forceinline__ int8_t lowest() { return -128; } static __device__ __forceinline__ int8_t highest() { return 127; } };
template <> struct fz_limits<uint8_t> { static __device__ __forceinline__ uint8_t lowest() { return 0; } static __device__ __forceinline__ uint8_t highest() { return 255; } };
template <> struct fz_limits<int16_t> { static __device__ __forceinline__ int16_t lowest() { return -32768; } static __device__ __forceinline__ int16_t highest() { return 32767; } };
template <> struct fz_limits<int32_t> { static __device__ __forceinline__ int32_t lowest() { return -2147483647 - 1; } static __device__ __forceinline__ int32_t highest() { return 2147483647; } };
template <> struct fz_limits<int64_t> { static __device__ __forceinline__ int64_t lowest() { return -9223372036854775807ll - 1; } static __device__ __forceinline__ int64_t highest() { return 9223372036854775807ll; } };
#define FZ_INF_F __int_as_float(0x7f800000)
#define FZ_NAN_F __int_as_float(0x7fffffff)
#define FZ_INF_D __longlong_as_double(0x7ff0000000000000ll)
#define FZ_NAN_D __longlong_as_double(0x7fffffffffffffffll)
#define FZ_LOWEST(T) fz_limits<T>::lowest()
#define FZ_HIGHEST(T) fz_limits<T>::highest()
// NaN from the bits: ptxas took fabsf(x) >= -0.25f as true for a NaN x, and NaN-checked operands keep an
// ordered comparison right whatever it assumes (abs(hardswish(sinh(-3e38))) >= -0.25; the CUDA fuzzer)
__device__ __forceinline__ bool fz_isnan(float a) { return (__float_as_uint(a) & 0x7fffffffu) > 0x7f800000u; }
__device__ __forceinline__ bool fz_isnan(double a) {
  return ((unsigned long long)__double_as_longlong(a) & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
}
// integer abs that wraps as eager's (abs(INT32_MIN) is INT32_MIN) through a sign mask the optimizer cannot see:
// an abs.s32 result is taken as never negative by ptxas, and erfc(abs(INT32_MIN)) came out 0, not 2 (the fuzzer)
${opaque}__device__ __forceinline__ int fz_iabs(int a) {
  const int m = fz_opaque(a >> 31);
  return (int)(((unsigned)a ^ (unsigned)m) - (unsigned)m);
}
__device__ __forceinline__ long long fz_iabs(long long a) {
  const long long m = fz_opaque(a >> 63);
  return (long long)((FZ_U(a) ^ FZ_U(m)) - FZ_U(m));
}

// N elements of T moved together: 16-byte accesses (the compiler splits a 32-byte struct into two, both
// issued before either is used); alignment capped at 16, the widest access
template <class T, int N> struct __align__(sizeof(T) * N < 16 ? sizeof(T) * N : 16) fz_vec { T v[N]; };
// the tiled path's vector form (TILED_READY_VEC): whether an operand's runs of n elements along dim `unit` are whole
// vectors (stride 1 there, every other stride a multiple of n), and whether a pointer is aligned to `bytes`
template <class I> __device__ __forceinline__ bool fz_vec_strides(const I* st, int rank, int unit, int n) {
  bool ok = st[unit] == 1;
  for (int d = 0; d < rank; ++d) ok = ok && (d == unit || st[d] % n == 0);
  return ok;
}
__device__ __forceinline__ bool fz_aligned(const void* p, unsigned int bytes) { return (uint64_t)p % bytes == 0; }
""")

# float16 loads and stores: one PTX conversion each (round to nearest even; NaN stays NaN)
HALF_LOAD = r"""__device__ __forceinline__ float fz_ld(fz_half h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x)); return f;
}
"""
HALF_STORE = r"""template <> __device__ __forceinline__ fz_half fz_st<fz_half, float>(float f) {
  fz_half h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f)); return h;
}
"""
# a value the optimizer must take as unknown (an empty asm that "changes" it)
OPAQUE = r"""__device__ __forceinline__ int fz_opaque(int x) { asm("" : "+r"(x)); return x; }
__device__ __forceinline__ long long fz_opaque(long long x) { asm("" : "+l"(x)); return x; }
"""
# 2^x and 1/x as one MUFU instruction each (.ftz: subnormal operands and results are zeros). NVRTC's default
# (no -ftz) makes ptxas wrap ex2.approx and rcp.approx in a range check and two fixups each; the fast
# expressions only call them where a subnormal cannot change the result (fz_exp_1p, fz_div_ge1)
FAST_MATH = r"""__device__ __forceinline__ float fz_ex2_ftz(float x) {
  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
__device__ __forceinline__ float fz_rcp_ftz(float x) {
  float y; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
"""
PRELUDE = PRELUDE_TEMPLATE.substitute(half_load=HALF_LOAD, half_store=HALF_STORE, helpers=HELPERS, opaque=OPAQUE,
                                      fast_math=FAST_MATH)

# appended to the prelude when a kernel draws random numbers (rand_like)
RNG = "\n#define FZ_MULHI(a, b) __umulhi(a, b)\n" + PHILOX

KERNEL = Template(r"""// fuser CUDA kernel ${name}
${prelude}
typedef ${index_t} fz_index;
struct FzArgs {
  fz_index numel;
  fz_index sizes[${max_dims}];
  unsigned int magic[${max_dims}];  // sizes[d] as a multiply-and-shift divider (32-bit indexing)
  unsigned int shift[${max_dims}];
  fz_index strides[${n_strided_slots}][${max_dims}];
  int rank;
  int vec;
  int tile_dim;  // the tiled path's second dim (the strided inputs' fastest), or -1: no tiles
  void* ptrs[${n_ptrs}];
  double scalars[${n_scalar_slots}];
};

extern "C" __global__ void __launch_bounds__(${block_size}${min_blocks}) ${name}(const FzArgs args) {
  const fz_index numel = args.numel;
${params}
${hoisted}
  const fz_index step = (fz_index)blockDim.x * gridDim.x;
  fz_index first = (fz_index)blockIdx.x * blockDim.x + threadIdx.x;
${tiled_loop}${vector_loop}
  for (fz_index i = first; i < numel; i += step) {
${offsets}
${body}
  }
}
""")

# Only emitted when no input is generically strided; args.vec says pointers, row length and row starts suit
# whole vectors (fuser.executor.Geometry and the launcher check).
VECTOR_LOOP = Template(r"""  if (args.vec) {
    const fz_index nvec = numel / ${vec};
    for (fz_index v = first; v < nvec; v += step) {
      const fz_index base = v * ${vec};
${vloads}
${vdecls}
#pragma unroll
      for (int k = 0; k < ${vec}; ++k) {
${vbody}
      }
${vstores}
    }
    first = nvec * ${vec} + first;
  }""")

# Only emitted when some input is generically strided, every output is dense and the scalar form's tiles fit 48 KB
# (codegen.common.has_tiled_path); args.tile_dim >= 0 says the
# launcher chose it (fuser.executor.Geometry.tile_dim: a strided input's fastest dim, not the map's innermost).
# The map is cut into tiles of tile_a (along the innermost dim, a) x tile_b (along that dim, b), a tile per block and
# trip (codegen.tile_shape): the strided inputs are read along b into shared memory, then every tensor is read and
# written along a, so both sides of the transpose are coalesced. ${trip} is one tile's work, in one of two forms.
# Scalar form (TILED_TRIP, 64 x 32): an element per lane and access (a row of padding keeps both phases free of bank
# conflicts). A tile is 64 wide so that each thread has several loads in flight per phase. Measured on an H100 (GELU
# of a transposed view plus a contiguous residual, 16384 x 4096, float32 / float16 of the copy floor): 32 x 32 tiles
# in rolled loops 0.56 / 0.37; unrolled 0.76 / 0.41; 64 wide 0.74 / 0.45; with the operands loaded ahead (below)
# 0.93 / 0.63; 128 wide for 2-byte dtypes 0.55 (fewer blocks resident); 64 x 64 for 2-byte dtypes (a warp's stage
# reads covering whole 128-byte lines) 0.54 / 0.58 against 0.62 / 0.64 in the same run (64 registers a thread: half
# the occupancy). ncu on the float16 kernel: bound by instruction issue (78% of issue slots, DRAM at 47%); dividing
# the tile numbers by magic numbers (below) took it to 0.68 / 0.71 (bfloat16), 32 registers, 81% of issue slots:
# a warp moves 64 bytes of 2-byte elements per instruction. Vector form (TILED_TRIP_VEC, 2-byte staged inputs):
# 16-byte vectors on both sides, see there; it runs where TILED_READY_VEC allows it, the scalar form otherwise.
TILED_LOOP = Template(r"""  if (${condition}) {
    const int bd = args.tile_dim, ad = args.rank - 1;
    const fz_index sa = args.sizes[ad], sb = args.sizes[bd];
    constexpr int tile_a = ${tile_a}, tile_b = ${tile_b};
    const fz_index ta = (sa + tile_a - 1) / tile_a, tb = (sb + tile_b - 1) / tile_b;
    const fz_index n_tiles = numel / (sa * sb) * ta * tb;
${dividers}${setup}
${tiles}
    for (fz_index tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
      // (divisions by magic numbers where the index is 32 bits: a division is tens of instructions, and the 2-byte
      // dtypes' tiled kernels are bound by instruction issue)
      fz_index r = tile, q = ${div_ta};
      const fz_index a0 = (r - q * ta) * tile_a;
      r = q;
      q = ${div_tb};
      const fz_index b0 = (r - q * tb) * tile_b;
      r = q;
      // the tile's first element: its map index and each strided operand's offset
      fz_index lin = a0, dense_b = 1, ${bases};
      {
        fz_index dense = sa;
        for (int d = ad - 1; d >= 0; --d) {
          if (d == bd) {
            dense_b = dense;
            lin += b0 * dense;
          } else {
            q = ${div_d};
            const fz_index m = r - q * args.sizes[d];
            r = q;
            lin += m * dense;
${accumulate}
          }
          dense *= args.sizes[d];
        }
${corner}
      }
${trip}
      __syncthreads();  // the tiles are free for the next trip
    }
    return;
  }
""")

# the scalar form's constants: rows: blockDim.x / 32, a constant (the launcher's block size) so that the loops over a
# thread's elements of a tile unroll and their loads are in flight together (a rolled loop waits for each load in turn)
TILED_SETUP = Template(r"""    constexpr int rows = ${rows};
    const int lane = threadIdx.x % 32, row0 = threadIdx.x / 32;""")

# the scalar form's tile: the other tensor operands' elements of this thread first, into registers: with the stage's
# reads after them, every load of the tile is in flight before the first is used (loads inside the guarded bodies,
# branches around the whole element, waited for each other)
TILED_TRIP = Template(r"""${pre_decls}
#pragma unroll
      for (int it = 0; it < tile_b / rows; ++it) {
#pragma unroll
        for (int ja = 0; ja < tile_a; ja += 32) {
          const int e = row0 + it * rows, al = ja + lane, q = it * (tile_a / 32) + ja / 32;
          if (a0 + al < sa && b0 + e < sb) {
            const fz_index i = lin + e * dense_b + al;
${offsets}
${preload}
          }
        }
      }
${stage}
#pragma unroll
      for (int it = 0; it < tile_b / rows; ++it) {
#pragma unroll
        for (int ja = 0; ja < tile_a; ja += 32) {
          const int e = row0 + it * rows, al = ja + lane, q = it * (tile_a / 32) + ja / 32;
          if (a0 + al < sa && b0 + e < sb) {
            const fz_index i = lin + e * dense_b + al;
${body}
          }
        }
      }""")

# the scalar form's first phase for one strided input: its tile read along b (lanes) into shared memory, a row of
# the tile (its 32 elements along b) per warp and step
TILE_STAGE = Template(r"""#pragma unroll
      for (int it = 0; it < tile_a / rows; ++it) {
        const int e = row0 + it * rows;
        if (a0 + e < sa && b0 + lane < sb)
          ${tile}[e][lane] = fz_ld(t${k}[${base} + lane * args.strides[${j}][bd] + e * args.strides[${j}][ad]]);
      }""")

# Whether the vector form runs (the same in every thread): every operand moves in whole, aligned vectors of vw
# elements: both tiled sizes multiples of vw, a staged input with stride 1 along b and a row-strided one with stride
# 1 along a (their other strides multiples of vw), every pointer aligned to its vector. Otherwise (odd sizes, a view
# starting an element in, a step) the scalar form after it runs: one form's loops carry no branches of the other,
# and the registers of element-by-element loads (a 2-byte element in a 32-bit register each, all in flight) do not
# weigh on the vector form's occupancy (sm_90, a GELU: 72 registers with such loads beside the vectors, 40 without).
TILED_READY_VEC = Template(r"""  bool fz_vec_tiles = false;
  if (args.tile_dim >= 0) {
    const int bd = args.tile_dim, ad = args.rank - 1;
    fz_vec_tiles = args.sizes[ad] % ${vw} == 0 && args.sizes[bd] % ${vw} == 0${checks};
  }
""")

# the vector form's constants: vw, elements a vector (16 bytes: 8 of 2-byte elements, 4 of 4-byte ones); per, a
# thread's vectors of each tensor per tile
TILED_SETUP_VEC = Template(r"""    constexpr int vw = ${vw}, per = tile_a * tile_b / vw / ${block_size};""")

# The vector form's tile (a tile_b x tile_a shared tile of storage-type elements per staged input, b-major). Thread
# t's vectors are t, t + block, ... of the tile: along b (staging: the vectors of an a-row are consecutive threads)
# or along a (the dense side). With 2-byte elements a warp's stage reads cover 4 (tile_b 64) or 8 (tile_b 32) a-rows
# of 128 or 64 contiguous bytes, its dense accesses 4 b-rows of 128 bytes; with 4-byte elements (tile_b 32) 4 a-rows
# of 128 bytes and 2 b-rows of 256. Each stage vector is written to the tile as vw elements of one a-column; the
# tile's vw-element chunks along a are swizzled by b / vw (chunk ^ (b / vw)), so that those writes (a warp's lanes:
# 8 or 4 b-chunks c, 4 or 8 a in one chunk) fall in distinct banks, and so do the dense side's 16-byte reads of a
# b-row's chunks. Loads: every staged vector, then every other operand's, all in
# flight before the first is used. Sizes are multiples of vw (TILED_READY_VEC): a vector is all inside or all outside.
TILED_TRIP_VEC = Template(r"""${stage_loads}
${pre_decls}
#pragma unroll
      for (int it = 0; it < per; ++it) {
        const int q = threadIdx.x + it * ${block_size}, e = q / (tile_a / vw), c = q % (tile_a / vw);
        if (a0 + c * vw < sa && b0 + e < sb) {
          const fz_index i = lin + e * dense_b + c * vw;
${preload}
        }
      }
${stage_stores}
      __syncthreads();
#pragma unroll
      for (int it = 0; it < per; ++it) {
        const int q = threadIdx.x + it * ${block_size}, e = q / (tile_a / vw), c = q % (tile_a / vw);
        if (a0 + c * vw < sa && b0 + e < sb) {
          const fz_index i = lin + e * dense_b + c * vw;
${tile_reads}
${out_decls}
#pragma unroll
          for (int k = 0; k < vw; ++k) {
${body}
          }
${stores}
        }
      }""")

# the vector form's stage for one strided input (strides row ${j}, storage ${s}): its vectors along b into registers
TILE_STAGE_VEC = Template(r"""      fz_vec<${s}, vw> sv${k}[per];
#pragma unroll
      for (int it = 0; it < per; ++it) {
        const int q = threadIdx.x + it * ${block_size}, c = q % (tile_b / vw), e = q / (tile_b / vw);
        if (a0 + e < sa && b0 + c * vw < sb)
          sv${k}[it] = *reinterpret_cast<const fz_vec<${s}, vw>*>(
              t${k} + base${j} + e * args.strides[${j}][ad] + c * vw);
      }""")

# ... and from registers into its shared tile, element (b, a) at b * tile_a + a with a's chunks swizzled
TILE_STORE_VEC = Template(r"""#pragma unroll
      for (int it = 0; it < per; ++it) {
        const int q = threadIdx.x + it * ${block_size}, c = q % (tile_b / vw), e = q / (tile_b / vw);
        ${s}* at = fz_tile${k} + c * vw * tile_a + ((e / vw) ^ c) * vw + e % vw;
        if (a0 + e < sa && b0 + c * vw < sb) {
#pragma unroll
          for (int k = 0; k < vw; ++k) at[k * tile_a] = sv${k}[it].v[k];
        }
      }""")

# Offsets of the strided inputs at element ${index}. The vector path unrolls the walk over MAX_DIMS (a rolled
# loop cost 10-25% of the GELU row's speed on an H200); the per-element path keeps it rolled, which halves
# NVRTC's time for such kernels. ${fast}: what comes before the walk (the vector path's case of two dims).
OFFSETS = Template(r"""    fz_index ${decls};
${fast}    {
      fz_index r = ${index};
#pragma unroll ${unroll}
      for (int d = ${max_dims} - 1; d >= 0; --d) {
        if (d < args.rank) {
          // the outermost dim needs no division: what is left of the index is its coordinate
          const fz_index q = d == 0 ? 0 : ${divide};
          const fz_index m = r - q * args.sizes[d];
          r = q;
${accumulate}
        }
      }
    }""")

# The vector path's offsets where the map has two dims (rows and columns, the common case after compression: a
# bias, a row or column vector, a transposed or channels_last operand): one division, no walk over MAX_DIMS. Every
# branch of the walk is an instruction of each vector, and a GELU over float16 rows is bound by its instructions.
OFFSETS_2D = Template(r"""    if (args.rank == 2) {
      const fz_index r = ${index}, q = ${divide};
      const fz_index m = r - q * args.sizes[1];
${accumulate}
    } else
""")

# thread block clusters (sm_90): the primitives a kernel whose row spans the CTAs of a cluster uses, after the
# prelude (the host emulation swaps this text too: fuser/cuda/host_prelude.py's CLUSTER). fz_cluster_put writes a
# value into this CTA's shared slot ``p``; fz_cluster_get reads the slot at the same address in CTA ``rank`` of the
# cluster (distributed shared memory); fz_cluster_sync is the cluster-wide barrier (every thread of every CTA;
# release on arrival, acquire on wait: what a CTA put before it, every CTA gets after it).
CLUSTER = r"""// fuser: thread block clusters
__device__ __forceinline__ unsigned fz_cluster_rank() {
  unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
__device__ __forceinline__ void fz_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
template <class A> __device__ __forceinline__ void fz_cluster_put(A* p, A v) { *(volatile A*)p = v; }
template <class A> __device__ __forceinline__ A fz_cluster_get(const A* p, unsigned rank) {
  static_assert(sizeof(A) == 4 || sizeof(A) == 8, "cluster slots of 4 or 8 bytes");
  unsigned a = (unsigned)__cvta_generic_to_shared(p), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  A v;
  if (sizeof(A) == 4) {
    unsigned x; asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(x) : "r"(r) : "memory");
    memcpy(&v, &x, 4);
  } else {
    unsigned long long x; asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(x) : "r"(r) : "memory");
    memcpy(&v, &x, 8);
  }
  return v;
}
"""


# dynamic shared memory (a staged row kernel's, fuser/rows/templates.py's CUDA_STAGE: the launch gives its bytes) and
# copies into it from global memory that do not pass through registers (cp.async, sm_80 and later: a thread has
# as many in flight as it issues; before sm_80 plain copies), waited for by the issuing thread (fz_cp_wait); the host
# emulation swaps this for host_prelude.STAGE
STAGE = r"""// fuser: dynamic shared memory
__device__ __forceinline__ unsigned char* fz_dyn_smem() {
  extern __shared__ __align__(16) unsigned char fz_dsmem[];
  return fz_dsmem;
}
template <int B> __device__ __forceinline__ void fz_cp(void* dst, const void* src) {
  static_assert(B == 4 || B == 8 || B == 16, "copies of 4, 8 or 16 bytes");
#if __CUDA_ARCH__ >= 800
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  if (B == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(d), "l"(src), "n"(B) : "memory");
#else
  *reinterpret_cast<fz_vec<unsigned char, B>*>(dst) = *reinterpret_cast<const fz_vec<unsigned char, B>*>(src);
#endif
}
__device__ __forceinline__ void fz_cp_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
"""
