"""C++ source templates of the CPU backend (data, filled by ``fuser.codegen`` with strict substitution).

ABI of every CPU kernel (one ctypes signature for all):
``void name(int64_t numel, int64_t rank, const int64_t* sizes, const int64_t* strides,
void* const* ptrs, const double* scalars)``
``sizes``: the compressed map dims; ``strides``: ``rank`` strides (in elements) per strided input, in input
order; ``ptrs``: inputs then outputs; ``scalars``: the float arguments.

Two kinds of kernel: scalar loops over the C prelude (``KERNEL``), and vector loops over ATen's
``at::vec::Vectorized`` (``VECTOR_KERNEL``), which include ``VECTOR_HEADER`` (precompiled once by
``fuser.cpu.compiler``) and keep a scalar loop for each row's tail.
"""
import re
from string import Template

from ..c_helpers import HELPERS
from ..rng import PHILOX

PRELUDE = r"""
#define FZ_FN static inline
// C headers only: they parse in a fraction of <cmath>'s time, and compile time is most of a CPU kernel's
// first call
#include <stdint.h>
#include <string.h>
#include <math.h>

struct fz_half { uint16_t x; };
struct fz_bf16 { uint16_t x; };

static inline float fz_ld(fz_half h) {
  uint32_t sign = (uint32_t)(h.x & 0x8000u) << 16;
  uint32_t exp = (h.x >> 10) & 0x1fu, mant = h.x & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: normalize into a float
      exp = 113;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f; memcpy(&f, &bits, 4); return f;
}
static inline float fz_ld(fz_bf16 h) {
  uint32_t bits = (uint32_t)h.x << 16; float f; memcpy(&f, &bits, 4); return f;
}
template <class T> static inline T fz_ld(T v) { return v; }

template <class S, class C> static inline S fz_st(C v) { return (S)v; }
template <> inline fz_half fz_st<fz_half, float>(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7fffffffu;
  fz_half h;
  if (a > 0x7f800000u) { h.x = sign | 0x7e00u; return h; }        // NaN stays NaN
  if (a >= 0x477ff000u) { h.x = sign | 0x7c00u; return h; }       // rounds to inf
  if (a < 0x38800000u) {                                          // half subnormal or zero
    float af; memcpy(&af, &a, 4);
    h.x = sign | (uint16_t)nearbyintf(af * 16777216.0f);      // exact scaling, round half to even
    return h;
  }
  uint32_t e = a - 0x38000000u;
  h.x = sign | (uint16_t)((e + 0xfffu + ((e >> 13) & 1u)) >> 13); // round half to even
  return h;
}
template <> inline fz_bf16 fz_st<fz_bf16, float>(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  fz_bf16 h;
  if ((x & 0x7fffffffu) > 0x7f800000u) { h.x = (uint16_t)((x >> 16) | 0x40u); return h; }
  h.x = (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  return h;
}

""" + HELPERS + r"""#define FZ_INF_F __builtin_inff()
#define FZ_NAN_F __builtin_nanf("")
#define FZ_INF_D __builtin_inf()
#define FZ_NAN_D __builtin_nan("")
// a missing clamp bound: -inf/+inf for floating types (NaN and infinities pass unchanged), else the limits
template <class T> struct fz_limits {
  static inline T lowest() { return (T)((T)-1 < (T)0 ? (T)1 << (sizeof(T) * 8 - 1) : 0); }
  static inline T highest() { return (T)~lowest(); }
};
template <> struct fz_limits<bool> { static inline bool lowest() { return false; } static inline bool highest() { return true; } };
template <> struct fz_limits<float> { static inline float lowest() { return -FZ_INF_F; } static inline float highest() { return FZ_INF_F; } };
template <> struct fz_limits<double> { static inline double lowest() { return -FZ_INF_D; } static inline double highest() { return FZ_INF_D; } };
#define FZ_LOWEST(T) fz_limits<T>::lowest()
#define FZ_HIGHEST(T) fz_limits<T>::highest()

// Loops and regions split across OpenMP threads only where `parallel`: a false omp `if` clause still enters
// libgomp for a team of one (about 0.3 us a call, more than a small kernel's work). A body is a lambda inlined
// into both forms (FZ_BODY).
#define FZ_BODY __attribute__((always_inline))
template <class F> static inline void fz_for(bool parallel, int64_t n, const F& body) {
  if (parallel) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n; ++t) body(t);
  } else {
    for (int64_t t = 0; t < n; ++t) body(t);
  }
}
// a parallel region, body(thread, threads), or one thread's run of it, body(0, 1): the body splits its loop by
// those numbers itself (fuser/rows/templates.py's CPU_SHARE_FOR), not by an orphaned `omp for`, which a call from
// inside a user's OpenMP region would bind to that region's team
extern "C" int omp_get_thread_num(void);
extern "C" int omp_get_num_threads(void);
template <class F> static inline void fz_region(bool parallel, const F& body) {
  if (parallel) {
#pragma omp parallel
    body((int64_t)omp_get_thread_num(), (int64_t)omp_get_num_threads());
  } else {
    body((int64_t)0, (int64_t)1);
  }
}
"""

