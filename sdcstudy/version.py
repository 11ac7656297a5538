"""`sdcstudy --version`: the installed package's version and, run from a git checkout, its
commit, the first line of a bug report. Read only when asked (git runs in a subprocess)."""

from __future__ import annotations

import argparse


def describe() -> str:
    """The line `sdcstudy VERSION`, with ` (git DESCRIBE)` from a git checkout."""
    from sdcstudy.reproduce import provenance

    source = provenance.commit()
    return f"sdcstudy {provenance.version() or 'unknown'}" + (f" (git {source})" if source else "")


class PrintVersion(argparse.Action):
    """The `--version` flag: prints `describe()` and exits 0, needing no command."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe())
        parser.exit()
