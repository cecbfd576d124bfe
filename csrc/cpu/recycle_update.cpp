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
  const bool* kp = reinterpret_cast<const bool*>(keep.data());
  int64_t* out = table.data_ptr<int64_t>();
  using tr_engine_cpu::bf16;
  using tr_engine_cpu::f16;
  using tr_engine_cpu::kernels_for;
  using tr_engine_cpu::data;
  switch (lg.scalar_type()) {
    case at::kFloat: kernels_for<float>().top_k_rows(out, k, t, kp, data<float>(lg), rows, V); break;
    case at::kBFloat16: kernels_for<bf16>().top_k_rows(out, k, t, kp, data<bf16>(lg), rows, V); break;
    case at::kHalf: kernels_for<f16>().top_k_rows(out, k, t, kp, data<f16>(lg), rows, V); break;
    case at::kDouble: kernels_for<double>().top_k_rows(out, k, t, kp, data<double>(lg), rows, V); break;
    default: TORCH_CHECK(false, "recycle_update_: logits dtype ", lg.scalar_type(), " is not supported");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("recycle_update_", &recycle_update_cpu_); }