# appended to the prelude when a kernel draws random numbers (rand_like)
RNG = "#define FZ_MULHI(a, b) ((unsigned int)(((unsigned long long)(a) * (b)) >> 32))\n" + PHILOX
KERNEL = Template(r"""// fuser CPU kernel ${name}
${prelude}
extern "C" void ${name}(int64_t numel, int64_t rank, const int64_t* sizes, const int64_t* strides,
                        void* const* ptrs, const double* scalars) {
  (void)rank; (void)sizes; (void)strides; (void)scalars;
${params}
${hoisted}
${loop}
}
""")

# every input dense or a broadcast scalar: element i of the map is element i of each tensor
LOOP_FLAT = Template(r"""  fz_for(numel >= ${parallel_threshold}, numel, [&](int64_t i) FZ_BODY {
${body}
  });""")

# the offsets of a row's first element: one divmod walk over the outer dims
ROW_BASES = r"""    int64_t ${bases};
    {
      int64_t r = row;
      for (int64_t d = rank - 2; d >= 0; --d) {
        const int64_t q = r / sizes[d], m = r - q * sizes[d];
        r = q;
${accumulate}
      }
    }
"""

# strided inputs: one divmod walk over the outer dims per row of the innermost dim, not per element
LOOP_ROWS = Template(r"""  const int64_t inner = sizes[rank - 1], rows = numel / inner;
  fz_for(numel >= ${parallel_threshold}, rows, [&](int64_t row) FZ_BODY {
""" + ROW_BASES + r"""    for (int64_t j = 0; j < inner; ++j) {
      const int64_t i = row * inner + j;
${offsets}
${body}
    }
  });""")

# ------------------------------------------------------------------------------------------ the vector path

VECTOR_HEADER_NAME = "fuser_cpu_vec.h"
VECTOR_INCLUDE = f'#include "{VECTOR_HEADER_NAME}"'

# What VECTOR_HEADER overloads for fz_vf and fz_vd: a scalar expression of the op table that calls only these
# (besides arithmetic, its operands and constants) compiles on vectors unchanged (fuser.codegen checks it).
VECTOR_FUNCTIONS = frozenset("""
    fabsf fabs acosf acos asinf asin atanf atan ceilf ceil cosf cos coshf cosh expf exp expm1f expm1 erff erf
    erfcf erfc floorf floor truncf trunc lgammaf lgamma logf log log10f log10 log1pf log1p log2f log2
    nearbyintf nearbyint sinf sin sinhf sinh sqrtf sqrt tanf tan tanhf tanh atan2f atan2 fmodf fmod powf pow
    fmaf fma fz_max fz_min fz_remainder fz_pow_scalar fz_vsel fz_vround fz_vuniform
""".split())

# ops whose float32 results eager computes with MKL's VML (at::vml, contiguous float32), by their VML function: the
# vector path calls the same function on a loop trip's vectors where a probe finds it gives eager's bits
# (fuser.cpu.vml). Those where VML is as fast as SLEEF's 1-ulp functions on a trip of 64 floats or faster (2-core
# Xeon, AVX-512, one thread, ns an element SLEEF / VML): tanh 1.85 / 0.71, atan 1.18-1.27 / 0.69, erfc 4.50 / 1.06,
# log 0.66 / 0.63, log10 0.67-0.69 / 0.66, log2 0.71-1.12 / 0.67-0.99, asin 0.89-0.92 / 0.72-0.81, acos 1.01-1.10 /
# 0.83, tan 1.19-1.30 / 0.89-1.20. Not exp (0.42 / 0.62-0.64), sin (0.37 / 0.71-0.80), cos (0.41-0.42 / 0.82-1.04),
# erf (0.87-1.26 / 0.97-1.75) or sqrt (one instruction).
VML_FUNCTIONS = {"tanh": "vmsTanh", "atan": "vmsAtan", "erfc": "vmsErfc", "log": "vmsLn", "log10": "vmsLog10",
                 "log2": "vmsLog2", "asin": "vmsAsin", "acos": "vmsAcos", "tan": "vmsTan"}

# calls that cost tens of simple ops (libm's or SLEEF's): they weigh in the threshold of splitting a kernel across
# threads (fuser.codegen.CPU_PARALLEL_WORK)
EXPENSIVE_CALL = re.compile(r"\b(?:" + "|".join("""
    expf? expm1f? logf? log10f? log1pf? log2f? sinf? cosf? tanf? tanhf? sinhf? coshf? asinf? acosf? atanf? atan2f?
    erff? erfcf? lgammaf? powf? fmodf? fz_remainder fz_pow_scalar fz_uniform_[fd] fz_vuniform
""".split()) + r")\s*\(")

