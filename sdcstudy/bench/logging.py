"""`sdcstudy bench logging`: a run folder's logging at the paper's row rate, without the model.

A lock-step run at the paper's scale logs 8,192 mismatch.parquet rows a step (4 sites x 32
layers x 64 pairs of microstep and tp rank) for 4,500 steps: 36.9 million rows. This suite
drives the path the host loop takes (`tablelog.TableLog` for mismatch.parquet with
`MISMATCH_COLUMNS`, `runfolder.MetricsWriter` for metrics.jsonl) with rows like a lock-step
run's, flushing every 100 steps as a run that checkpoints that often does, and reports the
process's peak RSS and the wall seconds of the first and the last flushes (`first_flush_s`,
`last_flush_s`: each the median of up to five, and their CPU seconds beside), then sums the table
up per site as the run's end does for summary.json (`summary_s`; `metrics.site_aggregates_of_parts`
over the parts, within the same peak RSS). A table kept whole in memory and rewritten at each
flush grows both with the run's length; an appended one keeps both flat. Imports no JAX.
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from sdcstudy.bench import common as B
from sdcstudy.bench.goals import goal
from sdcstudy.core import metrics as MX
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.core.errors import UserError

STEPS, ROWS_PER_STEP, FLUSH_EVERY = 4_500, 8_192, 100
SITES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")
LAYERS, TP = 32, 4
ELEMENTS = 4_096 * 4_096 // TP  # one rank's share of a (tokens, d_model) activation
MISMATCH_SHARE = 0.05  # rows with mismatching elements
EDGE_FLUSHES = 5  # first_flush_s, last_flush_s: the median of this many flushes (a third of
# them, if fewer than 15: a shared machine makes any one flush's wall time noisy)


def add_parser(sub) -> None:
    p = sub.add_parser("logging", help="run-folder tables and metrics at the paper's row rate "
                                       "(8,192 mismatch rows a step, 4,500 steps): peak RSS and "
                                       "flush times")
    p.add_argument("--steps", type=int, default=STEPS, metavar="N",
                   help=f"optimizer steps to log (default {STEPS:,})")
    p.add_argument("--rows-per-step", type=int, default=ROWS_PER_STEP, metavar="R",
                   help=f"mismatch rows a step (default {ROWS_PER_STEP:,})")
    p.add_argument("--flush-every", type=int, default=FLUSH_EVERY, metavar="K",
                   help=f"steps between flushes, as checkpoint_every (default {FLUSH_EVERY})")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write the tables into this new folder and keep it (default: a "
                        "temporary folder, removed)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write results here")
    p.add_argument("--markdown", type=Path, default=None, metavar="FILE",
                   help="write the table here")
    p.set_defaults(bench=run_logging_suite)


def mismatch_rows(step: int, n: int, rng: np.random.Generator) -> list[dict]:
    """`n` mismatch.parquet rows of one step, as `LockstepTaps.rows` gives them: python numbers,
    most rows without a mismatch, the others with a few and their relative errors."""
    mismatches = np.where(rng.random(n) < MISMATCH_SHARE, rng.integers(1, 5_000, n), 0)
    severity = np.where(mismatches > 0, rng.lognormal(-9.0, 2.0, n), 0.0)
    max_rel_err = severity * rng.uniform(1.0, 50.0, n)
    per_microstep = len(SITES) * LAYERS * TP
    return [{"step": step, "microstep": i // per_microstep, "layer": (i // TP) % LAYERS,
             "site": SITES[(i // (TP * LAYERS)) % len(SITES)], "tp_rank": i % TP,
             "mismatches": int(mismatches[i]), "elements": ELEMENTS,
             "severity": float(severity[i]), "max_rel_err": float(max_rel_err[i]),
             "nonfinite": 0} for i in range(n)]


def metrics_row(step: int, rows: list[dict], rng: np.random.Generator) -> dict:
    """metrics.jsonl's line of a lock-step step."""
    loss = 3.0 + 5.0 / (1.0 + step / 200.0) + 0.01 * float(rng.standard_normal())
    return {"step": step, "loss/healthy": loss, "loss/suspect": loss, "grad/norm": 1.0,
            "grad/norm_suspect": 1.0, "grad/diff_l2": 1e-6, "grad/nts": 1e-6,
            "param/diff_l2": 1e-7, "lr": 3e-4, "mismatches": sum(r["mismatches"] for r in rows),
            "faults/landed": 1, "time/step_s": 0.0}


