// The argument checks of every op that has a CPU kernel and a CUDA launcher, one function per op, called first by
// both (csrc/cpu/*.cpp, csrc/cuda/ops_cuda.cpp) so the two refuse the same inputs with the same messages. The
// contracts themselves are in registration.cpp; tests/test_op_contract.py feeds every op the inputs refused here, on
// every device it has, and checks that each backend calls its op's function.
//
// What each backend adds on its own: the CPU kernels range-check the indices they read (token ids, cache slots) as they
// go; the CUDA launchers cannot without a host sync, so their kernels skip an index out of range (nothing is read or
// written for it). The CUDA launchers also refuse what their kernels cannot do (a head dim or k beyond their register
// budgets, float64).
#pragma once

#include <ATen/ATen.h>

namespace tr_engine {

inline void check_compact_kv_args(const at::Tensor& cache, const at::Tensor& src_slots, int64_t dst_start) {
  TORCH_CHECK(cache.dim() == 5, "compact_kv_: cache must be [L, 2, Hkv, S, D], got ", cache.dim(), " dims");
  TORCH_CHECK(cache.is_contiguous(), "compact_kv_: cache must be contiguous");
  TORCH_CHECK(src_slots.dim() == 1 && src_slots.scalar_type() == at::kLong,
              "compact_kv_: src_slots must be a 1-D int64 tensor, got ", src_slots.scalar_type(), " with ",
              src_slots.dim(), " dims");
  TORCH_CHECK(src_slots.device() == cache.device(), "compact_kv_: src_slots must be on ", cache.device(), " like cache, "
              "got ", src_slots.device());
  const int64_t S = cache.size(3), n = src_slots.numel();
  TORCH_CHECK(dst_start >= 0 && dst_start + n <= S, "compact_kv_: dst_start ", dst_start, " + ", n,
              " slots exceeds the cache capacity ", S);
}

inline void check_recycle_update_args(const at::Tensor& table, const at::Tensor& tokens, const at::Tensor& logits) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous(),
              "recycle_update_: table must be a contiguous int64 [V, k] tensor");
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "recycle_update_: tokens must be int64 [T]");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == tokens.size(0), "recycle_update_: logits must be [T, V] with T = ",
              tokens.size(0), ", got ", logits.sizes());
  TORCH_CHECK(logits.size(1) == table.size(0), "recycle_update_: logits have ", logits.size(1),
              " columns but the table has ", table.size(0), " rows (the vocabulary sizes differ)");
  TORCH_CHECK(table.size(1) >= 1 && table.size(1) <= logits.size(1), "recycle_update_: k = ", table.size(1),
              " must be in 1..", logits.size(1));
  TORCH_CHECK(table.device() == tokens.device() && tokens.device() == logits.device(),
              "recycle_update_: table, tokens and logits must be on one device");
}

// `max_rows`: the most rows the backend's kernel takes.
inline void check_skinny_linear_args(const at::Tensor& x, const at::Tensor& w, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "skinny_linear: x must be [T, K] and w [N, K], got ", x.dim(), " and ",
              w.dim(), " dims");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_linear: x is [", x.size(0), ", ", x.size(1), "] but w is [", w.size(0),
              ", ", w.size(1), "]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_rows, "skinny_linear: x has ", x.size(0), " rows; 1..", max_rows,
              " are supported (use a regular matmul for more)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "skinny_linear: x is ", x.scalar_type(), " but w is ",
              w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "skinny_linear: w must be contiguous [N, K]");
  TORCH_CHECK(x.device() == w.device(), "skinny_linear: x and w must be on one device");
}

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

// tree_attention_dynamic: tree_attention's checks (with the prefix length as 0: the CPU reads the length and checks
// it again; the CUDA kernel clamps it), and its prefix length one int64 on q's device.
inline void check_tree_attention_dynamic_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& prefix_len, const at::Tensor& tree_mask) {
  TORCH_CHECK(prefix_len.numel() == 1 && prefix_len.scalar_type() == at::kLong,
              "tree_attention_dynamic: prefix_len must be a one-element int64 tensor, got ", prefix_len.scalar_type(),
              " ", prefix_len.sizes());
  TORCH_CHECK(prefix_len.device() == q.device(), "tree_attention_dynamic: prefix_len must be on ", q.device(),
              ", got ", prefix_len.device());
  check_tree_attention_args(q, k, v, 0, tree_mask);
}

