"""`sdcstudy bench`: performance benchmarks, measured side by side in one run."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="suite", metavar="SUITE")
    sub.required = True
    t = sub.add_parser("train", help="tokens/s of our training step against transformers+torch")
    t.add_argument("--presets", default="tiny,small")


def main(args) -> int:
    raise NotImplementedError
