"""Pure-PyTorch twins of the custom ops: the readable specification the C++/CUDA kernels must match.

Same names and signatures as `torch.ops.tr_engine.*` (contracts in csrc/registration.cpp); the engine runs on these
with `ops="reference"`.
"""

import torch


def compact_kv_(cache: torch.Tensor, src_slots: torch.Tensor, dst_start: int) -> None:
    """cache [L, 2, Hkv, S, D]: slots dst_start + i <- old slot src_slots[i] in every layer and head.

    index_select gathers into a new tensor before anything is written, so overlapping ranges are safe.
    """
    n = src_slots.numel()
    cache[:, :, :, dst_start : dst_start + n] = cache.index_select(3, src_slots)


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K].T for T <= 16, accumulated in float32 and rounded once to x's dtype."""
    return torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)


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
