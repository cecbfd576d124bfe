"""The batched engine as a service: requests submitted from any thread, at any time, join the running batch.

    scheduler = Scheduler(engine, max_queued=64)
    handle = scheduler.submit([{"role": "user", "content": "Hi"}], max_new_tokens=64)
    for tokens in handle.tokens():      # each step's committed ids, as they come
        ...
    result = handle.result()            # the Generation (or a RequestError)
    handle.cancel()                     # a client gone: its slot is freed at the next step
    scheduler.close(grace=10.0)         # finish what runs (or cancel it after `grace` seconds), then stop

An asyncio server submits with `loop=` (its running loop) and reads `async for tokens in handle.atokens()`: the
events then reach it through the loop (call_soon_threadsafe), and no thread of its own waits on a queue.

One thread runs tr_engine.core.batch.batch_steps over a queue: a request waits there until a slot is free, and joins at
the next step boundary; each request's events go to its own handle. The queue is bounded: past `max_queued` waiting
requests, submit raises QueueFull (a server answers 503 with Retry-After). Every request gets exactly the tokens it
would get alone (tr_engine/core/batch.py says why). A finished request's slot keeps its conversation: the next turn, or
any prompt that starts the same way, takes that slot and prefills only what is new (prefix_reuse; least recently
used slots are the first emptied for prompts that share nothing).
"""

import asyncio
import itertools
import queue
import sys
import threading
import time
from collections import deque

from tr_engine.core.batch import END, Request
from tr_engine.core.generation import Generation
from tr_engine.core.sampling import Sampling, sampling_of
from tr_engine.errors import ContextOverflow, UserError
from tr_engine.model.parallel import heartbeat_s


class QueueFull(UserError):
    """Too many requests are waiting for a slot; try again shortly."""


class RequestError(UserError):
    """A request that could not run, or was cancelled."""


class Handle:
    """One submitted request: its events as they come, its result, and cancel()."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None = None):
        self.request, self.id = request, request.id
        self._result: Generation | None = None
        self._error: str | None = None
        self._ended = False  # the end was read
        self._async = loop is not None
        if loop is None:
            self._events = queue.Queue()
            self._put = self._events.put
        else:
            self._events = asyncio.Queue()
            self._put = lambda item: _call_soon(loop, self._events.put_nowait, item)

    def tokens(self):
        """Yield each step's committed token ids until the request ends; then return (result() says how)."""
        if self._async:
            raise RuntimeError("this request was submitted with loop=: read it with `async for … in atokens()`")
        while not self._ended:
            event = self._events.get()
            if event is None:
                self._ended = True
                return
            yield event

    async def atokens(self):
        """tokens(), for a request submitted with loop=, awaited on that loop."""
        while not self._ended:
            event = await self._events.get()
            if event is None:
                self._ended = True
                return
            yield event

    def result(self) -> Generation:
        """Wait for the end; the Generation, or a RequestError (cancelled, or the request could not run). A request
        submitted with loop= must have been read to its end with atokens() first."""
        if not self._ended:
            for _ in self.tokens():
                pass
        if self._error is not None:
            raise RequestError(self._error)
        return self._result

    def cancel(self) -> None:
        """Leave at the next step boundary (or before joining), freeing the slot."""
        self.request.cancel()


