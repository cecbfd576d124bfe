// CPU kernel of tr_engine::compact_kv_: after a tree verify, move the accepted tokens' K/V of every layer into
// contiguous cache slots. Each (layer, k|v, head) row is independent: gather its n source slots into a buffer, then
// write them to the destination range (so overlapping source and destination ranges are safe).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../op_checks.h"

#include <cstring>
#include <vector>

namespace {

void compact_kv_cpu_(at::Tensor& cache, const at::Tensor& src_slots, int64_t dst_start) {
  tr_engine::check_compact_kv_args(cache, src_slots, dst_start);
  const int64_t S = cache.size(3), n = src_slots.numel();
  const auto src = src_slots.contiguous();
  const int64_t* s = src.data_ptr<int64_t>();
  bool identity = true;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < S, "compact_kv_: src_slots[", i, "] = ", s[i], " is outside [0, ", S, ")");
    identity = identity && s[i] == dst_start + i;
  }
  if (n == 0 || identity) return;

  const int64_t rows = cache.numel() / (S * cache.size(4));
  const int64_t slot_bytes = cache.size(4) * cache.element_size();
  char* base = static_cast<char*>(cache.data_ptr());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> buffer(n * slot_bytes);
    for (int64_t r = begin; r < end; ++r) {
      char* row = base + r * S * slot_bytes;
      for (int64_t i = 0; i < n; ++i) std::memcpy(buffer.data() + i * slot_bytes, row + s[i] * slot_bytes, slot_bytes);
      std::memcpy(row + dst_start * slot_bytes, buffer.data(), n * slot_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("compact_kv_", &compact_kv_cpu_); }
