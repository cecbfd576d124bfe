"""Checks for the values that cross a boundary (API arguments, command-line flags, request fields), each failing with
one line that names the value, what it must be and what it was. No torch import: the command-line tools use these
while parsing their flags, before the model loads.
"""

import math
import os

from tr_engine.errors import InvalidType, InvalidValue

MAX_SEED = 2**63 - 1  # torch.Generator seeds are 64-bit; the sampler mixes in positions modulo 2**63


def integer(value, name: str, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int in [low, high]; bools and floats are refused (True is not a token count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidType(f"{name} must be an integer, got {_show(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidValue(f"{name} must be {_range(low, high)}, got {value}")
    return value


def real(value, name: str, low: float | None = None, high: float | None = None, low_open: bool = False) -> float:
    """`value` as a finite float in [low, high] (or (low, high] with low_open); ints are welcome, NaN and inf not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidType(f"{name} must be a number, got {_show(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidValue(f"{name} must be a finite number, got {value}")
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        where = _range(low, high) if not low_open else \
            f"above {low:g}" + (f" and at most {high:g}" if high is not None else "")
        raise InvalidValue(f"{name} must be {where}, got {value:g}")
    return value


def flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidType(f"{name} must be True or False, got {_show(value)}")
    return value


def text(value, what: str) -> str:
    """A string that is valid Unicode all the way to UTF-8. Bytes that were not UTF-8 reach Python as lone surrogates
    (command-line arguments, and stdin as the chat reads it), and no tokenizer can take them: refuse them here, saying
    which byte and where."""
    if not isinstance(value, str):
        raise InvalidType(f"{what} must be a string, got {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(value[e.start])
        byte = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"code point U+{ch:04X}"
        raise InvalidValue(f"{what} is not valid UTF-8 text ({byte} at character {e.start}); send it as UTF-8")
    return value


def cpu_set() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    return len(cpu_set())


def _range(low, high) -> str:
    if low is not None and high is not None:
        return f"between {low} and {high}"
    return f"at least {low}" if low is not None else f"at most {high}"


def _show(value) -> str:
    """A short description of a refused value: its type, and the value itself when it is short."""
    shown = repr(value)
    return f"{type(value).__name__} {shown}" if len(shown) <= 40 else type(value).__name__


def seed(value: int | None) -> int | None:
    """A sampling seed, or None (draw one)."""
    return None if value is None else integer(value, "seed", 0, MAX_SEED)


def nth_seed(base: int | None, n: int) -> int | None:
    """The seed of a batch's n-th prompt: base + n (wrapping past MAX_SEED), or None (each draws its own)."""
    return None if base is None else (base + n) % (MAX_SEED + 1)


def generation(max_new_tokens, seed_value=None, cancel=None, **flags) -> None:
    """The arguments every generate call takes: at least one new token, a seed (or None), what cancels it (a
    threading.Event, or None) and its flags (bools)."""
    integer(max_new_tokens, "max_new_tokens", 1)
    seed(seed_value)
    if cancel is not None and not (hasattr(cancel, "is_set") and hasattr(cancel, "set")):
        raise InvalidType(f"cancel must be a threading.Event, got {type(cancel).__name__}")
    for name, value in flags.items():
        flag(value, name)
