// CPU kernel of tr_engine::decoder_layers: every Llama decoder layer of a decode step or a draft-tree verify, in one
// op. The model's module path runs ~35 PyTorch ops per layer (RMSNorm alone is eight), each a dispatch, an
// allocation and a pass over a few KB; on SmolLM2 that glue cost as much as streaming the weights (issue 25,
// bench/results/step_profile.md). Here the elementwise work (RMSNorm, RoPE, the cache write, SiLU * up, the residual
// adds) runs in plain loops over the T rows between the layer's four packed matmuls and its attention, which are the
// same kernels the ops packed_linear and tree_attention_batch run (csrc/cpu/kernels.h).
//
// Row independence, kept: every loop computes a row from that row alone, in a fixed order, and the matmuls and the
// attention are row-independent already, so a verify row's bits are its decode step's and bf16 speculative decoding
// stays bit-identical to plain decoding. Rounding follows the module path's (tr_engine.reference.decoder_layers):
// each PyTorch op's result is rounded to the model's dtype where that op would round it. Two sums differ in order
// from PyTorch's (RMSNorm's mean of squares, SiLU's exp), so the op agrees with its reference to a rounding, not to the
// bit; every method runs the same op, so they still agree with each other bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "convert.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using tr_engine_cpu::to_float;

// The layer's shape, read from its arguments.
struct Dims {
  int64_t T, E, Hq, Hkv, D, F;
};

using tr_engine_cpu::from_float;

// out[t] = w * round(x[t] / rms(x[t])), each row alone: RMSNorm as the module computes it (the half types normalise
// in float and round once before the weight's multiply; float stays float). The sum of squares runs in 16 lanes
// (element i into lane i % 16), then the lanes in order: a fixed order that the compiler vectorises. out is
// [rows, ldo]: columns E..ldo-1 (the matmul's padding to its column pairs) are zeros.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t ldo, int64_t rows, int64_t E, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* xr = x + t * E;
    float lane[16] = {};
    int64_t i = 0;
    for (; i + 16 <= E; i += 16)
      for (int l = 0; l < 16; ++l) {
        const float v = to_float(xr[i + l]);
        lane[l] += v * v;
      }
    for (int l = 0; i + l < E; ++l) {
      const float v = to_float(xr[i + l]);
      lane[l] += v * v;
    }
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += lane[l];
    const float r = 1.f / std::sqrt(sum / static_cast<float>(E) + eps);
    T* o = out + t * ldo;
    for (int64_t j = 0; j < E; ++j) {
      const float normed = to_float(from_float<T>(to_float(xr[j]) * r));
      o[j] = from_float<T>(to_float(w[j]) * normed);
    }
    std::fill(o + E, o + ldo, T(0));
  }
}

// RoPE on the q and k heads of qkv [T, Hq + 2 Hkv, D] in place, then the rotated k and the v heads written to the
// cache: row r of sequence b to slot slots[b], position prefix_lens[b] + (r - offsets[b]). As apply_rope in
// tr_engine/model.py: a = round(x * cos), then round(a + swap(x) * sin), with the tables' (cos, cos) and (-sin, sin).
template <typename T>
void rope_and_cache(T* qkv, const T* cos, const T* sin, const Dims& d, T* kv, const int64_t* kv_strides,
                    at::IntArrayRef slots, at::IntArrayRef prefix_lens, at::IntArrayRef offsets) {
  const int64_t half = d.D / 2, heads = d.Hq + 2 * d.Hkv;
  for (int64_t b = 0; b + 1 < static_cast<int64_t>(offsets.size()); ++b)
    for (int64_t r = offsets[b]; r < offsets[b + 1]; ++r) {
      const T* c = cos + r * d.D;
      const T* s = sin + r * d.D;
      for (int64_t h = 0; h < d.Hq + d.Hkv; ++h) {
        T* row = qkv + (r * heads + h) * d.D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(row[i]), x2 = to_float(row[i + half]);
          const float a1 = to_float(from_float<T>(x1 * to_float(c[i])));
          const float a2 = to_float(from_float<T>(x2 * to_float(c[i + half])));
          row[i] = from_float<T>(a1 + x2 * to_float(s[i]));
          row[i + half] = from_float<T>(a2 + x1 * to_float(s[i + half]));
        }
      }
      const int64_t pos = prefix_lens[b] + (r - offsets[b]);
      for (int64_t h = 0; h < d.Hkv; ++h)
        for (int64_t kind = 0; kind < 2; ++kind) {  // 0: k (rotated above), 1: v
          const T* src = qkv + (r * heads + d.Hq + kind * d.Hkv + h) * d.D;
          T* dst = kv + slots[b] * kv_strides[0] + kind * kv_strides[1] + h * kv_strides[2] + pos * kv_strides[3];
          std::copy(src, src + d.D, dst);
        }
    }
}

