// CPU kernel of tr_engine::top_k_rows: each row's k largest logits' ids, best first, ties to the lower id, by the
// pass recycle_update_ makes over a row (the active CPU tier's top_k_rows, csrc/cpu/kernels/rows.h), each row into
// its own row of the output.
//
// Why a kernel: a greedy verify under tensor parallelism merges each rank's top-k of its columns (Llama.top_k); in
// PyTorch ops (parallel.stable_topk: torch.topk, then the ties' fix-up and two sorts) that took 0.8 ms for 16 rows of
// a 2-rank shard of SmolLM2's vocabulary (24,576 columns, bf16) and 1.6 ms for a whole row set, against 0.05 and
// 0.07 ms here (an Intel Xeon, 2 threads).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "tiers.h"

#include <cstdint>
#include <numeric>
#include <vector>

namespace {

at::Tensor top_k_rows_cpu(const at::Tensor& x, int64_t k) {
  tr_engine::check_top_k_rows_args(x, k);
  const auto xc = x.contiguous();
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, k}, x.options().dtype(at::kLong));
  std::vector<int64_t> row_ids(rows);  // row r's ids go to the output's row r
  std::iota(row_ids.begin(), row_ids.end(), 0);
  const std::vector<char> every(rows, 1);
  tr_engine_cpu::top_k_rows(out.data_ptr<int64_t>(), k, row_ids.data(), reinterpret_cast<const bool*>(every.data()),
                            xc);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("top_k_rows", &top_k_rows_cpu); }
