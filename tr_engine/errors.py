"""User-facing errors: each one is a single line that names the problem and the fix.

The Python API raises these for bad input (so `except UserError` catches every one); the command-line tools print
them as one line without a traceback (tr_engine/cli/common.py). Anything else escaping is a bug. A problem that
does not stop the work is a warning: one line on stderr (warn).
"""

import sys


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def one_line(text: str) -> str:
    """`text` with line breaks and other unprintable characters written as escapes (a newline as \\n), so that a
    message quoting the user's own value (a file name with a carriage return in it, say) stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class UserError(Exception):
    """Bad input from the user (model folder, config, prompt, flags, files). The message says what to do about it,
    in one line whatever it quotes."""

    def __init__(self, message: str):
        super().__init__(one_line(str(message)))


class ModelNotFound(UserError):
    pass


class UnsupportedConfig(UserError):
    pass


class WeightsError(UserError):
    """A weights file that cannot be used: missing, truncated, corrupt, or holding tensors that are no weights."""


class ContextOverflow(UserError):
    pass


class InvalidValue(UserError, ValueError):
    """An argument of the right type with a value the engine cannot use (a negative count, a temperature of NaN)."""


class InvalidType(UserError, TypeError):
    """An argument of the wrong type (an int where a prompt goes): a UserError, and a TypeError as Python expects."""


class MatrixFileError(UserError):
    """A recycling-matrix file that cannot be loaded or saved. A failed save keeps the previous file."""


def or_error(call, *args):
    """call(*args), or the UserError it raised: for a batch whose items are refused one by one."""
    try:
        return call(*args)
    except UserError as e:
        return e
