"""The decode methods and tree settings the engine, the command-line tools and the benchmarks accept (no torch import
here, so `--help` stays instant)."""

# ar: plain greedy; tr: Token Recycling; pld: prompt lookup; hybrid: Token Recycling's tree with prompt lookup's chain
METHODS = ("ar", "tr", "pld", "hybrid")
# What a user gets unless they ask: the fastest exact method measured on this project's machines (hybrid beats
# Token Recycling alone in every Spec-Bench group of the dev split; README, "Benchmarks").
DEFAULT_METHOD = "hybrid"
ADAPTIVE = "adaptive"  # --tree adaptive: the cost-aware tree of tr_engine/adaptive.py
