// The CPU kernels that other CPU kernels call directly, below the dispatcher: the fused decoder layer
// (decoder_layers.cpp) runs a layer's matmuls and attention through these, without a PyTorch op per step.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tr_engine_cpu {

// y [rows, N] (contiguous) = x [rows, ldx] @ w.T with wp = pack_linear(w) of w [N, groups * P], T = float,
// c10::BFloat16 or c10::Half: packed_linear's kernel (csrc/cpu/packed_linear.cpp), row-independent.
template <typename T>
void packed_rows(const T* x, int64_t ldx, const T* wp, T* y, int64_t rows, int64_t groups, int64_t N);

// tree_attention_batch's kernel into out [T, Hq, D] (contiguous), its arguments checked already: sequence b's rows
// offsets[b]..offsets[b+1] of q against slot slots[b] of k, v [N, Hkv, S, D] after prefix_lens[b] cached keys, with
// its flattened T_b x T_b block of tree_masks (csrc/cpu/tree_attention.cpp).
void attend_batch_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef slots,
                       at::IntArrayRef prefix_lens, at::IntArrayRef offsets, const at::Tensor& tree_masks,
                       double scale, at::Tensor& out);

// A cache's keys and values as pointers: slot s, KV head h, position j at k + s * seq + h * head + j * pos (v the
// same), the head dim contiguous.
template <typename T>
struct CacheView {
  const T* k;
  const T* v;
  int64_t Hkv, seq, head, pos;
};

// attend_batch_into on pointers (no tensor views, for a kernel that calls it once a layer): q [T, Hq, D] with rows
// q_row and heads q_head apart, the flattened tree_masks contiguous, out [T, Hq, D] contiguous. T = float, double,
// c10::BFloat16 or c10::Half.
template <typename T>
void attend_batch(const T* q, int64_t q_row, int64_t q_head, int64_t Hq, int64_t D, const CacheView<T>& cache,
                  at::IntArrayRef slots, at::IntArrayRef prefix_lens, at::IntArrayRef offsets, const bool* tree_masks,
                  double scale, T* out);

}  // namespace tr_engine_cpu
