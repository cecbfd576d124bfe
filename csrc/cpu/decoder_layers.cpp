// CPU kernel of tr_engine::decoder_layers: every Llama decoder layer of a decode step or a draft-tree verify, in one
// op (the model's module path runs ~35 PyTorch ops per layer, whose glue cost as much as streaming the weights). This
// file checks the arguments and describes the layers to the active CPU tier, whose kernel
// (csrc/cpu/kernels/layers.h) runs them: RMSNorm, the packed matmuls, RoPE and the cache write, the attention, SiLU,
// the residual adds, each row from that row alone, so a verify row's bits are its decode step's.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "tiers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

at::Tensor decoder_layers_cpu(const at::Tensor& x, at::TensorList weights, const at::Tensor& cos,
                              const at::Tensor& sin, at::Tensor kv, at::IntArrayRef slots,
                              at::IntArrayRef prefix_lens, at::IntArrayRef offsets, const at::Tensor& tree_masks,
                              int64_t n_heads, int64_t ffn, double eps) {
  tr_engine::check_decoder_layers_args(x, weights, cos, sin, kv, n_heads, ffn);
  const int64_t T = x.size(0), Hkv = kv.size(3), D = kv.size(5);
  // The q/k/v projection's output, [T, Hq + 2 Hkv, D]: its q heads are the attention's queries, so the attention's
  // checks (tree_attention_batch's, on the first layer's cache: every layer's has its shape) run on them before
  // anything is computed or written.
  auto qkv = at::empty({T, n_heads + 2 * Hkv, D}, x.options());
  auto attended = at::empty({T, n_heads, D}, x.options());
  const auto q = qkv.narrow(1, 0, n_heads), k = kv.select(0, 0).select(1, 0), v = kv.select(0, 0).select(1, 1);
  tr_engine::check_tree_attention_batch_args(q, k, v, slots, prefix_lens, offsets, tree_masks);
  auto out = x.contiguous().clone();  // the residual stream, through every layer
  const auto masks = tree_masks.contiguous();
  tr_engine_cpu::check_rows_see_a_key(masks.data_ptr<bool>(), prefix_lens, offsets);
  const int64_t L = kv.size(0);
  auto run = [&](auto* tag) {
    using S = typename tr_engine_cpu::Storage<std::remove_pointer_t<decltype(tag)>>::type;
    using tr_engine_cpu::data;
    std::vector<tr_engine_cpu::LayerWeights<S>> layers;
    for (int64_t l = 0; l < L; ++l) {
      const auto& qkv_w = weights[6 * l + 1];
      const auto& o_w = weights[6 * l + 2];
      const auto& gate_up_w = weights[6 * l + 4];
      const auto& down_w = weights[6 * l + 5];
      layers.push_back({data<S>(weights[6 * l]), data<S>(qkv_w), data<S>(o_w), data<S>(weights[6 * l + 3]),
                        data<S>(gate_up_w), data<S>(down_w), qkv_w.size(1), o_w.size(1), gate_up_w.size(1),
                        down_w.size(1)});
    }
    const bool final_norm = static_cast<int64_t>(weights.size()) > 6 * L;
    const tr_engine_cpu::Layers<S> a{data<S>(out), layers.data(), L, final_norm ? data<S>(weights.back()) : nullptr,
                                     data<S>(cos), data<S>(sin), data<S>(kv),
                                     {kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4)},
                                     slots.data(), prefix_lens.data(), offsets.data(),
                                     static_cast<int64_t>(slots.size()), masks.data_ptr<bool>(), T, x.size(1),
                                     n_heads, Hkv, D, ffn, static_cast<float>(eps), data<S>(qkv), data<S>(attended)};
    tr_engine_cpu::kernels_for<S>().layers(a);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    default: run(static_cast<c10::Half*>(nullptr)); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("decoder_layers", &decoder_layers_cpu); }
