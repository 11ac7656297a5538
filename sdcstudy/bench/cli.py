"""`sdcstudy bench`: performance benchmarks, measured side by side in one run.

This module holds the command line: one subcommand per suite and `all`. common.py holds
what the suites share (shapes per preset, the common options, a preset's config, the
machine's description, writing the table and the JSON file); timing.py compiles, warms up
and times a suite's contenders in interleaved repetitions and takes the ratios per
repetition. The suites, one module each:

- `train` (train.py): our `Trainer.train_step` against the same Llama trained by
  transformers + torch on the CPU, all in float32.
- `faults` (faults.py): the plain single-node step against the step with the fault
  engine built from profiles that never fire.
- `abft` (abft.py): the single-node step without ABFT, with checksummed matmuls and with
  recomputation on a flag.
- `paired` (paired.py): the `PairedTrainer` step in modes free, lockstep and paramsync,
  with XLA's compiled memory per device.
- `collectives` (collectives.py): the paired step at tp >= 2 (lock-step unless `--mode` says
  otherwise) with the collectives' checksums off and on, with XLA's compiled memory per
  device (not in `all`: see `run_all_suites`).
- `paft` (paft.py), `detect` (detect.py, not in `all`); `plot` (plot.py) draws the
  overhead ratios of saved results against the parameter count.
- `logging` (logging.py): the run folder's tables and metrics at the paper's row rate,
  without the model: peak RSS and flush times (not in `all`: it measures no step).
Each suite's JSON records the seconds spent per phase (initial states, lowering, compiling,
warm-up, timed steps), and `all` prints each suite's elapsed time.

JAX and torch are imported inside the functions that use them (the CLI builds its parser
without them); the CLI sets the simulated CPU device count before JAX starts.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sdcstudy.bench.common import add_common_args, check_args, echo_stderr, write


def add_bench_args(p: argparse.ArgumentParser) -> None:
    from sdcstudy.bench.abft import add_parser as add_abft_parser
    from sdcstudy.bench.collectives import add_parser as add_collectives_parser
    from sdcstudy.bench.detect import add_parser as add_detect_parser
    from sdcstudy.bench.faults import add_parser as add_faults_parser
    from sdcstudy.bench.logging import add_parser as add_logging_parser
    from sdcstudy.bench.paft import add_parser as add_paft_parser
    from sdcstudy.bench.paired import add_parser as add_paired_parser
    from sdcstudy.bench.plot import add_parser as add_plot_parser
    from sdcstudy.bench.train import add_parser as add_train_parser

    sub = p.add_subparsers(dest="suite", metavar="SUITE")
    sub.required = True
    add_train_parser(sub)
    add_faults_parser(sub)
    add_paired_parser(sub)
    add_collectives_parser(sub)
    add_abft_parser(sub)
    add_paft_parser(sub)
    add_detect_parser(sub)
    add_logging_parser(sub)
    add_plot_parser(sub)

    a = sub.add_parser("all", help="the suites train, faults, paired, abft and paft (4 "
                                   "workers) in turn, 3 repetitions each unless --repeats says "
                                   "otherwise")
    add_common_args(a, None, repeats=3)
    a.set_defaults(bench=run_all_suites)


def main(args) -> int:
    return args.bench(args)


def run_all_suites(args) -> int:
    """The suites train, faults, paired, abft and paft in turn with the shared options (the
    suites' own at their defaults, paft with 4 workers, which the batch of every preset splits
    over); one table, and one JSON file holding each suite's results."""
    from sdcstudy.core import runfolder as RF
    from sdcstudy.bench.abft import run_abft_suite
    from sdcstudy.bench.goals import goals_table
    from sdcstudy.bench.faults import run_faults_suite
    from sdcstudy.bench.paft import run_paft_suite
    from sdcstudy.bench.paired import run_paired_suite
    from sdcstudy.bench.train import TORCH_ATTENTION, run_train_suite

    # Not here: `detect`, and `collectives` (two tp-2 programs per preset, 6.4 minutes for
    # tiny and small on a loaded 2-core machine, 2026-12-01), which would take `all` past the
    # 10 minutes its shapes are held to (common.SHAPES); run `sdcstudy bench collectives`.
    suites = {"train": (run_train_suite, {"torch_attention": ",".join(TORCH_ATTENTION),
                                          "no_torch": False}),
              "faults": (run_faults_suite, {}),
              "paired": (run_paired_suite, {"tp": "1", "dp": 1}),
              "abft": (run_abft_suite, {}),
              "paft": (run_paft_suite, {"workers": "4", "sigma2": 1e-3})}
    check_args(args)
    tables, results, elapsed = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (run, extra) in suites.items():
            echo_stderr(f"== sdcstudy bench {name}")
            start = time.perf_counter()
            out = Path(tmp) / name
            sub = argparse.Namespace(**{**vars(args), **extra, "json": out.with_suffix(".json"),
                                        "markdown": out.with_suffix(".md"), "plot": None})
            run(sub)
            elapsed[name] = time.perf_counter() - start
            tables.append(f"## {name}\n\n" + out.with_suffix(".md").read_text())
            results[name] = RF.json_load(out.with_suffix(".json"))
    goals = [g for r in results.values() for g in r.get("goals", [])]
    table = "\n".join(tables) + "\n## goals\n\n" + goals_table(goals)
    total = sum(elapsed.values())
    echo_stderr("elapsed: " + ", ".join(f"{name} {s:.0f} s" for name, s in elapsed.items()) +
                f"; all {total:.0f} s ({total / 60:.1f} min)")
    print("\n## goals\n\n" + goals_table(goals), end="")
    write(args, {"suite": "all", "goals": goals, "suites": results, "elapsed_s": elapsed},
          table)
    return 0