// tree_attention_batch: the batch's shape, then each sequence's own rows as tree_attention's, all before anything is
// computed. k, v are one layer of the batch cache, [N, Hkv, S, D]; slots, prefix_lens and offsets are host lists.
inline void check_tree_attention_batch_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            at::IntArrayRef slots, at::IntArrayRef prefix_lens,
                                            at::IntArrayRef offsets, const at::Tensor& tree_masks) {
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "tree_attention_batch: k and v must be [N, Hkv, S, D], got ", k.dim(),
              " and ", v.dim(), " dims");
  const int64_t B = static_cast<int64_t>(slots.size());
  TORCH_CHECK(static_cast<int64_t>(prefix_lens.size()) == B && static_cast<int64_t>(offsets.size()) == B + 1,
              "tree_attention_batch: B slots need B prefix_lens and B + 1 offsets; got ", B, ", ", prefix_lens.size(),
              " and ", offsets.size());
  TORCH_CHECK(q.dim() == 3 && offsets[0] == 0 && offsets[B] == q.size(0),
              "tree_attention_batch: offsets must run from 0 to q's ", q.dim() == 3 ? q.size(0) : -1, " rows");
  int64_t masks = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slots[b] >= 0 && slots[b] < k.size(0), "tree_attention_batch: slots[", b, "] = ", slots[b],
                " is outside the cache's ", k.size(0), " slots");
    for (int64_t c = 0; c < b; ++c)
      TORCH_CHECK(slots[c] != slots[b], "tree_attention_batch: two sequences share slot ", slots[b]);
    TORCH_CHECK(offsets[b + 1] >= offsets[b], "tree_attention_batch: offsets must not decrease");
    masks += (offsets[b + 1] - offsets[b]) * (offsets[b + 1] - offsets[b]);
  }
  TORCH_CHECK(tree_masks.dim() == 1 && tree_masks.scalar_type() == at::kBool && tree_masks.numel() == masks,
              "tree_attention_batch: tree_masks must be bool [", masks, "] (each sequence's T_b x T_b mask, "
              "flattened), got ", tree_masks.scalar_type(), " ", tree_masks.sizes());
  for (int64_t b = 0, mask_at = 0; b < B; ++b) {
    const int64_t n = offsets[b + 1] - offsets[b];
    check_tree_attention_args(q.narrow(0, offsets[b], n), k.select(0, slots[b]), v.select(0, slots[b]),
                              prefix_lens[b], tree_masks.narrow(0, mask_at, n * n).view({n, n}));
    mask_at += n * n;
  }
}

// tree_attention_rows: k, v are one layer of the batch cache, [N, Hkv, S, D]; rows int64 [T, 3] and tree_mask bool
// [T, T] on q's device; the heads, dtypes and strides as tree_attention's. What rows hold (each row's slot, prefix
// and sequence) the CPU kernel reads and checks; the CUDA kernel clamps it (checking it there would need a host sync).
inline void check_tree_attention_rows_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& rows, const at::Tensor& tree_mask) {
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) >= 1,
              "tree_attention_rows: k and v must be [N, Hkv, S, D] with N >= 1, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.dim() == 3, "tree_attention_rows: q must be [T, Hq, D], got ", q.dim(), " dims");
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == q.size(0) && rows.size(1) == 3 && rows.scalar_type() == at::kLong,
              "tree_attention_rows: rows must be int64 [T, 3] = [", q.size(0), ", 3] (slot, prefix, first row), got ",
              rows.scalar_type(), " ", rows.sizes());
  TORCH_CHECK(rows.device() == q.device(), "tree_attention_rows: rows must be on ", q.device(), ", got ",
              rows.device());
  TORCH_CHECK(k.stride(0) == v.stride(0), "tree_attention_rows: k and v must have the same strides");
  check_tree_attention_args(q, k.select(0, 0), v.select(0, 0), 0, tree_mask);
}

// argmax_rows (CPU only): logits [..., V], V >= 1, float32 or float64.
inline void check_argmax_rows_args(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "argmax_rows: x must be [..., V] with V >= 1, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, "argmax_rows: x is ", x.scalar_type(),
              "; float32 and float64 are supported");
}

// top_k_rows (CPU only): logits [T, V], V >= 1, float32, bfloat16, float16 or float64; 1 <= k <= V.
inline void check_top_k_rows_args(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1, "top_k_rows: x must be [T, V] with V >= 1, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kDouble,
              "top_k_rows: x is ", x.scalar_type(), "; float32, bfloat16, float16 and float64 are supported");
  TORCH_CHECK(k >= 1 && k <= x.size(1), "top_k_rows: k = ", k, " must be in 1..", x.size(1));
}

