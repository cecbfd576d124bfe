"""Batched decoding (tr_engine/core/batch.py): every request in a batch gets exactly the tokens it gets alone, whatever
rides with it, whenever it joins, and whichever slot it lands in; the ragged attention op; bad requests fail alone."""

import pytest
import torch

from curves import pinned
from tr_engine.engine import Engine
from tr_engine.errors import InvalidType
from tr_engine.model import reference
from tr_engine.model.ops import load_ops

kernels = load_ops("kernels")
PROMPTS = ["hello there", "a b c a b c a b c", "the cat sat on the mat and the cat", "why?", "one two three four",
           "hello hello hello", "tell me about the sea", "x"]


def ragged(dtype, sizes=(3, 1, 5), slots=(2, 0, 3), prefixes=(7, 0, 12), N=4, S=24, Hq=4, Hkv=2, D=16):
    g = torch.Generator().manual_seed(5)
    T = sum(sizes)
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    k, v = (torch.randn(N, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    masks = []
    for n in sizes:
        m = torch.rand(n, n, generator=g) < 0.5
        masks.append((m | torch.eye(n, dtype=torch.bool)).tril())
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    return q, k, v, list(slots), list(prefixes), offsets, masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_sequence_of_a_batch_is_bit_for_bit_its_own_call(dtype):
    q, k, v, slots, prefixes, offsets, masks = ragged(dtype)
    flat = torch.cat([m.reshape(-1) for m in masks])
    got = kernels.tree_attention_batch(q, k, v, slots, prefixes, offsets, flat, 0.25)
    want = reference.tree_attention_batch(q, k, v, slots, prefixes, offsets, flat, 0.25)
    torch.testing.assert_close(got, want, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    for b, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        alone = kernels.tree_attention(q[lo:hi], k[slots[b]], v[slots[b]], prefixes[b], masks[b], 0.25)
        assert torch.equal(got[lo:hi], alone), b


@pytest.fixture(scope="module")
def tiny64(tiny_factory):
    return str(tiny_factory("batch64", dtype=torch.float64, vocab_size=300, std=0.5))


@pytest.fixture(scope="module")
def tiny_bf16(tiny_factory):
    return str(tiny_factory("batch-bf16", dtype=torch.bfloat16, vocab_size=300, std=0.5))


def alone(engine, prompts, n, **kwargs):
    return [engine.generate(p, max_new_tokens=n, method="ar", **kwargs).token_ids for p in prompts]


@pytest.mark.parametrize("model,dtype", [("tiny64", "float64"), ("tiny_bf16", "bfloat16")])
@pytest.mark.parametrize("method", ["ar", "tr", "hybrid", "pld"])
def test_a_batch_gives_each_request_its_tokens_alone(model, dtype, method, request):
    """8 prompts of mixed lengths and lengths of answer through 3 slots: requests join and leave mid-run."""
    engine = Engine.from_pretrained(request.getfixturevalue(model), dtype=dtype, max_batch=3)
    lengths = [40, 7, 25, 1, 33, 18, 3, 12]
    want = [engine.generate(p, max_new_tokens=n, method="ar").token_ids for p, n in zip(PROMPTS, lengths)]
    for n, w in zip(lengths, want):
        assert len(w) == n  # no EOS in the tiny vocabulary: every request runs to its own length
    got = [engine.generate_batch([p], max_new_tokens=n, method=method)[0].token_ids
           for p, n in zip(PROMPTS[:2], lengths[:2])]
    assert got == want[:2]
    # all eight at once, one max_new_tokens: a request ends when its text does (the eos case) or at the length
    results = engine.generate_batch(PROMPTS, max_new_tokens=40, method=method)
    assert [r.token_ids for r in results] == alone(engine, PROMPTS, 40)
    assert all(r.error is None and r.generation.finish_reason == "length" for r in results)


def test_requests_that_stop_at_eos_leave_and_free_their_slot(tiny64):
    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=2)
    free = alone(engine, PROMPTS, 30)
    engine.tokenizer.eos_ids = (free[0][5], free[2][9])  # some requests end early, at different steps
    want = alone(engine, PROMPTS, 30)
    results = engine.generate_batch(PROMPTS, max_new_tokens=30, method="hybrid")
    assert [r.token_ids for r in results] == want
    assert any(r.generation.finish_reason == "eos" for r in results)
    assert engine.batch_cache().free() == 2  # every slot given back


def test_a_batch_seeds_the_matrix_from_each_prompt_as_one_request_alone_does(tiny64):
    """--seed-from-prompt in a batch: each prompt's prefill seeds the shared matrix exactly as generate() seeds it
    (one token: no step recycles anything after the seeding), and the answers stay plain decoding's."""
    alone_engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=2)
    fresh = alone_engine.matrix.table.clone()
    alone_engine.generate(PROMPTS[2], max_new_tokens=1, method="tr", seed_from_prompt=True)
    seeded = alone_engine.matrix.table.clone()
    assert not torch.equal(seeded, fresh)
    batch_engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=2)
    batch_engine.generate_batch([PROMPTS[2]], max_new_tokens=1, method="tr", seed_from_prompt=True)
    assert torch.equal(batch_engine.matrix.table, seeded)
    batch_engine.generate_batch([PROMPTS[5]], max_new_tokens=1, method="tr")  # without the flag: no seeding
    assert torch.equal(batch_engine.matrix.table, seeded)
    results = batch_engine.generate_batch(PROMPTS[:4], max_new_tokens=20, method="hybrid", seed_from_prompt=True)
    assert [r.token_ids for r in results] == alone(batch_engine, PROMPTS[:4], 20)


