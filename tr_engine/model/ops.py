"""Chooses the implementation of the custom ops: the compiled kernels (`"kernels"`, the default) or their
pure-PyTorch references (`"reference"`). Both expose the same functions with the same signatures, so one op can be
swapped for its reference alone: `"kernels,tree_attention=reference"` (the --ops flag takes the same spec).

The ops are one namespace (load_ops), built once per spec and handed to everything that calls them: the model
(projections, attention), the recycling matrix (recycle_update_) and the decode loop (compact_kv_) all read the same
one, so a swap reaches every caller.
"""

from functools import lru_cache
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tr_engine.errors import InvalidType, UserError
from tr_engine.model import cpu, reference

OP_NAMES = ("compact_kv_", "skinny_linear", "pack_linear", "packed_linear", "recycle_update_", "tree_attention",
            "tree_attention_dynamic", "tree_attention_batch", "tree_attention_rows", "decoder_layers", "argmax_rows",
            "top_k_rows")
KINDS = ("kernels", "reference")
# On a CPU, float32, bfloat16 and float16 models keep their projections packed (pack_linear, at load time) and
# multiply with packed_linear at every row count: each 32-row block of a weight is read once and applied to up to 12
# rows of x from registers, so a small verify's matmuls cost little more than one token's, and it beats oneDNN's
# F.linear from one row to a whole prefill (bench/results/kernels_cpu.md, all of SmolLM2's projections). Each output
# is one sum in a fixed order whatever the other rows, so a verify's projections are bit for bit a decode step's.
PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Unpacked CPU weights (a weight passed as a plain tensor): skinny_linear for up to this many rows, else F.linear
# (which GPU weights always take).
SKINNY_ROWS = {torch.float32: 8, torch.bfloat16: 6, torch.float16: 1}


class PackedWeight(NamedTuple):
    """A projection weight w [n, K] as pack_linear(w), for packed_linear; what `linear` receives once a CPU model is
    packed (Llama.pack_)."""

    data: torch.Tensor  # [ceil(n/32), ceil(K/P), 32, P]
    n: int


