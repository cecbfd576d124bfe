"""The decode methods: plain decoding ("ar") and one per drafter in DRAFTERS, the registry the engine, the command-line
tools and the benchmarks all read. No torch import here, so `--help` stays instant.

A new drafter is one class (tr_engine/core/drafters.py says what it implements) and one line in DRAFTERS, or, from
outside the package, one call to register_drafter.
"""

import importlib

from tr_engine.errors import InvalidValue

# method -> its drafter, as "module:Class" (imported when first used) or the class itself
DRAFTERS: dict[str, object] = {
    "tr": "tr_engine.core.drafters:TokenRecycling",  # Token Recycling: the recycling matrix's tree
    "pld": "tr_engine.core.drafters:PromptLookup",  # prompt lookup: the continuation of an earlier match, as a chain
    "hybrid": "tr_engine.core.hybrid:Hybrid",  # Token Recycling's tree with prompt lookup's chain merged in
}
AR = "ar"  # plain greedy (or sampled) decoding, one token per forward: no drafter
# What a user gets unless they ask: the fastest exact method measured on this project's machines (hybrid beats
# Token Recycling alone in every Spec-Bench group of the dev split; README, "Benchmarks").
DEFAULT_METHOD = "hybrid"
ADAPTIVE = "adaptive"
# Candidates kept per token in the recycling matrix, at most: the CUDA recycle kernel keeps a row's best k in
# registers, up to 16 of them (csrc/cuda/recycle_update.cu). The paper keeps 8.
MAX_MATRIX_K = 16


def methods() -> tuple[str, ...]:
    """Every method a caller may ask for: plain decoding, then the registered drafters."""
    return (AR, *DRAFTERS)


def register_drafter(name: str, drafter) -> None:
    """Add a drafter (a class, or "module:Class") as method `name`, for the engine and the command-line tools."""
    if not isinstance(name, str) or not name or name == AR:
        raise ValueError(f"a drafter needs a name other than {AR!r}, got {name!r}")
    DRAFTERS[name] = drafter


def drafter_class(name: str):
    """The class registered as method `name` (importing it on first use)."""
    entry = DRAFTERS[name]
    if isinstance(entry, str):
        module, _, cls = entry.partition(":")
        entry = DRAFTERS[name] = getattr(importlib.import_module(module), cls)
    return entry


def check_method(method: str) -> str:
    """`method` if it is a decode method's name (a one-line error naming the choices otherwise)."""
    if not isinstance(method, str) or method not in methods():
        raise InvalidValue(f"unknown method {method!r}; choose one of {', '.join(methods())}")
    return method
