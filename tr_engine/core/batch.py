"""The decode driver: requests admitted (prefilled), stepped (tr_engine/core/speculative.py's `step`), stopped and
retired, up to N sequences in one forward per step, each exactly what it would be decoded alone. One sequence runs
through the same loop (speculative_steps: its cache as a batch of one slot, BatchKVCache.of).

Every step, each active sequence drafts as it would alone (the same drafter object for all: its per-step state
travels in the Draft, and Token Recycling's matrix is shared, so every sequence teaches every other), and one
forward verifies all the drafts: a ragged batch, each sequence with its own prefix, tree and cache slot
(tree_attention_batch). Then each sequence accepts, compacts its own slot and commits, as in the single-sequence loop
(tr_engine/core/speculative.py), and the matrix recycles every sequence's verify in request order (arrival order, never
the slot a sequence happens to occupy), each breadth-first: where several sequences write one row in a step, the
last request's last node wins.

Exact: the CPU kernels are row-independent (a row's bits depend on its own query and keys, whatever else the call
holds), and the rest of the model works row by row, so a sequence's logits in a batch are bit for bit the ones it
gets alone; what it accepts and commits is then plain decoding's (tests/test_batch.py holds it to that).

Continuous batching: a request joins at the next step boundary once a slot is free (its prompt prefilled alone, in
its slot, between steps), and leaves when it ends; its slot is reused at once. A long prompt that joins while others
decode is prefilled a chunk at a time, one chunk between two of their steps (`prefill_chunk`), so that it holds them
up for one chunk's forward at most, not for its whole prefill: the chunks cache the same K/V and give the same logits
as one prefill where the model says so (Llama.chunks_exact: the CPU kernels attend each row as its decode step would),
and only there are prompts cut. A request that cannot run (an empty or oversize prompt) fails alone, with a one-line
error, and the others go on.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tr_engine.core.decode import uncached
from tr_engine.core.drafters import Draft
from tr_engine.core.generation import DraftCounts, Generation, run_to_end
from tr_engine.core.sampling import Sampler, greedy
from tr_engine.core.speculative import PHASES, PhaseClock, prefill_and_seed, step, stop
from tr_engine.errors import UserError
from tr_engine.model.kv_cache import BatchKVCache, KVCache
from tr_engine.model.llama import Llama, RaggedBatch


@dataclass
class Request:
    """One prompt's decoding. `id` orders the requests (the order they recycle into the matrix in a step)."""

    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampler: Sampler | None = None
    slot: int | None = None
    out: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    verify_tokens: list[int] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    started: float = 0.0  # when its decoding began (after its prefill)
    cancel_event: threading.Event = field(default_factory=threading.Event)  # set from any thread: cancel()
    ignore_eos: bool = False  # decode past the end-of-sequence token, to max_new_tokens (a benchmark's fixed length)
    max_draft: int | None = None  # the most draft tokens one of its steps verifies (0: plain steps; None: the tree's)
    prefilled: int = 0  # prompt tokens its prefill ran (those its cache did not hold already)
    reused: int = 0  # prompt tokens its cache held already (an earlier turn's, or a shared system prompt's)
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # its steps', by phase
    drafts: DraftCounts = field(default_factory=DraftCounts)  # draft tokens verified and accepted, by source
    history: list[int] = field(init=False, repr=False)  # the prompt and the answer so far, kept as they grow

    def __post_init__(self):
        self.history = list(self.prompt_ids) + self.out

    def cancel(self) -> None:
        """Leave at the next step boundary (or before joining), the slot freed; safe from any thread."""
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def commit(self, tokens: list[int]) -> None:
        self.out += tokens
        self.history += tokens

    def generation(self, eos_ids) -> Generation:
        reason = "cancelled" if self.cancelled else "eos" if self.out and self.out[-1] in eos_ids else "length"
        return Generation(token_ids=self.out, finish_reason=reason,
                          prompt_tokens=self.prefilled, prefill_s=self.prefill_s,
                          decode_s=time.perf_counter() - self.started, steps=len(self.accept_lengths),
                          accept_lengths=self.accept_lengths, verify_tokens=self.verify_tokens,
                          step_end_s=self.step_end_s, phase_s=self.phase_s, drafts=self.drafts)


