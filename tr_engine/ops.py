"""Chooses the implementation of the custom ops: the compiled kernels (`"kernels"`, the default) or their
pure-PyTorch references (`"reference"`). Both expose the same functions with the same signatures.
"""

from types import SimpleNamespace

from tr_engine import reference
from tr_engine.errors import UserError

OP_NAMES = ("compact_kv_",)
KINDS = ("kernels", "reference")


def load_ops(kind: str = "kernels") -> SimpleNamespace:
    """A namespace with one callable per op in OP_NAMES."""
    if kind == "reference":
        return SimpleNamespace(kind=kind, **{name: getattr(reference, name) for name in OP_NAMES})
    if kind != "kernels":
        raise UserError(f"unknown ops {kind!r}; choose one of {', '.join(KINDS)}")
    try:
        import tr_engine._C  # noqa: F401  (registers torch.ops.tr_engine.*)
    except ImportError as e:
        raise UserError(f"the compiled ops are not built ({e}); run `make install`, or pass --ops reference")
    import torch

    return SimpleNamespace(kind=kind, **{name: getattr(torch.ops.tr_engine, name) for name in OP_NAMES})