class Scheduler:
    """The batch loop over a queue of requests. By default it runs on a thread of its own; with `thread=False` the
    caller runs it, with run(), on a thread of its choosing (until close()). A server should run it on the thread
    that loaded the model: each native thread that runs parallel ops gets an OpenMP team of its own, and on a CPU
    with no core to spare, two teams (the loader's, idle, and the loop's) make libgomp put its workers to sleep
    between ops instead of spinning, which here cost 40% of a decode step's speed."""

    def __init__(self, engine, method: str | None = None, max_queued: int = 64, thread: bool = True,
                 prefix_reuse: bool = True, seed_from_prompt: bool = False):
        from tr_engine import checks
        from tr_engine.core.methods import check_method

        self.engine, self.max_queued = engine, max_queued
        self.method = check_method(method or engine.method)
        self._waiting: deque[Request] = deque()
        self._handles: dict[int, Handle] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._chores: list = []  # between_steps' callables, for the batch's thread
        shard = engine.model.shard  # under --tp every rank runs this loop: rank 0's decisions, followed by all
        source = self if shard.world == 1 else Lockstep(shard, self)
        self._steps = engine.batch_loop(source, self.method, checks.flag(seed_from_prompt, "seed_from_prompt"),
                                        reuse_prefix=checks.flag(prefix_reuse, "prefix_reuse"))
        self._finished = threading.Event()  # run() returned
        self._started = False
        if thread:
            threading.Thread(target=self.run, name="tr-engine-batch", daemon=True).start()

    @property
    def context(self) -> int:
        """The tokens each sequence may hold, its prompt and its answer together."""
        return self.engine.batch_context

    def submit(self, prompt, max_new_tokens: int | None = 256, *, chat_template: bool = True,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               sampling: Sampling | None = None, ignore_eos: bool = False, max_draft: int | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> Handle:
        """Queue a prompt (a string, messages, or with chat_template=False a list of token ids) for the running
        batch, for up to `max_new_tokens` (None: as many as the context holds after the prompt); its one-line error
        at once if it is not a prompt or does not fit (ContextOverflow), QueueFull when too many wait already,
        RequestError after close(). Sampling as Engine.generate's: the keywords, or `sampling` (a Sampling, as an HTTP
        body's fields were checked into). With `ignore_eos`, it decodes past the end-of-sequence token to
        max_new_tokens; `max_draft` caps the draft tokens each of its steps verifies (0: plain steps).
        With `loop`, the handle is read with atokens() on that event loop."""
        from tr_engine import checks

        sampling = sampling_of(sampling, temperature, top_k, top_p)
        if max_new_tokens is not None:
            checks.integer(max_new_tokens, "max_new_tokens", 1)
        if not chat_template and isinstance(prompt, (list, tuple)) and prompt and \
                all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [checks.integer(t, "a prompt token id", 0, self.engine.model.config.vocab_size - 1) for t in prompt]
        else:
            ids = self.engine.prompt_ids(prompt, chat_template)
        room = self.context - len(ids)
        if max_new_tokens is None:
            max_new_tokens = max(room, 1)
        if max_new_tokens > room:
            raise ContextOverflow(f"the prompt ({len(ids)} tokens) plus up to {max_new_tokens} new tokens needs "
                                  f"{len(ids) + max_new_tokens} tokens of context but each sequence holds "
                                  f"{self.context}; shorten the prompt or ask for fewer new tokens")
        with self._cond:
            if self._closed:
                raise RequestError("the server is shutting down; send the request again once it is back")
            if len(self._waiting) >= self.max_queued:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for a slot already; retry shortly")
            request = Request(next(self._ids), ids, max_new_tokens, self.engine.sampler(sampling, seed),
                              ignore_eos=checks.flag(ignore_eos, "ignore_eos"),
                              max_draft=None if max_draft is None else checks.integer(max_draft, "max_draft", 0))
            handle = self._handles[request.id] = Handle(request, loop)
            self._waiting.append(request)
            self._cond.notify()
        return handle

    def take(self, block: bool, timeout: float | None = None):
        """batch_steps' request source: the next waiting request (cancelled ones are dropped), None when none waits,
        END once closed and drained; with `block`, wait for one (doing the chores of between_steps meanwhile), or
        with `timeout` too, for at most that many seconds (then None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while self._waiting and self._waiting[0].cancelled:
                    self._end(self._handles.pop(self._waiting.popleft().id), None, "cancelled")
                if self._waiting:
                    return self._waiting.popleft()
                if self._closed:
                    return END
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    return None
                if not self._chores:
                    self._cond.wait(left)
            self._do_chores()

    @staticmethod
    def leaving(active: list[Request]) -> list[Request]:
        """batch_steps' question at each step boundary: the running requests that were cancelled."""
        return [r for r in active if r.cancelled]

    def follow(self, spec) -> Request:
        """A request rank 0 took (Lockstep's spec), as this rank's batch decodes it."""
        rid, ids, max_new_tokens, sampler, ignore_eos, max_draft = spec
        return Request(rid, ids, max_new_tokens, sampler, ignore_eos=ignore_eos, max_draft=max_draft)

    def between_steps(self, chore) -> None:
        """Run chore() on the batch's thread at the next step boundary (at once when no request runs), where nothing
        changes the engine's state meanwhile: a consistent snapshot of the recycling matrix, say."""
        with self._cond:
            self._chores.append(chore)
            self._cond.notify()

    def stats(self) -> dict:
        """Sequences decoding and waiting now."""
        with self._cond:
            return {"running": len(self._handles) - len(self._waiting), "queued": len(self._waiting)}

    @property
    def closed(self) -> bool:
        """close() was called: no request is taken any more."""
        return self._closed

    def close(self, grace: float = 10.0) -> None:
        """Take no more requests; let the running ones finish for up to `grace` seconds, then cancel the rest."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            started = self._started
        if not started:  # nothing ever ran the loop: the waiting requests end here
            self._drain("the server is shutting down; send the request again once it is back")
            return
        if not self._finished.wait(grace):
            with self._cond:
                handles = list(self._handles.values())
            for h in handles:
                h.cancel()
            self._finished.wait()

    def run(self) -> None:
        """The batch loop, on the calling thread, until close() (and every request taken has ended)."""
        with self._cond:
            if self._started:
                raise RuntimeError("this scheduler's loop is running already")
            self._started = True
        try:
            self._loop()
        finally:
            self._finished.set()

    def _drain(self, error: str) -> None:
        with self._cond:
            handles = list(self._handles.values())
            self._handles.clear()
            self._waiting.clear()
        for h in handles:
            self._end(h, None, error)

    def _loop(self) -> None:
        try:
            for event in self._steps:
                if self._chores:  # batch_steps yields only between its ops: nothing is half-updated here
                    self._do_chores()
                with self._cond:
                    handle = self._handles.get(event.request)
                if handle is None:
                    continue
                if event.tokens:
                    handle._put(event.tokens)
                if event.done is not None or event.error is not None:
                    with self._cond:
                        self._handles.pop(event.request, None)
                    self._end(handle, event.done, event.error)
        except BaseException as e:  # the batch itself failed: every request hears why, none waits forever
            with self._cond:
                self._closed = True
            self._drain(f"internal error ({type(e).__name__}: {e})")
            raise

    def _do_chores(self) -> None:
        with self._cond:
            chores, self._chores = self._chores, []
        for chore in chores:
            try:
                chore()
            except Exception as e:  # a chore's failure is its own: the batch goes on
                print(f"warning: a chore between steps failed ({type(e).__name__}: {e})", file=sys.stderr,
                      flush=True)

    @staticmethod
    def _end(handle: Handle, result: Generation | None, error: str | None) -> None:
        handle._result, handle._error = result, error
        handle._put(None)


class Lockstep:
    """The request source of a batch under tensor parallelism (--tp). Every rank runs the batch loop on the same
    numbers (tr_engine/model/parallel.py), so every rank must also admit and drop the same requests at the same step
    boundaries: rank 0's scheduler, which alone hears the clients, decides (take, leaving), and each decision is
    broadcast to the other ranks, which rebuild the request (its ids, length, sampler and seed: the same draws) and
    follow. While no request comes, rank 0 says so every parallel.heartbeat_s() seconds, so that the other ranks'
    wait, a collective, never reaches the run's timeout."""

    def __init__(self, shard, scheduler: "Scheduler"):
        self.shard, self.scheduler = shard, scheduler

    def take(self, block: bool):
        spec = None
        if self.shard.rank == 0:
            r = self.scheduler.take(block, timeout=heartbeat_s() if block else None)
            spec = "end" if r is END else None if r is None else (r.id, r.prompt_ids, r.max_new_tokens, r.sampler,
                                                                  r.ignore_eos, r.max_draft)
        spec = self.shard.from_rank0(spec)
        if self.shard.rank == 0:
            return r
        return END if spec == "end" else None if spec is None else self.scheduler.follow(spec)

    def leaving(self, active: list[Request]) -> list[Request]:
        ids = self.shard.from_rank0([r.id for r in Scheduler.leaving(active)] if self.shard.rank == 0 else None)
        return [r for r in active if r.id in ids]


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody reads this request any more
        pass
