"""C source shared by both backends' preludes: helpers with eager's semantics where C's own functions differ.
The generic ``fz_max``/``fz_min`` keep the first operand on a tie, which is CPU eager's rule for signed zeros
(``max(-0.0, +0.0)`` is -0.0); the CUDA prelude overloads them for floating types with CUDA eager's rule.
Each prelude defines ``FZ_FN`` (the function qualifiers) before including it; the Philox source of
``fuser/rng.py`` uses it too."""

HELPERS = r"""
// pow with a scalar exponent as eager's kernels on both devices: sqrt / 1/sqrt for 0.5 / -0.5 (they differ from
// pow at -inf and -0.0), products for 2, 3 and -2 (1 / (a * a) is 0 where a * a overflows, and pow(a, -2) is not:
// pow(rsqrt(1e-310), -2) is 1e-310 in pow, 0 in eager; the CUDA fuzzer)
FZ_FN float fz_pow_scalar(float a, float b) {
  return b == 0.5f ? sqrtf(a) : b == -0.5f ? 1.f / sqrtf(a) : b == 2.f ? a * a : b == 3.f ? a * a * a
       : b == -2.f ? 1.f / (a * a) : powf(a, b);
}
FZ_FN double fz_pow_scalar(double a, double b) {
  return b == 0.5 ? sqrt(a) : b == -0.5 ? 1.0 / sqrt(a) : b == 2.0 ? a * a : b == 3.0 ? a * a * a
       : b == -2.0 ? 1.0 / (a * a) : pow(a, b);
}
// integer arithmetic in unsigned 64 bits, cast back: it wraps as eager's does, and no signed overflow (undefined,
// and NVRTC takes it as impossible: max(x, x + 5) was x + 5 at INT64_MAX; the CUDA fuzzer) is left in a kernel
#define FZ_U(x) ((unsigned long long)(x))
// integer negation that wraps as eager's (-INT64_MIN is INT64_MIN), without signed overflow, which NVRTC takes as
// impossible (abs(INT64_MIN) came out positive; the fuzzer)
template <class T> FZ_FN T fz_neg(T a) { return (T)(0ull - (unsigned long long)a); }
// max/min as eager's (NaN-propagating); each prelude adds its device's rule for a tie of signed zeros
template <class T> FZ_FN T fz_max(T a, T b) { return (a != a || a >= b) ? a : b; }
template <class T> FZ_FN T fz_min(T a, T b) { return (a != a || a <= b) ? a : b; }
FZ_FN float fz_remainder(float a, float b) {
  float m = fmodf(a, b);
  if (m != 0.f && ((b < 0.f) != (m < 0.f))) m += b;
  return m;
}
FZ_FN double fz_remainder(double a, double b) {
  double m = fmod(a, b);
  if (m != 0.0 && ((b < 0.0) != (m < 0.0))) m += b;
  return m;
}
"""
