// The op library's side of the CPU kernel tiers: the active tier's table (csrc/cpu/kernels/api.h), which the CPU ops
// call after checking their arguments, and the element types they hand it. tr_engine/model/cpu.py chooses the tier when
// the ops load (the best this CPU runs, or TR_ENGINE_CPU's) and loads it through the ops of tiers.cpp.
#pragma once

#include <ATen/ATen.h>

#include "kernels/api.h"

#include <algorithm>
#include <string>
#include <vector>

namespace tr_engine_cpu {

// The active tier's kernels; a one-line error while none is loaded.
const Kernels& kernels();

// The kernels of element type S (float, double, bf16, f16) in the active tier.
template <typename S>
const TypedKernels<S>& kernels_for() {
  return typed<S>(kernels());
}

// The kernels' element type for a tensor's element type: c10::BFloat16 and c10::Half are bit for bit bf16 and f16.
template <typename T>
struct Storage {
  using type = T;
};
template <>
struct Storage<c10::BFloat16> {
  using type = bf16;
};
template <>
struct Storage<c10::Half> {
  using type = f16;
};
static_assert(sizeof(c10::BFloat16) == sizeof(bf16) && sizeof(c10::Half) == sizeof(f16), "16-bit storage");

// A tensor's data as the kernels' element type S.
template <typename S>
S* data(const at::Tensor& t) {
  return static_cast<S*>(t.data_ptr());
}

// The active tier's top_k_rows for contiguous logits [rows, V] of any dtype the recycle takes (float32, bfloat16,
// float16, float64): row r's k best ids to table[tokens[r]] where keep[r] (recycle_update_, top_k_rows).
inline void top_k_rows(int64_t* table, int64_t k, const int64_t* tokens, const bool* keep, const at::Tensor& logits) {
  const int64_t rows = logits.size(0), V = logits.size(1);
  switch (logits.scalar_type()) {
    case at::kFloat: return kernels_for<float>().top_k_rows(table, k, tokens, keep, data<float>(logits), rows, V);
    case at::kBFloat16: return kernels_for<bf16>().top_k_rows(table, k, tokens, keep, data<bf16>(logits), rows, V);
    case at::kHalf: return kernels_for<f16>().top_k_rows(table, k, tokens, keep, data<f16>(logits), rows, V);
    case at::kDouble: return kernels_for<double>().top_k_rows(table, k, tokens, keep, data<double>(logits), rows, V);
    default: TORCH_CHECK(false, "top_k_rows: logits dtype ", logits.scalar_type(), " is not supported");
  }
}

// The ops of tiers.cpp (registered in csrc/registration.cpp).
std::vector<std::string> cpu_features();
void use_cpu_tier(const std::string& name, const std::string& path, const std::vector<std::string>& needs);
std::string cpu_tier();
double multiply_add_peak(int64_t units, bool bf16);

}  // namespace tr_engine_cpu

namespace tr_engine_cpu {

// The one argument check the attention kernel used to make as it went, made by its callers (tree_attention's ops and
// decoder_layers) before any tier runs: with no prefix, each of a sequence's rows must see one of its tree keys.
// masks: each sequence's T_b x T_b block in turn, as tree_attention_batch takes them.
inline void check_rows_see_a_key(const bool* masks, at::IntArrayRef prefix_lens, at::IntArrayRef offsets) {
  const bool* block = masks;
  for (size_t b = 0; b < prefix_lens.size(); ++b) {
    const int64_t n = offsets[b + 1] - offsets[b];
    for (int64_t t = 0; t < n && prefix_lens[b] == 0; ++t)
      TORCH_CHECK(std::any_of(block + t * n, block + (t + 1) * n, [](bool seen) { return seen; }), "tree_attention: "
                  "token ", t, " sees no key (prefix_len is 0 and its tree_mask row is all False)");
    block += n * n;
  }
}

}  // namespace tr_engine_cpu
