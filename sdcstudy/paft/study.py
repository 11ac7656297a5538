"""The set-up the PAFT studies share (experiments/paft_noise.py, experiments/paft_packets.py):
their base config and optimizer, their command line, one run folder per method under --out, and
the tables written beside them.

No persistent compilation cache: each run compiles its own step. On the CPU a step loaded from
JAX's cache crashed in XLA's collectives until its conditionals were ordered by data
(docs/developing.md, "A crash in programs loaded from the compilation cache"); a fresh compile
never did.

JAX is imported inside the functions: a study sets XLA_FLAGS (8 simulated CPU devices) first.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sdcstudy.core.errors import ArgumentParser

# The tiny Llama with one decoder layer, M = 4 workers, the synthetic corpus (the project's
# learning-rate schedule: warm-up then cosine).
BASE = ["experiment.mode=paft", "mesh.dp=4", "model.preset=tiny", "model.n_layers=1",
        "experiment.batch_size=16", "data.seq_len=64", "experiment.checkpoint_every=0",
        "data.synthetic_tokens=200000"]
# Plain SGD with momentum and no clipping: per-worker clipping or Adam's normalization would
# rescale each worker's error by its own norm, which is another experiment.
OPTIM = ["optim.name=sgdm", "optim.lr=0.3", "optim.clip_norm=null"]


def parse(doc: str, steps: int, argv=None) -> argparse.Namespace:
    """A study's arguments (--out, --steps, --set, --resume); --out is created, and refused
    when it holds files unless --resume. `doc`: the study's docstring, its command first, then
    a blank line and the question it answers (the description)."""
    p = ArgumentParser(description=doc.split("\n\n")[1].splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    p.add_argument("--steps", type=int, default=steps, help=f"steps per run (default {steps})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for every run")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted study in --out: finished runs are kept")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, not {args.steps}.")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {str(args.out)!r} is a file; give a new or empty folder.")
    if args.out.exists() and any(args.out.iterdir()) and not args.resume:
        p.error(f"--out {str(args.out)!r} already holds files; choose a new folder "
                f"(or --resume an interrupted study).")
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def run(args, name: str, overrides: list[str]):
    """One run folder `runs/NAME` under --out; returns its Run (report.load_run)."""
    from sdcstudy import runner
    from sdcstudy.core import config as C
    from sdcstudy.report import runs as report

    cfg = C.from_dict({}, BASE + [f"experiment.steps={args.steps}", f"experiment.name={name}"]
                      + list(args.overrides) + overrides)
    folder = args.out / "runs" / name
    if not (folder / "summary.json").is_file():  # a finished run is kept as it is
        runner.run(cfg, folder, progress=False, echo=lambda *_: None,
                   resume=getattr(args, "resume", False) and (folder / "config.yaml").is_file())
    print(f"  {name}: done", flush=True)
    return report.load_run(folder)


def write(args, name: str, text: str) -> None:
    """`text` as the file `name` under --out, written atomically."""
    from sdcstudy.core import runfolder as RF

    RF.atomic_write_text(args.out / name, text)
