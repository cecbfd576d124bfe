"""What a call generated: the driver's Generation (ids, finish reason, timings) and the API's GenerateResult (its
text beside them), and run_to_end, which drives a decode generator without streaming."""

from dataclasses import dataclass, field


@dataclass
class Generation:
    """What one call generated: the new ids (ending with the EOS id when finish_reason == 'eos') and its timings."""

    token_ids: list[int]
    finish_reason: str  # "eos", "length", or "cancelled" (asked to stop: Engine.stream's cancel)
    prompt_tokens: int  # tokens prefilled by this call (the context minus what the cache already held)
    prefill_s: float
    decode_s: float
    steps: int  # forwards after the prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed by each step
    phase_s: dict[str, float] = field(default_factory=dict)  # decode seconds by phase (speculative methods)
    verify_tokens: list[int] = field(default_factory=list)  # tokens each step's forward verified (root included)
    step_end_s: list[float] = field(default_factory=list)  # batched: when each step ended, in seconds of decode_s


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    generation: Generation
    error: str | None = None  # a request of a batch that could not run: why, in one line (nothing generated)

    @property
    def tokens_per_s(self) -> float:
        g = self.generation
        return len(g.token_ids) / (g.prefill_s + g.decode_s) if g.token_ids else 0.0

    @property
    def mean_accepted(self) -> float:
        """MAT: tokens committed per decode step, the bonus token included (the paper's measure)."""
        lengths = self.generation.accept_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    def as_dict(self) -> dict:
        g = self.generation
        histogram = {}
        for a in g.accept_lengths:
            histogram[a] = histogram.get(a, 0) + 1
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": g.prompt_tokens,
            "new_tokens": len(g.token_ids),
            "finish_reason": g.finish_reason,
            "steps": g.steps,
            "prefill_s": round(g.prefill_s, 6),
            "decode_s": round(g.decode_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "mean_accepted_tokens": round(self.mean_accepted, 4),
            "accept_length_histogram": dict(sorted(histogram.items())),
            "phase_s": {k: round(v, 6) for k, v in g.phase_s.items()},
        }


def run_to_end(steps) -> Generation:
    """Drive a decode generator to its end, dropping the streamed pieces; return its Generation."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def failed(error: str) -> GenerateResult:
    """The result of a batch's request that could not run."""
    return GenerateResult("", [], [], Generation([], "error", 0, 0.0, 0.0, 0), error=error)
