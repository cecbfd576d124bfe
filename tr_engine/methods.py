"""The decode methods and tree settings the engine, the command-line tools and the benchmarks accept (no torch import
here, so `--help` stays instant)."""

# ar: plain greedy; tr: Token Recycling; pld: prompt lookup; hybrid: Token Recycling's tree with prompt lookup's chain
METHODS = ("ar", "tr", "pld", "hybrid")
# What a user gets unless they ask: the fastest exact method measured on this project's machines (hybrid beats
# Token Recycling alone in every Spec-Bench group of the dev split; README, "Benchmarks").
DEFAULT_METHOD = "hybrid"
ADAPTIVE = "adaptive"
# Candidates kept per token in the recycling matrix, at most: the CUDA recycle kernel keeps a row's best k in
# registers, up to 16 of them (csrc/cuda/recycle_update.cu). The paper keeps 8.
MAX_MATRIX_K = 16  # --tree adaptive: the cost-aware tree of tr_engine/adaptive.py
