"""`sdcstudy fleet simulate [CONFIG] [--set key=value ...] [--json F] [--plot F.png]
[--max-corrupted-steps X] [--bench-detect F.json] [--seed N] [--trials N]`.

For each strategy: expected goodput, corrupted steps and rollback loss, analytic and Monte
Carlo, as a table on stdout; the cheapest strategy (highest goodput) whose expected corrupted
steps stay within --max-corrupted-steps (any strategy when no limit is given). Bad input
raises `UserError` (one sentence; the top-level CLI prints it and exits 2). The table is
printed before `--json` and `--plot` are written; a file that cannot be written is one warning
naming it (core/reports.py), and the exit code stays 0.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from sdcstudy.core import reports
from sdcstudy.core.errors import UserError
from sdcstudy.fleet import config as FC
from sdcstudy.fleet.model import Job, executed_step_hours, expect, golden_steps
from sdcstudy.fleet.montecarlo import simulate as monte_carlo
from sdcstudy.fleet.strategies import strategies, with_bench_overheads


def add_parser(sub) -> None:
    """The `fleet` command and its `simulate` subcommand, on an argparse subparsers object."""
    p = sub.add_parser("fleet", help="what SDC costs a training job at fleet scale "
                                     "(docs/fleet.md)")
    fsub = p.add_subparsers(dest="fleet_command", metavar="simulate")
    s = fsub.add_parser("simulate", help="goodput, corrupted steps and rollback loss of each "
                                         "detector strategy, analytic and Monte Carlo")
    s.add_argument("config", nargs="?", type=Path, default=None,
                   help="YAML config (default: the values of configs/fleet.yaml)")
    s.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override a key, e.g. --set fleet.nodes=16384 "
                                             "(repeatable)")
    s.add_argument("--json", type=Path, default=None, metavar="FILE", help="write results here")
    s.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="goodput against fleet size (1 to 100,000 nodes) per strategy")
    s.add_argument("--max-corrupted-steps", type=float, default=None, metavar="X",
                   help="the cheapest strategy must expect at most X corrupted steps")
    s.add_argument("--bench-detect", type=Path, default=None, metavar="FILE.json",
                   help="detector overheads from `sdcstudy bench detect --json FILE`")
    s.add_argument("--seed", type=int, default=None, help="Monte Carlo seed")
    s.add_argument("--trials", type=int, default=None, help="Monte Carlo trials (jobs)")
    p.set_defaults(func=main)


def resolve_config(args) -> tuple[FC.FleetConfig, dict | None]:
    overrides = list(args.overrides)
    if args.max_corrupted_steps is not None:
        overrides.append(f"max_corrupted_steps={args.max_corrupted_steps!r}")
    if args.seed is not None:
        overrides.append(f"montecarlo.seed={args.seed}")
    if args.trials is not None:
        overrides.append(f"montecarlo.trials={args.trials}")
    cfg = FC.load(args.config, overrides)
    if args.bench_detect is None:
        return cfg, None
    return with_bench_overheads(cfg, args.bench_detect)


def cheapest(rows: list[dict], limit: float | None) -> str | None:
    """The strategy with the highest goodput among those within `limit` corrupted steps."""
    allowed = [r for r in rows if not r["diverges"]
               and (limit is None or r["corrupted_steps"] <= limit)]
    return max(allowed, key=lambda r: r["goodput"])["name"] if allowed else None


def run(cfg: FC.FleetConfig, bench: dict | None = None) -> dict:
    """The whole report: resolved config, derived quantities, one row per strategy."""
    job = Job.from_config(cfg)
    trials, seed = cfg["montecarlo.trials"], cfg["montecarlo.seed"]
    rows = []
    for strategy in strategies(cfg):
        row = expect(job, strategy)
        row["detectors"] = [asdict(d) for d in strategy.detectors]
        row["executed_step_seconds"] = executed_step_hours(job, strategy) * 3600
        row["golden_every_steps"] = golden_steps(job, strategy) if job.golden else None
        if not row["diverges"]:
            row.update(monte_carlo(job, strategy, trials, seed))
        else:
            row.update({"goodput_mc": 0.0, "corrupted_steps_mc": None,
                        "rollback_steps_mc": None, "trials": trials, "finished": False,
                        "simulated": False})
        limit = cfg["max_corrupted_steps"]
        row["meets_limit"] = (not row["diverges"]
                              and (limit is None or row["corrupted_steps"] <= limit))
        rows.append(row)
    derived = {"steps": job.steps, "events_per_job_without_detectors":
               job.nodes * job.steps * job.step_hours
               * (job.transient_rate + job.persistent_rate)}
    return {"config": cfg.data, "derived": derived, "bench_detect": bench,
            "strategies": rows, "cheapest": cheapest(rows, cfg["max_corrupted_steps"])}


def _steps(x: float | None) -> str:
    if x is None:
        return "inf"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _no_strategy(limit: float | None) -> str:
    """Why no strategy is the cheapest, in words that cannot be read as the strategy `none`."""
    if limit is None:
        return "no strategy: in every one, rework outgrows progress and the job never ends"
    return "no strategy meets the limit"


def table(report: dict) -> str:
    cfg = report["config"]
    job, sdc = cfg["job"], cfg["sdc"]
    golden = cfg["golden"]
    lines = [f"{cfg['fleet']['nodes']:,} nodes, {job['hours']:g} h job = "
             f"{report['derived']['steps']:,} steps of {job['step_seconds']:g} s; checkpoint "
             f"every {job['checkpoint_every']} steps ({job['checkpoint_seconds']:g} s), restart "
             f"{job['restart_seconds']:g} s, rollback {job['rollback']}; SDC per node-hour "
             f"{sdc['transient_per_node_hour']:.3g} transient + "
             f"{sdc['persistent_per_node_hour']:.3g} persistent "
             f"({report['derived']['events_per_job_without_detectors']:.1f} events per job); "
             + (f"golden check every {golden['interval_hours']:g} h for "
                f"{golden['duration_hours']:g} h, recall {golden['recall']:g}"
                if golden["enabled"] else "no golden checks"),
             "",
             "| strategy | overhead | recall transient / persistent | goodput | goodput MC | "
             "corrupted steps | corrupted MC | rollback steps | rollback MC | restarts |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["strategies"]:
        mark = " *" if r["name"] == report["cheapest"] else ""
        drawn = r["goodput_mc"] is not None  # None: too many events a job to draw (montecarlo)
        goodput_mc = f"{r['goodput_mc']:.4f}" if drawn else "-"
        corrupted_mc = _steps(r["corrupted_steps_mc"]) if drawn else "-"
        rollback_mc = _steps(r["rollback_steps_mc"]) if drawn else "-"
        lines.append(
            f"| {r['name']}{mark} | {r['overhead']:.3f} | {r['recall']['transient']:.3f} / "
            f"{r['recall']['persistent']:.3f} | {r['goodput']:.4f} | {goodput_mc} | "
            f"{_steps(r['corrupted_steps'])} | {corrupted_mc} | "
            f"{_steps(r['rollback_steps'])} | {rollback_mc} | {_share(r['restarts'])} |")
    limit = cfg["max_corrupted_steps"]
    mc = cfg["montecarlo"]
    lines += ["",
              f"Expectations per job; MC: means over {mc['trials']:,} simulated jobs (seed "
              f"{mc['seed']}). recall: chance an event is flagged before the job ends (golden "
              "checks included). corrupted steps: steps trained on corrupted state before "
              "detection, or to the job's end.",
              ("cheapest strategy (highest goodput)"
               + (f" with at most {limit:g} expected corrupted steps" if limit is not None
                  else "") + f": {report['cheapest'] or _no_strategy(limit)}")]
    if report["bench_detect"]:
        b = report["bench_detect"]
        lines.append(f"overheads from {b['file']} (preset {b['preset']}): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in b["overheads"].items()))
    return "\n".join(lines) + "\n"


def main(args) -> int:
    if getattr(args, "fleet_command", None) != "simulate":
        raise UserError("name a fleet command: sdcstudy fleet simulate [CONFIG].")
    if args.trials is not None and args.trials < 1:
        raise UserError(f"--trials must be at least 1, not {args.trials}.")
    cfg, bench = resolve_config(args)
    report = run(cfg, bench)
    print(table(report), end="", flush=True)
    # After the table: a file that cannot be written is one warning, not a lost result.
    if args.json is not None:
        reports.write_report_json(args.json, report)
    if args.plot is not None:
        from sdcstudy.fleet.plot import plot_goodput

        reports.write_report_file(args.plot, lambda path: plot_goodput(
            cfg, report["strategies"], path), what="plot")
    return 0