// act[t] = round(round(silu(gate[t])) * up[t]) from gate_up [T, 2F] (gate, then up): F.silu(gate) * up, into act
// [T, lda], zeros in columns F..lda-1. silu(g) = g / (1 + e^-g), e^-g as 2^(-g log2 e) (exp2_clamped: 0 or a huge
// finite value past its range, so silu is g or -0 there).
template <typename T>
void silu_mul_rows(const T* gate_up, T* act, int64_t lda, int64_t rows, int64_t F) {
  constexpr float kLog2e = 1.4426950408889634f;
  for (int64_t t = 0; t < rows; ++t) {
    const T* gate = gate_up + t * 2 * F;
    T* a = act + t * lda;
    for (int64_t j = 0; j < F; ++j) {
      const float g = to_float(gate[j]);
      const float silu = to_float(from_float<T>(g / (1.f + tr_engine_cpu::exp2_clamped(-g * kLog2e))));
      a[j] = from_float<T>(silu * to_float(gate[F + j]));
    }
    std::fill(a + F, a + lda, T(0));
  }
}

// x += y, rounded, elementwise.
template <typename T>
void add_into(T* x, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(y[i]));
}

// Scratch that a thread keeps between calls (a step's buffers are the same few sizes every layer).
template <typename T>
T* scratch(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// One layer's weights: entries 6l..6l+5 of the op's list.
struct LayerWeights {
  const at::Tensor &input_norm, &qkv, &o, &post_norm, &gate_up, &down;
};

// One decoder layer on the residual stream h [T, E] in place; kv is this layer's cache [N, 2, Hkv, S, D] (kv_strides:
// its first four strides), qkv [T, Hq + 2 Hkv, D] and attended [T, Hq, D] buffers the layers share. Pointers
// throughout: a tensor view costs a dispatch, and a step would make some 200 of them.
template <typename T>
void layer(T* h, const LayerWeights& w, const T* cos, const T* sin, T* kv, const int64_t* kv_strides,
           at::IntArrayRef slots, at::IntArrayRef prefix_lens, at::IntArrayRef offsets, const bool* tree_masks,
           const Dims& d, float eps, T* qkv, T* attended) {
  static thread_local std::vector<T> norm_buf, gate_up_buf, act_buf, proj_buf;
  const int64_t T_ = d.T, E = d.E, F = d.F, heads = d.Hq + 2 * d.Hkv;
  // The matmuls read their input rows in column pairs (bf16: P = 2); the rows they read are padded to that.
  const int64_t P = w.qkv.size(3), ld_norm = w.qkv.size(1) * P, ld_act = w.down.size(1) * P;
  T* normed = scratch(norm_buf, T_ * ld_norm);
  T* proj = scratch(proj_buf, T_ * E);
  // attention: norm, q/k/v, RoPE and the cache write, attention, o_proj, residual
  rms_norm_rows(h, w.input_norm.data_ptr<T>(), normed, ld_norm, T_, E, eps);
  tr_engine_cpu::packed_rows(normed, ld_norm, w.qkv.data_ptr<T>(), qkv, T_, w.qkv.size(1), heads * d.D);
  rope_and_cache(qkv, cos, sin, d, kv, kv_strides, slots, prefix_lens, offsets);
  const tr_engine_cpu::CacheView<T> cache{kv, kv + kv_strides[1], d.Hkv, kv_strides[0], kv_strides[2], kv_strides[3]};
  tr_engine_cpu::attend_batch(qkv, heads * d.D, d.D, d.Hq, d.D, cache, slots, prefix_lens, offsets, tree_masks,
                              std::pow(static_cast<double>(d.D), -0.5), attended);
  tr_engine_cpu::packed_rows(attended, d.Hq * d.D, w.o.data_ptr<T>(), proj, T_, w.o.size(1), E);
  add_into(h, proj, T_ * E);
  // MLP: norm, gate/up, SiLU * up, down_proj, residual
  rms_norm_rows(h, w.post_norm.data_ptr<T>(), normed, ld_norm, T_, E, eps);
  T* gate_up = scratch(gate_up_buf, T_ * 2 * F);
  tr_engine_cpu::packed_rows(normed, ld_norm, w.gate_up.data_ptr<T>(), gate_up, T_, w.gate_up.size(1), 2 * F);
  T* act = scratch(act_buf, T_ * ld_act);
  silu_mul_rows(gate_up, act, ld_act, T_, F);
  tr_engine_cpu::packed_rows(act, ld_act, w.down.data_ptr<T>(), proj, T_, w.down.size(1), E);
  add_into(h, proj, T_ * E);
}

// Every layer in turn, in one call: a step's 30 layers cost one dispatch, one set of checks and three allocations,
// where one op per layer paid those 30 times (~15 us each, half a millisecond of a 9 ms SmolLM2 step). Then the final
// norm, when weights ends with its weight: as eight PyTorch ops after the layers it took ~0.3 ms of a SmolLM2 step,
// fifteen times what it takes in a loop of its own, because each op's dispatch ran with the caches full of the
// weights just streamed; here it made a plain bf16 step 2.4% faster (alternating in one process).
at::Tensor decoder_layers_cpu(const at::Tensor& x, at::TensorList weights, const at::Tensor& cos,
                              const at::Tensor& sin, at::Tensor kv, at::IntArrayRef slots,
                              at::IntArrayRef prefix_lens, at::IntArrayRef offsets, const at::Tensor& tree_masks,
                              int64_t n_heads, int64_t ffn, double eps) {
  tr_engine::check_decoder_layers_args(x, weights, cos, sin, kv, n_heads, ffn);
  const Dims d{x.size(0), x.size(1), n_heads, kv.size(3), kv.size(5), ffn};
  // The q/k/v projection's output, [T, Hq + 2 Hkv, D]: its q heads are the attention's queries, so the attention's
  // checks (tree_attention_batch's, on the first layer's cache: every layer's has its shape) run on them before
  // anything is computed or written.
  auto qkv = at::empty({d.T, d.Hq + 2 * d.Hkv, d.D}, x.options());
  const auto q = qkv.narrow(1, 0, d.Hq), k = kv.select(0, 0).select(1, 0), v = kv.select(0, 0).select(1, 1);
  tr_engine::check_tree_attention_batch_args(q, k, v, slots, prefix_lens, offsets, tree_masks);
  auto out = x.contiguous().clone();  // the residual stream, through every layer
  auto attended = at::empty({d.T, d.Hq, d.D}, x.options());
  const auto masks = tree_masks.contiguous();
  const int64_t kv_strides[4] = {kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4)};  // [N, 2, Hkv, S]
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (int64_t l = 0; l < kv.size(0); ++l) {
      const LayerWeights w{weights[6 * l], weights[6 * l + 1], weights[6 * l + 2],
                           weights[6 * l + 3], weights[6 * l + 4], weights[6 * l + 5]};
      layer<T>(out.data_ptr<T>(), w, cos.data_ptr<T>(), sin.data_ptr<T>(), kv.data_ptr<T>() + l * kv.stride(0),
               kv_strides, slots, prefix_lens, offsets, masks.data_ptr<bool>(), d, static_cast<float>(eps),
               qkv.data_ptr<T>(), attended.data_ptr<T>());
    }
    if (static_cast<int64_t>(weights.size()) > 6 * kv.size(0)) {  // the final norm, in place: a row is read whole
      T* h = out.data_ptr<T>();                                    // before any of it is written
      rms_norm_rows(h, weights.back().data_ptr<T>(), h, d.E, d.T, d.E, static_cast<float>(eps));
    }
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
