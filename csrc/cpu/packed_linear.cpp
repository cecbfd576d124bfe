// CPU kernels of tr_engine::pack_linear and tr_engine::packed_linear: y = x @ w.T with w stored, once at load time, in
// the blocked layout of csrc/registration.cpp (blocks of 32 output rows; inside a block, for each group of P input
// columns, the 32 rows' P values side by side; P = 2 for bfloat16, 1 for float32 and float16).
//
// Why the layout: in a decode step or a draft-tree verify (1..~100 rows of x), each weight must be read from memory
// once and applied to every row of x while it sits in registers. With w blocked like this, one 64-byte load holds 16
// output rows' next P weights; the kernel broadcasts x[t]'s next P values and multiply-adds them into 16 per-output
// accumulators (the AVX512-BF16 dot product for bf16: two products per fp32 lane; an FMA for fp32, and for fp16
// after converting the weights in registers: this CPU has no fp16 arithmetic). 2 weight loads
// feed 2 x R multiply-adds, R up to 8 rows of x, and nothing needs a horizontal sum: the accumulators are the
// outputs. So fp32 stays memory-bound up to 8 rows, and bf16 (half the bytes) until its dot products catch up with
// memory; what that buys against oneDNN's F.linear and skinny_linear's row-major tiles, on all of SmolLM2's
// projections, is measured by `make bench-kernels` (bench/results/kernels_cpu.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "convert.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr int64_t kBlock = 32;       // output rows per block (two 16-lane vectors)
// Rows of x per register tile: 2 x 8 accumulators + 2 weight vectors. 12 rows fit the registers too, but a tile
// of 12 ran slower than two of 8 at a 7B model's shapes (12 rows through an 11008 x 4096 bf16 weight: 4.5-4.8 ms,
// 16 rows 4.0-4.2; in tiles of 8, 12 rows 3.3-3.7 and 24 rows 5.7-5.9 instead of 7.1-7.3), no faster at SmolLM2's.
constexpr int kMaxGroup = 8;
constexpr int64_t kRowChunk = 192;   // rows of x per pass over w, so x's chunk stays in L2 for a long prefill

using tr_engine_cpu::to_float;

template <typename T>
constexpr int64_t pack_width() { return std::is_same_v<T, c10::BFloat16> ? 2 : 1; }  // P: one row's values side by side

// ---- pack_linear: w [N, K] -> wp [ceil(N/32), ceil(K/P), 32, P], zero-padded -------------------------------------
template <typename T>
void pack(const T* w, T* wp, int64_t N, int64_t K) {
  constexpr int64_t P = pack_width<T>();
  const int64_t blocks = (N + kBlock - 1) / kBlock, groups = (K + P - 1) / P;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < groups; ++j)
        for (int64_t i = 0; i < kBlock; ++i)
          for (int64_t e = 0; e < P; ++e) {
            const int64_t n = b * kBlock + i, k = j * P + e;
            wp[((b * groups + j) * kBlock + i) * P + e] = (n < N && k < K) ? w[n * K + k] : T(0);
          }
  });
}

// ---- packed_linear: one block of 32 outputs for R rows of x ------------------------------------------------------
// x [R, ldx] (ldx >= groups * P, padded with zeros past K), wb: one block [groups, 32, P], y [R, ldy]: columns
// 0..valid-1 written.

// The readable loop: the specification of the vector kernels below, and the kernel where AVX-512 is missing.
template <typename T>
void block_loop(const T* x, int64_t ldx, const T* wb, int64_t groups, T* y, int64_t ldy, int rows, int valid) {
  constexpr int64_t P = pack_width<T>();
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < valid; ++i) {
      float acc = 0.f;
      for (int64_t j = 0; j < groups; ++j)
        for (int64_t e = 0; e < P; ++e)
          acc += to_float(x[r * ldx + j * P + e]) * to_float(wb[(j * kBlock + i) * P + e]);
      y[r * ldy + i] = static_cast<T>(acc);
    }
}

