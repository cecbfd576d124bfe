// CPU kernel of tr_engine::recycle_update_: after a verify step, each tree token's matrix row <- the top-k token ids of
// the logits at its node. One pass over each logits row keeps the k best (value, id) pairs in a small sorted buffer;
// most values fail the threshold test, so a vector max over each chunk of 64 usually skips the chunk whole and the pass
// runs at memory speed. Rows run in parallel; a token met at several nodes is written once, from its last node.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "convert.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using tr_engine_cpu::to_float;

constexpr int64_t kChunk = 64;

// The k largest values of row[0..V) by (value descending, id ascending), ids written to out[0..k).
template <typename T>
void top_k_ids(const T* row, int64_t V, int64_t k, int64_t* out) {
  using Acc = decltype(to_float(row[0]));  // float, or double for double logits
  std::vector<Acc> best(k, -std::numeric_limits<Acc>::infinity());
  std::vector<int64_t> ids(k, -1);
  int64_t filled = 0;
  Acc threshold = -std::numeric_limits<Acc>::infinity();  // the k-th best value once `filled == k`
  auto insert = [&](Acc v, int64_t id) {
    // Only strictly better values enter a full buffer: ids arrive in increasing order, so ties keep the lower id.
    if (filled == k && !(v > threshold)) return;
    int64_t pos = filled < k ? filled++ : k - 1;
    while (pos > 0 && v > best[pos - 1]) {  // equal values stay behind the earlier (lower) id
      best[pos] = best[pos - 1];
      ids[pos] = ids[pos - 1];
      --pos;
    }
    best[pos] = v;
    ids[pos] = id;
    if (filled == k) threshold = best[k - 1];
  };
  int64_t j = 0;
  for (; j < V; j += kChunk) {
    const int64_t end = std::min(V, j + kChunk);
    if (filled == k) {
      Acc m = -std::numeric_limits<Acc>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t i = j; i < end; ++i) m = std::max(m, to_float(row[i]));
      if (!(m > threshold)) continue;  // nothing in this chunk can enter
    }
    for (int64_t i = j; i < end; ++i) insert(to_float(row[i]), i);
  }
  for (int64_t i = 0; i < k; ++i) out[i] = ids[i];
}

template <typename T>
void recycle_rows(int64_t* table, int64_t k, const int64_t* tokens, const bool* keep, const T* logits, int64_t rows,
                  int64_t V) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (keep[r]) top_k_ids(logits + r * V, V, k, table + tokens[r] * k);
  });
}

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
  switch (lg.scalar_type()) {
    case at::kFloat: recycle_rows(out, k, t, kp, lg.data_ptr<float>(), rows, V); break;
    case at::kBFloat16: recycle_rows(out, k, t, kp, lg.data_ptr<c10::BFloat16>(), rows, V); break;
    case at::kHalf: recycle_rows(out, k, t, kp, lg.data_ptr<c10::Half>(), rows, V); break;
    case at::kDouble: recycle_rows(out, k, t, kp, lg.data_ptr<double>(), rows, V); break;
    default: TORCH_CHECK(false, "recycle_update_: logits dtype ", lg.scalar_type(), " is not supported");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("recycle_update_", &recycle_update_cpu_); }
