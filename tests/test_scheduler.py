"""The batched engine as a service (tr_engine/scheduler.py): requests from many threads, at any time, each exactly
what it gets alone; cancellation frees the slot; a bounded queue; a clean close."""

import asyncio
import threading

import pytest
import torch

from tr_engine.engine import Engine
from tr_engine.errors import ContextOverflow
from tr_engine.scheduler import QueueFull, RequestError, Scheduler

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
