// CPU kernel of tr_engine::skinny_linear: y = x @ w.T for the few rows of a decode step, where reading w from memory
// is the whole cost. Each weight row is streamed once, front to back, into dot products whose accumulators live in
// registers (MKL's sgemv reaches about half this machine's bandwidth on these shapes; bench/results/kernels_cpu.md).
// Plain loops: with -O3, -fopenmp-simd and the host's vector ISA the compiler vectorises the reductions
// (bf16 -> float is a 16-bit shift).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "convert.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 16;  // the schema's limit on T (rows of x)
constexpr int64_t kLanes = 64;    // partial sums per dot product: four 16-float vectors

using tr_engine_cpu::to_float;

// y[t, n] = sum_k x[t, k] * w[n, k]. Threads split the outputs n; each weight row is read from memory once, in order
// (one sequential stream per thread, which the hardware prefetcher follows best), and stays in L1 while every row
// of x is reduced against it.
template <typename T>
void skinny_linear_kernel(const T* x, const T* w, T* y, int64_t rows, int64_t K, int64_t N) {
  std::vector<float> xf(rows * K);
  for (int64_t i = 0; i < rows * K; ++i) xf[i] = to_float(x[i]);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* wn = w + n * K;
      __builtin_prefetch(wn + 4 * K);  // a few rows ahead of the stream
      for (int64_t t = 0; t < rows; ++t) {
        const float* xt = xf.data() + t * K;
        // kLanes independent partial sums (several vector registers) hide the latency of the multiply-adds.
        float acc[kLanes] = {};
        int64_t k = 0;
        for (; k + kLanes <= K; k += kLanes)
#pragma omp simd
          for (int64_t j = 0; j < kLanes; ++j) acc[j] += xt[k + j] * to_float(wn[k + j]);
        float s = 0.f;
        for (; k < K; ++k) s += xt[k] * to_float(wn[k]);
        for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
        y[t * N + n] = static_cast<T>(s);
      }
    }
  });
}

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "skinny_linear: x must be [T, K] and w [N, K], got ", x.dim(), " and ",
              w.dim(), " dims");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_linear: x is [", x.size(0), ", ", x.size(1), "] but w is [", w.size(0),
              ", ", w.size(1), "]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "skinny_linear: x has ", x.size(0), " rows; 1..", kMaxRows,
              " are supported (use a regular matmul for more)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "skinny_linear: x is ", x.scalar_type(), " but w is ",
              w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "skinny_linear: w must be contiguous [N, K]");
  const auto xc = x.contiguous();
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  const int64_t rows = x.size(0), K = x.size(1), N = w.size(0);
  switch (x.scalar_type()) {
    case at::kFloat:
      skinny_linear_kernel(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, K, N);
      break;
    case at::kBFloat16:
      skinny_linear_kernel(xc.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                           rows, K, N);
      break;
    case at::kHalf:
      skinny_linear_kernel(xc.data_ptr<c10::Half>(), w.data_ptr<c10::Half>(), y.data_ptr<c10::Half>(), rows, K, N);
      break;
    default:
      TORCH_CHECK(false, "skinny_linear: dtype ", x.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }
