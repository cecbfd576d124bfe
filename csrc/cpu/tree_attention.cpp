// CPU kernels of tr_engine::tree_attention and its forms (a prefix length in a tensor; a ragged batch): the attention
// of a verify step, each of the T tree tokens attending to every cached prefix key and to its own ancestors in the
// tree. This file checks the arguments and describes the operands to the active CPU tier, whose kernel
// (csrc/cpu/kernels/attention.h) computes them: row-independent, so a verify step reproduces plain decoding exactly,
// in bfloat16 too.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "tiers.h"

#include <algorithm>
#include <cstdint>
#include <vector>

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

// The rows' places read and checked on the host, grouped into their sequences, and attended as tree_attention_batch
// does (the same kernel: the same bits).
at::Tensor tree_attention_rows_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& rows, const at::Tensor& tree_mask, double scale) {
  tr_engine::check_tree_attention_rows_args(q, k, v, rows, tree_mask);
  const auto r = rows.contiguous();
  const auto m = tree_mask.contiguous();
  const int64_t T = q.size(0), N = k.size(0), S = k.size(2);
  const int64_t* place = r.data_ptr<int64_t>();
  const bool* sees = m.data_ptr<bool>();
  std::vector<int64_t> slots, prefix_lens, offsets{0};
  std::vector<bool> blocks;  // each sequence's T_b x T_b block of the mask, in turn
  for (int64_t t = 0; t < T;) {
    const int64_t slot = place[3 * t], prefix = place[3 * t + 1];
    TORCH_CHECK(place[3 * t + 2] == t, "tree_attention_rows: row ", t, " starts a sequence but names row ",
                place[3 * t + 2], " as its first (a sequence's rows are consecutive)");
    TORCH_CHECK(slot >= 0 && slot < N, "tree_attention_rows: row ", t, "'s slot ", slot, " is outside the cache's ",
                N, " slots");
    int64_t end = t + 1;
    for (; end < T && place[3 * end + 2] == t; ++end)
      TORCH_CHECK(place[3 * end] == slot && place[3 * end + 1] == prefix, "tree_attention_rows: row ", end,
                  " of the sequence from row ", t, " names another slot or prefix");
    TORCH_CHECK(prefix >= 0 && prefix + (end - t) <= S, "tree_attention_rows: the sequence from row ", t, " needs ",
                prefix, " + ", end - t, " positions but the cache holds ", S);
    for (int64_t i = t; i < end; ++i)
      for (int64_t j = 0; j < T; ++j) {
        TORCH_CHECK(!sees[i * T + j] || (j >= t && j < end), "tree_attention_rows: row ", i, " sees row ", j,
                    " of another sequence");
        if (j >= t && j < end) blocks.push_back(sees[i * T + j]);
      }
    slots.push_back(slot);
    prefix_lens.push_back(prefix);
    offsets.push_back(end);
    t = end;
  }
  auto masks = at::empty({static_cast<int64_t>(blocks.size())}, m.options());
  std::copy(blocks.begin(), blocks.end(), masks.data_ptr<bool>());
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  attend(q, k, v, k.size(1), k.stride(0), k.stride(1), k.stride(2), slots, prefix_lens, offsets, masks, scale, out);
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
  m.impl("tree_attention_rows", &tree_attention_rows_cpu);
}
