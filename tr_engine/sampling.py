"""Sampling: temperature, top-k and top-p, plain and over a draft tree, exactly the model's distribution.

Plain decoding draws the j-th new token from the processed distribution at its position (logits / temperature, then
the top-k, then the smallest set of tokens whose probability reaches top-p) by inverse transform with the j-th number
u_j of a seeded stream of uniforms: the first token, in token-id order, whose cumulative probability exceeds u_j.

Over a draft tree (tr_engine/speculative.py: accept_sampled) the verify step walks from the root: at each node it
draws the sample of that position from the node's logits, descends to the child drafted with that token if there is
one, and otherwise commits the sample and stops. Each committed token is therefore one draw from the model's
distribution given everything committed before it (a node's logits are the model's at that prefix), drawn once and
shared by every path through the node; the drafts only decide how many of them one forward settles. Because the
walk uses u_j for the j-th new token, as plain decoding does, a seed gives the same tokens with or without drafting
(up to the rounding differences between a tree forward and a one-token forward that greedy decoding has too).

Temperature 0 is greedy decoding (argmax), the default; top-k and top-p then do nothing.
"""

from dataclasses import dataclass

import torch

from tr_engine.errors import UserError

# Top-p looks for its nucleus among this many most likely tokens first, and sorts the whole vocabulary only when they
# hold less than top-p of the probability (a flat distribution). Both give the same set.
_NUCLEUS_FIRST = 1024


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0  # 1: all tokens

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UserError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (1 keeps every token), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        return ", ".join(parts)


GREEDY = Sampling()


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution sampled from at one position: logits [V] -> probabilities [V] (float64 for float64 logits,
    else float32), zero outside the top-k and the top-p nucleus and not renormalised (sample() scales by the sum)."""
    z = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / s.temperature
    if 0 < s.top_k < z.shape[-1]:
        kth = torch.topk(z, s.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))  # ties with the k-th are kept
    p = torch.softmax(z, dim=-1)
    if s.top_p < 1:
        p = _nucleus(p, s.top_p)
    return p


def _nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest most-likely set whose probability reaches top_p (the most likely token is
    always kept)."""
    n = min(_NUCLEUS_FIRST, p.shape[-1])
    top, idx = torch.topk(p, n)  # descending
    if n < p.shape[-1] and float(top.sum()) < top_p:
        top, idx = torch.sort(p, descending=True)
    before = torch.cumsum(top, 0) - top  # mass of the more likely tokens
    keep = idx[before < top_p]
    return torch.zeros_like(p).index_copy_(0, keep, p[keep])


def sample(p: torch.Tensor, u: float) -> int:
    """Inverse transform: the first token, in id order, whose cumulative probability exceeds u times the total.
    u in [0, 1); the token returned always has a non-zero probability."""
    cdf = torch.cumsum(p, 0)
    target = torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    return int(torch.searchsorted(cdf, target, right=True).clamp_(max=p.shape[-1] - 1))


class Sampler:
    """The sampling of one generation: draw(logits, j) is the j-th new token, from the j-th uniform of a stream
    seeded by `generator` (extended as needed, so it never runs out)."""

    def __init__(self, sampling: Sampling, generator: torch.Generator, expected: int = 256):
        if sampling.greedy:
            raise ValueError("a Sampler samples; greedy decoding takes the argmax")
        self.sampling, self.generator = sampling, generator
        self.uniforms: list[float] = []
        self._extend(expected)

    def _extend(self, n: int) -> None:
        self.uniforms += torch.rand(n, generator=self.generator, dtype=torch.float64).tolist()

    def uniform(self, j: int) -> float:
        while j >= len(self.uniforms):
            self._extend(max(64, len(self.uniforms)))
        return self.uniforms[j]

    def draw(self, logits: torch.Tensor, j: int) -> int:
        return sample(probabilities(logits, self.sampling), self.uniform(j))
