"""tr_engine: Token Recycling (Luo et al., ACL 2025) — lossless speculative decoding with no draft model.

Data flows config -> weights -> model -> decode loop; see README.md for the map of the package.
"""

__version__ = "0.1.0"
