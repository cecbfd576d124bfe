"""The batched engine as a service (tr_engine/serving/scheduler.py): requests from many threads, at any time, each
exactly what it gets alone; cancellation frees the slot; a bounded queue; a clean close."""

import asyncio
import threading

import pytest
import torch

from tr_engine.engine import Engine
from tr_engine.errors import ContextOverflow
from tr_engine.model.kv_cache import shared_prefix
from tr_engine.serving.scheduler import QueueFull, RequestError, Scheduler

PROMPTS = ["hello there", "a b c a b c", "the cat sat on the mat", "why?", "one two three", "hello hello",
           "tell me about the sea", "x"]


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return str(tiny_factory("sched64", dtype=torch.float64, vocab_size=300, std=0.5))


@pytest.mark.parametrize("method", ["ar", "hybrid"])
def test_requests_from_eight_threads_each_get_their_tokens_alone(tiny, method):
    engine = Engine.from_pretrained(tiny, dtype="float64", max_batch=3)
    want = [engine.generate(p, max_new_tokens=24, method="ar").token_ids for p in PROMPTS]
    scheduler = Scheduler(engine, method=method)
    got = [None] * len(PROMPTS)

    def client(i):
        handle = scheduler.submit(PROMPTS[i], max_new_tokens=24)
        streamed = [t for tokens in handle.tokens() for t in tokens]
        got[i] = (streamed, handle.result().token_ids)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    scheduler.close()
    assert [g[0] for g in got] == want and [g[1] for g in got] == want


def test_a_cancelled_request_leaves_and_the_others_finish(tiny):
    engine = Engine.from_pretrained(tiny, dtype="float64", max_batch=2)
    want = [engine.generate(p, max_new_tokens=40, method="ar").token_ids for p in PROMPTS[:4]]
    scheduler = Scheduler(engine, method="tr")
    handles = [scheduler.submit(p, max_new_tokens=40) for p in PROMPTS[:4]]
    steps = handles[0].tokens()
    next(steps), next(steps)
    handles[0].cancel()  # a client gone mid-stream
    handles[3].cancel()  # one that has not joined yet (2 slots), maybe
    with pytest.raises(RequestError, match="cancelled"):
        handles[0].result()
    assert [h.result().token_ids for h in handles[1:3]] == want[1:3]
    with pytest.raises(RequestError, match="cancelled"):
        handles[3].result()
    scheduler.close()
    assert engine.batch_cache().free() == 2


def test_the_queue_is_bounded_and_a_closed_scheduler_takes_nothing(tiny):
    engine = Engine.from_pretrained(tiny, dtype="float64", max_batch=1)
    scheduler = Scheduler(engine, method="ar", max_queued=2)
    handles, refused = [], 0
    for p in PROMPTS[:5]:
        try:
            handles.append(scheduler.submit(p, max_new_tokens=30))
        except QueueFull as e:
            refused += 1
            assert "waiting for a slot" in str(e)
    assert refused >= 1 and len(handles) >= 2
    assert scheduler.stats()["queued"] <= 2
    scheduler.close()
    assert all(len(h.result().token_ids) == 30 for h in handles)  # closing lets the running ones finish
    with pytest.raises(RequestError, match="shutting down"):
        scheduler.submit("hi")


def test_bad_prompts_are_refused_at_submit(tiny):
    engine = Engine.from_pretrained(tiny, dtype="float64", max_batch=1, max_context=64)
    scheduler = Scheduler(engine, method="ar")
    with pytest.raises(Exception, match="empty"):
        scheduler.submit("   ")
    with pytest.raises(ContextOverflow, match="each sequence holds 64"):  # too long for a sequence's cache
        scheduler.submit("word " * 80, max_new_tokens=4)
    with pytest.raises(ContextOverflow, match="each sequence holds 64"):  # and with no limit: no room at all
        scheduler.submit("word " * 80, max_new_tokens=None)
    with pytest.raises(Exception, match="token id"):
        scheduler.submit([1, 2, 10**6], chat_template=False)
    assert len(scheduler.submit("hi", max_new_tokens=3).result().token_ids) == 3
    ids = engine.prompt_ids("hi")
    assert len(scheduler.submit(ids, max_new_tokens=None, chat_template=False).result().token_ids) == 64 - len(ids)
    scheduler.close()


def test_an_asyncio_reader_gets_each_request_alone(tiny):
    engine = Engine.from_pretrained(tiny, dtype="float64", max_batch=2)
    want = [engine.generate(p, max_new_tokens=16, method="ar").token_ids for p in PROMPTS[:3]]
    scheduler = Scheduler(engine, method="tr")

    async def one(prompt):
        handle = scheduler.submit(prompt, max_new_tokens=16, loop=asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="atokens"):
            next(handle.tokens())
        streamed = [t async for tokens in handle.atokens() for t in tokens]
        return streamed, handle.result().token_ids

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS[:3]))

    got = asyncio.run(main())
    scheduler.close()
    assert [g[0] for g in got] == want and [g[1] for g in got] == want