def test_a_batched_request_reports_the_seconds_of_its_steps_by_phase(tiny64):
    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=3)
    for r in engine.generate_batch(PROMPTS[:5], max_new_tokens=12, method="hybrid"):
        g = r.generation
        assert set(g.phase_s) == {"retrieve", "verify", "accept", "compact", "recycle"}
        assert all(s >= 0 for s in g.phase_s.values()) and 0 < sum(g.phase_s.values()) <= g.decode_s


def test_seeded_sampling_in_a_batch_is_each_requests_own(tiny64):
    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=3)
    want = [engine.generate(p, max_new_tokens=20, method="ar", temperature=0.8, seed=100 + i).token_ids
            for i, p in enumerate(PROMPTS)]
    for method in ("ar", "tr", "hybrid"):
        got = engine.generate_batch(PROMPTS, max_new_tokens=20, method=method, temperature=0.8, seed=100)
        assert [r.token_ids for r in got] == want, method


def test_the_shared_matrix_is_written_in_request_order_whatever_the_slots(tiny64):
    """Identical prompts write the same matrix rows in the same step; the result is the one of recycling the
    requests one after another in request order, and does not depend on which slot each request occupies."""
    prompts = ["hello hello", "hello hello", "a b a b", "hello hello"]
    first = Engine.from_pretrained(tiny64, dtype="float64", max_batch=4, tree="2.2.2")
    first.generate_batch(prompts, max_new_tokens=12, method="tr")
    second = Engine.from_pretrained(tiny64, dtype="float64", max_batch=4, tree="2.2.2")
    cache = second.batch_cache()

    def highest_first(ids=None) -> int:  # the slots handed out in the opposite order
        slot = max(cache._free)
        cache._free.remove(slot)
        cache.view(slot).reset()
        return slot

    cache.take = highest_first
    second.generate_batch(prompts, max_new_tokens=12, method="tr")
    assert torch.equal(first.matrix.table, second.matrix.table)
    assert torch.equal(first.matrix.confidence, second.matrix.confidence)


def test_a_bad_request_fails_alone(tiny64):
    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=2, max_context=64)
    prompts = ["hello there", "   ", "word " * 80, "why?"]
    results = engine.generate_batch(prompts, max_new_tokens=10, method="tr")
    assert "prompt 1" in results[1].error and "empty" in results[1].error and not results[1].token_ids
    assert "prompt 2" in results[2].error and "--max-context" in results[2].error
    assert [r.token_ids for r in (results[0], results[3])] == alone(engine, [prompts[0], prompts[3]], 10)
    with pytest.raises(InvalidType):
        engine.generate_batch("hello", max_new_tokens=4)


