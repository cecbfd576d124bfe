"""Sampling: temperature, top-k and top-p, plain and over a draft tree, exactly the model's distribution.

Plain decoding draws the j-th new token from the processed distribution at its position (logits / temperature, then
the top-k, then the smallest set of tokens whose probability reaches top-p) with the Gumbel-max trick: the token whose
log-probability plus Gumbel noise is largest, the noise of position j coming from a generator seeded by (the call's
seed, j) alone. The argmax of log p_k + G_k, with G_k independent Gumbel variables, is distributed exactly as p.

Over a draft tree (tr_engine/core/speculative.py: accept_sampled) the verify step walks from the root: at each node it
draws the sample of that position from the node's logits, descends to the child drafted with that token if there is
one, and otherwise commits the sample and stops. Each committed token is therefore one draw from the model's
distribution given everything committed before it (a node's logits are the model's at that prefix), drawn once and
shared by every path through the node; the drafts only decide how many of them one forward settles. Because the
walk uses position j's noise for the j-th new token, as plain decoding does, a seed gives the same tokens with or
without drafting. With the CPU kernels a tree forward computes each node's logits bit for bit as a one-token forward
does, so that holds exactly; where a tree forward rounds a little differently (PyTorch's kernels on a GPU), Gumbel-max
changes a draw only when the two best perturbed scores are that close, as rare as a near-tie in greedy decoding
(inverse-transform sampling, by contrast, moves with the rounding error summed along the whole cumulative sum).

Temperature 0 is greedy decoding (argmax), the default; top-k and top-p then do nothing.
"""

from dataclasses import dataclass

import torch

from tr_engine import checks
from tr_engine.errors import InvalidType, InvalidValue

# Top-p looks for its nucleus among this many most likely tokens first, and sorts the whole vocabulary only when they
# hold less than top-p of the probability (a flat distribution). Both give the same set.
_NUCLEUS_FIRST = 1024


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0  # 1: all tokens

    def __post_init__(self):
        # Any finite temperature above 0 works, however small: probabilities() divides logits already shifted to a
        # maximum of 0, which cannot overflow (a tiny temperature is greedy decoding, ties shared).
        # Kept as the checks return them: a float (an int temperature of 2**64 would not divide a tensor).
        object.__setattr__(self, "temperature", checks.real(self.temperature, "--temperature (0 is greedy)", 0.0))
        checks.integer(self.top_k, "--top-k (0 keeps every token)", 0)
        object.__setattr__(self, "top_p", checks.real(self.top_p, "--top-p (1 keeps every token)", 0.0, 1.0,
                                                      low_open=True))

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


def sampling_of(sampling: Sampling | None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Sampling:
    """A call's one Sampling: `sampling` as it was built (and checked) where the request came in, a command's flags
    or an HTTP body, passed on untouched; or, without it, one built from the keywords of the Python API."""
    if sampling is None:
        return Sampling(temperature, top_k, top_p)
    if not isinstance(sampling, Sampling):
        raise InvalidType(f"sampling must be a Sampling, got {type(sampling).__name__}")
    if (temperature, top_k, top_p) != (0.0, 0, 1.0):
        raise InvalidValue("give sampling= or temperature/top_k/top_p, not both")
    return sampling


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution sampled from at one position: logits [V] -> probabilities [V] (float64 for float64 logits,
    else float32), zero outside the top-k and the top-p nucleus and not renormalised (sample() scales by the sum)."""
    # float64 below float32's smallest normal temperature: there a float32 division would round the temperature
    # itself to 0 (1e-46, 5e-324) or lose the subnormal's bits, and 0 / 0 is NaN; in float64 every positive
    # temperature divides, the best token scoring 0 and the rest -inf (the limit T -> 0: greedy, ties shared)
    wide = logits.dtype == torch.float64 or s.temperature < torch.finfo(torch.float32).tiny
    z = logits.to(torch.float64 if wide else torch.float32)
    z = (z - z.max()) / s.temperature  # <= 0 everywhere: no overflow to inf - inf = NaN at tiny temperatures
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


def greedy(logits: torch.Tensor, ops) -> torch.Tensor:
    """logits.argmax(dim=-1), the same index bit for bit (ties go to the lowest id, a NaN counts as the largest
    value), with the model's `ops` (tr_engine.model.ops): CPU float32/float64 logits take ops.argmax_rows, one op where
    PyTorch's CPU argmax carries an index with every element (~0.9 ns each here: 85 us for a row of SmolLM2's 49,152
    logits) and where any chain of small ops pays tens of microseconds a dispatch right after a step has streamed the
    weights. Elsewhere (a GPU, half types) logits.argmax(dim=-1)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(p: torch.Tensor, noise: torch.Tensor) -> int:
    """Gumbel-max: the token maximising log p + noise, with `noise` [V] standard Gumbel variables; never a token of
    probability zero (its score is -inf)."""
    return int(torch.argmax(torch.log(p) + noise))


def gumbel_noise(seed: int, j: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [V] (float64) for position j of the call seeded `seed`: a function of (seed, j) alone."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + j) % 2**63)
    u = torch.rand(vocab, generator=g, dtype=torch.float64)
    return -torch.log(-torch.log(u))  # u = 0 gives -inf: that token is never drawn


class Sampler:
    """The sampling of one generation: draw(logits, j) is the j-th new token, with position j's noise."""

    def __init__(self, sampling: Sampling, seed: int):
        if sampling.greedy:
            raise ValueError("a Sampler samples; greedy decoding takes the argmax")
        self.sampling, self.seed = sampling, seed

    @classmethod
    def of(cls, sampling: Sampling, seed: int | None, rng: torch.Generator) -> "Sampler | None":
        """The draws of one sampled call (None when greedy): from `seed`, else from a seed taken off `rng` (an
        engine's stream, one per call whatever the method, so seeded runs repeat exactly)."""
        if sampling.greedy:
            return None
        return cls(sampling, int(torch.randint(2**62, (1,), generator=rng)) if seed is None else seed)

    def noise(self, j: int, vocab: int) -> torch.Tensor:
        return gumbel_noise(self.seed, j, vocab)

    def draw(self, logits: torch.Tensor, j: int) -> int:
        p = probabilities(logits, self.sampling)
        return sample(p, self.noise(j, p.shape[-1]).to(p.device, p.dtype))
