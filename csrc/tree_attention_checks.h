// The argument checks of tr_engine::tree_attention, shared by its CPU kernel and its CUDA launcher so both refuse the
// same inputs with the same messages (contract in registration.cpp).
#pragma once

#include <ATen/ATen.h>

namespace tr_engine {

inline void check_tree_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      int64_t prefix_len, const at::Tensor& tree_mask) {
  TORCH_CHECK(q.dim() == 3, "tree_attention: q must be [T, Hq, D], got ", q.dim(), " dims");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "tree_attention: k and v must be [Hkv, S, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(),
              "tree_attention: k and v must have the same shape and strides, got ", k.sizes(), " and ", v.sizes());
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(k.size(2) == D, "tree_attention: q has head dim ", D, " but k has ", k.size(2));
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "tree_attention: q's ", Hq, " heads are not a multiple of k's ", Hkv);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "tree_attention: q, k and v must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "tree_attention: q, k and v need a contiguous last (head) dim");
  TORCH_CHECK(q.device() == k.device() && k.device() == v.device() && tree_mask.device() == q.device(),
              "tree_attention: q, k, v and tree_mask must be on one device");
  TORCH_CHECK(prefix_len >= 0 && prefix_len + T <= S, "tree_attention: prefix_len ", prefix_len, " + T ", T,
              " exceeds the cache's ", S, " slots");
  TORCH_CHECK(tree_mask.dim() == 2 && tree_mask.size(0) == T && tree_mask.size(1) == T &&
                  tree_mask.scalar_type() == at::kBool,
              "tree_attention: tree_mask must be bool [T, T] = [", T, ", ", T, "], got ", tree_mask.scalar_type(), " ",
              tree_mask.sizes());
}

// tree_attention_dynamic's prefix length: one int64 on q's device.
inline void check_dynamic_prefix(const at::Tensor& prefix_len, const at::Tensor& q) {
  TORCH_CHECK(prefix_len.numel() == 1 && prefix_len.scalar_type() == at::kLong,
              "tree_attention_dynamic: prefix_len must be a one-element int64 tensor, got ", prefix_len.scalar_type(),
              " ", prefix_len.sizes());
  TORCH_CHECK(prefix_len.device() == q.device(), "tree_attention_dynamic: prefix_len must be on ", q.device(),
              ", got ", prefix_len.device());
}

}  // namespace tr_engine