VECTOR_HEADER = r"""// fuser CPU vector header: ATen's at::vec::Vectorized, whose transcendental functions are the
// SLEEF ones eager's vector loops call, and the scalar prelude. The C math functions and fuser's helpers are overloaded
// for vectors (fz_vf: floats, fz_vd: doubles), so an op's scalar expression compiles on vectors unchanged.
#ifndef FUSER_CPU_VEC_H
#define FUSER_CPU_VEC_H
#include <ATen/cpu/vec/vec.h>
""" + PRELUDE + r"""
typedef at::vec::Vectorized<float> fz_vf;
typedef at::vec::Vectorized<double> fz_vd;
#define FZ_VFN static inline

// comparisons with a scalar on either side (at::vec takes scalars in + - * / only): lanes of all-one bits
#define FZ_VCMP(V, S, op) \
  FZ_VFN V operator op(const V& a, S b) { return a op V(b); } \
  FZ_VFN V operator op(S a, const V& b) { return V(a) op b; }
#define FZ_VCMPS(V, S) FZ_VCMP(V, S, <) FZ_VCMP(V, S, <=) FZ_VCMP(V, S, >) FZ_VCMP(V, S, >=) \
  FZ_VCMP(V, S, ==) FZ_VCMP(V, S, !=)
FZ_VCMPS(fz_vf, float)
FZ_VCMPS(fz_vd, double)
// arithmetic with a scalar as non-template overloads: a float constant converts to a double vector's lanes
#define FZ_VARITH(V, S, op) FZ_VCMP(V, S, op)
#define FZ_VARITHS(V, S) FZ_VARITH(V, S, +) FZ_VARITH(V, S, -) FZ_VARITH(V, S, *) FZ_VARITH(V, S, /)
FZ_VARITHS(fz_vf, float)
FZ_VARITHS(fz_vd, double)

// both spellings of each C function for both vector types, so one vector expression serves both families
#define FZ_V1(fn, fnf, method) \
  FZ_VFN fz_vf fn(const fz_vf& a) { return a.method(); } FZ_VFN fz_vd fn(const fz_vd& a) { return a.method(); } \
  FZ_VFN fz_vf fnf(const fz_vf& a) { return a.method(); } FZ_VFN fz_vd fnf(const fz_vd& a) { return a.method(); }
#define FZ_V2(fn, fnf, method) \
  FZ_VFN fz_vf fn(const fz_vf& a, const fz_vf& b) { return a.method(b); } \
  FZ_VFN fz_vd fn(const fz_vd& a, const fz_vd& b) { return a.method(b); } \
  FZ_VFN fz_vf fnf(const fz_vf& a, const fz_vf& b) { return a.method(b); } \
  FZ_VFN fz_vd fnf(const fz_vd& a, const fz_vd& b) { return a.method(b); }
FZ_V1(fabs, fabsf, abs) FZ_V1(acos, acosf, acos) FZ_V1(asin, asinf, asin) FZ_V1(atan, atanf, atan)
FZ_V1(ceil, ceilf, ceil) FZ_V1(cos, cosf, cos) FZ_V1(cosh, coshf, cosh) FZ_V1(exp, expf, exp)
FZ_V1(expm1, expm1f, expm1) FZ_V1(erfc, erfcf, erfc) FZ_V1(floor, floorf, floor) FZ_V1(trunc, truncf, trunc)
FZ_V1(lgamma, lgammaf, lgamma) FZ_V1(log, logf, log) FZ_V1(log10, log10f, log10) FZ_V1(log1p, log1pf, log1p)
FZ_V1(log2, log2f, log2) FZ_V1(nearbyint, nearbyintf, round) FZ_V1(sin, sinf, sin) FZ_V1(sinh, sinhf, sinh)
FZ_V1(sqrt, sqrtf, sqrt) FZ_V1(tan, tanf, tan) FZ_V1(tanh, tanhf, tanh)
FZ_V2(atan2, atan2f, atan2) FZ_V2(fmod, fmodf, fmod) FZ_V2(pow, powf, pow)
// a softmax's exp(x - max) (fuser.codegen.cpu_vector.ROW_EXP_ORIGINS): at::vec's exp_u20 on float vectors, NaN lanes
// kept NaN (exp_u20 clamps its input with a min that turns NaN into 88.72, whose exp is inf: a row holding +inf,
// whose x - max is NaN there, summed to inf and gave 0 where eager gives NaN)
FZ_VFN fz_vf fz_exp_row(const fz_vf& a) { return fz_vf::blendv(a.exp_u20(), a, a != a); }
// erf: at::vec's float erf is an approximation (1.5e-7 absolute error: 1e-3 relative near 0); SLEEF's is 1 ulp
#if defined(CPU_CAPABILITY_AVX512)
#define FZ_SLEEF_ERFF Sleef_erff16_u10
#else
#define FZ_SLEEF_ERFF Sleef_erff8_u10
#endif
FZ_VFN fz_vf erff(const fz_vf& a) { return fz_vf(FZ_SLEEF_ERFF(a)); }
FZ_VFN fz_vf erf(const fz_vf& a) { return erff(a); }
FZ_VFN fz_vd erf(const fz_vd& a) { return a.erf(); }
FZ_VFN fz_vd erff(const fz_vd& a) { return a.erf(); }
// an op of C float vectors in one call of MKL's VML (libtorch_cpu exports it), in the mode eager's at::vml calls it
// with (VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE), so the results are eager's bits; only kernels of a process
// where the function gives eager's bits call it (fuser.cpu.vml)
#define FZ_VML(op, mkl) \
  extern "C" void mkl(int n, const float* a, float* r, long long mode); \
  template <int C> FZ_VFN void fz_vml_##op##f(const fz_vf (&a)[C], fz_vf (&r)[C]) { \
    constexpr int W = fz_vf::size(); \
    alignas(64) float in[C * W], out[C * W]; \
    for (int c = 0; c < C; ++c) a[c].store(in + c * W); \
    mkl(C * W, in, out, 0x140102LL); \
    for (int c = 0; c < C; ++c) r[c] = fz_vf::loadu(out + c * W); \
  }
""" + "".join(f"FZ_VML({op}, {fn})\n" for op, fn in VML_FUNCTIONS.items()) + r"""// lane 0; whether every lane of a vector is x, known when the kernel compiles (a broadcast constant after inlining)
template <class R, size_t... K> FZ_VFN bool fz_known_lanes(const R& r, double x, std::index_sequence<K...>) {
  return __builtin_constant_p(((r[K] == x) && ...)) && ((r[K] == x) && ...);
}
#if defined(CPU_CAPABILITY_AVX512)
FZ_VFN float fz_vfirst(const fz_vf& v) { return _mm512_cvtss_f32(v); }
FZ_VFN double fz_vfirst(const fz_vd& v) { return _mm512_cvtsd_f64(v); }
FZ_VFN bool fz_vknown(const fz_vf& v, double x) { return fz_known_lanes(__m512(v), x, std::make_index_sequence<16>()); }
FZ_VFN bool fz_vknown(const fz_vd& v, double x) { return fz_known_lanes(__m512d(v), x, std::make_index_sequence<8>()); }
#else
FZ_VFN float fz_vfirst(const fz_vf& v) { return _mm256_cvtss_f32(v); }
FZ_VFN double fz_vfirst(const fz_vd& v) { return _mm256_cvtsd_f64(v); }
FZ_VFN bool fz_vknown(const fz_vf& v, double x) { return fz_known_lanes(__m256(v), x, std::make_index_sequence<8>()); }
FZ_VFN bool fz_vknown(const fz_vd& v, double x) { return fz_known_lanes(__m256d(v), x, std::make_index_sequence<4>()); }
#endif
// fma(1, b, c) is b + c and fma(-1, b, c) is c - b exactly (add and sub with alpha 1): an add's latency, not an
// fma's, where the chain of a kernel's ops is what takes the time
template <class V> FZ_VFN V fz_vfma(const V& a, const V& b, const V& c) {
  return fz_vknown(a, 1) ? c + b : fz_vknown(a, -1) ? c - b : at::vec::fmadd(a, b, c);
}
FZ_VFN fz_vf fmaf(const fz_vf& a, const fz_vf& b, const fz_vf& c) { return fz_vfma(a, b, c); }
FZ_VFN fz_vf fma(const fz_vf& a, const fz_vf& b, const fz_vf& c) { return fz_vfma(a, b, c); }
FZ_VFN fz_vd fma(const fz_vd& a, const fz_vd& b, const fz_vd& c) { return fz_vfma(a, b, c); }
FZ_VFN fz_vd fmaf(const fz_vd& a, const fz_vd& b, const fz_vd& c) { return fz_vfma(a, b, c); }

// c ? t : f, lane by lane (c: a comparison's mask)
template <class V> FZ_VFN V fz_vsel(const V& c, const V& t, const V& f) { return V::blendv(f, t, c); }
// the scalar helpers' semantics exactly: NaN-propagating, the first operand on a tie (-0.0 vs +0.0)
template <class V> FZ_VFN V fz_vmax(const V& a, const V& b) { return fz_vsel((a != a) | (a >= b), a, b); }
template <class V> FZ_VFN V fz_vmin(const V& a, const V& b) { return fz_vsel((a != a) | (a <= b), a, b); }
FZ_VFN fz_vf fz_max(const fz_vf& a, const fz_vf& b) { return fz_vmax(a, b); }
FZ_VFN fz_vd fz_max(const fz_vd& a, const fz_vd& b) { return fz_vmax(a, b); }
FZ_VFN fz_vf fz_min(const fz_vf& a, const fz_vf& b) { return fz_vmin(a, b); }
FZ_VFN fz_vd fz_min(const fz_vd& a, const fz_vd& b) { return fz_vmin(a, b); }
template <class V> FZ_VFN V fz_vremainder(const V& a, const V& b) {
  const V m = a.fmod(b), zero(0);
  return fz_vsel((m != zero) & ((b < zero) ^ (m < zero)), m + b, m);
}
FZ_VFN fz_vf fz_remainder(const fz_vf& a, const fz_vf& b) { return fz_vremainder(a, b); }
FZ_VFN fz_vd fz_remainder(const fz_vd& a, const fz_vd& b) { return fz_vremainder(a, b); }
// eager's CPU kernel takes these exponents apart: 2 and 3 as products, -1 and -2 as reciprocals, +-0.5 as roots
// (b is a Scalar's broadcast: one test of its first lane, folded away for a constant)
template <class V> FZ_VFN V fz_vpow_scalar(const V& a, const V& b) {
  const auto e = fz_vfirst(b);
  return e == 2 ? a * a : e == 3 ? a * a * a : e == 0.5 ? a.sqrt() : e == -0.5 ? V(1) / a.sqrt()
       : e == -1 ? V(1) / a : e == -2 ? V(1) / (a * a) : a.pow(b);
}
FZ_VFN fz_vf fz_pow_scalar(const fz_vf& a, const fz_vf& b) { return fz_vpow_scalar(a, b); }
FZ_VFN fz_vd fz_pow_scalar(const fz_vd& a, const fz_vd& b) { return fz_vpow_scalar(a, b); }

// one vector of elements from memory and back, converting float16/bfloat16 (fz_half/fz_bf16 have c10's layout)
FZ_VFN fz_vf fz_vload(const float* p) { return fz_vf::loadu(p); }
FZ_VFN fz_vd fz_vload(const double* p) { return fz_vd::loadu(p); }
FZ_VFN fz_vf fz_vload(const fz_bf16* p) {
  fz_vf v; at::vec::load_fp32_from_bf16(reinterpret_cast<const c10::BFloat16*>(p), v); return v;
}
FZ_VFN fz_vf fz_vload(const fz_half* p) {
  fz_vf v; at::vec::load_fp32_from_fp16(reinterpret_cast<const c10::Half*>(p), v); return v;
}
FZ_VFN void fz_vstore(float* p, const fz_vf& v) { v.store(p); }
FZ_VFN void fz_vstore(double* p, const fz_vd& v) { v.store(p); }
#if defined(CPU_CAPABILITY_AVX512)
FZ_VFN void fz_vstore(fz_bf16* p, const fz_vf& v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_bf16(__m512(v)));
}
FZ_VFN void fz_vstore(fz_half* p, const fz_vf& v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_fp16(__m512(v)));
}
#else
FZ_VFN void fz_vstore(fz_bf16* p, const fz_vf& v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_bf16(__m256(v)));
}
FZ_VFN void fz_vstore(fz_half* p, const fz_vf& v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_fp16(__m256(v)));
}
#endif
// a vector rounded to storage type S and back (what a scalar fz_ld(fz_st<S>(x)) does to each element)
template <class S, class V> FZ_VFN V fz_vround(const V& v) {
  S tmp[V::size()];
  fz_vstore(tmp, v);
  return fz_vload(tmp);
}
template <> inline fz_vf fz_vround<float, fz_vf>(const fz_vf& v) { return v; }
template <> inline fz_vd fz_vround<double, fz_vd>(const fz_vd& v) { return v; }
// elements `stride` apart (a strided operand's innermost dim)
template <class S> FZ_VFN auto fz_vgather(const S* p, int64_t stride) -> decltype(fz_vload(p)) {
  S tmp[decltype(fz_vload(p))::size()];
  for (int k = 0; k < decltype(fz_vload(p))::size(); ++k) tmp[k] = p[k * stride];
  return fz_vload(tmp);
}
#if defined(CPU_CAPABILITY_AVX512)
// float32 elements through the gather instruction, where the offsets fit its 32-bit indices
FZ_VFN fz_vf fz_vgather(const float* p, int64_t stride) {
  if (stride > 0 && stride <= 0x7fffffff / 16) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(stride)));
    return _mm512_i32gather_ps(idx, p, 4);
  }
  float tmp[16];
  for (int k = 0; k < 16; ++k) tmp[k] = p[k * stride];
  return fz_vf::loadu(tmp);
}
#elif defined(CPU_CAPABILITY_AVX2)
FZ_VFN fz_vf fz_vgather(const float* p, int64_t stride) {
  if (stride > 0 && stride <= 0x7fffffff / 8) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32(static_cast<int>(stride)));
    return _mm256_i32gather_ps(p, idx, 4);
  }
  float tmp[8];
  for (int k = 0; k < 8; ++k) tmp[k] = p[k * stride];
  return fz_vf::loadu(tmp);
}
#endif
template <class S, class V> FZ_VFN void fz_vscatter(S* p, int64_t stride, const V& v) {
  S tmp[V::size()];
  fz_vstore(tmp, v);
  for (int k = 0; k < V::size(); ++k) p[k * stride] = tmp[k];
}
// the first n (< a vector) of them: a row's tail as one partial vector, its other lanes 0 and never stored
template <class S> FZ_VFN auto fz_vgather_n(const S* p, int64_t stride, int64_t n) -> decltype(fz_vload(p)) {
  S tmp[decltype(fz_vload(p))::size()] = {};
  for (int64_t k = 0; k < n; ++k) tmp[k] = p[k * stride];
  return fz_vload(tmp);
}
template <class S, class V> FZ_VFN void fz_vscatter_n(S* p, int64_t stride, const V& v, int64_t n) {
  S tmp[V::size()];
  fz_vstore(tmp, v);
  for (int64_t k = 0; k < n; ++k) p[k * stride] = tmp[k];
}

// a W x W block (W: the vector's lanes) of an operand that steps by 1 along the map's rows and by `ld` along its
// inner dim, transposed into `dst` in the compute type (row m: the block's elements of row m): each source line read
// whole as a vector, W a block, then transposed in registers, where a gather per vector touched W lines (and W
// pages) for each of W rows
template <class S, class T> FZ_VFN void fz_transpose_any(const S* src, int64_t ld, T* dst) {
  using V = decltype(fz_vload(src));
  constexpr int W = V::size();
  T tmp[W * W];
  for (int c = 0; c < W; ++c) fz_vload(src + c * ld).store(tmp + c * W);
  for (int m = 0; m < W; ++m)
    for (int c = 0; c < W; ++c) dst[m * W + c] = tmp[c * W + m];
}
template <class S> FZ_VFN void fz_transpose(const S* src, int64_t ld, double* dst) { fz_transpose_any(src, ld, dst); }
#if defined(CPU_CAPABILITY_AVX512)
// 16 x 16: pairs of rows interleaved by element, then by element pair, then 128-bit lanes twice
template <class S> FZ_VFN void fz_transpose(const S* src, int64_t ld, float* dst) {
  __m512 r[16], t[16];
  for (int c = 0; c < 16; ++c) r[c] = __m512(fz_vload(src + c * ld));
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * k + 1]), d = _mm512_castps_pd(t[4 * k + 3]);
    r[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_f32x4(r[k], r[k + 4], 0x88);
    t[k + 4] = _mm512_shuffle_f32x4(r[k], r[k + 4], 0xdd);
    t[k + 8] = _mm512_shuffle_f32x4(r[k + 8], r[k + 12], 0x88);
    t[k + 12] = _mm512_shuffle_f32x4(r[k + 8], r[k + 12], 0xdd);
  }
  for (int k = 0; k < 8; ++k) {
    _mm512_storeu_ps(dst + k * 16, _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88));
    _mm512_storeu_ps(dst + (k + 8) * 16, _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd));
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// 8 x 8: pairs of rows interleaved by element, then by element pair, then 128-bit lanes
template <class S> FZ_VFN void fz_transpose(const S* src, int64_t ld, float* dst) {
  __m256 r[8], t[8];
  for (int c = 0; c < 8; ++c) r[c] = __m256(fz_vload(src + c * ld));
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    r[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    r[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xee);
    r[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    r[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xee);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(dst + k * 8, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
    _mm256_storeu_ps(dst + (k + 4) * 8, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
  }
}
#else
template <class S> FZ_VFN void fz_transpose(const S* src, int64_t ld, float* dst) { fz_transpose_any(src, ld, dst); }
#endif

// bools on the vector path are masks: lanes of all-one bits (what comparisons give) or zero
template <class V> FZ_VFN V fz_vmask_value(const V& m) { return m & V(1); }  // a bool as 1 or 0
template <class V> FZ_VFN V fz_vload_mask(const bool* p, int64_t stride) {
  typename V::value_type tmp[V::size()];
  for (int k = 0; k < V::size(); ++k) tmp[k] = p[k * stride] ? 1 : 0;
  return V::loadu(tmp) != V(0);
}
template <class V> FZ_VFN void fz_vstore_mask(bool* p, int64_t stride, const V& m) {
  typename V::value_type tmp[V::size()];
  fz_vmask_value(m).store(tmp);
  for (int k = 0; k < V::size(); ++k) p[k * stride] = tmp[k] != 0;
}
template <class V> FZ_VFN V fz_vload_mask_n(const bool* p, int64_t stride, int64_t n) {
  typename V::value_type tmp[V::size()] = {};
  for (int64_t k = 0; k < n; ++k) tmp[k] = p[k * stride] ? 1 : 0;
  return V::loadu(tmp) != V(0);
}
template <class V> FZ_VFN void fz_vstore_mask_n(bool* p, int64_t stride, const V& m, int64_t n) {
  typename V::value_type tmp[V::size()];
  fz_vmask_value(m).store(tmp);
  for (int64_t k = 0; k < n; ++k) p[k * stride] = tmp[k] != 0;
}

// rand_like on vectors: the scalar fz_philox_at's numbers (fuser/rng.py) for a vector of elements at once
#if defined(CPU_CAPABILITY_AVX512)
typedef __m512i fz_vu32;
FZ_VFN fz_vu32 fz_vset1(unsigned int k) { return _mm512_set1_epi32((int)k); }
FZ_VFN fz_vu32 fz_vxor(fz_vu32 a, fz_vu32 b) { return _mm512_xor_si512(a, b); }
FZ_VFN fz_vu32 fz_vmullo(fz_vu32 x, unsigned int k) { return _mm512_mullo_epi32(x, fz_vset1(k)); }
FZ_VFN fz_vu32 fz_vmulhi(fz_vu32 x, unsigned int k) {  // even lanes' products, then odd lanes'
  const fz_vu32 even = _mm512_srli_epi64(_mm512_mul_epu32(x, fz_vset1(k)), 32);
  return _mm512_mask_blend_epi32(0xAAAA, even, _mm512_mul_epu32(_mm512_srli_epi64(x, 32), fz_vset1(k)));
}
#else
typedef __m256i fz_vu32;
FZ_VFN fz_vu32 fz_vset1(unsigned int k) { return _mm256_set1_epi32((int)k); }
FZ_VFN fz_vu32 fz_vxor(fz_vu32 a, fz_vu32 b) { return _mm256_xor_si256(a, b); }
FZ_VFN fz_vu32 fz_vmullo(fz_vu32 x, unsigned int k) { return _mm256_mullo_epi32(x, fz_vset1(k)); }
FZ_VFN fz_vu32 fz_vmulhi(fz_vu32 x, unsigned int k) {
  const fz_vu32 even = _mm256_srli_epi64(_mm256_mul_epu32(x, fz_vset1(k)), 32);
  return _mm256_blend_epi32(even, _mm256_mul_epu32(_mm256_srli_epi64(x, 32), fz_vset1(k)), 0xAA);
}
#endif
#define FZ_VU32_LANES ((int)(sizeof(fz_vu32) / 4))
// blocks b, b + 1, ... of random op r (a lane each): their four Philox words, c[w] holding word w of each block
FZ_VFN void fz_vphilox_at(fz_vu32 c[4], const unsigned int* st, unsigned int r, unsigned long long b) {
  unsigned int w0[FZ_VU32_LANES], w1[FZ_VU32_LANES];
  for (int k = 0; k < FZ_VU32_LANES; ++k) {
    w0[k] = (unsigned int)(b + k); w1[k] = (unsigned int)((b + k) >> 32) | (r << 24);
  }
  fz_vu32 c0, c1, c2 = fz_vset1(st[2]), c3 = fz_vset1(st[3]);
  memcpy(&c0, w0, sizeof(c0)); memcpy(&c1, w1, sizeof(c1));
  unsigned int k0 = st[0], k1 = st[1];
  for (int round = 0; round < 10; ++round) {
    const fz_vu32 hi0 = fz_vmulhi(c0, 0xD2511F53u), lo0 = fz_vmullo(c0, 0xD2511F53u);
    const fz_vu32 hi1 = fz_vmulhi(c2, 0xCD9E8D57u), lo1 = fz_vmullo(c2, 0xCD9E8D57u);
    c0 = fz_vxor(fz_vxor(hi1, c1), fz_vset1(k0)); c2 = fz_vxor(fz_vxor(hi0, c3), fz_vset1(k1));
    c1 = lo1; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  c[0] = c0; c[1] = c1; c[2] = c2; c[3] = c3;
}
// uniform on [0, 1) as fz_uniform_f / fz_uniform_d (the vector type chooses): elements i, i + 1, ... from the
// blocks that hold them (4 elements a block, 8 for `bits` <= 16, 2 in double; a vector's elements span at most a few
// lanes' blocks)
FZ_VFN fz_vf fz_vuniform(const fz_vf&, const unsigned int* st, unsigned int r, unsigned long long i, int bits) {
  const unsigned int h = bits <= 16 ? 1u : 0u;  // log2 of the elements a word
  const unsigned int per_block = 4u << h;
  fz_vu32 c[4];
  fz_vphilox_at(c, st, r, i >> (2u + h));
  unsigned int w[4][FZ_VU32_LANES];
  float u[fz_vf::size()];
  memcpy(w, c, sizeof(w));
  for (int k = 0; k < fz_vf::size(); ++k) {
    const unsigned int e = (unsigned int)(i & (per_block - 1u)) + k;  // from the first lane's block
    const unsigned int word = w[(e >> h) & 3u][e / per_block] << ((e & h) * 16u);
    u[k] = (float)(word >> (32 - bits)) * (1.0f / (float)(1u << bits));
  }
  return fz_vf::loadu(u);
}
FZ_VFN fz_vd fz_vuniform(const fz_vd&, const unsigned int* st, unsigned int r, unsigned long long i, int) {
  fz_vu32 c[4];
  fz_vphilox_at(c, st, r, i >> 1);
  unsigned int w[4][FZ_VU32_LANES];
  double u[fz_vd::size()];
  memcpy(w, c, sizeof(w));
  for (int k = 0; k < fz_vd::size(); ++k) {
    const unsigned int e = (unsigned int)(i & 1u) + k, j = (e & 1u) * 2u;
    u[k] = (double)(((unsigned long long)w[j][e >> 1] << 21) ^ (w[j + 1][e >> 1] >> 11)) * (1.0 / 9007199254740992.0);
  }
  return fz_vd::loadu(u);
}
#endif
"""

