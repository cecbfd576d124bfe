// pack_linear's layout in plain C++, for the programs that drive a tier library without torch (tests/kernel_harness.cpp,
// bench/native_rows.cpp): wp[b, j, i, e] = w[32 b + i, P j + e] for w [N, K], zeros past N and K (P = 2 for bf16, 1
// otherwise). The op itself packs in csrc/cpu/packed_linear.cpp, on torch's threads.
#pragma once

#include "api.h"
#include "numbers.h"

#include <cstdint>
#include <vector>

namespace tr_engine_cpu {

template <typename T>
std::vector<T> pack_weights(const std::vector<T>& w, int64_t N, int64_t K, int64_t P) {
  const int64_t blocks = (N + kPackBlock - 1) / kPackBlock, groups = (K + P - 1) / P;
  std::vector<T> wp(blocks * groups * kPackBlock * P, from_float<T>(0.f));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      wp[((n / kPackBlock * groups + k / P) * kPackBlock + n % kPackBlock) * P + k % P] = w[n * K + k];
  return wp;
}

}  // namespace tr_engine_cpu
