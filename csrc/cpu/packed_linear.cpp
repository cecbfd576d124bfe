// CPU kernels of tr_engine::pack_linear and tr_engine::packed_linear: y = x @ w.T with w stored, once at load time, in
// the blocked layout of csrc/registration.cpp (blocks of 32 output rows; inside a block, for each group of P input
// columns, the 32 rows' P values side by side; P = 2 for bfloat16, 1 for float32 and float16). This file packs the
// weights (into huge pages, below) and checks the matmul's arguments; the matmul itself is the active CPU tier's
// (csrc/cpu/kernels/linear.h says why the layout and how the tiles use it). The layout is the same on every tier, so
// a model packed once runs on any of them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tiers.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr int64_t kBlock = tr_engine_cpu::kPackBlock;  // output rows per block

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
// pages that packing frees are handed back by tr_engine/model/weights.py.)
//
// TR_ENGINE_HUGE_PAGES=0 leaves the advice out (the chunks and their order stay, in ordinary pages). On a VM whose host
// takes back the 2 MB pages its guest frees (virtio-balloon's free page reporting), every huge page costs ~15 ms at
// its first touch, 25x as much as the same bytes in 4 KB pages: 540 MB took 4.1 s against 0.17 s on this project's
// KVM hosts, and SmolLM2 loaded in 3.9-7.2 s instead of ~1.5 s. Worth it for a server or a long chat (the steps above);
// not for a run of a few hundred tokens, nor for the test suite, which loads the default model dozens of times.
constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kChunk = size_t(64) << 20;
constexpr size_t kPooledMax = kChunk / 8;

bool advise_huge_pages() {
  static const bool advise = [] {
    const char* v = std::getenv("TR_ENGINE_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return advise;
}

// `bytes` rounded up to whole huge pages, 2 MB aligned and advised (where the system has THP, unless
// TR_ENGINE_HUGE_PAGES=0), freed with the last owner; nullptr when the allocation fails.
std::shared_ptr<char> huge_block(size_t bytes) {
  const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
  char* p = static_cast<char*>(std::aligned_alloc(kHuge, rounded));
  if (p == nullptr) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (advise_huge_pages()) madvise(p, rounded, MADV_HUGEPAGE);  // advice: ignored where THP is off
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
    using S = typename tr_engine_cpu::Storage<std::remove_pointer_t<decltype(tag)>>::type;
    using tr_engine_cpu::data;
    tr_engine_cpu::kernels_for<S>().packed_rows(data<S>(xc), groups * P, data<S>(wp), data<S>(y), x.size(0), groups,
                                                 n);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) {
  m.impl("pack_linear", &pack_linear_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
}