VECTOR_KERNEL = Template(r"""// fuser CPU kernel ${name} (vector loops over at::vec and their tails)
${include}
${rng}
extern "C" void ${name}(int64_t numel, int64_t rank, const int64_t* sizes, const int64_t* strides,
                        void* const* ptrs, const double* scalars) {
  (void)rank; (void)sizes; (void)strides; (void)scalars;
  typedef ${vtype} fz_v;
  const int64_t W = fz_v::size();
  (void)W;
${params}
${hoisted}
${loop}
}
""")

# every input dense or a broadcast scalar: trips of ${copies} vectors split across threads, then single vectors
# and the tail
VECTOR_LOOP_FLAT = Template(r"""  const int64_t trip = ${copies} * W, trips = numel / trip;
  fz_for(numel >= ${parallel_threshold}, trips, [&](int64_t t) FZ_BODY {
    const int64_t i = t * trip;
${wide}
  });
  int64_t i0 = trips * trip;
  for (; i0 + W <= numel; i0 += W) {
    const int64_t i = i0;
${vbody}
  }
${tail}""")

# one task's elements j0..j1 of a row: trips of ${copies} vectors, single vectors, the tail
ROW_TRIPS = r"""    int64_t j = ${jstart};
    for (; j + ${copies} * W <= j1; j += ${copies} * W) {
      const int64_t i = row * inner + j;
${offsets}
${wide}
    }
    for (; j + W <= j1; j += W) {
      const int64_t i = row * inner + j;
${offsets}
${vbody}
    }
${tail}
"""

