// Two passes over rows of logits: greedy decoding's choice (argmax_rows) and recycling's top-k (recycle_update_).
//
// argmax: PyTorch's CPU argmax carries an index with every element (~0.9 ns each, 85 us for a row of SmolLM2's
// 49,152 logits). Here: one pass for the max (and whether a NaN is there), a max with no index to carry, which the
// compiler vectorises; then the first element equal to it, found a chunk at a time. The same index as torch.argmax,
// bit for bit: the first maximum, a NaN counting as the largest value (the first NaN wins).
//
// top-k: one pass over each row keeps the k best (value, id) pairs in a small sorted buffer; most values fail the
// threshold test, so a vector max over each chunk of 64 usually skips the chunk whole and the pass runs at memory
// speed. Rows run in parallel.
#pragma once

#include "numbers.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace tr_engine_cpu {

template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  T best = -std::numeric_limits<T>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < V; ++i) {
    best = x[i] > best ? x[i] : best;
    nan |= x[i] != x[i];
  }
  constexpr int64_t kChunk = 64;
  for (int64_t c = 0; c < V; c += kChunk) {  // the first chunk holding the answer, then the answer inside it
    const int64_t end = c + kChunk < V ? c + kChunk : V;
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = c; i < end; ++i) hit |= nan ? x[i] != x[i] : x[i] == best;
    if (hit)
      for (int64_t i = c; i < end; ++i)
        if (nan ? x[i] != x[i] : x[i] == best) return i;
  }
  return 0;  // (not reached: V >= 1, and every row holds its max or its NaN)
}

template <typename T>
void argmax_rows(const T* x, int64_t rows, int64_t V, int64_t* out) {
  // a thread gets at least ~64K logits: one row of a big vocabulary, several of a small one
  parallel_for(0, rows, (65536 + V - 1) / V, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(x + r * V, V);
  });
}

// The k largest values of row[0..V) by (value descending, id ascending), ids written to out[0..k).
template <typename T>
void top_k_ids(const T* row, int64_t V, int64_t k, int64_t* out) {
  using Acc = decltype(to_float(row[0]));  // float, or double for double logits
  constexpr int64_t kChunk = 64;
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
  for (int64_t j = 0; j < V; j += kChunk) {
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
void top_k_rows(int64_t* table, int64_t k, const int64_t* tokens, const bool* keep, const T* logits, int64_t rows,
                int64_t V) {
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (keep[r]) top_k_ids(logits + r * V, V, k, table + tokens[r] * k);
  });
}

}  // namespace tr_engine_cpu