#if defined(__AVX512F__)
// Ask for the cache lines kPrefetch bytes past the `lines` 64-byte lines at p, into L2. A thread streams its blocks
// in order, and a block follows the one before it in memory, so that is where this thread reads next. The hardware
// prefetchers alone left this stream short of the memory's bandwidth: each matmul of a step is short (0.7-3.5 MB for
// SmolLM2, split between the threads), and at R = 8 rows the dot products keep the core busy while the next lines
// are still on their way. Measured on whole SmolLM2 steps here, against no prefetch: bf16 4-7% faster at 1 row and
// 12-15% at 8, fp32 3% and 8%; 2 KB ahead helped less at 8 rows, 6 KB was no better at 1.
constexpr int64_t kPrefetch = 4096;
inline void prefetch_ahead(const void* p, int lines) {
  const char* ahead = static_cast<const char*>(p) + kPrefetch;
  for (int i = 0; i < lines; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T1);
}

// The first `valid` of 16 lanes (none for valid <= 0).
inline __mmask16 lanes(int valid) {
  return valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max(valid, 0)) - 1);
}

template <int R>
void block_f32(const float* x, int64_t ldx, const float* wb, int64_t groups, float* y, int64_t ldy, int valid) {
  __m512 lo[R], hi[R];  // outputs 0..15 and 16..31 of the block, for each row of x
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < groups; ++k) {
    prefetch_ahead(wb + k * kBlock, 2);
    const __m512 w0 = _mm512_loadu_ps(wb + k * kBlock), w1 = _mm512_loadu_ps(wb + k * kBlock + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      lo[r] = _mm512_fmadd_ps(xb, w0, lo[r]);
      hi[r] = _mm512_fmadd_ps(xb, w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, lanes(valid), lo[r]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, lanes(valid - 16), hi[r]);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int R>
void block_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* wb, int64_t groups, c10::BFloat16* y,
                int64_t ldy, int valid) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < groups; ++k) {
    prefetch_ahead(wb + k * 2 * kBlock, 2);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + k * 2 * kBlock);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + k * 2 * kBlock + 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // x[r, 2k] and x[r, 2k+1], broadcast to every lane
      std::memcpy(&pair, x + r * ldx + 2 * k, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      lo[r] = _mm512_dpbf16_ps(lo[r], xb, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) {  // round to nearest even, once
    _mm256_mask_storeu_epi16(y + r * ldy, lanes(valid), (__m256i)_mm512_cvtneps_pbh(lo[r]));
    _mm256_mask_storeu_epi16(y + r * ldy + 16, lanes(valid - 16), (__m256i)_mm512_cvtneps_pbh(hi[r]));
  }
}
#define TR_ENGINE_PACKED_BF16 1
#endif

// float16: one 64-byte load holds the block's 32 weights of column k, widened to two float vectors (exact), then
// the same FMAs as float32.
template <int R>
void block_f16(const c10::Half* x, int64_t ldx, const c10::Half* wb, int64_t groups, c10::Half* y, int64_t ldy,
               int valid) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < groups; ++k) {
    prefetch_ahead(wb + k * kBlock, 1);
    const __m512i w = _mm512_loadu_si512(wb + k * kBlock);
    const __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(w)), w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(static_cast<float>(x[r * ldx + k]));
      lo[r] = _mm512_fmadd_ps(xb, w0, lo[r]);
      hi[r] = _mm512_fmadd_ps(xb, w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {  // round to nearest even, once
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm256_mask_storeu_epi16(y + r * ldy, lanes(valid), _mm512_cvtps_ph(lo[r], kRound));
    _mm256_mask_storeu_epi16(y + r * ldy + 16, lanes(valid - 16), _mm512_cvtps_ph(hi[r], kRound));
  }
}
#endif  // __AVX512F__

