"""The exit-code contract, the errors a user can fix, and the "did you mean" that ends their
sentence.

Every command ends with one of these codes (docs/golden.md "Exit codes", deploy/README.md):

- 0 `EXIT_PASS`: the command did its work; a check PASSed.
- 1 `EXIT_FAIL`: bits were compared and differ (a FAIL verdict), or a training stopped on what
  it measured (a non-finite loss, a detector that gave up). Deploy scripts drain on 1 only
  with the FAIL verdict printed (a Python stopped before sdcstudy could report exits 1 too).
- 2 `EXIT_BAD_INPUT`: bad input the user can fix (`UserError`), or an INCONCLUSIVE check.
- 3 `EXIT_COULD_NOT_RUN`: the command could not run or could not report (a backend that does
  not start, a report file that cannot be written, any unexpected exception). Deploy scripts
  log and alert on it, and never drain.
- 130 / 143: interrupted by SIGINT / SIGTERM.

This module imports nothing of the package, so every module can use it.
"""

from __future__ import annotations

import argparse
import difflib
import re


EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_BAD_INPUT = 2
EXIT_COULD_NOT_RUN = 3
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class UserError(Exception):
    """A problem the user can fix (bad input); the CLI prints it as one sentence, exit 2."""


class ConfigError(UserError):
    """A configuration key or value that is not valid."""


class CouldNotRun(Exception):
    """The command could not run or could not report (not the user's input, not a verdict):
    the CLI prints it as one sentence, exit 3."""


class ReportWriteError(CouldNotRun):
    """A report file asked for (`--json`, `--junit`, `--plot`, `--out`) could not be written.

    A command with a verdict prints the verdict first and keeps its code, with one warning
    sentence naming the file (`warn_unwritten`); a command whose output *is* the report (e.g.
    `sdcstudy report`) ends with this error, exit 3."""


def unexpected(error: BaseException) -> str:
    """The one sentence that ends a command stopped by an exception nobody foresaw (or by a
    device that ran out of memory, which is no bug: `out_of_memory`)."""
    oom = out_of_memory(error)
    if oom is not None:
        return oom
    return (f"could not run: {type(error).__name__}: {first_line(error, 300)} (a bug or a broken "
            f"environment, not a verdict on the hardware; set SDCSTUDY_TRACEBACK=1 for the "
            f"traceback)")


def out_of_memory(error: BaseException) -> str | None:
    """The sentence for XLA's RESOURCE_EXHAUSTED allocation failure: the setup does not fit the
    device's memory (a setup the user can shrink, not a bug, not a verdict); None for any
    other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text or "Out of memory" not in text:
        return None
    asked = re.search(r"allocating (\d+) bytes", text)
    size = f" (XLA asked for {_bytes(int(asked.group(1)))} at once)" if asked else ""
    return (f"could not run: the device ran out of memory{size}; the setup is too large for "
            f"it: `sdcstudy plan CONFIG` states its memory per device, and a shorter "
            f"data.seq_len, a smaller experiment.batch_size (more experiment.microsteps) or a "
            f"smaller model fits (not a verdict on the hardware)")


def _bytes(n: int) -> str:
    for unit, size in (("TB", 10 ** 12), ("GB", 10 ** 9), ("MB", 10 ** 6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:,} bytes"


def did_you_mean(word: str, choices) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, or nothing when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (its type's name when it has none), to quote
    inside a one-sentence error; at most `limit` characters when given."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def quoted(value, limit: int = 60) -> str:
    """`repr(value)` to quote a user's value inside a one-sentence error: the first `limit`
    characters, an ellipsis and the whole length where it is longer (a whole file read as a
    config, say)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose bad-input message is one line, exit `EXIT_BAD_INPUT`: the
    sentence and where the options are listed, not the usage block before it (subcommands'
    parsers are of the same class)."""

    def error(self, message: str, prog: str | None = None):
        prog = prog or self.prog
        self.exit(EXIT_BAD_INPUT, f"{prog}: error: {message} ({prog} --help lists the "
                                  f"options)\n")

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, noting in the namespace the innermost (sub)command that was left an
        option it does not take, so that the refusal names that command's --help."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(namespace, _LEFT_OVER_BY):
            setattr(namespace, _LEFT_OVER_BY, self.prog)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}",
                       getattr(namespace, _LEFT_OVER_BY, None))
        return namespace


_LEFT_OVER_BY = "_sdcstudy_left_over_by"  # ArgumentParser: the command left an unknown option