def packs(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the compiled kernels keep a model of this dtype on this device packed."""
    return torch.device(device).type == "cpu" and dtype in PACKED_DTYPES


def parse_ops(spec: str) -> tuple[str, dict[str, str]]:
    """'kernels' or 'reference', then any number of ',OP=KIND' overrides -> (base kind, {op: kind}); a one-line
    error for anything else."""
    if not isinstance(spec, str):
        raise UserError(f"ops must be a string like 'kernels' or 'kernels,tree_attention=reference', got "
                        f"{type(spec).__name__}")
    base, *rest = spec.split(",")
    if base not in KINDS:
        raise UserError(f"unknown ops {base!r}; choose one of {', '.join(KINDS)}, then any OP=KIND overrides")
    overrides = {}
    for item in rest:
        name, _, kind = item.partition("=")
        if name not in OP_NAMES or kind not in KINDS:
            raise UserError(f"ops override {item!r}: expected OP=KIND with an op of {', '.join(OP_NAMES)} and a kind "
                            f"of {', '.join(KINDS)}")
        overrides[name] = kind
    return base, overrides


def load_ops(spec: str = "kernels") -> SimpleNamespace:
    """A namespace with one callable per op in OP_NAMES, from the kind `spec` names (parse_ops), each op overridden
    there taken from its own kind, plus `linear` and `pack` (the model's projections) and `kind` (the spec). Built
    once per spec: every later call returns the same namespace."""
    parse_ops(spec)  # (a bad spec is not cached)
    return _load_spec(spec)


def resolve_ops(ops) -> SimpleNamespace:
    """An ops namespace from a spec string (load_ops) or a namespace already built (returned as it is, once it has
    every op): what the model, the matrix, the engine and the loaders accept."""
    if isinstance(ops, str):
        return load_ops(ops)
    missing = [n for n in (*OP_NAMES, "linear", "pack", "kind") if not hasattr(ops, n)]
    if missing:
        raise InvalidType(f"ops must be a spec like 'kernels' or a namespace from tr_engine.model.ops.load_ops; "
                          f"{type(ops).__name__} lacks {', '.join(missing)}")
    return ops


def is_compiled(ops: SimpleNamespace, name: str) -> bool:
    """Whether the namespace's op `name` is the compiled kernel (not its reference, nor another stand-in)."""
    try:
        return getattr(ops, name) is getattr(torch.ops.tr_engine, name)
    except (AttributeError, RuntimeError):  # the kernels are not loaded
        return False


@lru_cache(maxsize=None)
def _load_spec(spec: str) -> SimpleNamespace:
    kind, overrides = parse_ops(spec)
    ops = _load(kind)
    for name, other in overrides.items():
        setattr(ops, name, getattr(_load(other), name))
    if overrides:
        ops.kind = spec
    return ops


def _load(kind: str) -> SimpleNamespace:
    if kind == "reference":
        # The model's projections stay plain F.linear here: the readable engine, end to end (and nothing is packed;
        # a packed model handed to these ops multiplies through the reference's unpacking twin).
        def reference_linear(x: torch.Tensor, w) -> torch.Tensor:
            if isinstance(w, PackedWeight):
                return ns.packed_linear(x, w.data, w.n)
            return F.linear(x, w)

        ns = SimpleNamespace(kind=kind, linear=reference_linear, pack=None,
                             **{name: getattr(reference, name) for name in OP_NAMES})
        return ns
    if KERNELS_MISSING:
        raise UserError(f"the compiled ops are not built ({KERNELS_MISSING}); run `make install`, or pass --ops "
                        "reference")
    if not cpu.active():
        cpu.use()  # the tier TR_ENGINE_CPU names, or the best this CPU runs; a one-line error when it cannot be had

    def linear(x: torch.Tensor, w) -> torch.Tensor:
        """x [T, K] @ w.T: packed_linear for a PackedWeight; else F.linear, through skinny_linear for the few rows of a
        CPU decode step or small draft (SKINNY_ROWS). (The ops are read from the namespace: an override holds.)"""
        if isinstance(w, PackedWeight):
            return ns.packed_linear(x, w.data, w.n)
        if x.shape[0] <= SKINNY_ROWS.get(x.dtype, 0) and x.device.type == "cpu":
            return ns.skinny_linear(x, w)
        return F.linear(x, w)

    def pack(w: torch.Tensor) -> PackedWeight:
        return PackedWeight(ns.pack_linear(w), w.shape[0])

    ns = SimpleNamespace(kind=kind, linear=linear, pack=pack,
                         **{name: getattr(torch.ops.tr_engine, name) for name in OP_NAMES})
    return ns


def _register_fakes() -> None:
    """Shape-only versions of every op (the mutating ones return nothing), so that torch.compile and opcheck can
    trace them; registered once, when the library loads."""

    @torch.library.register_fake("tr_engine::compact_kv_")
    def _(cache, src_slots, dst_start):
        return None

    @torch.library.register_fake("tr_engine::skinny_linear")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("tr_engine::pack_linear")
    def _(w):
        P = reference.pack_width(w.dtype)
        return w.new_empty((w.shape[0] + 31) // 32, (w.shape[1] + P - 1) // P, 32, P)

    @torch.library.register_fake("tr_engine::packed_linear")
    def _(x, wp, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tr_engine::recycle_update_")
    def _(table, tokens, logits):
        return None

    @torch.library.register_fake("tr_engine::tree_attention")
    def _(q, k, v, prefix_len, tree_mask, scale):
        return q.new_empty(q.shape)

    @torch.library.register_fake("tr_engine::tree_attention_dynamic")
    def _(q, k, v, prefix_len, tree_mask, scale):
        return q.new_empty(q.shape)

    @torch.library.register_fake("tr_engine::tree_attention_batch")
    def _(q, k, v, slots, prefix_lens, offsets, tree_masks, scale):
        return q.new_empty(q.shape)

    @torch.library.register_fake("tr_engine::tree_attention_rows")
    def _(q, k, v, rows, tree_mask, scale):
        return q.new_empty(q.shape)

    @torch.library.register_fake("tr_engine::argmax_rows")
    def _(x):
        return x.new_empty(x.shape[:-1], dtype=torch.long)

    @torch.library.register_fake("tr_engine::top_k_rows")
    def _(x, k):
        return x.new_empty(x.shape[0], k, dtype=torch.long)

    @torch.library.register_fake("tr_engine::decoder_layers")
    def _(x, weights, cos, sin, kv, slots, prefix_lens, offsets, tree_masks, n_heads, ffn, eps):
        return x.new_empty(x.shape)


# The compiled library registers torch.ops.tr_engine.* when it loads; its fakes go with it. Its CPU ops call the
# kernels of one instruction-set tier (tr_engine/model/cpu.py): the best this CPU runs, or TR_ENGINE_CPU's, loaded here
# (or,
# if TR_ENGINE_CPU names one this CPU cannot run, refused in one line by load_ops("kernels")).
try:
    import tr_engine._C  # noqa: F401
except ImportError as e:
    KERNELS_MISSING = str(e) or type(e).__name__  # what load_ops("kernels") reports
else:
    KERNELS_MISSING = ""
    _register_fakes()
    try:
        cpu.use()
    except UserError:
        pass
