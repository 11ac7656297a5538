"""What the studies that profile the bench's steps share (experiments/profile_step.py,
compiler_options.py, profile_overheads.py): a suite's parsed arguments and the config
`sdcstudy bench train` times for a preset, and a table printed and written.

Imports no JAX.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def bench_args(suite: str, *extra: str) -> argparse.Namespace:
    """The arguments `sdcstudy bench SUITE EXTRA...` parses, defaults included."""
    from sdcstudy.bench.cli import add_bench_args

    parser = argparse.ArgumentParser(prog="sdcstudy bench")
    add_bench_args(parser)
    return parser.parse_args([suite, *extra])


def train_config(preset: str):
    """The config `sdcstudy bench train` times for `preset`."""
    from sdcstudy.bench import common as B

    args = bench_args("train", "--presets", preset)
    return B.preset_config("train", preset, args, ["experiment.mode=train"])[0]


def emit(text: str, out: Path | None) -> None:
    """`text` on stdout and, when `out` is given, in that file (written atomically)."""
    print(text, end="")
    if out is not None:
        from sdcstudy.core import runfolder as RF

        RF.atomic_write_text(out, text)
