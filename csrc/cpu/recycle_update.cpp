// CPU kernel of tr_engine::recycle_update_: after a verify step, each tree token's matrix row <- the top-k token ids of
// the logits at its node; a token met at several nodes is written once, from its last node (decided here). The pass
// over each row of logits is the active CPU tier's (csrc/cpu/kernels/rows.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "tiers.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

void recycle_update_cpu_(at::Tensor& table, const at::Tensor& tokens, const at::Tensor& logits) {
  tr_engine::check_recycle_update_args(table, tokens, logits);
  const int64_t k = table.size(1), V = logits.size(1), rows = tokens.size(0);
  const auto tok = tokens.contiguous();
  const int64_t* t = tok.data_ptr<int64_t>();
  // The duplicate rule: a token's row is written from its last occurrence only (T is ~100, so T^2 is nothing).
  std::vector<char> keep(rows, 1);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(t[i] >= 0 && t[i] < V, "recycle_update_: tokens[", i, "] = ", t[i], " is outside [0, ", V, ")");
    for (int64_t j = i + 1; j < rows && keep[i]; ++j) keep[i] = t[j] != t[i];
  }
  const auto lg = logits.contiguous();
  tr_engine_cpu::top_k_rows(table.data_ptr<int64_t>(), k, t, reinterpret_cast<const bool*>(keep.data()), lg);
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("recycle_update_", &recycle_update_cpu_); }
