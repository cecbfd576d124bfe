"""User-facing errors: each one is a single line that names the problem and the fix.

Command-line entry points catch `UserError` and print it without a traceback; anything else is a bug.
"""


class UserError(Exception):
    """Bad input from the user (model folder, config, prompt, flags). The message says what to do about it."""


class ModelNotFound(UserError):
    pass


class UnsupportedConfig(UserError):
    pass


class WeightsError(UserError):
    pass


class ContextOverflow(UserError):
    pass
