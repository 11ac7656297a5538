"""Overhead against model size, from `sdcstudy bench` results. Imports no JAX.

Every ratio a suite measures against its plain step (faults, abft, paired, collectives, paft,
detect) is one curve over the presets' parameter counts: the median with a bar from the
smallest to the largest per-repetition ratio; PAFT's goal ratio, dyn-overlap / noised, is drawn too. The
train suite's ratio (ours / torch) is a speed-up, not an overhead, and is left out.
`sdcstudy bench SUITE ... --plot FILE.png` draws the results it has just measured;
`sdcstudy bench plot A.json [B.json ...] --out FILE.png` draws saved ones (e.g. `bench all`
for tiny and small beside a later run for medium).
"""

from __future__ import annotations

from pathlib import Path

from sdcstudy.core.config import UserError

# The contender every other one of its suite is divided by.
BASES = {"faults": "plain", "abft": "off", "paired": "free", "collectives": "off", "paft": "dp",
         "detect": "none"}


def suites_of(report: dict, name: str = "the JSON file") -> dict[str, list[dict]]:
    """{suite: results} of one bench JSON: a single suite's, or every suite of `bench all`;
    `name` says which file in the sentence that refuses anything else."""
    if isinstance(report, dict) and isinstance(report.get("suites"), dict):
        return {suite: r.get("results", []) for suite, r in report["suites"].items()}
    if isinstance(report, dict) and "suite" in report and "results" in report:
        return {report["suite"]: report["results"]}
    raise UserError(f"{name} is not a `sdcstudy bench` result (no 'suite' and 'results'); "
                    f"give a file written by `sdcstudy bench ... --json`.")


def overhead_points(report: dict) -> list[dict]:
    """One row per (suite, overhead, preset): the ratio's median, min and max and the
    preset's parameter count."""
    rows = []

    def add(suite, label, result, ratio):
        rows.append({"suite": suite, "overhead": f"{suite}: {label}",
                     "preset": result["preset"], "n_params": result["n_params"],
                     "median": ratio["median"], "min": ratio["min"], "max": ratio["max"]})

    for suite, results in suites_of(report).items():
        base = BASES.get(suite)
        if base is None:
            continue
        for result in results:
            for r, suffix in _groups(result):
                contenders = r.get("variants") or r.get("modes") or {}
                for name, v in contenders.items():
                    if name != base and "ratio" in v:
                        add(suite, f"{name}/{base}{suffix}", {**result, **r}, v["ratio"])
                    if suite == "paft" and name == "dyn-overlap" and "ratio_to_noised" in v:
                        # PAFT's goal: its cost under the same simulated error (bench_paft)
                        add(suite, f"{name}/noised{suffix}", {**result, **r},
                            v["ratio_to_noised"])
                if "free_ratio_to_tp" in r and r["mesh"]["tp"] != r["free_ratio_to_tp"]["tp"]:
                    add(suite, f"free tp {r['mesh']['tp']}/tp {r['free_ratio_to_tp']['tp']}",
                        r, r["free_ratio_to_tp"])
    return rows


def _groups(result: dict):
    """(measurement, label suffix) pairs: PAFT results hold one per worker count, paired
    results name their tp degree when it is not 1."""
    if "by_workers" in result:
        for w in result["by_workers"]:
            yield w, f" (M={w['workers']})"
        return
    tp = result.get("mesh", {}).get("tp", 1)
    yield result, "" if tp == 1 else f" (tp {tp})"


def overhead_figure(reports: dict | list[dict], path: Path) -> Path | None:
    """Each overhead ratio against parameter count (log axis), median with min-max bars; one
    PNG written atomically. None, and nothing written, when the results hold no overhead."""
    from sdcstudy.report.plots import pyplot, save_figure, styles

    reports = [reports] if isinstance(reports, dict) else reports
    rows = [row for report in reports for row in overhead_points(report)]
    if not rows:
        return None
    plt = pyplot()
    curves: dict[str, list[dict]] = {}
    for row in rows:
        curves.setdefault(row["overhead"], []).append(row)
    fig, ax = plt.subplots(figsize=(8 + 2.4 * (len(curves) > 18), 4.8))
    for i, ((label, points), style) in enumerate(zip(curves.items(),
                                                     styles(curves).values())):
        points = sorted(points, key=lambda p: p["n_params"])
        x = [p["n_params"] * dodge(i, len(curves)) for p in points]
        y = [p["median"] for p in points]
        bars = [[p["median"] - p["min"] for p in points], [p["max"] - p["median"] for p in points]]
        ax.errorbar(x, y, yerr=bars, marker="o", capsize=3, label=label, **style)
    ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle="--")
    ax.set_xscale("log")
    ax.set_xlabel("parameters (each curve shifted a little sideways so bars do not cover "
                  "each other)", fontsize=9)
    ax.set_ylabel("step time ratio (named in the legend)")
    ax.set_title("Overhead against model size (median, min-max over repetitions)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
              ncol=1 if len(curves) <= 18 else 2)
    fig.tight_layout()
    return save_figure(fig, path)


def dodge(i: int, n: int) -> float:
    """The factor that shifts curve `i` of `n` sideways on the log parameter axis (at most
    about 12% either way): curves measured at the same presets would otherwise draw their
    markers and bars on top of one another."""
    return 10 ** (0.05 * (i - (n - 1) / 2) / max(1, (n - 1) / 2)) if n > 1 else 1.0


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="overhead ratios against parameter count from bench JSON "
                                    "files")
    p.add_argument("json_files", type=Path, nargs="+", metavar="FILE.json",
                   help="files written by `sdcstudy bench ... --json`")
    p.add_argument("--out", type=Path, required=True, metavar="FILE.png", help="the figure")
    p.set_defaults(bench=run_plot)


def run_plot(args) -> int:
    from sdcstudy.core import reports as RP
    from sdcstudy.core import runfolder as RF
    from sdcstudy.core.errors import ReportWriteError

    if args.out.exists():  # a figure already there is kept
        raise UserError(f"--out {str(args.out)!r} already exists; sdcstudy bench plot does not "
                        f"overwrite it: remove it or give a new file name.")
    RP.check_writable(args.out, args.out.parent, "figure")
    results = []
    for path in args.json_files:
        if not path.is_file():
            raise UserError(f"bench result {str(path)!r} does not exist; give a file written "
                            f"by `sdcstudy bench ... --json`.")
        try:
            results.append(RF.json_load(path))
        except ValueError:
            raise UserError(f"bench result {str(path)!r} is not valid JSON.")
        suites_of(results[-1], f"bench result {str(path)!r}")
    with RP.writing(args.out, "figure"):
        written = RP.publish(args.out, lambda tmp: overhead_figure(results, tmp))
    if written is None:
        raise UserError("the bench results hold no overhead ratio to plot (the train suite "
                        "measures a speed-up); give results of faults, abft, paired, collectives, "
                        "paft or detect.")
    if written != args.out:  # kept, as an --out there at the start would have been
        raise ReportWriteError(f"--out {str(args.out)!r} appeared while drawing and is kept; "
                               f"this figure is {str(written)!r}.")
    print(f"figure: {written}")
    return 0
