"""The OpenAI API over the batched engine: the FastAPI app that `python -m tr_engine.serve` runs.

    GET  /v1/models              the one model served
    POST /v1/chat/completions    messages in, an answer out (or, with "stream", server-sent events)
    POST /v1/completions         raw text (or token ids) in, its continuation out
    GET  /health                 200 while the engine runs
    GET  /metrics                Prometheus text: requests, tokens, reused prefix tokens, MAT, running and queued

Every request goes to the Scheduler (tr_engine/serving/scheduler.py) as it arrives and joins the running batch at the
next step, so each client gets exactly the tokens it would get alone, while Token Recycling's matrix learns from all of
them. A request the server cannot take gets the OpenAI API's error shape, {"error": {"message", "type", "param",
"code"}}, with a 4xx status that names the problem (or 503 and Retry-After while the queue is full); never a 500
for what a client sent.

Sampling fields a request leaves out take the server's flags (--temperature, --top-p, --top-k: greedy unless the
server was started otherwise). Beyond OpenAI's fields, a request may set `top_k`, `ignore_eos` (vLLM's: decode to
max_tokens past the end-of-sequence token) and `speculative_config` ({"method": "ar"} to decode it plainly, or
{"num_speculative_tokens": N} to cap its drafts: tr_engine/core/speculative_config.py; an unknown key is a 400).
Every answer (a stream's last chunk) carries the request's speculative numbers where vLLM puts them,
`metrics.speculative_decoding` (verify steps, draft tokens and those accepted, mean acceptance length, acceptance
rate and its histogram, by source: matrix, prompt lookup, suffix index; and the method), and llama.cpp's `timings`
(prompt_n, predicted_n, their milliseconds, cache_n, draft_n, draft_n_accepted);
`usage.prompt_tokens_details.cached_tokens` (OpenAI's field) counts the prompt tokens that were not prefilled again
because a slot held them (the conversation's earlier turns: prefix reuse).
"""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from tr_engine.core.generation import DraftCounts, Generation
from tr_engine.core.sampling import Sampling
from tr_engine.core.suffix import BYTES_PER_TOKEN
from tr_engine.errors import ContextOverflow, UserError, one_line
from tr_engine.model.tokenizer import StreamDecoder
from tr_engine.model.weights import release_freed_memory
from tr_engine.serving.api_schema import CHAT_FIELDS, COMPLETION_FIELDS, APIError, Job, Shape, read_body, read_job
from tr_engine.serving.protocol import BODY_TIMEOUT_S
from tr_engine.serving.scheduler import QueueFull, RequestError, Scheduler

RETRY_AFTER_S = 1  # what a 503 asks a client to wait before it tries again
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


class ClientGone(Exception):
    """The client of a non-streamed request disconnected while it ran."""


@dataclass
class Defaults:
    """What a request that leaves a field out gets: the server's flags."""

    sampling: Sampling = field(default_factory=lambda: Sampling(0.0, 0, 1.0))


@dataclass
class Metrics:
    """Counters since start, kept on the event loop's thread (no locks)."""

    started: float = field(default_factory=time.time)
    requests: dict = field(default_factory=dict)  # outcome -> count
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens a slot's cache held already: not prefilled again (prefix reuse)
    completion_tokens: int = 0
    decode_tokens: int = 0  # tokens committed by decode steps (MAT's numerator: the prefill's token is not one)
    decode_steps: int = 0
    drafts: DraftCounts = field(default_factory=DraftCounts)  # draft tokens verified and accepted, by source

    def count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1