def test_stream_batch_yields_each_requests_text(tiny64):
    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=2)
    pieces = {}
    steps = engine.stream_batch(PROMPTS[:5], max_new_tokens=16, method="hybrid")
    while True:
        try:
            i, piece = next(steps)
        except StopIteration as done:
            results = done.value
            break
        pieces[i] = pieces.get(i, "") + piece
    assert [pieces.get(i, "") for i in range(5)] == [r.text for r in results]


LONG = ["the sea " * 12 + "and the cat sat on the mat", "one two three four five six seven " * 4]


def logged_batch(monkeypatch, engine, prompts, lengths, method="ar"):
    """Decode `prompts` (each to its own length) in engine's batch, logging what happens between two steps: ("prefill",
    request id, tokens) for each prefill call and ("step", the request ids stepped) for each step. Returns the
    requests' tokens by id and the log."""
    import tr_engine.core.batch as batch
    from tr_engine.core.batch import Request

    log, prefill, step = [], batch.prefill_and_seed, batch.step
    now = {}

    def logged_prefill(model, cache, ids, seed_matrix=None):
        log.append(("prefill", now["request"], len(ids)))
        return prefill(model, cache, ids, seed_matrix)

    def logged_step(model, caches, histories, *args, **kwargs):
        log.append(("step", len(histories)))
        return step(model, caches, histories, *args, **kwargs)

    monkeypatch.setattr(batch, "prefill_and_seed", logged_prefill)
    monkeypatch.setattr(batch, "step", logged_step)
    requests = [Request(i, engine.prompt_ids(p), n) for i, (p, n) in enumerate(zip(prompts, lengths))]
    for r in requests:  # (the prefill logs the request whose slot it fills)
        r.prompt_ids = _Tagged(r.prompt_ids, r.id, now)
    out = {r.id: [] for r in requests}
    for event in engine.batch_loop(requests, method):
        assert event.error is None, event.error
        out[event.request] += event.tokens
    return out, log


class _Tagged(list):
    """A prompt's ids that say whose they are when a prefill takes a slice of them (logged_batch)."""

    def __init__(self, ids, request, now):
        super().__init__(ids)
        self.request, self.now = request, now

    def __getitem__(self, i):
        self.now["request"] = self.request
        return super().__getitem__(i)


@pytest.mark.parametrize("model,dtype", [("tiny64", "float64"), ("tiny_bf16", "bfloat16")])
@pytest.mark.parametrize("method", ["ar", "hybrid"])
def test_a_long_prompt_joins_a_chunk_between_steps_and_every_answer_stays_its_own(model, dtype, method, request,
                                                                                   monkeypatch):
    """A long prompt that joins while others decode is prefilled --prefill-chunk tokens at a time, one chunk
    between two steps of the others (never more than one chunk holds them up), and every request, the long ones
    too, gets exactly the tokens it gets alone."""
    engine = Engine.from_pretrained(request.getfixturevalue(model), dtype=dtype, max_batch=2)
    prompts, lengths = [PROMPTS[0], PROMPTS[3], *LONG], [30, 3, 12, 12]
    want = [engine.generate(p, max_new_tokens=n, method="ar").token_ids for p, n in zip(prompts, lengths)]
    engine.prefill_chunk = 5
    got, log = logged_batch(monkeypatch, engine, prompts, lengths, method)
    assert [got[i] for i in range(4)] == want
    long_ids = [len(engine.prompt_ids(p)) for p in LONG]
    assert min(long_ids) > 3 * engine.prefill_chunk
    # Request 2 joins when request 1 ends, 3 when request 0 does. Once steps run, one prefill at most between two, of
    # one chunk, unless nobody else decodes (the next step steps the request alone: 3's rest once 2 has ended).
    chunks = [e for e in log if e[0] == "prefill" and e[1] >= 2]
    assert len(chunks) >= 6 and sum(n for _, r, n in chunks if r == 2) == long_ids[0]
    steps = [i for i, e in enumerate(log) if e[0] == "step"]
    for i, j in zip(steps, steps[1:]):
        between = log[i + 1 : j]
        assert len(between) <= 1 and all(n <= engine.prefill_chunk or log[j] == ("step", 1) for *_, n in between), log
    engine.prefill_chunk = None  # off: each prompt in one prefill
    got, log = logged_batch(monkeypatch, engine, prompts, lengths, method)
    assert [got[i] for i in range(4)] == want
    assert [n for e, _, n in (e for e in log if e[0] == "prefill")] == [len(engine.prompt_ids(p)) for p in prompts]


