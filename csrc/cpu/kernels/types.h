// The 16-bit element types of the CPU kernels: storage only (bit for bit c10::BFloat16 and c10::Half, which the op
// library casts to them), converted to and from float by numbers.h.
#pragma once

#include <cstdint>

namespace tr_engine_cpu {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

}  // namespace tr_engine_cpu
