// The arithmetic of the CPU kernels' element types, without torch: every kernel computes in float (double for float64
// inputs), converting bf16 and f16 (types.h) as it goes. Conversions to the 16-bit types round to nearest even, as
// c10's do.
#pragma once

#include "types.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
// GCC 12's AVX-512 half-precision conversions start from a self-initialised `__Y` and warn at every use
// (-Wmaybe-uninitialized, in the header: GCC bug 105593, fixed in 13); silenced for the header alone.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace tr_engine_cpu {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// half -> float, exact: the hardware conversion where the tier has one, else the IEEE-754 definition (a normal
// number's exponent rebiased from 15 to 127; a subnormal m * 2^-24; infinities and NaNs keep their payload).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#elif defined(__aarch64__)
  __fp16 v;
  std::memcpy(&v, &h, sizeof v);
  return static_cast<float>(v);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));      // inf, NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));  // 127 - 15 = 112
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;            // 2^-24, exact
  return sign ? -magnitude : magnitude;
#endif
}

// float -> half, rounded to nearest even (overflow to infinity, NaN stays NaN).
inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__aarch64__)
  const __fp16 v = static_cast<__fp16>(f);
  uint16_t h;
  std::memcpy(&h, &v, sizeof h);
  return h;
#else
  const uint32_t bits = float_to_bits(f), sign = (bits >> 16) & 0x8000u, abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));  // NaN, kept quiet
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504: infinity
  if (abs >= 0x38800000u) {  // a normal half (>= 2^-14): drop 13 mantissa bits, round to nearest even
    const uint32_t rebiased = abs - 0x38000000u;  // exponent 127 -> 15
    return static_cast<uint16_t>(sign | ((rebiased + 0xFFFu + ((rebiased >> 13) & 1u)) >> 13));
  }
  // A subnormal half (or zero): m * 2^-24 with m = round(|f| * 2^24). The float addition of 0.5 (2^-1) rounds |f| to
  // a multiple of 2^-24 by the hardware's own round-to-nearest-even; what is left in the low mantissa bits is m.
  const float shifted = bits_to_float(abs) + 0.5f;
  return static_cast<uint16_t>(sign | (float_to_bits(shifted) - 0x3F000000u));
#endif
}

inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }
inline float to_float(bf16 v) { return bits_to_float(static_cast<uint32_t>(v.bits) << 16); }
inline float to_float(f16 v) { return half_to_float(v.bits); }

// float -> T, rounded to nearest even; for bf16 without branches, so that loops which round each element vectorise.
template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }
template <>
inline bf16 from_float<bf16>(float v) {
  const uint32_t bits = float_to_bits(v);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return bf16{static_cast<uint16_t>(v != v ? 0x7FC0u : rounded)};
}
template <>
inline f16 from_float<f16>(float v) { return f16{float_to_half(v)}; }

// a * b + c, fused (one rounding) where the tier has FMA instructions, else two roundings: std::fma without the
// instruction is a library call per element. It is what simd.h's mul_add computes, lane by lane, so a loop written
// with it rounds as the vector code beside it does (the kernels are built with -ffp-contract=off: no other multiply
// and add is ever fused). Each tier uses one of the two everywhere; tiers differ from each other in the last bits.
#if defined(__FMA__) || defined(__aarch64__)
inline float fmadd(float a, float b, float c) { return std::fma(a, b, c); }
inline double fmadd(double a, double b, double c) { return std::fma(a, b, c); }
#else
inline float fmadd(float a, float b, float c) { return a * b + c; }
inline double fmadd(double a, double b, double c) { return a * b + c; }
#endif

// round(x) to nearest even for |x| < 2^22, in two additions that vectorise on every tier (std::nearbyint is a
// library call without SSE4.1): adding 1.5 * 2^23 leaves no fraction bits, so the sum is rounded by the hardware.
inline float round_nearest(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (x + kMagic) - kMagic;
}

// 2^x for x clamped to [-126, 127], within 2 ulp, as branch-free arithmetic the compiler vectorises (std::exp2 is a
// scalar call). The range reduction is exact: x = n + r with n = round(x), |r| <= 1/2; 2^r = e^(r ln2) by its
// degree-6 Taylor polynomial (relative error < 2e-7); 2^n is written into the exponent bits.
inline float exp2_clamped(float x) {
  x = x < -126.0f ? -126.0f : (x > 127.0f ? 127.0f : x);  // keeps the exponent arithmetic below in range
  const float n = round_nearest(x);
  const float r = x - n;
  float p = 1.5403530e-4f;  // (ln 2)^6 / 6!
  p = fmadd(p, r, 1.3333558e-3f);
  p = fmadd(p, r, 9.6181291e-3f);
  p = fmadd(p, r, 5.5504109e-2f);
  p = fmadd(p, r, 2.4022651e-1f);
  p = fmadd(p, r, 6.9314718e-1f);  // ln 2
  p = fmadd(p, r, 1.0f);
  return p * bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace tr_engine_cpu