def test_chores_run_on_the_batch_thread_and_a_failing_one_does_not_stop_it(tiny):
    engine = Engine.from_pretrained(tiny, dtype="float64", max_batch=2)
    scheduler = Scheduler(engine, method="tr")
    seen, idle = [], threading.Event()
    handle = scheduler.submit(PROMPTS[0], max_new_tokens=40)
    steps = handle.tokens()
    next(steps)
    scheduler.between_steps(lambda: seen.append(threading.current_thread().name))
    scheduler.between_steps(lambda: 1 / 0)  # a failing chore is reported, and the batch goes on
    assert len(handle.result().token_ids) == 40
    scheduler.between_steps(idle.set)  # nothing runs: done at once, on the batch's thread
    assert idle.wait(10) and seen == ["tr-engine-batch"]
    scheduler.close()


def test_a_free_slot_is_taken_for_the_longest_prefix_it_holds_else_the_least_recently_used():
    from tr_engine.model.kv_cache import BatchKVCache
    from tr_engine.model.config import LlamaConfig

    config = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8, max_position_embeddings=32)
    cache = BatchKVCache(config, 3, 32, torch.float32, "cpu")
    a, b, c = cache.take([1, 2, 3]), cache.take([4, 5]), cache.take([6])
    assert (a, b, c) == (0, 1, 2) and all(cache.view(s).length == 0 for s in (a, b, c))  # nothing held yet
    for slot, ids in [(b, [4, 5, 7, 8]), (a, [1, 2, 3, 9]), (c, [6, 6])]:  # given back in this order: b is the oldest
        cache.view(slot).length = len(ids)
        cache.give_back(slot, ids)
    assert cache.take([1, 2, 3, 9, 10, 11]) == a and cache.view(a).length == 4  # all it holds, then the new tokens
    cache.view(a).length = 0
    cache.give_back(a, [1, 2, 3, 9])  # (a length of 0: it holds nothing after all)
    assert cache.held[a] == []
    assert cache.take([4, 5, 7, 8]) == b and cache.view(b).length == 3  # the last token is always prefilled
    assert cache.take([9, 9]) == c and cache.view(c).length == 0  # shares nothing: the least recently given back
    assert cache.take([1, 2]) == a and cache.free() == 0


def test_prefix_reuse_answers_each_turn_as_a_cold_prefill_does(tiny, tiny_factory):
    """A conversation's second turn (its first turn's prompt and answer, then more), and prompts that share a system
    message, through one scheduler with reuse: each answer is the one from an empty cache, and the turns after the
    first prefill only what is new. (bf16 with the kernels: a prefix cached by earlier steps rounds as a cold prefill
    only if they are row-independent.) The second turn is given as token ids: the tiny models' answers are random
    bytes, which do not survive a trip through text (a real model's do, mostly: bench.serve --multi-turn)."""
    bf16 = str(tiny_factory("sched-bf16", dtype=torch.bfloat16, vocab_size=300, std=0.5))
    for model, dtype in [(tiny, "float64"), (bf16, "bfloat16")]:
        engine = Engine.from_pretrained(model, dtype=dtype, max_batch=2)
        system = {"role": "system", "content": "you answer in few words about the sea and the cat"}
        first = [system, {"role": "user", "content": "hello there"}]
        first_ids = engine.prompt_ids(first)
        answer = engine.generate(first, max_new_tokens=20, method="ar").token_ids
        second = first_ids + answer + engine.tokenizer.encode(" and why is that so?")
        other = [system, {"role": "user", "content": "one two three"}]
        prompts = [(first, True), (second, False), (other, True)]

        def run(prefix_reuse):
            scheduler = Scheduler(engine, method="hybrid", prefix_reuse=prefix_reuse)
            handles = []
            for prompt, chat in prompts:  # one after another: each finds the slots the earlier ones left
                handles.append(scheduler.submit(prompt, max_new_tokens=20, chat_template=chat))
                handles[-1].result()
            scheduler.close()
            return [h.result().token_ids for h in handles], [h.request.reused for h in handles]

        cold, none = run(False)
        warm, reused = run(True)
        assert warm == cold and cold[0] == answer and none == [0, 0, 0], dtype
        assert reused[1] == len(first_ids) + len(answer) - 1, (dtype, reused)  # all but the answer's last token
        system_turn = shared_prefix(first_ids, engine.prompt_ids(other))
        assert system_turn > 10 and reused[2] == system_turn, (dtype, reused)  # the system message's turn
