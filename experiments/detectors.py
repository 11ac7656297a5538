"""python experiments/detectors.py --out DIR [--steps 150] [--overhead-reps 30] [--tables-only]

Which SDC detector catches what, how fast, and at what cost, on the same faults. One run of
`experiment.mode: detect` per fault profile (paper nodes and synthetic ones, transient and
repeatable) plus a healthy run, each with every detector on at once: the loss / gradient-norm
monitor, ABFT, a shadow data-parallel replica (round robin over ranks), same-device
re-execution, the lock-step mirror (the reference) and localization with three replicas. The
state advances on the mirror's clean gradient (`detect.advance: reference`), so every step's
faults are an independent event, as in lock-step. After each run the same process times each
detector alone against no detector as `sdcstudy bench detect` does (interleaved repetitions,
median) with the peak memory of each compiled step (`detect_overhead.json` in the run folder).

What it should show: re-execution misses repeatable faults; the shadow replica catches what
lands on the rank it checks (about one step in `mesh.dp` under round robin); the lock-step
mirror and the three-replica localization catch every event, and localization also names the
device; the monitor only sees faults large enough to move the loss or the gradient norm.

Results in DIR: one run folder per profile, detectors.md and detectors.csv (the table, also
in `sdcstudy report DIR`), detectors.png. About 20 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from sdcstudy.core import config as C  # noqa: E402
from sdcstudy.core import runfolder as RF  # noqa: E402
from sdcstudy.core.errors import ArgumentParser, UserError  # noqa: E402

# (profile, suspect.fault_kind): zoo nodes and synthetic profiles, transient and repeatable.
PROFILES = (("paper-node-1", "transient"), ("paper-node-1", "repeatable"),
            ("exponent-flip", "transient"), ("mantissa-noise", "repeatable"),
            ("nan-burst", "transient"), ("repeatable", "profile"))


def base_config(args, profile: str, kind: str) -> C.Config:
    return C.from_dict({
        "experiment": {"mode": "detect", "steps": args.steps, "batch_size": 4, "seed": args.seed,
                       "checkpoint_every": 0, "name": f"detect-{profile}-{kind}"},
        "model": {"preset": "tiny", "n_layers": args.layers},
        "mesh": {"dp": 2},
        "data": {"seq_len": 32, "synthetic_tokens": 40_000},
        "optim": {"schedule": "constant", "lr": 1e-3},
        "suspect": {"profile": profile, "fault_kind": kind},
        "detect": {"detectors": "all", "advance": "reference"}})


def overhead(cfg: C.Config, repeats: int) -> dict:
    """Each detector alone against none on `cfg`'s model and mesh, advancing on the ranks
    without rollback (so none runs the ranks' executions and nothing else), one step a
    repetition: `sdcstudy bench detect`'s timing (`bench/detect.py`), its overheads."""
    from sdcstudy.bench import detect as bench_detect

    timed = C.from_dict(C.to_dict(cfg), ["detect.advance=primary", "detect.rollback=false"])
    result = bench_detect.time_detectors(
        timed, 1, argparse.Namespace(repeats=repeats, compile_threads=None), timed.experiment.name)
    return bench_detect.overheads(result)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead-reps", type=int, default=30)
    p.add_argument("--tables-only", action="store_true",
                   help="only redo the table and figure from the run folders already in --out")
    args = p.parse_args(argv)
    if args.steps < 1 or args.layers < 1 or args.overhead_reps < 0:
        p.error(f"--steps and --layers must be at least 1 and --overhead-reps at least 0, not "
                f"{args.steps}, {args.layers} and {args.overhead_reps}.")
    from sdcstudy.detect import tables as DT
    from sdcstudy.report import tables, writer as report

    names = [f"{profile}-{kind}" for profile, kind in (("healthy", "profile"), *PROFILES)]
    if args.tables_only and not any((args.out / name / RF.CONFIG).is_file() for name in names):
        print(f"detectors: --tables-only: {str(args.out)!r} holds none of the study's run "
              f"folders ({names[0]}, ...); give the --out of an earlier run.", file=sys.stderr)
        return 2
    if not args.tables_only:
        if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
            print(f"detectors: {str(args.out)!r} is not an empty folder; give a new --out.",
                  file=sys.stderr)
            return 2
        from sdcstudy import runner

        for name, (profile, kind) in zip(names, (("healthy", "profile"), *PROFILES)):
            cfg = base_config(args, profile, kind)
            print(f"== {profile} ({kind})")
            runner.run(cfg, args.out / name)
            if args.overhead_reps:
                RF.atomic_write_json(args.out / name / DT.OVERHEAD,
                                     overhead(cfg, args.overhead_reps))
    missing = [name for name in names if not (args.out / name).is_dir()]  # --tables-only
    try:
        runs, problems = report.load_runs([args.out / n for n in names if n not in missing])
    except UserError as e:
        print(f"detectors: error: {e}", file=sys.stderr)
        return 2
    problems += [f"{str(args.out / name)!r} does not exist; the table leaves that run out."
                 for name in missing]
    table = DT.benchmark_table(runs)
    text = f"# {DT.TITLE}\n\n" + tables.markdown(DT.indexed(table), DT.INDEX) + "\n"
    RF.atomic_write_text(args.out / "detectors.md", text)
    RF.atomic_write_text(args.out / "detectors.csv", table.to_csv(index=False,
                                                                  float_format="%.6g"))
    DT.recall_figure(table, args.out / "detectors.png")
    print(text)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