// One block for `rows` <= kMaxGroup rows: the vector kernel with R = rows as a compile-time constant.
template <typename T>
void block(const T* x, int64_t ldx, const T* wb, int64_t groups, T* y, int64_t ldy, int rows, int valid) {
#define TR_ENGINE_ROWS(FN, ...)                                                                      \
  switch (rows) {                                                                                    \
    case 1: FN<1>(__VA_ARGS__); break;   case 2: FN<2>(__VA_ARGS__); break;                          \
    case 3: FN<3>(__VA_ARGS__); break;   case 4: FN<4>(__VA_ARGS__); break;                          \
    case 5: FN<5>(__VA_ARGS__); break;   case 6: FN<6>(__VA_ARGS__); break;                          \
    case 7: FN<7>(__VA_ARGS__); break;   default: FN<8>(__VA_ARGS__); break;                         \
  }
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    TR_ENGINE_ROWS(block_f32, x, ldx, wb, groups, y, ldy, valid)
    return;
  }
  if constexpr (std::is_same_v<T, c10::Half>) {
    TR_ENGINE_ROWS(block_f16, x, ldx, wb, groups, y, ldy, valid)
    return;
  }
#endif
#if defined(TR_ENGINE_PACKED_BF16)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    TR_ENGINE_ROWS(block_bf16, x, ldx, wb, groups, y, ldy, valid)
    return;
  }
#endif
#undef TR_ENGINE_ROWS
  block_loop(x, ldx, wb, groups, y, ldy, rows, valid);
}

int64_t width_of(at::ScalarType t) { return t == at::kBFloat16 ? 2 : 1; }  // pack_width at run time

// f(static_cast<T*>(nullptr)) for the element type T of a dtype that check_dtype admitted.
template <typename F>
void with_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    default: f(static_cast<c10::Half*>(nullptr)); break;
  }
}

void check_dtype(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, op,
              ": ", name, " is ", t.scalar_type(), "; float32, bfloat16 and float16 are supported");
}

// A weight streams through the TLB at every step: in 2 MB pages (Linux transparent huge pages, asked for with
// madvise, since most systems grant them only on request) that is 512x fewer entries than in 4 KB pages.
//
// A weight of a few MB would waste much of a huge page of its own, and one under 2 MB got none: SmolLM2's q/k/v, o
// and down projections, 39% of its bytes, sat in 4 KB pages of the heap. So a weight of up to kPooledMax bytes is
// carved out of a shared chunk of huge pages, in the order the weights are packed: a model packs its layers in order,
// the order a step reads them, so the step streams one run of memory. Measured here against the weights where they
// were: SmolLM2 bf16 steps 3-8% faster at 1 row and 5% at 8 (alternating in one process); plain bf16 decoding 1.065x
// (bench.ab, 24 dev questions, per-question median 1.053x); fp32, whose weights were mostly 2 MB or more, 1.003x.
// A chunk is freed with the last weight in it; bigger weights (a 7B model's) get huge pages of their own. (The heap
// pages that packing frees are handed back by tr_engine/weights.py.)
constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kChunk = size_t(64) << 20;
constexpr size_t kPooledMax = kChunk / 8;

// `bytes` rounded up to whole huge pages, 2 MB aligned and advised (where the system has THP), freed with the last
// owner; nullptr when the allocation fails.
std::shared_ptr<char> huge_block(size_t bytes) {
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  char* p = static_cast<char*>(std::aligned_alloc(kHuge, rounded));
  if (p == nullptr) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, rounded, MADV_HUGEPAGE);  // advice: ignored where THP is off
#endif
  return std::shared_ptr<char>(p, [](char* q) { std::free(q); });
}

at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  std::shared_ptr<char> block;  // what the tensor keeps alive
  char* data = nullptr;
  if (bytes > kPooledMax) {
    block = huge_block(bytes);
    data = block.get();
  } else if (bytes > 0) {
    static std::mutex mutex;
    static std::weak_ptr<char> chunk;  // the chunk being filled: alive while a weight in it is
    static size_t used = 0;
    const std::lock_guard<std::mutex> lock(mutex);
    block = chunk.lock();
    if (block == nullptr || used + bytes > kChunk) {
      block = huge_block(kChunk);
      chunk = block;
      used = 0;
    }
    if (block != nullptr) {
      data = block.get() + used;
      used += (bytes + 4095) / 4096 * 4096;  // the next weight starts on a 4 KB page, as the prefetchers see pages
    }
  }
  if (data == nullptr) return at::empty(sizes, options);
  return at::from_blob(data, sizes, [block](void*) {}, options);
}

