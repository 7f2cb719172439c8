"""C++ source templates of the CPU backend (data, filled by ``fuser.codegen`` with strict substitution).

ABI of every CPU kernel (one ctypes signature for all):
``void name(int64_t numel, int64_t rank, const int64_t* sizes, const int64_t* strides,
void* const* ptrs, const double* scalars)``
``sizes``: the compressed map dims; ``strides``: ``rank`` strides (in elements) per strided input, in input
order; ``ptrs``: inputs then outputs; ``scalars``: the float arguments.
"""
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
LOOP_FLAT = Template(r"""#pragma omp parallel for schedule(static) if (numel >= ${parallel_threshold})
  for (int64_t i = 0; i < numel; ++i) {
${body}
  }""")

# strided inputs: one divmod walk over the outer dims per row of the innermost dim, not per element
LOOP_ROWS = Template(r"""  const int64_t inner = sizes[rank - 1], rows = numel / inner;
#pragma omp parallel for schedule(static) if (numel >= ${parallel_threshold})
  for (int64_t row = 0; row < rows; ++row) {
    int64_t ${bases};
    {
      int64_t r = row;
      for (int64_t d = rank - 2; d >= 0; --d) {
        const int64_t q = r / sizes[d], m = r - q * sizes[d];
        r = q;
${accumulate}
      }
    }
    for (int64_t j = 0; j < inner; ++j) {
      const int64_t i = row * inner + j;
${offsets}
${body}
    }
  }""")
