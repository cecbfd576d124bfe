// Element conversions shared by the CPU kernels: every kernel computes in float (double for float64 inputs).
// bf16 -> float is a 16-bit shift, which the compiler vectorises inside the kernels' loops.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tr_engine_cpu {

inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> T, rounded to nearest even: what static_cast<T> gives, written without branches for bf16 so that loops
// which round each element vectorise (c10's conversion tests for NaN with a branch).
template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

// 2^x for x clamped to [-126, 127], within 2 ulp, as branch-free arithmetic the compiler vectorises (std::exp2 is a
// scalar call). The range reduction is exact: x = n + r with n = round(x), |r| <= 1/2; 2^r = e^(r ln2) by its
// degree-6 Taylor polynomial (relative error < 2e-7); 2^n is written into the exponent bits.
inline float exp2_clamped(float x) {
  x = std::min(std::max(x, -126.0f), 127.0f);  // keeps the exponent arithmetic below in range
  const float n = std::nearbyint(x);
  const float r = x - n;
  float p = 1.5403530e-4f;  // (ln 2)^6 / 6!
  p = std::fma(p, r, 1.3333558e-3f);
  p = std::fma(p, r, 9.6181291e-3f);
  p = std::fma(p, r, 5.5504109e-2f);
  p = std::fma(p, r, 2.4022651e-1f);
  p = std::fma(p, r, 6.9314718e-1f);  // ln 2
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace tr_engine_cpu
