"""The OpenAI API's requests and responses, as this server reads and writes them (tr_engine/serving/openai_api.py serves
them): which fields an endpoint takes, each checked with an error that names it; the error body; the JSON of an
answer, whole or in chunks.
"""

import json
import math
import time
from dataclasses import dataclass, field

from tr_engine import checks
from tr_engine.core.sampling import Sampling
from tr_engine.core.speculative_config import REQUEST_KEYS, SpeculativeConfig
from tr_engine.errors import UserError, one_line

MAX_STOPS = 4  # as OpenAI's API: up to four stop sequences
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "ignore_eos", "speculative_config", "n", "user", "metadata", "store", "service_tier",
                 "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "functions", "function_call", "parallel_tool_calls", "response_format", "modalities"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
# Fields the API defines that this server does not do: each is refused (400, naming it) unless it has its default.
UNSUPPORTED = {
    "presence_penalty": ((None, 0), "penalties change the model's distribution, and tr-engine decodes it exactly"),
    "frequency_penalty": ((None, 0), "penalties change the model's distribution, and tr-engine decodes it exactly"),
    "logit_bias": ((None, {}), "a bias changes the model's distribution, and tr-engine decodes it exactly"),
    "logprobs": ((None, False), "log-probabilities are not returned"),
    "top_logprobs": ((None, 0), "log-probabilities are not returned"),
    "tools": ((None, []), "tool calls are not supported"),
    "functions": ((None, []), "function calls are not supported"),
    "tool_choice": ((None, "none"), "tool calls are not supported"),
    "function_call": ((None, "none"), "function calls are not supported"),
    "response_format": ((None, {"type": "text"}), "only plain text answers are supported"),
    "modalities": ((None, ["text"]), "only text is supported"),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "insertion (a suffix) is not supported"),
    "best_of": ((None, 1), "one completion is made per request"),
}
ROLES = {"system", "user", "assistant", "developer"}  # developer: OpenAI's newer name for system


class APIError(Exception):
    """An error response: status, and the body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(one_line(message))
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """A validated request: the prompt the scheduler takes and how to answer."""

    prompt: object  # a string, messages, or token ids
    chat: bool
    max_tokens: int | None
    sampling: Sampling
    seed: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # an extension, as vLLM's: decode to max_tokens whatever the model says
    max_draft: int | None = None  # speculative_config's: the most draft tokens a step verifies (0: plain decoding)


def read_body(raw: bytes, fields: set[str]) -> dict:
    """The request's JSON object, its fields checked against what the endpoint takes (`fields`) and does."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" ({e.msg} at line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise APIError(400, f"the request body is not valid JSON{where}; send a JSON object", code="invalid_json")
    except RecursionError:  # (Python's reader recurses per level: a body of nested arrays ran out of stack)
        raise APIError(400, "the request body nests arrays or objects too deep to read; send a flatter JSON object",
                       code="invalid_json") from None
    except ValueError as e:  # an integer of more digits than Python converts (4300), say
        raise APIError(400, f"the request body holds a number that cannot be read ({one_line(str(e))[:80]}); send "
                            "ordinary numbers", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise APIError(400, f"unrecognized request argument supplied: {unknown[0]}; leave it out", unknown[0],
                       "unknown_parameter")
    for name, (defaults, why) in UNSUPPORTED.items():
        if body.get(name) not in defaults and name in fields:
            raise APIError(400, f"{name} is not supported by this server ({why}); leave it out", name,
                           "unsupported_parameter")
    return body


def read_job(body: dict, chat: bool, model_name: str, defaults: Sampling, method: str = "hybrid") -> Job:
    """A chat (or completion) request's Job; sampling fields left out take `defaults`; `method` is the server's."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model {_show(model)} does not exist here; this server serves {model_name!r} "
                            "(GET /v1/models)", "model", "model_not_found")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise APIError(400, f"n must be 1 (one answer per request), got {_show(n)}", "n", "unsupported_parameter")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise APIError(400, 'stream_options must be an object like {"include_usage": true}', "stream_options")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise APIError(400, f"{name} must be an integer of at least 1, got {_show(max_tokens)}", name)
    d = defaults
    temperature = _number(body, "temperature", d.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", d.top_p, 0.0, 1.0)
    if top_p == 0.0:
        raise APIError(400, "top_p must be above 0 and at most 1, got 0", "top_p")
    top_k = body.get("top_k", d.top_k)
    if top_k is None:
        top_k = d.top_k
    if not _is_int(top_k) or top_k < 0:
        raise APIError(400, f"top_k must be an integer of at least 0 (0: all tokens), got {_show(top_k)}", "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= checks.MAX_SEED):
        raise APIError(400, f"seed must be an integer in 0..{checks.MAX_SEED}, got {_show(seed)}", "seed")
    prompt = _messages(body) if chat else _prompt(body)
    return Job(prompt, chat, max_tokens, Sampling(temperature, top_k, top_p), seed, _stops(body), stream,
               include_usage, _flag(body, "ignore_eos"), _max_draft(body, method))


def _max_draft(body: dict, method: str) -> int | None:
    """The request's own speculative_config: plain decoding ("ar") or a cap on the server's drafts."""
    value = body.get("speculative_config")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, f"speculative_config must be a JSON object like {{\"num_speculative_tokens\": 8}}, got "
                            f"{_show(value)}", "speculative_config")
    try:
        config = SpeculativeConfig.parse(value, "speculative_config", REQUEST_KEYS)
    except UserError as e:
        raise APIError(400, f"{e} (a request may set these; the rest is the server's --speculative-config)",
                       "speculative_config")
    if config.method == "ar":
        return 0
    if config.method is not None and (config.method != method or config.suffix):
        raise APIError(400, f"speculative_config: this server drafts with {method}; a request may turn drafting off "
                            "(\"method\": \"ar\") or cap it (num_speculative_tokens), not change the method",
                       "speculative_config")
    return config.num_speculative_tokens


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "messages is missing; send a list like [{\"role\": \"user\", \"content\": \"Hi\"}]",
                       "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or "role" not in m:
            raise APIError(400, f"{where} must be an object with a role and content", where)
        role = m["role"]
        if not isinstance(role, str) or role not in ROLES:  # (a list or object is no role, and unhashable)
            raise APIError(400, f"{where}.role {_show(role)} is not supported; use system, user or assistant",
                           f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.content[{j}] must be a text part ({{\"type\": \"text\", \"text\": "
                                        "…}); other content is not supported", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string, got {_show(content)}", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompt(body: dict):
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "prompt is missing; send the text to continue", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    raise APIError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise APIError(400, f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return stops


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{param or name} must be true or false, got {_show(value)}", param or name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise APIError(400, f"{name} must be a number in {low:g}..{high:g}, got {_show(value)}", name)
    return float(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:60] + "…"


@dataclass
class Shape:
    """The JSON of one response: chat.completion or text_completion, whole or in chunks."""

    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}
