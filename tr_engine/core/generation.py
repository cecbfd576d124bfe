"""What a call generated: the driver's Generation (ids, finish reason, timings) and the API's GenerateResult (its
text beside them); run_to_end, which drives a decode generator without streaming, and batch_results, which turns a
batch's events into each prompt's text and result."""

from dataclasses import dataclass, field

from tr_engine.core.drafters import SOURCES, source_names
from tr_engine.model.tokenizer import StreamDecoder


@dataclass
class DraftCounts:
    """A generation's draft tokens (every node its verifies checked, roots left out) and how many of them it committed
    (bonus tokens left out), in all and by the source that proposed them (tr_engine/core/drafters.py's SOURCES: a node
    two sources proposed counts for both, once in the totals)."""

    drafted: int = 0
    accepted: int = 0
    by_source: dict[str, list[int]] = field(default_factory=lambda: {s: [0, 0] for s in SOURCES})  # [drafted, accepted]
    histogram: dict[int, int] = field(default_factory=dict)  # draft tokens accepted by a step -> steps

    def count(self, size: int, sources: list[int], path: list[int]) -> None:
        """One step: the draft's size (root included), its per-node source bits (root first; empty from a drafter
        that does not say: counted in the totals only) and the nodes accepted."""
        self.drafted += size - 1
        self.accepted += len(path)
        self.histogram[len(path)] = self.histogram.get(len(path), 0) + 1
        if not sources:
            return
        for which, nodes in ((0, range(1, len(sources))), (1, path)):
            for node in nodes:
                for name in source_names(sources[node]):
                    self.by_source[name][which] += 1

    def add(self, other: "DraftCounts") -> None:
        """Fold another generation's counts into these (a server's totals)."""
        self.drafted += other.drafted
        self.accepted += other.accepted
        for n, steps in other.histogram.items():
            self.histogram[n] = self.histogram.get(n, 0) + steps
        for name, (d, a) in other.by_source.items():
            self.by_source[name][0] += d
            self.by_source[name][1] += a


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
    drafts: DraftCounts = field(default_factory=DraftCounts)  # draft tokens verified and accepted, by source

    def speculative(self) -> dict:
        """The speculative numbers in the shape vLLM reports per request (`metrics.speculative_decoding`): verify
        steps (drafts), draft tokens (every tree node, roots left out) and those accepted (bonus tokens left out), mean
        acceptance length (1 + accepted per step: the bonus counted), acceptance rate, the histogram of accepted draft
        tokens per step, and the same counts by source (matrix, lookup, suffix)."""
        d, steps = self.drafts, self.steps
        return {"num_drafts": steps, "num_draft_tokens": d.drafted, "num_accepted_tokens": d.accepted,
                "mean_acceptance_length": round(1 + d.accepted / steps, 4) if steps else 0.0,
                "acceptance_rate": round(d.accepted / d.drafted, 4) if d.drafted else 0.0,
                "acceptance_histogram": dict(sorted(d.histogram.items())),
                "by_source": {name: {"num_draft_tokens": n, "num_accepted_tokens": a}
                              for name, (n, a) in d.by_source.items()}}

    def timings(self, cached: int = 0) -> dict:
        """llama.cpp's server `timings`: prompt and predicted tokens and milliseconds, tokens per second, tokens the
        cache held (`cache_n`), and the draft's tokens and those accepted (`draft_n`, `draft_n_accepted`)."""
        prompt_ms, predicted_ms = 1000 * self.prefill_s, 1000 * self.decode_s
        n = len(self.token_ids)
        return {"cache_n": cached, "prompt_n": self.prompt_tokens, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_second": round(1000 * self.prompt_tokens / prompt_ms, 3) if prompt_ms else 0.0,
                "predicted_n": n, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_second": round(1000 * n / predicted_ms, 3) if predicted_ms else 0.0,
                "draft_n": self.drafts.drafted, "draft_n_accepted": self.drafts.accepted}


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    generation: Generation
    error: str | None = None  # a request of a batch that could not run: why, in one line (nothing generated)

    @classmethod
    def of(cls, gen: Generation, prompt_ids: list[int], tokenizer) -> "GenerateResult":
        """A generation as the API returns it: its text (without the end-of-sequence token that ended it), ids and
        timings."""
        text_ids = gen.token_ids[:-1] if gen.finish_reason == "eos" else gen.token_ids
        return cls(tokenizer.decode(text_ids), gen.token_ids, prompt_ids, gen)

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
            "speculative_decoding": g.speculative(),
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


def batch_results(tokenizer, ids: list, events):
    """Drive a batch's events (tr_engine/core/batch.py) for prompts whose token ids are `ids` (a prompt refused before
    it ran: its UserError instead), yielding (prompt index, text piece) as tokens are accepted; return one
    GenerateResult per prompt, in order (one that could not run: `error` set, no tokens)."""
    results = [failed(f"prompt {i}: {p}") if isinstance(p, Exception) else None for i, p in enumerate(ids)]
    texts = {i: StreamDecoder(tokenizer, p) for i, p in enumerate(ids) if results[i] is None}
    for event in events:
        i = event.request
        if event.error is not None:
            results[i] = failed(f"prompt {i}: {event.error}")
            continue
        if piece := texts[i].take(event.tokens, end=event.done is not None):
            yield i, piece
        if event.done is not None:
            results[i] = GenerateResult.of(event.done, ids[i], tokenizer)
    return results