@dataclass
class Event:
    """What a step did for one request: the tokens it committed, and when the request ended, its Generation (or,
    when it could not run, its one-line error; a cancelled request has both: what it generated, and "cancelled")."""

    request: int
    tokens: list[int]
    done: Generation | None = None
    error: str | None = None


END = object()  # what a request source's take() returns once no request will come again


class Listed:
    """A request source over an iterable of Requests (in id order): all of them, read as slots free up."""

    def __init__(self, requests):
        self.pending = iter(requests)

    def take(self, block: bool):
        return next(self.pending, END)

    @staticmethod
    def leaving(active: list[Request]) -> list[Request]:
        return [r for r in active if r.cancelled]


def batch_steps(model: Llama, cache: BatchKVCache, requests, drafter, eos_ids: tuple[int, ...], ops,
                limit: int | None = None, reuse_prefix: bool = False, seed_matrix: Callable | None = None,
                plain_above: int | None = None, pace: Callable[[], None] | None = None,
                prefill_chunk: int | None = None):
    """Decode `requests` with at most `limit` (default cache.slots) of them in each forward, drafting with `drafter`
    (None: plain decoding). Yields Events as tokens are committed; a request ends with an Event carrying its
    Generation or its error. `requests` is an iterable of Requests in id order, or a source whose take(block)
    returns the next Request, None when none is waiting yet, or END, and whose leaving(active) returns the running
    requests to drop (tr_engine/serving/scheduler.py: requests that arrive while the batch runs, and leave when
    cancelled). A cancelled request leaves at the next step boundary with the error "cancelled". With `reuse_prefix`, a
    request takes the free slot that holds
    the longest start of its prompt (a finished request's prompt and answer stay in its slot) and prefills only the
    rest: the same bits as a cold prefill, the kernels being row-independent. `seed_matrix(ids, logits)`, if given,
    receives every prefill's logits at each prefilled position (Token Recycling's optional prompt seeding). With
    `plain_above`, a step of more sequences than that decodes plainly (--speculative-config's disable_by_batch_size);
    a request's `max_draft` caps its own drafts. A batch of several whose adaptive plan drafts nothing (no tree pays for
    its verify and the drafter's own host work) decodes plainly, without the drafter, for its PLAIN_STEPS steps or
    until the batch shrinks, then plans again. `pace()`, if given, is called before each step (the engine's CPU
    thread count following the machine's load: tr_engine/model/threads.py). With `prefill_chunk`, a prompt of more
    new tokens than that which joins while other requests decode is prefilled that many tokens at a time, one chunk
    between two steps, where chunks are exact (model.chunks_exact; elsewhere whole, as without it)."""
    limit = cache.slots if limit is None else min(limit, cache.slots)
    source, active = requests if hasattr(requests, "take") else Listed(requests), {}
    clock, before = PhaseClock(), {}  # the steps' seconds by phase (the whole batch's), and at the last step's start
    chunk = prefill_chunk if prefill_chunk and model.chunks_exact else None
    joining: dict[int, Request] = {}  # requests whose prompts are being prefilled a chunk at a time, in arrival order

    def ends(r: Request) -> tuple[int, ...]:
        return () if r.ignore_eos else eos_ids

    def admit(r: Request):
        """Take a slot for `r` and prefill its prompt whole (then it is active: its first token's Event, or its
        error's), or, when it is long and others decode, leave it joining, a chunk at each step boundary (None)."""
        r.slot = cache.take(r.prompt_ids if reuse_prefix else None)
        view = cache.view(r.slot)
        try:
            if not r.prompt_ids:
                raise UserError("the prompt is empty; give some text to answer")
            new = uncached(view, r.prompt_ids)  # (a batch's slot holds nothing; a conversation's cache, its turns)
            view.check_room(len(new) + r.max_new_tokens, "the prompt plus --max-new-tokens")
        except UserError as e:
            cache.give_back(r.slot, r.prompt_ids)  # (what it held before still holds)
            return Event(r.id, [], error=str(e))
        r.reused = len(r.prompt_ids) - len(new)
        if chunk is not None and len(new) > chunk and (active or joining):
            joining[r.id] = r  # (its chunks come one per step boundary, from the next one on)
            return None
        return prefill_rest(r)

    def prefill_rest(r: Request, most: int | None = None):
        """Prefill the next `most` (default: all) of `r`'s prompt tokens its slot does not hold yet; after the last,
        `r` joins the active requests with its first token (the Event returned; None before that)."""
        view = cache.view(r.slot)
        new = uncached(view, r.prompt_ids)
        part = new if most is None else new[:most]
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                logits = prefill_and_seed(model, view, part, seed_matrix)
                done = len(part) == len(new)
                first = None if not done else int(greedy(logits, ops)) if r.sampler is None else \
                    r.sampler.draw(logits, 0)
        except BaseException:  # Ctrl-C in a prefill, say: the slot is free again (keeping the chunks done)
            joining.pop(r.id, None)
            cache.give_back(r.slot, r.prompt_ids)
            raise
        r.prefill_s += time.perf_counter() - t0
        r.prefilled += len(part)
        if not done:
            return None
        joining.pop(r.id, None)
        r.started = time.perf_counter()
        r.commit([first])
        active[r.id] = r
        return Event(r.id, [first])

    def joined(event: Event, r: Request) -> Event:
        """`event` (a request's first token), ended at once where that token already ends it."""
        if event.error is None and (event.tokens[0] in ends(r) or r.max_new_tokens == 1):
            event.done = finish(r)
        return event

    remember = getattr(drafter, "remember", None)  # a drafter that learns from whole sequences (a suffix index)
    adaptive = getattr(drafter, "adaptive", None)
    plain_for, plain_size = 0, 0  # steps left to decode plainly, while the batch keeps at least plain_size sequences

    def finish(r: Request) -> Generation:
        view = cache.view(r.slot)  # the cache keeps the sequence only: every committed token but the last
        view.length = min(view.length, len(r.history) - 1)
        cache.give_back(r.slot, r.history)
        del active[r.id]
        if remember is not None:
            remember(r.history)
        return r.generation(ends(r))

    def drop(r: Request) -> Generation:
        """A joining request cancelled before its first token: its slot back, with the chunks it prefilled."""
        del joining[r.id]
        cache.give_back(r.slot, r.prompt_ids)
        r.started = time.perf_counter()
        return r.generation(ends(r))

    ended = False
    try:
        while True:
            if pace is not None:
                pace()
            for r in source.leaving(list(active.values()) + list(joining.values())):  # cancelled since the last step
                yield Event(r.id, [], done=drop(r) if r.id in joining else finish(r), error="cancelled")
            while not ended and cache.free() and len(active) + len(joining) < limit:  # join at the step boundary
                r = source.take(block=not active and not joining)
                if r is None:
                    break
                if r is END:
                    ended = True
                    break
                event = admit(r)
                if event is not None:
                    yield joined(event, r)
            if joining:  # one chunk of the earliest joining prompt between two steps (all of it when none decodes)
                r = next(iter(joining.values()))
                event = prefill_rest(r, chunk if active else None)
                if event is not None:
                    yield joined(event, r)
            if not active:
                if ended and not joining:
                    return
                continue
            order = sorted(active.values(), key=lambda r: r.id)  # request order: the order they recycle in
            slots = [r.slot for r in order]
            if len(order) < plain_size:  # the batch shrank: its plain spell ends, the next step plans again
                plain_for = 0
            drafting = drafter if (plain_above is None or len(order) <= plain_above) and not plain_for else None
            plain_for = max(plain_for - 1, 0)
            limits = None if all(r.max_draft is None for r in order) else [
                None if r.max_draft is None else r.max_draft + 1 for r in order]
            drafts, accepted = step(model, [cache.view(s) for s in slots], [r.history for r in order], drafting, ops,
                                    [r.sampler for r in order], [len(r.out) for r in order],
                                    verify_many=lambda drafts: verify_batch(model, cache, slots, drafts), clock=clock,
                                    limits=limits)
            if drafting is not None and len(order) > 1 and adaptive is not None and \
                    all(d.tree.size == 1 for d in drafts):  # nothing pays: no drafter for a while, unless it shrinks
                plain_for, plain_size = adaptive.PLAIN_STEPS, len(order)
            now = time.perf_counter()
            spent = {phase: clock.seconds[phase] - before.get(phase, 0.0) for phase in clock.seconds}
            before = dict(clock.seconds)
            for r, draft, (path, tokens) in zip(order, drafts, accepted):
                for phase, seconds in spent.items():
                    r.phase_s[phase] += seconds
                tokens, finished = stop(tokens, len(r.out), r.max_new_tokens, ends(r))
                r.step_end_s.append(now - r.started)
                r.commit(tokens)
                r.accept_lengths.append(len(tokens))
                r.verify_tokens.append(draft.tree.size)
                r.drafts.count(draft.tree.size, draft.sources, path[: len(tokens)])
                yield Event(r.id, tokens, done=finish(r) if finished else None)
    finally:  # stopped early (Ctrl-C, a closed stream, an error): the slots go back, emptied (a step may have been
        for r in list(active.values()) + list(joining.values()):  # cut between a compaction and its commit), the
            cache.view(r.slot).length = 0  # sequences are dropped
            cache.give_back(r.slot)
        active.clear()
        joining.clear()


