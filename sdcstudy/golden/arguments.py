"""The `golden` command's arguments: `record`, `check` and `quorum` (docs/golden.md). Kept
apart from golden/cli.py, which runs them, so that building the CLI's parser imports nothing
heavy."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    """The `golden` command and its subcommands, on an argparse subparsers object."""
    p = sub.add_parser("golden", help="pre-admission golden-run test: record on a trusted "
                                       "node, check a candidate bit for bit (docs/golden.md)")
    gsub = p.add_subparsers(dest="golden_command", metavar="record|check|quorum")
    gsub.required = True
    g = gsub.add_parser("record", help="record a golden run (exit 0, or 2 on bad input)")
    g.add_argument("config", type=Path, nargs="?", default=None,
                   help="YAML config, experiment.mode train (default: tiny, 6 steps)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    g.add_argument("--out", type=Path, required=True, help="new golden folder (never overwritten)")
    g.add_argument("--device", type=int, default=0, metavar="I", help="local device (default 0)")
    g.add_argument("--workload", choices=("tiny", "full"), default="tiny",
                   help="tiny (default, seconds) or full: sized to cover the device's SMs and "
                        "most of its memory (docs/golden.md, Coverage)")
    g.add_argument("--memory-share", type=float, default=None, metavar="S",
                   help="with --workload full: share of device memory written and read back "
                        "every step (default 0.75)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = gsub.add_parser("check", help="re-run and compare: exit 0 PASS, 1 FAIL, 2 INCONCLUSIVE")
    g.add_argument("golden_dir", type=Path, help="folder written by golden record")
    g.add_argument("--json", type=Path, default=None, metavar="FILE", help="JSON report here")
    g.add_argument("--junit", type=Path, default=None, metavar="FILE", help="JUnit XML here")
    g.add_argument("--inject", default=None, metavar="PROFILE",
                   help="inject faults to prove detection: a zoo name, a YAML profile, or "
                        "flip:step=K,site=S,layer=L,bit=B[,microstep=M][,seed=N]")
    g.add_argument("--allow-env-drift", action="store_true",
                   help="compare even when the environment differs from the golden record's")
    g.add_argument("--expect-sha", default=None, metavar="SHA",
                   help="the manifest SHA-256 golden record printed: any other record is "
                        "refused (exit 2) before anything runs")
    once = g.add_mutually_exclusive_group()
    once.add_argument("--repeat", type=int, default=None, metavar="N",
                      help="run the workload N times, comparing each (default 1)")
    once.add_argument("--duration", type=float, default=None, metavar="MINUTES",
                      help="repeat the workload for this long (whole repetitions)")
    g.add_argument("--device", default="0", metavar="I|all",
                   help="local device to check, or all of them, one table row each "
                        "(default 0; on CPU a simulated device)")
    g.add_argument("--inject-device", type=int, default=None, metavar="I",
                   help="with --device all: inject --inject on this device only")
    g.add_argument("--workers", type=int, default=None, metavar="N",
                   help="with --device all: devices checked at once (default: the CPU cores)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = gsub.add_parser("quorum", help="no trusted node: run on every local device (3 or "
                                       "more), the majority is the reference; exit 0 all "
                                       "agree, 1 a device differs, 2 no majority")
    g.add_argument("config", type=Path, nargs="?", default=None,
                   help="YAML config, experiment.mode train (default: as golden record)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    g.add_argument("--device", default="all", metavar="all",
                   help="the devices that vote: all (the only choice; default)")
    g.add_argument("--json", type=Path, default=None, metavar="FILE", help="JSON report here")
    g.add_argument("--junit", type=Path, default=None, metavar="FILE", help="JUnit XML here")
    g.add_argument("--inject", default=None, metavar="PROFILE",
                   help="inject faults (as golden check --inject), on --inject-device only")
    g.add_argument("--inject-device", type=int, default=None, metavar="I",
                   help="the device --inject corrupts (default: every device)")
    g.add_argument("--workers", type=int, default=None, metavar="N",
                   help="devices run at once (default: the CPU cores)")
    g.add_argument("--no-progress", action="store_true", help="no progress line")
    return p