# the last elements (fewer than a vector): a scalar loop over the op table's scalar expressions, or, where the body
# calls a transcendental function (its scalar form a libm call per element), one partial vector
FLAT_TAIL = Template(r"""  for (int64_t i = i0; i < numel; ++i) {
${body}
  }""")
FLAT_TAIL_PARTIAL = Template(r"""  if (i0 < numel) {
    const int64_t i = i0, n = numel - i0;
${nbody}
  }""")
ROW_TAIL = Template(r"""    for (; j < j1; ++j) {
      const int64_t i = row * inner + j;
${offsets}
${body}
    }""")
ROW_TAIL_PARTIAL = Template(r"""    if (j < j1) {
      const int64_t i = row * inner + j, n = j1 - j;
${offsets}
${nbody}
    }""")

# an operand gathered or scattered along the inner dim (a transposed one): tasks of ${tile_rows} rows by up to
# ${chunk} elements, row after row, so that the cache lines a gathered operand brings in for one row serve the
# next ones (a transposed tensor's next row is its next element); otherwise as VECTOR_LOOP_ROWS. ${blocks}: where
# the gathered inputs step by 1 along the rows (a transposed tensor), the task's first rows in blocks of W rows by W
# elements (TRANSPOSE_BLOCKS), each gathered input's block transposed through a local buffer; rows < rdone then
# start at jrem, past the blocks
VECTOR_LOOP_TILES = Template(r"""  const int64_t inner = sizes[rank - 1], rows = numel / inner;
  const int64_t chunks = (inner + ${chunk} - 1) / ${chunk}, tiles = (rows + ${tile_rows} - 1) / ${tile_rows};
${block_setup}
  fz_for(numel >= ${parallel_threshold}, tiles * chunks, [&](int64_t task) FZ_BODY {
    const int64_t tile = task / chunks, j0 = (task - tile * chunks) * ${chunk};
    const int64_t j1 = inner - j0 < ${chunk} ? inner : j0 + ${chunk};
    const int64_t row1 = rows - tile * ${tile_rows} < ${tile_rows} ? rows : (tile + 1) * ${tile_rows};
    int64_t rdone = tile * ${tile_rows};
    const int64_t jrem = j0 + (j1 - j0) / W * W;
    (void)jrem;
${blocks}
    for (int64_t row = tile * ${tile_rows}; row < row1; ++row) {
""" + ROW_BASES + ROW_TRIPS + r"""    }
  });""")

