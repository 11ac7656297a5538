"""python experiments/bench_scaling.py --out DIR [--repeats 3] [--steps 5] [--axes ...]

How each overhead grows with the model and the parallelism, on small models derived from
`tiny` (D=64, 1 layer, 4 heads and 4 KV heads so that tp = 4 divides them, FFN 2D, byte
vocabulary), batch 8 x 32 tokens unless an axis changes it. Each point is one measurement of
`sdcstudy bench`'s own suites (`bench_paired.measure_paired`, `bench_abft.measure_abft`,
`bench_paft.measure_paft`: compiled once, warmed up, timed in interleaved repetitions, ratios
per repetition to the plain step of the same rotation):

- layers (1, 2, 4), hidden size (32, 64, 128) and sequence length (32, 64, 128): lock-step /
  free and paramsync / free (a pair at tp 1), ABFT on / off (one node);
- tp degree (1, 2, 4): lock-step / free and paramsync / free at each degree, and free at the
  degree / free at tp 1, the nine programs (three modes at three degrees) in one rotation;
- PAFT workers (2, 4, 8): PAFT-Dyn with overlap / noised (PAFT's own share) and noised / plain
  data parallel.

What it should show: ABFT's ratio falling as the hidden size grows (checksums are a thin
extra row and column on each product); lock-step's share following the activations it
compares and paramsync's the parameters it copies, both relative to the step's work; the tp
degree costing collectives and smaller matmuls on simulated devices that share the cores;
PAFT-Dyn's share staying small next to the per-worker copies that simulate the error.

Results in DIR: scaling.csv and scaling.parquet (one row per axis, value and overhead:
median, min and max of the ratio, the parameter count), one PNG per axis, scaling.md (a table
per axis, each curve with a sentence on what is communicated or recomputed). The default sweep
compiles 53 small programs; estimated 5-7 minutes on a quiet 2-core CPU (three of the five
axes, 33 programs, at --repeats 1 --steps 1 took 8.5 minutes on a heavily loaded one).
Timings on a loaded machine are indicative: compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from sdcstudy.core import runfolder as RF  # noqa: E402
from sdcstudy.core.errors import ArgumentParser  # noqa: E402

BASE = {"model.n_layers": 1, "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 4,
        "model.ffn_dim": 128}
BATCH, SEQ_LEN = 8, 32
AXES = {  # axis: (what it changes, values)
    "layers": ("model.n_layers", (1, 2, 4)),
    "hidden": ("model.d_model", (32, 64, 128)),
    "seq_len": ("data.seq_len", (32, 64, 128)),
    "tp": ("mesh.tp", (1, 2, 4)),
    "workers": ("mesh.dp", (2, 4, 8)),
}
MODEL_AXES = ("layers", "hidden", "seq_len")

# One sentence per curve: what the overhead communicates or recomputes.
EXPLAIN = {
    "lockstep/free": "At the four sites of every layer (attention and FFN outputs forward, "
                     "their input gradients backward) the suspect's tensor is gathered with "
                     "the healthy one, compared bit for bit and overwritten, and the state is "
                     "copied after the step: extra work in layers x tokens x D against the "
                     "step's layers x tokens x D^2, so its share should fall with D and stay "
                     "flat in layers and tokens.",
    "paramsync/free": "After every step the healthy node's parameters and optimizer state "
                      "(three floats per parameter) are copied over the suspect's and the "
                      "gradient difference is reduced to a norm: extra work in the parameter "
                      "count, so its share falls as the tokens per step grow.",
    "abft on/off": "Every forward matmul and both backward products also compute row and "
                   "column checksums (matrix-vector products, O(nk + km) extra for an O(nkm) "
                   "product) and compare them, so the extra arithmetic falls as 1/D; vector "
                   "products run at memory speed on a CPU, so the time share falls more "
                   "slowly.",
    "free tp/tp 1": "Megatron tensor and sequence parallelism splits every matmul over the tp "
                    "ranks and adds an all-gather and a reduce-scatter around each attention "
                    "and FFN block, forward and backward; simulated devices share the same "
                    "cores, so there is no compute to gain and the ratio is the collectives' "
                    "and the smaller matmuls' cost.",
    "dyn-overlap/noised": "PAFT-Dyn all-reduces the workers' parameters every H steps (a "
                          "parameter-sized message) and estimates their divergence at each "
                          "average, applied one step late so it overlaps the next step, so "
                          "its share grows with the parameters and shrinks as H grows.",
    "noised/dp": "Simulating the aggregation error keeps one parameter and optimizer copy per "
                 "worker and draws each worker's noise every step (parameter-sized random "
                 "numbers per worker), so it grows with the worker count: the simulation's "
                 "cost, not PAFT's.",
}


def bench_args(args, overrides: dict, **extra) -> argparse.Namespace:
    """The Namespace `sdcstudy bench` suites read, for the tiny-derived model."""
    sets = [f"{k}={v}" for k, v in {**BASE, **overrides}.items() if k != "data.seq_len"]
    return argparse.Namespace(
        presets="tiny", batch=BATCH, seq_len=overrides.get("data.seq_len", SEQ_LEN),
        steps=args.steps, repeats=args.repeats, overrides=sets,
        compile_threads=args.compile_threads, json=None, markdown=None, plot=None,
        tp="1", dp=1, workers="4", sigma2=1e-3, **extra)


def rows_of(axis: str, value, result: dict, ratios: dict) -> list[dict]:
    return [{"axis": axis, "value": value, "overhead": name, "median": r["median"],
             "min": r["min"], "max": r["max"], "n_params": result["n_params"],
             "seq_len": result["seq_len"], "batch": result["batch"]}
            for name, r in ratios.items()]


def measure_model_point(args, axis: str, value, cache: dict) -> list[dict]:
    """lockstep / free, paramsync / free and ABFT on / off at one point of a model axis; the
    base point, shared by the three axes, is measured once."""
    from sdcstudy.bench import abft as bench_abft, paired as bench_paired

    key_name = AXES[axis][0]
    overrides = {} if value == _base_value(axis) else {key_name: value}
    if key_name == "model.d_model" and overrides:
        overrides["model.ffn_dim"] = 2 * value
    key = tuple(sorted(overrides.items()))
    if key not in cache:
        ns = bench_args(args, overrides)
        (paired,) = bench_paired.measure_paired("tiny", ns)
        abft = bench_abft.measure_abft("tiny", ns, which={"off": [], "on": ["abft.enabled=true"]})
        cache[key] = (paired, {"lockstep/free": paired["modes"]["lockstep"]["ratio"],
                               "paramsync/free": paired["modes"]["paramsync"]["ratio"]},
                      abft, {"abft on/off": abft["variants"]["on"]["ratio"]})
    paired, paired_ratios, abft, abft_ratios = cache[key]
    return rows_of(axis, value, paired, paired_ratios) + rows_of(axis, value, abft, abft_ratios)


def _base_value(axis: str):
    name = AXES[axis][0]
    return SEQ_LEN if name == "data.seq_len" else BASE.get(name)


def measure_tp(args) -> list[dict]:
    from sdcstudy.bench import paired as bench_paired

    degrees = AXES["tp"][1]
    ns = bench_args(args, {})
    ns.tp = ",".join(str(d) for d in degrees)
    rows = []
    for result in bench_paired.measure_paired("tiny", ns):
        tp = result["mesh"]["tp"]
        ratios = {"lockstep/free": result["modes"]["lockstep"]["ratio"],
                  "paramsync/free": result["modes"]["paramsync"]["ratio"],
                  "free tp/tp 1": result.get("free_ratio_to_tp",
                                             {"median": 1.0, "min": 1.0, "max": 1.0})}
        rows += rows_of("tp", tp, result, ratios)
    return rows


def measure_workers(args) -> list[dict]:
    from sdcstudy.bench import paft as BP

    ns = bench_args(args, {})
    ns.workers = ",".join(str(m) for m in AXES["workers"][1])
    rows = []
    for w in BP.measure_paft("tiny", ns)["by_workers"]:
        rows += rows_of("workers", w["workers"], w, {
            "dyn-overlap/noised": w["dyn_over_noised"],
            "noised/dp": w["variants"]["noised"]["ratio"]})
    return rows


def figure(table, axis: str, path: Path) -> None:
    from sdcstudy.report.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    part = table[table.axis == axis]
    for name, curve in part.groupby("overhead", sort=False):
        curve = curve.sort_values("value")
        ax.errorbar(curve["value"], curve["median"],
                    yerr=[curve["median"] - curve["min"], curve["max"] - curve["median"]],
                    marker="o", capsize=3, label=name)
    ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(part["value"].unique()), [str(v) for v in sorted(part["value"].unique())])
    ax.set_xlabel({"layers": "layers", "hidden": "hidden size D", "seq_len": "sequence length",
                   "tp": "tp degree", "workers": "PAFT workers M"}[axis])
    ax.set_ylabel("step time ratio")
    ax.set_title(f"Overhead against {axis} (median, min-max)")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    save_figure(fig, path)


def summary(table, elapsed: float, args) -> str:
    from sdcstudy.report import tables

    lines = ["# Overhead scaling", "",
             f"`python experiments/bench_scaling.py --out DIR --repeats {args.repeats} "
             f"--steps {args.steps}`: tiny-derived models (D=64, 1 layer, 4 heads, 4 KV heads, "
             f"FFN 2D), batch {BATCH} x {SEQ_LEN} unless the axis changes it; each ratio is the "
             f"median (min-max) over interleaved repetitions of `sdcstudy bench`'s suites. "
             f"Took {elapsed / 60:.1f} minutes.", ""]
    for axis in dict.fromkeys(table["axis"]):
        part = table[table.axis == axis].copy()
        part["ratio"] = [f"{m:.2f}x ({lo:.2f}-{hi:.2f})"
                         for m, lo, hi in zip(part["median"], part["min"], part["max"])]
        wide = part.pivot(index="value", columns="overhead", values="ratio")
        wide = wide[list(dict.fromkeys(part["overhead"]))]
        lines += [f"## {axis}", "", tables.markdown(wide, [axis]), "", f"![{axis}]({axis}.png)",
                  ""]
        lines += [f"- {name}: {EXPLAIN[name]}" for name in dict.fromkeys(part["overhead"])]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    p.add_argument("--axes", default=",".join(AXES),
                   help=f"comma-separated axes (default {','.join(AXES)})")
    p.add_argument("--compile-threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or (args.compile_threads or 1) < 1:
        p.error(f"--repeats, --steps and --compile-threads must be at least 1, not "
                f"{args.repeats}, {args.steps} and {args.compile_threads}.")
    axes = [a.strip() for a in args.axes.split(",") if a.strip()]
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        print(f"bench_scaling: --axes names {unknown[0] if unknown else 'nothing'}; choose "
              f"from {', '.join(AXES)}.", file=sys.stderr)
        return 2
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        print(f"bench_scaling: {str(args.out)!r} is not an empty folder; give a new --out.",
              file=sys.stderr)
        return 2
    import pandas as pd

    from sdcstudy.core import determinism

    determinism.configure()
    start, rows, cache = time.perf_counter(), [], {}
    for axis in axes:
        print(f"== {axis}", file=sys.stderr, flush=True)
        if axis in MODEL_AXES:
            for value in AXES[axis][1]:
                rows += measure_model_point(args, axis, value, cache)
        elif axis == "tp":
            rows += measure_tp(args)
        else:
            rows += measure_workers(args)
    elapsed = time.perf_counter() - start
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    RF.atomic_write_text(args.out / "scaling.csv", table.to_csv(index=False,
                                                                float_format="%.6g"))
    tmp = args.out / ".scaling.parquet.tmp"
    table.to_parquet(tmp, index=False)
    tmp.replace(args.out / "scaling.parquet")
    for axis in axes:
        figure(table, axis, args.out / f"{axis}.png")
    text = summary(table, elapsed, args)
    RF.atomic_write_text(args.out / "scaling.md", text)
    print(text)
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
