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