class StopText:
    """Stop sequences over streamed text: push() returns what may be shown now, holding back a tail that could be
    the start of a stop sequence; once one appears, `hit` is set and nothing after it is shown."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.hit = stops, "", False

    def push(self, piece: str) -> str:
        if self.hit or not self.stops:
            return "" if self.hit else piece
        text = self.held + piece
        ends = [(text.find(s), s) for s in self.stops if s in text]
        if ends:
            self.hit, self.held = True, ""
            return text[: min(ends)[0]]
        keep = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self.held = ("" if self.hit else self.held), ""
        return held


class Answer:
    """One request's run: its text as it comes (stop sequences applied), then how it ended and what it used."""

    def __init__(self, app_state, job: Job, handle):
        self.state, self.job, self.handle = app_state, job, handle
        self.decoder = StreamDecoder(app_state.engine.tokenizer, handle.request.prompt_ids)
        self.stops = StopText(job.stops)
        self.tokens: list[int] = []
        self.steps = 0
        self.finish_reason: str | None = None
        self.generation: Generation | None = None  # the engine's account of the request, once it ended

    @property
    def prompt_tokens(self) -> int:
        return len(self.handle.request.prompt_ids)

    async def pieces(self, disconnected=None):
        """Yield the answer's text as it is accepted; `finish_reason` is set at the end ("stop" or "length").
        `disconnected` (a coroutine function) is polled while waiting: once true, the request is cancelled."""
        events = self.handle.atokens()
        try:
            while True:
                try:
                    tokens = await self._next(events, disconnected)
                except StopAsyncIteration:
                    break
                self.steps += 1
                self.tokens += tokens
                text = self.stops.push(self.decoder.push(tokens))
                if text:
                    yield text
                if self.stops.hit:
                    self.handle.cancel()
                    self.finish_reason = "stop"
                    self.generation = self.handle.request.generation(self.state.engine.tokenizer.eos_ids)
                    return
            try:
                gen = self.handle.result()
            except RequestError as e:
                self.finish_reason = "error"
                if self.state.scheduler.closed:  # cancelled at shutdown, after the grace period
                    raise APIError(503, "the server shut down before the answer was complete; send the request "
                                        "again once it is back", kind="server_error", code="shutting_down",
                                   headers={"Retry-After": str(RETRY_AFTER_S)})
                raise APIError(500, f"the request could not finish: {e}", kind="server_error", code="engine_error")
            self.generation = gen
            text = self.stops.push(self.decoder.flush())
            text += "" if self.stops.hit else self.stops.flush()
            if text:
                yield text
            self.finish_reason = "stop" if gen.finish_reason == "eos" or self.stops.hit else "length"
        finally:
            if self.finish_reason is None:  # the client went away, or the stream was cancelled
                self.handle.cancel()
            self._account()

    async def _next(self, events, disconnected):
        if disconnected is None:
            return await events.__anext__()
        pending = asyncio.ensure_future(events.__anext__())
        while True:
            done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S)
            if done:
                return pending.result()
            if await disconnected():
                pending.cancel()
                raise ClientGone()

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.prompt_tokens + len(self.tokens),
                "prompt_tokens_details": {"cached_tokens": self.handle.request.reused}}

    def extras(self) -> dict:
        """What an answer carries beside OpenAI's fields: vLLM's per-request `metrics.speculative_decoding` (with
        the method) and llama.cpp's `timings` (empty before the request ended)."""
        if self.generation is None:
            return {}
        spec = {"method": self.state.scheduler.method, **self.generation.speculative()}
        return {"metrics": {"speculative_decoding": spec},
                "timings": self.generation.timings(self.handle.request.reused)}

    def _account(self) -> None:
        m = self.state.metrics
        m.count(self.finish_reason or "cancelled")
        m.prompt_tokens += self.prompt_tokens
        m.reused_tokens += self.handle.request.reused
        m.completion_tokens += len(self.tokens)
        m.decode_tokens += max(len(self.tokens) - 1, 0)
        m.decode_steps += max(self.steps - 1, 0)
        if self.generation is not None:
            m.drafts.add(self.generation.drafts)


LARGE_BODY_BYTES = 256 << 10  # a body this large has its freed memory handed back to the system (glibc keeps it)


def default_max_body_bytes(context: int) -> int:
    """What a request's body may weigh by default: far more than a prompt that fits `context` tokens can take (a
    token is a few bytes of text, a few more escaped in JSON), and never under 1 MiB."""
    return max(1 << 20, 64 * context)


