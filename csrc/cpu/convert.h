// Element conversions shared by the CPU kernels: every kernel computes in float (double for float64 inputs).
// bf16 -> float is a 16-bit shift, which the compiler vectorises inside the kernels' loops.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

}  // namespace tr_engine_cpu