at::Tensor pack_linear_cpu(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_linear: w must be [N, K], got ", w.dim(), " dims");
  check_dtype(w, "pack_linear", "w");
  const auto wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = width_of(w.scalar_type());
  auto wp = empty_huge({(N + kBlock - 1) / kBlock, (K + P - 1) / P, kBlock, P}, w.options());
  with_type(w.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    pack(wc.data_ptr<T>(), wp.data_ptr<T>(), N, K);
  });
  return wp;
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& wp, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [T, K], got ", x.dim(), " dims");
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == kBlock && wp.is_contiguous(),
              "packed_linear: wp must be a contiguous [blocks, groups, 32, P] tensor from pack_linear, got ",
              wp.sizes());
  check_dtype(x, "packed_linear", "x");
  TORCH_CHECK(x.scalar_type() == wp.scalar_type(), "packed_linear: x is ", x.scalar_type(), " but wp is ",
              wp.scalar_type());
  const int64_t P = wp.size(3), groups = wp.size(1), K = x.size(1);
  TORCH_CHECK(P == width_of(x.scalar_type()), "packed_linear: wp's last dim is ", P, ", not ",
              x.scalar_type(), "'s pack width");
  TORCH_CHECK(groups == (K + P - 1) / P, "packed_linear: x has K = ", K, " columns but wp was packed from ",
              groups * P, " (rounded up to ", P, ")");
  TORCH_CHECK(n > (wp.size(0) - 1) * kBlock && n <= wp.size(0) * kBlock, "packed_linear: n = ", n,
              " does not match wp's ", wp.size(0), " blocks of ", kBlock);
  // The kernels read x in groups of P columns: pad an odd K with a zero column (never the case for real models).
  const auto xc = groups * P == K ? x.contiguous() : at::constant_pad_nd(x, {0, groups * P - K}).contiguous();
  auto y = at::empty({x.size(0), n}, x.options());
  with_type(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    tr_engine_cpu::packed_rows(xc.data_ptr<T>(), groups * P, wp.data_ptr<T>(), y.data_ptr<T>(), x.size(0), groups, n);
  });
  return y;
}

}  // namespace

namespace tr_engine_cpu {

// Threads split the blocks of w (each block is 32 x K contiguous values, read once per chunk of rows); inside a
// block, the chunk's rows go in near-equal groups of at most kMaxGroup.
template <typename T>
void packed_rows(const T* x, int64_t ldx, const T* wp, T* y, int64_t rows, int64_t groups, int64_t N) {
  const int64_t blocks = (N + kBlock - 1) / kBlock, block_size = groups * kBlock * pack_width<T>();
  for (int64_t t0 = 0; t0 < rows; t0 += kRowChunk) {
    const int64_t chunk = std::min(kRowChunk, rows - t0);
    const int64_t tiles = (chunk + kMaxGroup - 1) / kMaxGroup;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int valid = static_cast<int>(std::min(kBlock, N - b * kBlock));
        for (int64_t g = 0, t = t0; g < tiles; ++g) {
          const int r = static_cast<int>((t0 + chunk - t) / (tiles - g));  // near-equal groups
          block(x + t * ldx, ldx, wp + b * block_size, groups, y + t * N + b * kBlock, N, r, valid);
          t += r;
        }
      }
    });
  }
}

template void packed_rows(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t);
template void packed_rows(const c10::BFloat16*, int64_t, const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t,
                          int64_t);
template void packed_rows(const c10::Half*, int64_t, const c10::Half*, c10::Half*, int64_t, int64_t, int64_t);

}  // namespace tr_engine_cpu

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) {
  m.impl("pack_linear", &pack_linear_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
}
