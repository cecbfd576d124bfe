"""The Llama's stateless math, shared by the modules that run it (tr_engine/model/llama.py) and by the pure-PyTorch
reference of the fused CPU layers op (tr_engine/model/reference.py): one definition, so the two cannot drift apart, in a
module that imports neither of them.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of x divided by its root mean square, times weight. Half types normalise in float32 (as the
    checkpoints were trained) and round once before the weight's multiply; float32/float64 stay in their own type."""
    h = x.float() if x.element_size() < 4 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by its positions' angles, pairing dimension i with i + D/2 (Hugging Face's layout).

    With x = (x1, x2) and cos/sin [T, D] from rope_table: (x1 c - x2 s, x2 c + x1 s) = x * cos + swap(x) * sin,
    where swap(x) = (x2, x1). The same IEEE operations as Hugging Face's rotate_half, in four ops.
    """
    T, H, D = x.shape
    swapped = x.view(T, H, 2, D // 2).flip(2).view(T, H, D)
    return torch.addcmul(x * cos[:, None, :], swapped, sin[:, None, :])