def rss_mb() -> float | None:
    """The process's resident memory now (Linux), in MiB."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(folder: Path, steps: int, rows_per_step: int, flush_every: int,
            table_log=TL.TableLog, metrics_writer=RF.MetricsWriter, echo=B.echo_stderr) -> dict:
    """Log `steps` steps into `folder` as the host loop does, flushing every `flush_every`
    steps and at the end; `table_log` and `metrics_writer` are the classes measured."""
    rng = np.random.default_rng(0)
    table = table_log(folder / RF.MISMATCH, TL.MISMATCH_COLUMNS, keep_below_step=1)
    writer = metrics_writer(folder / RF.METRICS, keep_below_step=1)
    flush_s, flush_cpu_s, rss_after_flush = [], [], []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        rows = mismatch_rows(step, rows_per_step, rng)
        table.extend(rows)
        writer.write(metrics_row(step, rows, rng))
        if step % flush_every == 0 or step == steps:
            began, began_cpu = time.perf_counter(), time.process_time()
            writer.flush()
            table.flush()
            flush_s.append(time.perf_counter() - began)
            flush_cpu_s.append(time.process_time() - began_cpu)
            rss_after_flush.append(rss_mb())
            echo(f"step {step:,}/{steps:,}: flush {flush_s[-1]:.3f} s, RSS "
                 f"{rss_after_flush[-1] or 0:,.0f} MiB")
    writer.close()
    began = time.perf_counter()
    aggregates = MX.site_aggregates_of_parts(table.frames(MX.AGGREGATE_COLUMNS))
    summary_s = time.perf_counter() - began
    echo(f"summary: {summary_s:.1f} s, {sum(aggregates['mismatches'].values()):,} mismatches")
    edge = max(1, min(EDGE_FLUSHES, len(flush_s) // 3))
    return {"steps": steps, "rows_per_step": rows_per_step, "flush_every": flush_every,
            "rows": steps * rows_per_step, "wall_s": time.perf_counter() - start,
            "peak_rss_mb": peak_rss_mb(),
            "first_flush_s": statistics.median(flush_s[:edge]),
            "last_flush_s": statistics.median(flush_s[-edge:]),
            "first_flush_cpu_s": statistics.median(flush_cpu_s[:edge]),
            "last_flush_cpu_s": statistics.median(flush_cpu_s[-edge:]),
            "summary_s": summary_s,
            "flush_s": flush_s, "flush_cpu_s": flush_cpu_s, "rss_mb_after_flush": rss_after_flush,
            "table_mb": _size(folder / RF.MISMATCH) / 2**20,
            "pending_rows_after_flush": getattr(table, "pending_rows", None)}


def _size(path: Path) -> int:
    """Bytes of a file, or of the files in a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def logging_goals(result: dict) -> list[dict]:
    where = {"steps": result["steps"], "rows_per_step": result["rows_per_step"]}
    ratio = result["last_flush_s"] / result["first_flush_s"] if result["first_flush_s"] else None
    return [goal("logging.peak_rss_mb", result["peak_rss_mb"], **where),
            goal("logging.last_over_first_flush", ratio, **where)]


def table(result: dict) -> str:
    return ("| steps | rows/step | rows | flushes | first flush s | last flush s | summary s "
            "| peak RSS MiB | table MiB | wall s |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
            f"| {result['steps']:,} | {result['rows_per_step']:,} | {result['rows']:,} | "
            f"{len(result['flush_s'])} | {result['first_flush_s']:.3f} | "
            f"{result['last_flush_s']:.3f} | {result['summary_s']:.1f} | "
            f"{result['peak_rss_mb']:,.0f} | {result['table_mb']:,.1f} | "
            f"{result['wall_s']:,.1f} |\n")


def run_logging_suite(args) -> int:
    for name in ("steps", "rows_per_step", "flush_every"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not "
                            f"{getattr(args, name)}.")
    if args.out is not None and args.out.exists():
        raise UserError(f"{str(args.out)!r} already exists; give --out a new folder.")
    B.check_outputs(args)
    with tempfile.TemporaryDirectory(prefix="sdcstudy-bench-logging-") as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        result = measure(folder, args.steps, args.rows_per_step, args.flush_every)
    environment = {**B.host(), "load_average_end": list(os.getloadavg()),
                   "cpus": os.cpu_count()}
    return B.finish(args, "logging", [result], table(result), goals=logging_goals(result),
                    environment=environment)