def verify_batch(model: Llama, cache: BatchKVCache, slots: list[int], drafts: list[Draft]) -> torch.Tensor:
    """One forward over every sequence's root and draft nodes, each in its own slot after its own prefix (positions
    = its length + depth). Returns the logits [sum of tree sizes, V], sequence by sequence."""
    device = cache.data.device
    prefix = [cache.view(s).length for s in slots]
    sizes = [d.tree.size for d in drafts]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    tokens = torch.cat([d.tokens for d in drafts])
    positions = torch.cat([d.tree.depth + p for d, p in zip(drafts, prefix)])
    seq = torch.tensor([s for s, n in zip(slots, sizes) for _ in range(n)], device=device)
    pos = torch.tensor([p + i for p, n in zip(prefix, sizes) for i in range(n)], device=device)
    batch = RaggedBatch(slots=slots, prefix_lens=prefix, offsets=offsets,
                        tree_masks=torch.cat([d.tree.mask.reshape(-1) for d in drafts]), seq=seq, pos=pos)
    return model(tokens, positions, cache.data, 0, batch=batch)


def speculative_steps(model: Llama, cache: KVCache | BatchKVCache, context_ids: list[int], drafter,
                      max_new_tokens: int, eos_ids: tuple[int, ...], ops, seed_matrix=None,
                      sampler: Sampler | None = None, ignore_eos: bool = False,
                      cancel: threading.Event | None = None, reuse_prefix: bool = False,
                      pace: Callable[[], None] | None = None):
    """One sequence through batch_steps, drafting with `drafter`: yields each step's committed tokens (the first
    token alone first), greedy or, with `sampler`, sampled. `cache` is a KVCache (emptied first), or a one-slot
    BatchKVCache that remembers what it holds: with `reuse_prefix`, the start of `context_ids` it holds already (an
    earlier turn of the conversation) is not prefilled again. `seed_matrix` as batch_steps'. With `ignore_eos` it
    decodes past the end-of-sequence token to max_new_tokens; once `cancel` (an Event, set from any thread) is set, it
    ends at the next step boundary with finish_reason "cancelled"; `pace` as batch_steps'. Returns the Generation; a
    request that cannot run (too long for the cache) raises its one-line error."""
    slots = cache if isinstance(cache, BatchKVCache) else BatchKVCache.of(cache)
    request = Request(0, context_ids, max_new_tokens, sampler, ignore_eos=ignore_eos,
                      cancel_event=cancel or threading.Event())
    for event in batch_steps(model, slots, [request], drafter, eos_ids, ops, reuse_prefix=reuse_prefix,
                             seed_matrix=seed_matrix, pace=pace):
        if event.error is not None and event.done is None:
            raise UserError(event.error)
        yield event.tokens
        if event.done is not None:
            return event.done


def speculative_generate(model, cache, context_ids, drafter, max_new_tokens, eos_ids, ops,
                         seed_matrix=None, sampler: Sampler | None = None, ignore_eos: bool = False) -> Generation:
    """speculative_steps without streaming."""
    return run_to_end(speculative_steps(model, cache, context_ids, drafter, max_new_tokens, eos_ids, ops,
                                        seed_matrix, sampler, ignore_eos))
