// The one place where tr_engine's op schemas live (the extension-cpp pattern). Each backend file registers its
// kernels with TORCH_LIBRARY_IMPL; tr_engine/model/reference.py holds the pure-PyTorch twin that specifies each op.
#include <Python.h>
#include <torch/library.h>

#include "cpu/tiers.h"

TORCH_LIBRARY(tr_engine, m) {
  // For every (layer, k|v, head) row of cache [L, 2, Hkv, S, D]: slots dst_start + i <- old slot src_slots[i],
  // i = 0..n-1, all read before any is written (overlapping ranges are safe; a repeated source is copied to each of
  // its destinations). src_slots: int64 [n], each in [0, S); dst_start + n <= S. Slots outside the destination
  // range are left as they were.
  m.def("compact_kv_(Tensor(a!) cache, Tensor src_slots, int dst_start) -> ()");

  // y = x @ w.T (F.linear without bias) for T = 1..16 rows of x [T, K] and a contiguous weight w [N, K] of the same
  // dtype; accumulates in float32 and rounds once to x's dtype. The few-row matmul for weights that are not packed
  // (packed_linear below serves float32/bfloat16/float16 models on a CPU).
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");

  // A projection weight w [N, K] (float32, bfloat16 or float16) in the blocked layout of the CPU matmul:
  // wp [ceil(N/32), ceil(K/P), 32, P] with wp[b, j, i, e] = w[32b + i, Pj + e], zeros past N and K; P = 2 for
  // bfloat16 (the pair a bf16 dot product consumes), 1 for float32 and float16. Packed once at load time.
  m.def("pack_linear(Tensor w) -> Tensor");

  // y = x @ w.T for any T rows of x [T, K] and wp = pack_linear(w) of w [n, K] of x's dtype; accumulates in float32
  // and rounds once to x's dtype, each output summed in a fixed order whatever the other rows (row-independent). The
  // CPU engine's projections (decode steps, tree verifies, prefill).
  m.def("packed_linear(Tensor x, Tensor wp, int n) -> Tensor");

  // For each i: table[tokens[i]] <- the k = table.size(1) ids of the largest logits[i], best first, ties broken by
  // the lower token id. A token at several i is written from its last i only (the decode loop's rule: the last node
  // in breadth-first order wins). table int64 [V, k]; tokens int64 [T] in [0, V); logits [T, V] finite floats.
  m.def("recycle_update_(Tensor(a!) table, Tensor tokens, Tensor logits) -> ()");

  // The attention of T new tokens: out[t, hq] = softmax_j(scale * q[t, hq] . k[h, j]) @ v[h, j] over the keys token t
  // sees: every prefix slot j < prefix_len, and slot prefix_len + i wherever tree_mask[t, i] (its ancestors and
  // itself). h = hq / (Hq / Hkv) (grouped-query attention). q [T, Hq, D]; k, v [Hkv, S, D], one layer's cache with
  // the new tokens' K/V already at slots prefix_len..prefix_len+T-1; tree_mask bool [T, T]; every token must see at
  // least one key. Accumulates in float32 (float64 for float64); returns [T, Hq, D] in q's dtype. The CPU kernel is
  // row-independent: a row's bits depend only on its query and its keys in order (prefix slots, then its visible
  // tree slots by index), so it equals a one-token call with those keys in the cache; CUDA agrees up to rounding.
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, int prefix_len, Tensor tree_mask, float scale) -> Tensor");

  // tree_attention with the prefix length in a one-element int64 tensor on q's device instead of an int, so that a
  // CUDA graph captured once replays at every prefix length (the kernel reads it; the launch does not depend on it).
  // The CPU kernel reads it and checks it like tree_attention; the CUDA kernel clamps it to 0..S-T on the device
  // (checking it there would need a host sync), so the caller keeps prefix_len + T <= S.
  m.def("tree_attention_dynamic(Tensor q, Tensor k, Tensor v, Tensor prefix_len, Tensor tree_mask, float scale) -> "
        "Tensor");

  // tree_attention for a ragged batch of B sequences in one call: sequence b's T_b = offsets[b+1] - offsets[b] new
  // tokens are rows offsets[b].. of q [T, Hq, D], its cache is slot slots[b] of k, v [N, Hkv, S, D] (one layer of
  // the batch cache, new K/V already at slots prefix_lens[b]..), and its tree mask is the T_b x T_b block of
  // tree_masks, bool [sum T_b^2], at sum_{c<b} T_c^2 (row-major). Each sequence's rows are exactly tree_attention's
  // on its own slot (on a CPU bit for bit: rows are independent of whatever rides with them). Returns [T, Hq, D].
  m.def("tree_attention_batch(Tensor q, Tensor k, Tensor v, int[] slots, int[] prefix_lens, int[] offsets, "
        "Tensor tree_masks, float scale) -> Tensor");

  // tree_attention_batch with every row's place in tensors on q's device, so that a CUDA graph of a batched step
  // replays with any sequences, prefixes and trees in it (the launch depends on T alone). rows int64 [T, 3]: row t's
  // cache slot, its sequence's prefix length P and the index f of its sequence's first row; row t attends to the
  // slot's positions j < P, then to position P + i - f wherever tree_mask[t, i] (tree_mask bool [T, T] over the
  // batch's rows). A sequence's rows are consecutive, share their row of `rows` and see rows of their own sequence
  // only; padding rows are a sequence of their own (two sequences may read one slot). k, v [N, Hkv, S, D] with the new
  // K/V in place. The CPU kernel reads and checks `rows` and gives tree_attention_batch's bits; the CUDA kernel clamps
  // slots and positions into the cache instead of checking them (that would need a host sync). Returns [T, Hq, D].
  m.def("tree_attention_rows(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor tree_mask, float scale) -> Tensor");

  // Every Llama decoder layer of a step (CPU; the model's path for decode steps and tree verifies of packed weights),
  // layer l from weights[6l..6l+5] = input_norm, qkv_w, o_w, post_norm, gate_up_w, down_w and its cache kv[l]:
  //   h = x + o_proj(attention(rope(q), rope(k), v)) from qkv = norm(x; input_norm) @ qkv_w.T, then
  //   x' = h + down(silu(gate) * up) from (gate, up) = norm(h; post_norm) @ gate_up_w.T,
  // each projection packed by pack_linear ([(Hq + 2 Hkv) D, E], [E, Hq D], [2 F, E], [E, F]), norm the RMSNorm with
  // eps, rope by the rows' cos/sin [T, D] (Hugging Face's half-split layout). The rows are a ragged batch as in
  // tree_attention_batch: sequence b's rows offsets[b].. write their rotated K and V into slot slots[b] of kv
  // [L, N, 2, Hkv, S, D] at positions prefix_lens[b].., then attend through their tree mask. Returns the last
  // layer's output [T, E] in x's dtype (float32, bfloat16, float16), through the model's final norm when weights
  // holds its weight after the layers' (6 L + 1 tensors); rounds where the module path's ops would
  // (tr_engine.model.reference.decoder_layers) and, like every CPU kernel here, computes each row from that row alone.
  m.def("decoder_layers(Tensor x, Tensor[] weights, Tensor cos, Tensor sin, Tensor(a!) kv, int[] slots, "
        "int[] prefix_lens, int[] offsets, Tensor tree_masks, int n_heads, int ffn, float eps) -> Tensor");

  // x.argmax(dim=-1) for logits x [..., V] (float32, float64; CPU), bit for bit: the first index of each row's
  // maximum, a NaN counting as the largest value. Greedy decoding's choice (sampling.greedy), in one op.
  m.def("argmax_rows(Tensor x) -> Tensor");

  // The ids of each row's k largest logits, x [T, V] (float32, bfloat16, float16, float64; CPU) -> int64 [T, k], best
  // first, ties to the lower id: the first k columns of x.sort(dim=-1, descending=True, stable=True).indices for any
  // row without a NaN (recycle_update_'s choice of a row's candidates, as its own op). What a greedy step under tensor
  // parallelism needs of a rank's columns of the logits (Llama.top_k), in one pass a row.
  m.def("top_k_rows(Tensor x, int k) -> Tensor");

  // The CPU kernel tiers (csrc/cpu/tiers.cpp; tr_engine/model/cpu.py chooses among them). cpu_features: the features the
  // tiers may need that this CPU and its OS support ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
  // "avx512dq", "avx512bf16"; "neon" on aarch64). use_cpu_tier: make the tier library at `path` (built for tier
  // `name`, needing every feature in `needs`) the one every CPU op calls; refused, with nothing changed, if this CPU
  // lacks a feature or the library is not that tier's of this build. cpu_tier: the active tier's name, "" if none.
  m.def("cpu_features() -> str[]", &tr_engine_cpu::cpu_features);
  m.def("use_cpu_tier(str name, str path, str[] needs) -> ()", &tr_engine_cpu::use_cpu_tier);
  m.def("cpu_tier() -> str", &tr_engine_cpu::cpu_tier);
  // multiply_add_peak: the active tier's arithmetic peak in GFLOPS, `units` units of independent multiply-adds on
  // every thread of torch's pool (csrc/cpu/kernels/peak.h), timed: what bench/ sets the kernels' FLOPs against; with
  // `bf16`, its bf16 arithmetic's (the pair dot product's, twice the multiply-add's work, where the tier has it).
  m.def("multiply_add_peak(int units, bool bf16=False) -> float", &tr_engine_cpu::multiply_add_peak);
}

// `import tr_engine._C` loads this library, which runs the registrations above; the module itself is empty.
static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
