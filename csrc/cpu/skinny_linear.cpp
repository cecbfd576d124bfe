// CPU kernel of tr_engine::skinny_linear: y = x @ w.T for the 1-16 rows of a decode step or a small draft tree, where
// reading w from memory is the whole cost of one row, and must stay most of it for 16. Each weight row is streamed once,
// front to back, and every row of x is reduced against it while it sits in L1 (stock sgemv and oneDNN's few-row GEMM
// fall well short of the memory bandwidth on these shapes: bench/results/kernels_cpu.md). With AVX-512 (the build is -march=native): register tiles of 4 x rows by 4 weight
// rows, fp32 FMAs, or for bf16 the AVX512-BF16 dot product (two bf16 products per fp32 lane, summed exactly into
// fp32). Elsewhere, plain loops the compiler vectorises.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "convert.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// The tiled kernels: y[t, n] over tiles of TR x rows by NR weight rows, K in vector steps (the tail masked to zeros).
// Each tile's TR*NR accumulators stay in zmm registers; the weight rows of a tile are re-read from L1 for each group
// of x rows, and from memory once.
constexpr int kTileN = 4;

template <int TR, int NR>
inline void tile_f32(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  __m512 acc[TR][NR];
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + j * K + k);
    for (int i = 0; i < TR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int TR, int NR>
inline void tile_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t K, int64_t N) {
  __m512 acc[TR][NR];
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {  // 32 bf16 = 16 pairs, one per fp32 lane
    const __mmask32 m = K - k >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (K - k)) - 1);
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * K + k);
    for (int i = 0; i < TR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = c10::BFloat16(_mm512_reduce_add_ps(acc[i][j]));
}
#endif

// Threads split the weight rows in tiles of kTileN; within a tile, x's rows go 4 at a time.
template <typename T, typename Tile>
void tiled(const T* x, const T* w, T* y, int64_t rows, int64_t K, int64_t N, Tile tile) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kTileN;
      const int nr = static_cast<int>(std::min<int64_t>(kTileN, N - n));
      for (int64_t t = 0; t < rows; t += 4) tile(x + t * K, w + n * K, y + t * N + n, std::min<int64_t>(4, rows - t), nr);
    }
  });
}

// Dispatch a runtime (rows, weight rows) pair to the compile-time tile shapes.
#define TR_ENGINE_TILE_DISPATCH(FN, x, w, y, tr, nr, K, N)                     \
  switch ((tr) * 8 + (nr)) {                                                  \
    case 1 * 8 + 4: FN<1, 4>(x, w, y, K, N); break;                           \
    case 2 * 8 + 4: FN<2, 4>(x, w, y, K, N); break;                           \
    case 3 * 8 + 4: FN<3, 4>(x, w, y, K, N); break;                           \
    case 4 * 8 + 4: FN<4, 4>(x, w, y, K, N); break;                           \
    default:  /* the last, partial tile of weight rows: one row at a time */  \
      for (int j = 0; j < (nr); ++j) switch (tr) {                            \
          case 1: FN<1, 1>(x, w + j * K, y + j, K, N); break;                 \
          case 2: FN<2, 1>(x, w + j * K, y + j, K, N); break;                 \
          case 3: FN<3, 1>(x, w + j * K, y + j, K, N); break;                 \
          default: FN<4, 1>(x, w + j * K, y + j, K, N); break;                \
        }                                                                     \
  }

void skinny_f32(const float* x, const float* w, float* y, int64_t rows, int64_t K, int64_t N) {
  tiled(x, w, y, rows, K, N, [K, N](const float* xt, const float* wn, float* yt, int64_t tr, int nr) {
    TR_ENGINE_TILE_DISPATCH(tile_f32, xt, wn, yt, tr, nr, K, N)
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
void skinny_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t rows, int64_t K,
                 int64_t N) {
  tiled(x, w, y, rows, K, N, [K, N](const c10::BFloat16* xt, const c10::BFloat16* wn, c10::BFloat16* yt, int64_t tr,
                                    int nr) { TR_ENGINE_TILE_DISPATCH(tile_bf16, xt, wn, yt, tr, nr, K, N) });
}
#endif
#endif  // __AVX512F__

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  tr_engine::check_skinny_linear_args(x, w, kMaxRows);
  const auto xc = x.contiguous();
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  const int64_t rows = x.size(0), K = x.size(1), N = w.size(0);
  switch (x.scalar_type()) {
    case at::kFloat:
#if defined(__AVX512F__)
      skinny_f32(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, K, N);
#else
      skinny_linear_kernel(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, K, N);
#endif
      break;
    case at::kBFloat16:
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
      skinny_bf16(xc.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, K,
                  N);
#else
      skinny_linear_kernel(xc.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                           rows, K, N);
#endif
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
