// CPU kernels of tr_engine::tree_attention and its forms (a prefix length in a tensor; a ragged batch): the attention
// of a verify step, each of the T tree tokens attending to every cached prefix key and to its own ancestors in the
// tree. This file checks the arguments and describes the operands to the active CPU tier, whose kernel
// (csrc/cpu/kernels/attention.h) computes them: row-independent, so a verify step reproduces plain decoding exactly,
// in bfloat16 too.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "tiers.h"

#include <cstdint>

namespace {

// f(static_cast<T*>(nullptr)) for the element type T of an attention dtype.
template <typename F>
void with_attention_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kDouble: f(static_cast<double*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    default:
      TORCH_CHECK(false, "tree_attention: dtype ", t, " is not supported (float32, bfloat16, float16, float64)");
  }
}

// The attention of a batch, its arguments checked: q [T, Hq, D]; the cache's keys and values with slot, head and
// position strides `seq`, `head`, `pos` (k and v alike, the head dim contiguous); out [T, Hq, D] contiguous.
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t Hkv, int64_t seq, int64_t head,
            int64_t pos, at::IntArrayRef slots, at::IntArrayRef prefix_lens, at::IntArrayRef offsets,
            const at::Tensor& masks, double scale, at::Tensor& out) {
  const auto m = masks.contiguous();
  tr_engine_cpu::check_rows_see_a_key(m.data_ptr<bool>(), prefix_lens, offsets);
  with_attention_type(q.scalar_type(), [&](auto* tag) {
    using S = typename tr_engine_cpu::Storage<std::remove_pointer_t<decltype(tag)>>::type;
    using tr_engine_cpu::data;
    const tr_engine_cpu::Attention<S> a{data<S>(q), q.stride(0), q.stride(1), q.size(1), q.size(2),
                                        tr_engine_cpu::CacheView<S>{data<S>(k), data<S>(v), Hkv, seq, head, pos},
                                        slots.data(), prefix_lens.data(), offsets.data(),
                                        static_cast<int64_t>(slots.size()), m.data_ptr<bool>(), scale, data<S>(out)};
    tr_engine_cpu::kernels_for<S>().attention(a);
  });
}

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t prefix_len,
                              const at::Tensor& tree_mask, double scale) {
  tr_engine::check_tree_attention_args(q, k, v, prefix_len, tree_mask);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t slot = 0, offsets[2] = {0, q.size(0)};  // one sequence, in "slot 0" of a cache of one
  attend(q, k, v, k.size(0), 0, k.stride(0), k.stride(1), {slot}, {prefix_len}, offsets, tree_mask.reshape(-1), scale,
         out);
  return out;
}

at::Tensor tree_attention_batch_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    at::IntArrayRef slots, at::IntArrayRef prefix_lens, at::IntArrayRef offsets,
                                    const at::Tensor& tree_masks, double scale) {
  tr_engine::check_tree_attention_batch_args(q, k, v, slots, prefix_lens, offsets, tree_masks);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  attend(q, k, v, k.size(1), k.stride(0), k.stride(1), k.stride(2), slots, prefix_lens, offsets, tree_masks, scale,
         out);
  return out;
}

// On a CPU the prefix length is simply read: nothing is captured here, so there is nothing to gain by not reading it.
at::Tensor tree_attention_dynamic_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& prefix_len, const at::Tensor& tree_mask, double scale) {
  tr_engine::check_tree_attention_dynamic_args(q, k, v, prefix_len, tree_mask);
  return tree_attention_cpu(q, k, v, prefix_len.item<int64_t>(), tree_mask, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) {
  m.impl("tree_attention", &tree_attention_cpu);
  m.impl("tree_attention_dynamic", &tree_attention_dynamic_cpu);
  m.impl("tree_attention_batch", &tree_attention_batch_cpu);
}
