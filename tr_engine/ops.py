"""Chooses the implementation of the custom ops: the compiled kernels (`"kernels"`, the default) or their
pure-PyTorch references (`"reference"`). Both expose the same functions with the same signatures.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tr_engine import reference
from tr_engine.errors import UserError

OP_NAMES = ("compact_kv_", "skinny_linear", "recycle_update_", "tree_attention")
KINDS = ("kernels", "reference")
# skinny_linear accepts up to 16 rows (csrc/registration.cpp) and streams each weight row once per call, reducing every
# row of x against it from L1 (AVX-512 register tiles; bf16 through the AVX512-BF16 dot product). It wins while the
# matmul is bound by reading the weights; measured here (2 threads, SmolLM2's shapes, `bench.kernels`, interleaved
# against F.linear): float32 1.9-3.9x at 2-4 rows, >= 1.0x up to 8 (LM head 1.9x), 0.9x at 12; bfloat16 1.4-2.5x at
# 2-4 rows, 1.1x at 6, parity at 8, 0.8-0.9x at 12 (oneDNN's bf16 GEMM takes over). float16 keeps the plain loop.
SKINNY_ROWS = {torch.float32: 8, torch.bfloat16: 6, torch.float16: 1}


def load_ops(kind: str = "kernels") -> SimpleNamespace:
    """A namespace with one callable per op in OP_NAMES."""
    if kind == "reference":
        # The model's projections stay plain F.linear here: the readable engine, end to end.
        return SimpleNamespace(kind=kind, linear=F.linear, **{name: getattr(reference, name) for name in OP_NAMES})
    if kind != "kernels":
        raise UserError(f"unknown ops {kind!r}; choose one of {', '.join(KINDS)}")
    try:
        import tr_engine._C  # noqa: F401  (registers torch.ops.tr_engine.*)
    except ImportError as e:
        raise UserError(f"the compiled ops are not built ({e}); run `make install`, or pass --ops reference")
    _register_fakes()
    ops = {name: getattr(torch.ops.tr_engine, name) for name in OP_NAMES}
    skinny = ops["skinny_linear"]

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """F.linear, through skinny_linear for the few rows of a CPU decode step or small draft (SKINNY_ROWS)."""
        if x.shape[0] <= SKINNY_ROWS.get(x.dtype, 0) and x.device.type == "cpu":
            return skinny(x, w)
        return F.linear(x, w)

    return SimpleNamespace(kind=kind, linear=linear, **ops)


_fakes_registered = False


def _register_fakes() -> None:
    """Shape-only versions of the ops that return tensors, so torch.compile and opcheck can trace them."""
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("tr_engine::skinny_linear")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("tr_engine::tree_attention")
    def _(q, k, v, prefix_len, tree_mask, scale):
        return q.new_empty(q.shape)

    _fakes_registered = True
