// CPU kernel of tr_engine::argmax_rows: x.argmax(dim=-1) for float32 and float64 logits, the same index bit for bit
// (the first maximum; a NaN counts as the largest value, the first NaN wins), for greedy decoding's choice.
//
// Why a kernel: PyTorch's CPU argmax carries an index with every element (~0.9 ns each here, 85 us for a row of
// SmolLM2's 49,152 logits), and the chunked max-then-argmax that sampling.greedy built from PyTorch ops took nine
// small ops, each one a dispatch that, right after a step has streamed the model's weights through the caches, costs
// tens of microseconds (~0.15 ms a plain step). Here: one pass for the max (and whether a NaN is there), a max with no
// index to carry, which the compiler vectorises; then the first element equal to it, found a chunk at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../op_checks.h"

#include <cstdint>
#include <limits>

namespace {

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

at::Tensor argmax_rows_cpu(const at::Tensor& x) {
  tr_engine::check_argmax_rows_args(x);
  const auto xc = x.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  auto out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* p = xc.data_ptr<T>();
    // a thread gets at least ~64K logits: one row of a big vocabulary, several of a small one
    at::parallel_for(0, rows, (65536 + V - 1) / V, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(p + r * V, V);
    });
  };
  if (x.scalar_type() == at::kDouble)
    run(static_cast<double*>(nullptr));
  else
    run(static_cast<float*>(nullptr));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("argmax_rows", &argmax_rows_cpu); }