def test_prompts_are_not_cut_where_chunks_would_not_be_exact(tiny64, monkeypatch):
    """The reference ops attend a prompt chunk through PyTorch's attention, which promises no bits: whole prompts."""
    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=2, ops="reference")
    assert not engine.model.chunks_exact and Engine.from_pretrained(tiny64, dtype="float64").model.chunks_exact
    engine.prefill_chunk = 5
    prompts, lengths = [PROMPTS[0], PROMPTS[3], *LONG], [30, 3, 12, 12]
    _, log = logged_batch(monkeypatch, engine, prompts, lengths)
    assert [n for e, _, n in (e for e in log if e[0] == "prefill")] == [len(engine.prompt_ids(p)) for p in prompts]


def test_a_joining_request_cancelled_or_stopped_between_its_chunks_gives_its_slot_back(tiny64):
    from tr_engine.core.batch import Request

    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=2)
    engine.prefill_chunk = 5
    requests = [Request(i, engine.prompt_ids(p), n) for i, (p, n) in enumerate(zip([PROMPTS[0], LONG[0]], [30, 8]))]
    events = []
    for event in engine.batch_loop(requests, "hybrid"):
        events.append(event)
        if len(events) == 2:  # request 0's first step: request 1 is joining, a chunk done
            requests[1].cancel()
    cancelled = [e for e in events if e.request == 1]
    assert [(e.tokens, e.error) for e in cancelled] == [([], "cancelled")]
    assert cancelled[0].done.finish_reason == "cancelled" and 0 < cancelled[0].done.prompt_tokens < len(
        requests[1].prompt_ids)
    assert [t for e in events if e.request == 0 for t in e.tokens] == alone(engine, [PROMPTS[0]], 30)[0]
    assert engine.batch_cache().free() == 2
    steps = engine.batch_loop([Request(i, engine.prompt_ids(p), 20) for i, p in enumerate([PROMPTS[0], LONG[1]])],
                              "tr")
    for _ in range(3):  # stopped (a closed stream, Ctrl-C) while request 1 is between its chunks
        next(steps)
    steps.close()
    assert engine.batch_cache().free() == 2
    results = engine.generate_batch([PROMPTS[0], *LONG], max_new_tokens=10, method="tr")
    assert [r.token_ids for r in results] == alone(engine, [PROMPTS[0], *LONG], 10)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16"])  # (float32 rounds less: the tiny models' float32 tests hold it)