// decoder_layers (CPU only): the layers' tensors against x [T, E] and the cache kv [L, N, 2, Hkv, S, D]; weights
// holds 6 per layer (input_norm, qkv, o, post_norm, gate_up, down), each projection packed (pack_linear) from its
// [out, in] weight, then optionally the final norm's [E]. The attention part is then checked as tree_attention_batch's, on the layers' queries.
inline void check_decoder_layers_args(const at::Tensor& x, at::TensorList weights, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& kv, int64_t n_heads, int64_t ffn) {
  TORCH_CHECK(x.dim() == 2, "decoder_layers: x must be [T, E], got ", x.dim(), " dims");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "decoder_layers: x is ", x.scalar_type(), "; float32, bfloat16 and float16 are supported");
  TORCH_CHECK(kv.dim() == 6 && kv.size(2) == 2 && kv.stride(5) == 1,
              "decoder_layers: kv must be [L, N, 2, Hkv, S, D] with a contiguous last dim, got ", kv.sizes());
  const int64_t L = kv.size(0), T = x.size(0), E = x.size(1), Hkv = kv.size(3), D = kv.size(5);
  const int64_t n = static_cast<int64_t>(weights.size());
  TORCH_CHECK(n == 6 * L || n == 6 * L + 1, "decoder_layers: weights must hold 6 tensors a layer "
              "(input_norm, qkv, o, post_norm, gate_up, down) for kv's ", L, " layers, then optionally the final "
              "norm's, got ", n);
  TORCH_CHECK(n_heads >= 1 && n_heads % Hkv == 0 && D % 2 == 0, "decoder_layers: n_heads = ", n_heads,
              " must be a multiple of the cache's ", Hkv, " KV heads, and the head dim ", D, " even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "decoder_layers: cos and sin must be [T, D] = [", T, ", ", D, "], got ", cos.sizes(), " and ",
              sin.sizes());
  const int64_t P = x.scalar_type() == at::kBFloat16 ? 2 : 1, F = ffn, Hq = n_heads;
  auto packed = [&](const at::Tensor& w, int64_t out, int64_t in) {
    return w.dim() == 4 && w.size(0) == (out + 31) / 32 && w.size(1) == (in + P - 1) / P && w.size(2) == 32 &&
           w.size(3) == P;
  };
  for (const at::Tensor& t : weights)
    TORCH_CHECK(t.scalar_type() == x.scalar_type() && t.device() == x.device() && t.is_contiguous(),
                "decoder_layers: every tensor must be ", x.scalar_type(), " on ", x.device(),
                " and contiguous (kv: its last dim), like x; got ", t.scalar_type(), " on ", t.device());
  for (const at::Tensor* t : {&cos, &sin, &kv})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->device() == x.device() && (t == &kv || t->is_contiguous()),
                "decoder_layers: every tensor must be ", x.scalar_type(), " on ", x.device(),
                " and contiguous (kv: its last dim), like x; got ", t->scalar_type(), " on ", t->device());
  TORCH_CHECK(n == 6 * L || (weights[6 * L].dim() == 1 && weights[6 * L].size(0) == E),
              "decoder_layers: the final norm's weight must be [E] = [", E, "], got ", weights[n - 1].sizes());
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor *norm1 = &weights[6 * l], *norm2 = &weights[6 * l + 3];
    TORCH_CHECK(norm1->dim() == 1 && norm1->size(0) == E && norm2->dim() == 1 && norm2->size(0) == E,
                "decoder_layers: the norms' weights must be [E] = [", E, "]; layer ", l, "'s are not");
    TORCH_CHECK(packed(weights[6 * l + 1], (Hq + 2 * Hkv) * D, E) && packed(weights[6 * l + 2], E, Hq * D) &&
                    packed(weights[6 * l + 4], 2 * F, E) && packed(weights[6 * l + 5], E, F),
                "decoder_layers: qkv, o, gate_up and down must be pack_linear's of [(Hq + 2 Hkv) D, E], [E, Hq D], "
                "[2 F, E] and [E, F] weights with E = ", E, ", Hq = ", Hq, ", Hkv = ", Hkv, ", D = ", D, ", F = ", F,
                "; layer ", l, "'s are not");
  }
}

}  // namespace tr_engine