# the blocks of VECTOR_LOOP_TILES: W rows in one run of the map's second-innermost dim (so that each operand's
# offsets step by their stride along it), ${copies} rows a trip
TRANSPOSE_BLOCKS = Template(r"""    static_assert(fz_v::size() % ${copies} == 0, "a block's rows come in trips");
    if (fz_blocks) {
      for (; rdone + W <= row1 && rdone % sizes[rank - 2] + W <= sizes[rank - 2]; rdone += W) {
        const int64_t row = rdone;
""" + ROW_BASES + r"""        for (int64_t jb = j0; jb < jrem; jb += W) {
${transposes}
          for (int64_t mb = 0; mb < W; mb += ${copies}) {
            const int64_t i = (rdone + mb) * inner + jb;
${offsets}
${body}
          }
        }
      }
    }""")

# strided operands: tasks of up to ${chunk} elements of one row (rows can be few and long), each trips of
# ${copies} vectors, then single vectors and the tail; one divmod walk over the outer dims per task
VECTOR_LOOP_ROWS = Template(r"""  const int64_t inner = sizes[rank - 1], rows = numel / inner;
  const int64_t chunks = (inner + ${chunk} - 1) / ${chunk};
  fz_for(numel >= ${parallel_threshold}, rows * chunks, [&](int64_t task) FZ_BODY {
    const int64_t row = task / chunks, j0 = (task - row * chunks) * ${chunk};
    const int64_t j1 = inner - j0 < ${chunk} ? inner : j0 + ${chunk};
""" + ROW_BASES + ROW_TRIPS + r"""  });""")