def test_smollm2_a_batch_of_8_dev_questions_is_plain_decoding_alone(smollm2_dir, dtype, request):
    """The dev split's subset (one first turn per category group) and two repeats (so several sequences write the
    same matrix rows in a step), 8 requests through 4 slots: every request's tokens are its plain decoding alone,
    with hybrid (the default: TR's tree and PLD's chain in one draft), greedy and (bf16) seeded sampling. Each
    method alone in a batch: the tiny models' test above."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(__file__).parent / "data" / "dev_subset.jsonl").read_text().splitlines()]
    prompts = [r["turns"][0] for r in rows] + [rows[0]["turns"][0], rows[3]["turns"][0]]
    TOKENS = 16  # several verify steps per request, each with 4 sequences in it
    engine = pinned(Engine.from_pretrained(str(smollm2_dir), dtype=dtype, max_context=1024, max_batch=4))
    if dtype == "float32":  # the session's plain fp32 answers (conftest.py), cut to 16 tokens: greedy, the same
        answers = [a.ids[:TOKENS] for a in request.getfixturevalue("smollm2_dev_answers")]
        assert [a.prompt for a in request.getfixturevalue("smollm2_dev_answers")] == prompts[:6]
        want = answers + [answers[0], answers[3]]
    else:
        want = alone(engine, prompts, TOKENS)
    # (bf16 is the hard case: a verify row rounds as its decode step only if the kernels are row-independent)
    got = engine.generate_batch(prompts, max_new_tokens=TOKENS, method="hybrid")
    assert [r.token_ids for r in got] == want
    if dtype == "bfloat16":  # seeded sampling in the hard case
        sampled = [engine.generate(p, max_new_tokens=TOKENS, method="ar", temperature=0.7, seed=7 + i).token_ids
                   for i, p in enumerate(prompts)]
        got = engine.generate_batch(prompts, max_new_tokens=TOKENS, method="hybrid", temperature=0.7, seed=7)
        assert [r.token_ids for r in got] == sampled


def test_a_batch_whose_plan_drafts_nothing_decodes_plainly_for_a_while(tiny64, monkeypatch):
    """Where no tree pays (every token priced a plain step), a batch's plan drafts nothing, and the next PLAIN_STEPS
    steps run without the drafter (no retrieve, no recycle); it plans again after them, or as soon as the batch
    shrinks. The answers stay plain decoding's."""
    import tr_engine.core.batch as batch
    from curves import LINEAR
    from tr_engine.core.adaptive import AdaptiveTrees

    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=4)
    engine.use_cost(LINEAR)
    free = alone(engine, PROMPTS[:4], 30)
    engine.tokenizer.eos_ids = (free[1][6],)  # one request leaves early: the batch shrinks
    want = alone(engine, PROMPTS[:4], 30)
    steps, inner = [], batch.step

    def step(model, caches, histories, drafter, *args, **kwargs):
        drafts, accepted = inner(model, caches, histories, drafter, *args, **kwargs)
        steps.append((len(histories), drafter is not None, [d.tree.size for d in drafts]))
        return drafts, accepted

    monkeypatch.setattr(batch, "step", step)
    results = engine.generate_batch(PROMPTS[:4], max_new_tokens=30, method="hybrid")
    assert [r.token_ids for r in results] == want
    assert all(sizes == [1] * n for n, _, sizes in steps)
    plain_for, size, expected = 0, 0, []  # the rule, step by step
    for n, _, _ in steps:
        drafts = not (plain_for and n >= size)
        expected.append(drafts)
        plain_for = AdaptiveTrees.PLAIN_STEPS if drafts and n > 1 else max(plain_for - 1, 0)
        size = n if drafts else size
    assert [d for _, d, _ in steps] == expected
    sizes = [n for n, _, _ in steps]
    assert len(set(sizes)) > 1 and 1 < sum(expected) < len(steps) / 3  # it shrank; planned a few times only
    shrunk = next(i for i, n in enumerate(sizes) if n < sizes[0])
    assert steps[shrunk][1]  # planned again at once


def test_a_batch_stopped_midway_gives_its_slots_back(tiny64):
    """Ctrl-C, or a stream closed by its reader: the next batch has every slot and answers as usual."""
    engine = Engine.from_pretrained(tiny64, dtype="float64", max_batch=3)
    steps = engine.stream_batch(PROMPTS, max_new_tokens=20, method="tr")
    for _ in range(5):
        next(steps)
    steps.close()
    assert engine.batch_cache().free() == 3
    results = engine.generate_batch(PROMPTS, max_new_tokens=20, method="tr")
    assert [r.token_ids for r in results] == alone(engine, PROMPTS, 20)


def test_recycling_a_batch_in_one_update_is_recycling_each_draft_in_order():
    """Rows written by several sequences in one step: the last draft's last node wins, as sequential recycles do."""
    from tr_engine.core.drafters import TokenRecycling
    from tr_engine.core.matrix import RecyclingMatrix
    from tr_engine.core.tree import load_tree

    g = torch.Generator().manual_seed(9)
    tree = load_tree("2.2.2", 8)
    drafts, one, many = [], TokenRecycling(RecyclingMatrix(60, 8), tree), TokenRecycling(RecyclingMatrix(60, 8), tree)
    for _ in range(3):
        tokens = torch.randint(0, 12, (tree.size,), generator=g)  # few ids: rows shared within and across drafts
        drafts.append(type("D", (), {"tokens": tokens})())
    logits = torch.randn(3 * tree.size, 60, generator=g)
    for d, rows in zip(drafts, logits.split(tree.size)):
        one.recycle(d, rows)
    many.recycle_batch(drafts, logits)
    assert torch.equal(one.matrix.table, many.matrix.table)
    assert torch.equal(one.matrix.confidence, many.matrix.confidence)
