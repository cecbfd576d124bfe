"""The speculative settings under the names vLLM users know: `--speculative-config '{"method": "suffix",
"num_speculative_tokens": 16, "disable_by_batch_size": 8}'` for generate, chat and serve, and, per request, a
`speculative_config` field in the server's API with the keys a request may set. No torch import here.

Keys:
- method: one of the engine's methods (ar, tr, pld, hybrid), or vLLM's names for what the engine does: "ngram"
  (prompt lookup: pld) and "suffix" (hybrid drafting with the suffix index of earlier requests, 64 MB unless
  --suffix-index says otherwise);
- num_speculative_tokens: the most draft tokens a step verifies (the tree's nodes, the root left out; 1 or more);
- disable_by_batch_size (vLLM's name; `max_concurrency` is accepted for it): with more sequences than this in a step,
  the step decodes plainly (each sequence one token: drafts cost more than they save when the batch fills a forward).
A request may set method ("ar" to decode it plainly, or the server's own) and num_speculative_tokens (down from the
server's); the rest is the server's. Any other key is refused in one line that names it (400 over HTTP).
"""

import difflib
import json
from dataclasses import dataclass

from tr_engine.errors import UserError

ALIASES = {"ngram": "pld", "suffix": "hybrid"}  # vLLM's method names -> the engine's
KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size", "max_concurrency")
REQUEST_KEYS = ("method", "num_speculative_tokens")
DEFAULT_SUFFIX_MB = 64  # every engine's suffix index unless --suffix-index sizes it (0: none; "suffix" still 64)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # an engine method (aliases resolved); None: the engine's default
    suffix: bool = False  # the method was "suffix": hybrid with the suffix index
    num_speculative_tokens: int | None = None  # None: the tree's own size
    disable_by_batch_size: int | None = None  # None: draft at every batch size

    @classmethod
    def parse(cls, value, where: str = "--speculative-config", keys: tuple[str, ...] = KEYS) -> "SpeculativeConfig":
        """A config from JSON text or a dict; UserError in one line naming the key or value at fault."""
        from tr_engine.core.methods import methods

        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise UserError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); pass an object like "
                                '\'{"method": "suffix", "num_speculative_tokens": 16}\'') from None
        if not isinstance(value, dict):
            raise UserError(f"{where} must be a JSON object, got {type(value).__name__}")
        for key in value:
            if key not in keys:
                near = difflib.get_close_matches(str(key), keys, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise UserError(f"{where} has an unknown key {key!r}; {hint}the keys are {', '.join(keys)}")
        if "disable_by_batch_size" in value and "max_concurrency" in value:
            raise UserError(f"{where} sets both disable_by_batch_size and max_concurrency (one setting); keep one")
        method, suffix = value.get("method"), False
        if method is not None:
            known = (*methods(), *ALIASES)
            if not isinstance(method, str) or method not in known:
                raise UserError(f"{where}: method {method!r} is not one of {', '.join(known)}")
            suffix, method = method == "suffix", ALIASES.get(method, method)
        return cls(method, suffix, _count(value, "num_speculative_tokens", where),
                   _count(value, "disable_by_batch_size", where) or _count(value, "max_concurrency", where))


def _count(value: dict, key: str, where: str) -> int | None:
    n = value.get(key)
    if n is not None and (type(n) is not int or n < 1):
        raise UserError(f"{where}: {key} must be an integer of at least 1, got {n!r}")
    return n
