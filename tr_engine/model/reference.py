"""Pure-PyTorch twins of the custom ops: the readable specification the C++/CUDA kernels must match.

Same names and signatures as `torch.ops.tr_engine.*` (contracts in csrc/registration.cpp); the engine runs on these
with `ops="reference"`.
"""

import torch

from tr_engine.model.functional import apply_rope, rms_norm


def compact_kv_(cache: torch.Tensor, src_slots: torch.Tensor, dst_start: int) -> None:
    """cache [L, 2, Hkv, S, D]: slots dst_start + i <- old slot src_slots[i] in every layer and head.

    index_select gathers into a new tensor before anything is written, so overlapping ranges are safe.
    """
    n = src_slots.numel()
    cache[:, :, :, dst_start : dst_start + n] = cache.index_select(3, src_slots)


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K].T for T <= 16, accumulated in float32 and rounded once to x's dtype."""
    return torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)


def pack_width(dtype: torch.dtype) -> int:
    """P, the values of one weight row that pack_linear puts side by side: 2 for bfloat16 (the pair a bf16 dot product
    takes), 1 for float32 and float16."""
    return 2 if dtype == torch.bfloat16 else 1


def pack_linear(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [ceil(N/32), ceil(K/P), 32, P] with [b, j, i, e] = w[32b + i, Pj + e] (zeros past N and K);
    P = pack_width(w.dtype): blocks of 32 output rows, their next P weights side by side."""
    N, K = w.shape
    P = pack_width(w.dtype)
    padded = torch.nn.functional.pad(w, (0, -K % P, 0, -N % 32))  # [32 * blocks, P * groups]
    return padded.view(-1, 32, padded.shape[1] // P, P).transpose(1, 2).contiguous()


def packed_linear(x: torch.Tensor, wp: torch.Tensor, n: int) -> torch.Tensor:
    """x [T, K] @ w.T for wp = pack_linear(w), w [n, K]: unpack, then multiply in float32, rounded once to x's dtype."""
    w = wp.transpose(1, 2).reshape(wp.shape[0] * 32, -1)[:n, : x.shape[1]]  # [n, K]
    return torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum of x [..., V] (the first, a NaN counting as the largest): x.argmax(dim=-1)."""
    return x.argmax(dim=-1)


def top_k_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of each row's k largest values of x [T, V], best first, ties to the lower id (a stable sort's head)."""
    return x.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def recycle_update_(table: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """table [V, k] int64; tokens [T] int64; logits [T, V]. For each i: table[tokens[i]] <- the k largest logits'
    ids at row i, best first, ties broken by the lower id (a stable sort; topk leaves tie order unspecified).
    A token at several rows takes the last row's (breadth-first order: the deepest, rightmost node wins);
    index_put_ with duplicate indices is undefined, so the earlier duplicates are dropped."""
    k = table.shape[1]
    top = logits.sort(dim=-1, descending=True, stable=True).indices[:, :k]  # [T, k]
    later_same = (tokens[:, None] == tokens[None, :]).triu(1).any(dim=1)  # [T]: a later row has the same token
    keep = ~later_same
    table[tokens[keep]] = top[keep]


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, tree_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of T new tokens over one layer's cache, written out as the textbook formula.

    q [T, Hq, D]; k, v [Hkv, S, D] with the new tokens' K/V at slots prefix_len..prefix_len+T-1; tree_mask bool [T, T].
    Token t sees all prefix_len cached keys and tree slot prefix_len + i where tree_mask[t, i]. Query head hq reads
    KV head hq // G (G = Hq // Hkv). Computed in float32 (float64 for float64); returns [T, Hq, D] in q's dtype.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[0]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k[:, : prefix_len + T].to(acc)  # [Hkv, P+T, D]
    values = v[:, : prefix_len + T].to(acc)  # [Hkv, P+T, D]
    queries = q.to(acc).view(T, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
    sees = torch.cat([tree_mask.new_ones(T, prefix_len), tree_mask], dim=1)  # [T, P+T]
    scores = scale * queries @ keys[:, None].transpose(-1, -2)  # [Hkv, G, T, P+T]
    probs = scores.masked_fill(~sees, float("-inf")).softmax(dim=-1)
    out = probs @ values[:, None]  # [Hkv, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(T, Hq, D).to(q.dtype).contiguous()


def tree_attention_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[int], prefix_lens: list[int],
                         offsets: list[int], tree_masks: torch.Tensor, scale: float) -> torch.Tensor:
    """tree_attention for a ragged batch: sequence b's rows offsets[b]..offsets[b+1] of q attend over slot slots[b] of
    k, v [N, Hkv, S, D] after prefix_lens[b] cached tokens, with its T_b x T_b block of the flattened tree_masks."""
    out, at = torch.empty_like(q), 0
    for slot, prefix, lo, hi in zip(slots, prefix_lens, offsets, offsets[1:]):
        n = hi - lo
        mask = tree_masks[at : at + n * n].view(n, n)
        out[lo:hi] = tree_attention(q[lo:hi], k[slot], v[slot], prefix, mask, scale)
        at += n * n
    return out


def tree_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                        tree_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """tree_attention_batch with every row's place in a tensor (what a CUDA graph of a batched step replays with):
    rows int64 [T, 3] holds row t's slot, its sequence's prefix length and its sequence's first row; tree_mask bool
    [T, T] over the batch's rows, each row seeing rows of its own sequence only. Reading rows here syncs, so the
    reference cannot be captured."""
    ragged = rows_to_ragged(rows.tolist(), tree_mask)
    return tree_attention_batch(q, k, v, *ragged, scale)


def rows_to_ragged(rows: list[list[int]], tree_mask: torch.Tensor) -> tuple[list, list, list, torch.Tensor]:
    """tree_attention_rows' places as tree_attention_batch's arguments: (slots, prefix_lens, offsets, tree_masks),
    each sequence a run of rows naming the run's first row."""
    slots, prefix_lens, offsets, blocks = [], [], [0], []
    for t, (slot, prefix, first) in enumerate(rows):
        if first == t:
            if t:
                offsets.append(t)
            slots.append(slot)
            prefix_lens.append(prefix)
    offsets.append(len(rows))
    for lo, hi in zip(offsets, offsets[1:]):
        blocks.append(tree_mask[lo:hi, lo:hi].reshape(-1))
    return slots, prefix_lens, offsets, torch.cat(blocks) if blocks else tree_mask.new_zeros(0)


def tree_attention_dynamic(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: torch.Tensor, tree_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """tree_attention with the prefix length in a one-element int64 tensor (what a captured CUDA graph replays with:
    the compiled kernel reads it on the device). Reading it here syncs, so the reference cannot be captured."""
    return tree_attention(q, k, v, int(prefix_len), tree_mask, scale)


def decoder_layers(x: torch.Tensor, weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                   kv: torch.Tensor, slots: list[int], prefix_lens: list[int], offsets: list[int],
                   tree_masks: torch.Tensor, n_heads: int, ffn: int, eps: float) -> torch.Tensor:
    """Every decoder layer of a ragged batch of rows, as tr_engine/model/llama.py's module path computes them
    (DecoderLayer, Attention, MLP), on packed weights: x [T, E] -> [T, E]. Layer l takes weights[6l..6l+5] (input
    norm, qkv, o, post-attention norm, gate_up, down) and writes its rows' rotated K and their V into kv[l]
    ([N, 2, Hkv, S, D]), sequence b's at slot slots[b], positions prefix_lens[b]..; attention by
    tree_attention_batch. A weight after the layers' (6 L + 1 in all) is the final norm's: the output is normed."""
    T, E = x.shape
    Hq, Hkv, D = n_heads, kv.shape[3], kv.shape[5]
    for layer, cache in enumerate(kv):
        norm1, qkv_w, o_w, norm2, gate_up_w, down_w = weights[6 * layer : 6 * layer + 6]
        qkv = packed_linear(rms_norm(x, norm1, eps), qkv_w, (Hq + 2 * Hkv) * D).view(T, Hq + 2 * Hkv, D)
        qk = apply_rope(qkv[:, : Hq + Hkv], cos, sin)  # [T, Hq + Hkv, D]
        for slot, p, lo, hi in zip(slots, prefix_lens, offsets, offsets[1:]):
            cache[slot, 0, :, p : p + hi - lo] = qk[lo:hi, Hq:].transpose(0, 1)
            cache[slot, 1, :, p : p + hi - lo] = qkv[lo:hi, Hq + Hkv :].transpose(0, 1)
        o = tree_attention_batch(qk[:, :Hq], cache[:, 0], cache[:, 1], slots, prefix_lens, offsets, tree_masks,
                                 D**-0.5)
        h = x + packed_linear(o.reshape(T, Hq * D), o_w, E)
        gate, up = packed_linear(rms_norm(h, norm2, eps), gate_up_w, 2 * ffn).chunk(2, dim=-1)
        x = h + packed_linear(torch.nn.functional.silu(gate) * up, down_w, E)
    return rms_norm(x, weights[-1], eps) if len(weights) > 6 * len(kv) else x