def create_app(scheduler: Scheduler, model_name: str, defaults: Defaults | None = None,
               max_body_bytes: int | None = None, body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    """The API over a running Scheduler, serving it as `model_name`; request bodies past `max_body_bytes` (default:
    default_max_body_bytes of the scheduler's context) get a 413, and a body that pauses longer than `body_timeout`
    seconds a 408. The caller closes the scheduler when the app stops
    (tr_engine/cli/serve.py does, after the running requests had their grace period)."""
    engine = scheduler.engine
    app = FastAPI(title="tr-engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.scheduler, app.state.model_name = engine, scheduler, model_name
    app.state.max_body_bytes = max_body_bytes or default_max_body_bytes(scheduler.context)
    app.state.body_timeout = body_timeout
    app.state.defaults, app.state.metrics = defaults or Defaults(), Metrics()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        if e.status >= 400 and e.status != 503:
            app.state.metrics.count(f"error_{e.status}")
        return respond(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        what = {404: f"there is no {request.url.path} here; the API is under /v1 (GET /v1/models)",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return respond(APIError(e.status_code, what, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return respond(APIError(400, f"the request is malformed ({one_line(str(e))[:200]})"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug: one line, and no traceback to the client
        print(f"error: internal error ({type(e).__name__}: {one_line(str(e))[:200]})", flush=True)
        return respond(APIError(500, f"internal error ({type(e).__name__}); see the server's log",
                                kind="server_error", code="internal_error"))

    @app.get("/health")
    async def health():
        engine = app.state.engine
        return {"status": "ok", "model": model_name, "cpu_tier": engine.cpu_tier, "cpu_threads": engine.cpu_threads,
                **app.state.scheduler.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(app.state.metrics
                                                                                              .started),
                                            "owned_by": "tr-engine"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(app.state))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    async def complete(request: Request, chat: bool):
        state = app.state
        try:
            raw = await read_limited(request, state.max_body_bytes, state.body_timeout)
        except ClientDisconnect:  # gone before its body was whole: nobody to answer
            print(f"note: a client hung up before sending its whole request to {request.url.path}", flush=True)
            return Response(status_code=499)
        large = len(raw) >= LARGE_BODY_BYTES
        try:
            body = read_body(raw, CHAT_FIELDS if chat else COMPLETION_FIELDS)
            job = read_job(body, chat, model_name, state.defaults.sampling, state.scheduler.method)
            # The template's rendering and the tokenization on a worker thread: a huge prompt holds up no other client
            # (nor /health) while it is read.
            handle = await asyncio.to_thread(submit, state, job, asyncio.get_running_loop())
        finally:
            if large:  # once its parse and tokens are freed (the answer sent), their pages go back to the system
                raw = body = None
                loop = asyncio.get_running_loop()
                loop.call_later(0.2, loop.run_in_executor, None, release_freed_memory)  # (glibc would keep them)
        answer = Answer(state, job, handle)
        ids = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = Shape(ids, model_name, chat)
        if job.stream:
            return StreamingResponse(sse(shape, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text = "".join([piece async for piece in answer.pieces(request.is_disconnected)])
        except ClientGone:  # nobody to answer; the request was cancelled and its slot freed
            return Response(status_code=499)
        return {**shape.whole(text, answer.finish_reason, answer.usage()), **answer.extras()}

    return app


def respond(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


async def read_limited(request: Request, limit: int, pause: float = BODY_TIMEOUT_S) -> bytes:
    """The request's body, refused with a 413 as soon as it passes `limit` bytes (its Content-Length says so before
    anything is read; a chunked body, once it has), and with a 408 when nothing of it arrives for `pause` seconds."""
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"the request body is larger than this server takes ({limit} bytes: --max-body-bytes); "
                            "send a shorter prompt", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    body = aiter(request.stream())
    while True:
        try:
            async with asyncio.timeout(pause):
                chunk = await anext(body)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise APIError(408, f"the request body paused for more than {pause:g} s (--body-timeout); send it whole",
                           code="request_timeout")
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def submit(state, job: Job, loop: asyncio.AbstractEventLoop):
    """Hand the job to the scheduler (its prompt rendered and tokenized: on a worker thread) for `loop` to read."""
    try:
        return state.scheduler.submit(job.prompt, job.max_tokens, chat_template=job.chat, sampling=job.sampling,
                                      seed=job.seed, ignore_eos=job.ignore_eos, max_draft=job.max_draft,
                                      loop=loop)
    except QueueFull as e:
        state.metrics.count("rejected_busy")
        raise APIError(503, f"the server is busy: {e}", kind="server_error", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    except RequestError as e:  # closed: shutting down
        raise APIError(503, str(e), kind="server_error", code="shutting_down",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    except ContextOverflow as e:
        raise APIError(400, str(e), "messages" if job.chat else "prompt", "context_length_exceeded")
    except UserError as e:
        raise APIError(400, str(e), "messages" if job.chat else "prompt")


async def sse(shape: Shape, answer: Answer):
    """The server-sent events of a streamed answer, ending in `data: [DONE]`."""
    def event(obj: dict) -> str:
        if answer.job.include_usage and "usage" not in obj:
            obj["usage"] = None
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    if shape.chat:
        yield event(shape.chunk("", first=True))
    try:
        async for piece in answer.pieces():
            yield event(shape.chunk(piece))
    except APIError as e:  # mid-stream: the status is sent already, so the error is an event
        yield event(e.body())
        yield "data: [DONE]\n\n"
        return
    yield event({**shape.chunk(None if shape.chat else "", answer.finish_reason), **answer.extras()})
    if answer.job.include_usage:
        yield event(shape.usage_chunk(answer.usage()))
    yield "data: [DONE]\n\n"


def suffix_index_metrics(index) -> list[tuple]:
    """The suffix index's size against its bound (none without an index: --suffix-index 0)."""
    if index is None:
        return []
    return [("suffix_index_bytes", "gauge", index.nbytes,
             "The most memory the suffix index can have made resident (it grows as the index fills)."),
            ("suffix_index_bound_bytes", "gauge", index.capacity * BYTES_PER_TOKEN, "The suffix index's bound."),
            ("suffix_index_tokens", "gauge", min(index.total, index.capacity), "Tokens the suffix index holds."),
            ("suffix_index_requests_total", "counter", index.requests, "Requests the suffix index learned from.")]


def prometheus(state) -> str:
    """The metrics in Prometheus' text format."""
    m, stats = state.metrics, state.scheduler.stats()
    lines = ["# HELP tr_engine_requests_total Requests by how they ended.", "# TYPE tr_engine_requests_total counter"]
    lines += [f'tr_engine_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(m.requests.items())]
    mat = m.decode_tokens / m.decode_steps if m.decode_steps else 0.0
    for name, kind, value, text in [
        ("prompt_tokens_total", "counter", m.prompt_tokens, "Prompt tokens of the requests that ran."),
        ("prefix_reused_tokens_total", "counter", m.reused_tokens,
         "Prompt tokens found in a slot's cache (an earlier turn, a shared system prompt): not prefilled again."),
        ("completion_tokens_total", "counter", m.completion_tokens, "Tokens generated."),
        ("decode_steps_total", "counter", m.decode_steps, "Decode steps (one verify each) over all requests."),
        ("mean_accepted_tokens", "gauge", round(mat, 4), "MAT: decode tokens per decode step, all requests."),
        ("draft_tokens_total", "counter", m.drafts.drafted, "Draft tokens verified (every tree node, roots left out)."),
        ("accepted_draft_tokens_total", "counter", m.drafts.accepted, "Draft tokens accepted (bonus tokens left out)."),
        ("running_sequences", "gauge", stats["running"], "Sequences decoding now."),
        ("queued_sequences", "gauge", stats["queued"], "Requests waiting for a slot."),
        ("uptime_seconds", "gauge", round(time.time() - m.started, 1), "Seconds since the server started."),
        *suffix_index_metrics(state.engine.drafting.suffix),
    ]:
        lines += [f"# HELP tr_engine_{name} {text}", f"# TYPE tr_engine_{name} {kind}", f"tr_engine_{name} {value}"]
    by_source = [("draft_tokens_by_source_total", "Draft tokens verified, by the source that proposed them (a node "
                  "two proposed counts for both)."),
                 ("accepted_draft_tokens_by_source_total", "Draft tokens accepted, by source.")]
    for which, (name, text) in enumerate(by_source):
        lines += [f"# HELP tr_engine_{name} {text}", f"# TYPE tr_engine_{name} counter"]
        lines += [f'tr_engine_{name}{{source="{source}"}} {counts[which]}'
                  for source, counts in m.drafts.by_source.items()]
    return "\n".join(lines) + "\n"
