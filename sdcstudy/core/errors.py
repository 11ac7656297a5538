"""The errors a user can fix, and the "did you mean" that ends their sentence.

The CLI prints a `UserError` as one sentence and exits with code 2; every layer raises it for
bad input (a config key, a missing file, a damaged golden record). This module imports nothing
of the package, so every module can use it.
"""

from __future__ import annotations

import difflib


class UserError(Exception):
    """A problem the user can fix (bad input); the CLI prints it as one sentence, exit 2."""


class ConfigError(UserError):
    """A configuration key or value that is not valid."""


def did_you_mean(word: str, choices) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, or nothing when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (its type's name when it has none), to quote
    inside a one-sentence error; at most `limit` characters when given."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__
