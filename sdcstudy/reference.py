"""docs/config.md, generated from the code: every config key with its default and meaning,
the sections each mode reads, what each mode writes to metrics.jsonl and summary.json, and
every `sdcstudy bench` option.

    python -m sdcstudy.reference --write   # regenerate docs/config.md
    python -m sdcstudy.reference --check   # exit 1 when docs/config.md is out of date

A key's meaning is the comment on its line in the dataclass (core/config.py,
core/presets.py), so the page cannot drift from the code: tests/test_reference.py fails when
the file differs from what this module writes, or when a key has no comment.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import sys
import tokenize
import typing
from pathlib import Path

from sdcstudy import modes
from sdcstudy.core.config import Config
from sdcstudy.modes.base import COMMON_METRICS, COMMON_SECTIONS, COMMON_SUMMARY, UNREAD

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"
REGENERATE = "python -m sdcstudy.reference --write"


def undocumented(mode: str, summary: dict, metrics_rows: list[dict]) -> list[str]:
    """The fields of a run's summary.json and metrics.jsonl rows that the mode's tables (and the
    tables every mode shares) leave out; a `<name>` in a documented field stands for any name."""
    cls = modes.get(mode)
    metrics = sorted({f for row in metrics_rows for f in row})
    found = [(f, (COMMON_SUMMARY, cls.summary)) for f in summary] + [
        (f, (COMMON_METRICS, cls.metrics)) for f in metrics]
    return [field for field, tables in found if not any(
        re.fullmatch(re.sub(r"<[^>]+>", ".+", re.escape(key)), field)
        for table in tables for key in table)]


def field_comments(cls) -> dict[str, str]:
    """field -> the comment on its line, or on the comment lines right above it."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    found = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for number, line in enumerate(lines, start=1):
        name = line.strip().split(":")[0]
        if name not in names or not line.startswith("    ") or line.startswith("     "):
            continue
        above, k = [], number - 1
        while k in comments and lines[k - 1].strip().startswith("#"):
            above.insert(0, comments[k])
            k -= 1
        found[name] = " ".join(above + ([comments[number]] if number in comments else []))
    return found


def config_keys(cls=Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, meaning) of every leaf field, in declaration order."""
    rows = []
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        if dataclasses.is_dataclass(default):
            rows += config_keys(type(default), f"{prefix}{f.name}.")
        else:
            kind = " | ".join("null" if a is type(None) else a.__name__
                                 for a in typing.get_args(hints[f.name]) or [hints[f.name]])
            rows.append((f"{prefix}{f.name}", kind, _yaml(default), comments.get(f.name, "")))
    return rows


def _readers(key: str, classes: dict) -> str:
    """The modes that read `key`: those that read its section (`Mode.reads`, or every mode for
    `COMMON_SECTIONS`), but for those that leave the key itself unread (`UNREAD`)."""
    section = key.split(".")[0]
    unread = [n for n in classes if key in UNREAD.get(n, {})]
    if section in COMMON_SECTIONS:
        return "every mode" + (f" but {', '.join(f'`{n}`' for n in unread)}" if unread else "")
    return ", ".join(f"`{n}`" for n, c in classes.items()
                     if section in c.reads and n not in unread) or "-"


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _table(header: tuple[str, ...], rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out + [""]


def bench_options() -> list[tuple[str, str, str]]:
    """(suite, option, help) of every `sdcstudy bench` subcommand."""
    from sdcstudy.cli import build_parser

    def subparsers(parser):
        for action in parser._actions:  # argparse keeps its sub-commands only here
            if isinstance(action, argparse._SubParsersAction):
                return action.choices
        return {}

    rows = []
    for suite, parser in subparsers(subparsers(build_parser())["bench"]).items():
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS \
                    and "--help" not in action.option_strings:
                rows.append((suite, f"`{', '.join(action.option_strings)}`",
                             " ".join((action.help or "").split()).replace("%%", "%")))
    return rows


def render() -> str:
    out = ["# Configuration reference", "",
           f"Generated by `{REGENERATE}` from the code; do not edit by hand.", "",
           "A run's config is YAML (`configs/`); `--set KEY=VALUE` overrides one key. "
           "Every mode reads `experiment`, `model`, `mesh`, `optim`, `data` and `logging`; the "
           "table of modes names the sections each reads beyond those. A key a mode would "
           "ignore, set to other than its default, is refused in one sentence before anything "
           "is built (modes/base.py, `refuse_ignored`): a key of a section the mode does not "
           "read, or the setting of something the config leaves off (abft.recompute with "
           "abft.enabled false, detect.replicas without the localize detector, paft.h_max "
           "without paft.dynamic, ...).", "",
           "Contents: [Keys](#keys) · [Modes](#modes) · "
           "[What every run writes](#what-every-run-writes) · "
           "[`sdcstudy bench` options](#sdcstudy-bench-options)", "",
           "## Keys", ""]
    classes = {name: modes.get(name) for name in modes.REGISTRY}
    out += _table(("key", "type", "default", "meaning", "read by"),
                  [(f"`{k}`", t, f"`{d}`", m, _readers(k, classes))
                   for k, t, d, m in config_keys()])
    out += ["## Modes", ""]
    out += _table(("mode", "reads", "what it runs"),
                  [(f"`{n}`", ", ".join(f"`{s}`" for s in c.reads) or "-",
                   " ".join(c.description.split()))
                   for n, c in classes.items()])
    out += ["## What every run writes", "", "`metrics.jsonl`, one line per step:", ""]
    out += _table(("field", "meaning"), [(f"`{k}`", v) for k, v in COMMON_METRICS.items()])
    out += ["`summary.json`:", ""]
    out += _table(("field", "meaning"), [(f"`{k}`", v) for k, v in COMMON_SUMMARY.items()])
    for name, cls in classes.items():
        out += [f"### `{name}`", ""]
        if cls.metrics:
            out += ["`metrics.jsonl` adds:", ""]
            out += _table(("field", "meaning"), [(f"`{k}`", v) for k, v in cls.metrics.items()])
        if cls.summary:
            out += ["`summary.json` adds:", ""]
            out += _table(("field", "meaning"), [(f"`{k}`", v) for k, v in cls.summary.items()])
        if not cls.metrics and not cls.summary:
            out += ["Nothing beyond what every run writes.", ""]
    out += ["## `sdcstudy bench` options", ""]
    out += _table(("suite", "option", "meaning"), bench_options())
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdcstudy.reference", description=__doc__)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="regenerate docs/config.md")
    what.add_argument("--check", action="store_true", help="exit 1 if it is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date; run `{REGENERATE}`.", file=sys.stderr)
            return 1
        return 0
    from sdcstudy.core import runfolder as RF

    RF.atomic_write_text(PAGE, text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
