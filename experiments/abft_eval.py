"""python experiments/abft_eval.py [--repeats 3] [--healthy 48] [--preset tiny] [--out DIR]
   python experiments/abft_eval.py --bounds [--seeds 4] [--trials 32] --out DIR

When does ABFT catch a silent data corruption, and why does it miss? Ma et al., appendix D,
give three explanations for ABFT's misses; this experiment turns each into numbers:

1. small corruptions within rounding bounds: recall per bit class (and per bit) of faults
   inside the matmuls, and how far below the threshold the missed corruptions stay;
2. faults outside the matmuls (softmax, SwiGLU activation, attention context, RMS norms):
   the rate at which any ABFT check of the step flags at all;
3. dtype: the same for float32 and bfloat16, with the paper's threshold (tau = k u, float32 u),
   the paper's formula with the bfloat16 epsilon, and our rounding bound (abft/bound.py),
   including the false-alarm rate on healthy steps.

Each trial is one forward and backward pass of the model (random tokens, the seed's initial
weights) with ABFT on every matmul and exactly one flipped bit of one random element at one
site and layer, injected by the fault engine (`faults.inject.inject_value`, the forward
injection of every trainer: a `bitflip` spec of `count` 1 over any bit, straight-through
gradient, the landed bit and values in its record). The site and layer (the spec's rate, 1
there and 0 elsewhere) and the key the element and bit are drawn from are inputs of one
compiled program per dtype, so thousands of trials take minutes. Each site gets (bits in its
values) x --repeats trials; their bits are drawn, not enumerated. Healthy trials flip nothing.
ABFT's records hold the residuals and norms, so every threshold is evaluated on the same
trials.

Definitions, per (dtype, threshold, site, bit class):
- recall: faulty trials flagged at the faulted matmul (forward check, that layer) over
  faulty trials; for sites outside the matmuls, trials with any flag in the step;
- precision: flags at the faulted matmul over all flags raised in those trials;
- false alarms: healthy trials with any flag, and flagged checks over all healthy checks.

Results: DIR/abft_eval.md (the tables, also printed), DIR/abft_eval.json (the same numbers),
DIR/abft_eval_checks.parquet (every check of every trial) and DIR/abft_eval_ratios.png. 6 to 13
minutes on 2 busy CPU cores (docs/results/abft.md).

`--bounds` asks instead whether the rounding bound holds for the arithmetic a GPU uses, and
what it costs in recall: the products of tiny's four linear shapes (q, up, down, head at 4 x
64 tokens; `abft/emulate.py`), computed as the CPU does, with TF32 operands (to nearest,
toward zero) and with a bfloat16 weight whose checksum is handed the unrounded float32 copy;
each checked by the rounding rule before it modelled the platform ("today") and as it is
("new"), healthy and with one element moved by 2^-16 to 2^4 times its row's RMS.
DIR/abft_bounds.md (also printed) and DIR/abft_bounds.json. About 5 minutes on 2 CPU cores,
most of it compiling.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from sdcstudy.abft import checker as A  # noqa: E402
from sdcstudy.abft import emulate as E  # noqa: E402
from sdcstudy.core import config as C  # noqa: E402
from sdcstudy.core import model  # noqa: E402
from sdcstudy.core import reports  # noqa: E402
from sdcstudy.core import sites as S  # noqa: E402
from sdcstudy.core.errors import ArgumentParser, ConfigError  # noqa: E402
from sdcstudy.faults.bits import bits_of_class  # noqa: E402
from sdcstudy.faults.inject import inject_value  # noqa: E402
from sdcstudy.faults.records import decode_record  # noqa: E402
from sdcstudy.faults.specs import FaultSpec  # noqa: E402

INSIDE = tuple(A.MATMULS)  # the protected matmuls' output sites
OUTSIDE = (S.ATTN_PROBS, S.ATTN_CONTEXT, S.FFN_ACT, S.ATTN_NORM, S.FFN_NORM)
SITES = INSIDE + OUTSIDE
RULES = A.HOST_THRESHOLDS
# One flipped bit, any of the value's, of one element: the spec each site's trials fire.
FLIPS = {site: FaultSpec(site=f"fwd/{site}", kind="bitflip", bit_class="any", count=1)
         for site in SITES}


def make_trial(dims, graphdef):
    """A jitted function (params, tokens, site id, layer, key data) -> ABFT's forward and
    backward records and the fault engine's records of every site and layer (stacked)."""
    checker = A.Checker(dims.n_layers, "rounding")  # records what every rule needs

    def trial(params, tokens, site_id, layer, key_data):
        landed = []

        def corrupt(site, x, at_layer):
            if site not in SITES:
                return x
            on = (site_id == SITES.index(site)) & (layer == at_layer)
            y, record = inject_value(x, key_data, jnp.where(on, 1.0, 0.0), FLIPS[site], 1)
            landed.append(record)
            return y

        def loss(params, sinks):
            hook = checker.hook(sinks, full=corrupt, fault=corrupt)
            total, count = model.token_losses(graphdef, params, tokens, hook=hook)
            return total / count, (hook.records, lax.stop_gradient(jnp.stack(landed)))

        (_, (fwd, faults)), (_, bwd) = jax.value_and_grad(
            loss, argnums=(0, 1), has_aux=True)(params, checker.init_sinks())
        return fwd, bwd, faults

    return jax.jit(trial)


def the_flip(records) -> dict:
    """The one corruption a faulty trial's fault records hold: {flat_index, bit, original,
    corrupted} and the bit width of its site; a healthy trial's: no bit, values 0."""
    found = [(hit, int(r[0, 2])) for r in records for hit in decode_record(r)[1]]
    if not found:
        return {"bit": 0, "width": 0, "original": 0.0, "corrupted": 0.0}
    (hit, width), = found  # a count-1 spec fires at one site and layer of the trial
    return {**hit, "width": width}


def plan(dims, width: int, repeats: int, healthy: int, seed: int) -> list[dict]:
    """The trials: `healthy`, then per site (bits of its values) x `repeats`, each with its
    layer, the seed of its fault key and of its tokens."""
    rng = np.random.default_rng(seed)
    trials = [{"site": "healthy", "layer": -1} for _ in range(healthy)]
    for site in SITES:
        # The logits are float32 in a bfloat16 model: their flips range over 32 bits.
        for _ in range((32 if site == S.LOGITS else width) * repeats):
            layer = 0 if site in S.MODEL_SITES else int(rng.integers(1, dims.n_layers + 1))
            trials.append({"site": site, "layer": layer})
    for t in trials:
        t["fault_seed"] = int(rng.integers(0, 2**31 - 1))
        t["token_seed"] = int(rng.integers(0, 2**31 - 1))
    return trials


def bit_class(bit: int, width: int) -> str:
    return next(c for c in ("sign", "exponent", "mantissa") if bit in bits_of_class(c, width))


def run_dtype(dtype: str, args) -> pd.DataFrame:
    """One row per (trial, check): the check's record plus the trial's fault."""
    cfg = C.from_dict({"model": {"preset": args.preset, "dtype": dtype}})
    dims = C.model_dims(cfg.model)
    graphdef, params = model.init(dims, jax.random.key(args.seed))
    width = 32 if dtype == "float32" else 16
    trials = plan(dims, width, args.repeats, args.healthy, args.seed)
    fn = make_trial(dims, graphdef)
    rows = []
    start = time.perf_counter()
    for i, t in enumerate(trials):
        tokens = jax.random.randint(jax.random.key(t["token_seed"]),
                                    (args.batch, args.seq_len + 1), 0, dims.vocab_size)
        site_id = SITES.index(t["site"]) if t["site"] in SITES else -1
        key_data = jax.random.key_data(jax.random.key(t["fault_seed"]))
        fwd, bwd, faults = jax.device_get(fn(
            params, tokens, jnp.int32(site_id), jnp.int32(t["layer"]), key_data))
        flip = the_flip(faults)
        for r in A.Checker.rows(fwd, bwd, 0, 0):
            rows.append({**r, "trial": i, "dtype": dtype, "fault_site": t["site"],
                         "fault_layer": t["layer"], "bit": flip["bit"],
                         "bit_class": "none" if t["site"] == "healthy" else
                         bit_class(flip["bit"], flip["width"]),
                         "original": flip["original"], "corrupted": flip["corrupted"]})
        if (i + 1) % 200 == 0:
            print(f"{dtype}: {i + 1}/{len(trials)} trials, {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    return pd.DataFrame(rows)


def evaluate(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(detection per dtype, threshold, site, bit class; false alarms per dtype, threshold)."""
    site_of = {m: s for s, m in A.MATMULS.items()}
    frame["at_fault"] = ((frame["direction"] == "fwd")
                         & (frame["matmul"].map(site_of) == frame["fault_site"])
                         & (frame["layer"] == frame["fault_layer"]))
    detection, alarms = [], []
    for dtype in frame["dtype"].unique():
        part = frame[frame["dtype"] == dtype]
        healthy = part["fault_site"] == "healthy"
        for rule in RULES:
            flag = pd.Series(A.host_flags(part, rule), index=part.index)
            row_ratio = pd.Series(A.host_ratios(part, rule)[0], index=part.index)
            per_trial = flag[healthy].groupby(part.loc[healthy, "trial"]).any()
            alarms.append({"dtype": dtype, "threshold": rule, "healthy trials": len(per_trial),
                           "trials with an alarm": per_trial.mean(),
                           "checks flagged": flag[healthy].mean()})
            faulty = part[~healthy].assign(flag=flag[~healthy], row_ratio=row_ratio[~healthy])
            for (site, cls), group in faulty.groupby(["fault_site", "bit_class"]):
                any_flag = group.groupby("trial")["flag"].any()
                target = group[group["at_fault"]]
                hit = any_flag if site in OUTSIDE else target.set_index("trial")["flag"]
                flags = int(group["flag"].sum())
                finite = np.isfinite(target["row_ratio"])
                detection.append({
                    "dtype": dtype, "threshold": rule, "site": site, "inside": site in INSIDE,
                    "bit class": cls, "trials": len(any_flag), "recall": hit.mean(),
                    "precision": target["flag"].sum() / flags if flags else np.nan,
                    "any flag": any_flag.mean(),
                    # The faulted row's residual over its threshold: below 1 the corruption
                    # hides within the rounding bound.
                    "median residual/threshold": np.median(target["row_ratio"][finite])
                    if finite.any() else np.nan})
    return pd.DataFrame(detection), pd.DataFrame(alarms)


def markdown(frame: pd.DataFrame) -> str:
    def cell(v):
        if isinstance(v, (bool, np.bool_)):
            return "yes" if v else "no"
        if isinstance(v, (float, np.floating)):
            return "-" if np.isnan(v) else f"{v:.3g}"
        return str(v)
    head = "| " + " | ".join(frame.columns) + " |"
    rule = "|" + "---|" * len(frame.columns)
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(False)]
    return "\n".join([head, rule, *body])


def tables(detection: pd.DataFrame, alarms: pd.DataFrame) -> str:
    inside = detection[detection["inside"]].groupby(["dtype", "threshold", "bit class"]).agg(
        trials=("trials", "sum"), recall=("recall", "mean"), precision=("precision", "mean"),
        **{"median residual/threshold": ("median residual/threshold", "median")}).reset_index()
    exponent = detection[detection["bit class"] == "exponent"][
        ["dtype", "threshold", "site", "inside", "trials", "recall", "precision", "any flag"]]
    outside = detection[~detection["inside"]].groupby(["dtype", "threshold", "site"]).agg(
        trials=("trials", "sum"), **{"any flag": ("any flag", "mean")}).reset_index()
    return "\n".join([
        "## False alarms on healthy trials", "", markdown(alarms), "",
        "## Faults inside the matmuls, per bit class (mean over the 8 matmuls)", "",
        markdown(inside), "",
        "## Exponent-bit flips, per site", "", markdown(exponent), "",
        "## Faults outside the matmuls: trials with any flag (all bit classes)", "",
        markdown(outside), ""])


def plot_ratios(frame: pd.DataFrame, path: Path) -> None:
    """Figure: residual / threshold of every forward check, per dtype and threshold rule, for
    healthy trials and at the faulted matmul of exponent and mantissa flips. A check flags
    where the ratio exceeds 1, so healthy mass right of the line is false alarms and faulty
    mass left of it is misses."""
    plt = reports.pyplot()

    fwd = frame[frame["direction"] == "fwd"]
    healthy = fwd[fwd["bit_class"] == "none"]
    at_fault = fwd[fwd["fault_site"].map(A.MATMULS).eq(fwd["matmul"])
                   & (fwd["layer"] == fwd["fault_layer"])]
    groups = {"healthy checks": (healthy, "tab:green"),
              "exponent flip, faulted matmul": (at_fault[at_fault["bit_class"] == "exponent"],
                                                "tab:red"),
              "mantissa flip, faulted matmul": (at_fault[at_fault["bit_class"] == "mantissa"],
                                                "tab:orange")}
    dtypes = [d for d in ("float32", "bfloat16") if d in set(frame["dtype"])]
    rules = ("paper", "rounding")
    fig, axes = plt.subplots(len(dtypes), len(rules), figsize=(11, 3.6 * len(dtypes)),
                             squeeze=False, sharex=True)
    bins = np.logspace(-6, 12, 73)  # ratios beyond either end are drawn in the end bins
    for i, dtype in enumerate(dtypes):
        for j, rule in enumerate(rules):
            ax = axes[i][j]
            for label, (rows, color) in groups.items():
                rows = rows[rows["dtype"] == dtype]
                ratio = np.asarray(A.host_ratios(rows, rule), dtype=np.float64)
                ratio = np.clip(ratio[np.isfinite(ratio)], bins[0], bins[-1])
                flagged = float(np.mean(ratio > 1)) if len(ratio) else float("nan")
                ax.hist(ratio, bins=bins, histtype="step", color=color, linewidth=1.5,
                        label=f"{label}: {flagged:.1%} flagged (n={len(ratio)})")
            ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{dtype}, threshold: {rule}")
            ax.set_ylabel("forward checks")
            ax.set_ylim(0.7, ax.get_ylim()[1] * 40)  # room for the legend above the bars
            ax.legend(fontsize=7, loc="upper left")
        for ax in axes[-1]:
            ax.set_xlabel("row residual / threshold (> 1 flags)")
    fig.suptitle("ABFT: residual over threshold, healthy and faulty checks (tiny model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bound_table(seeds: int, trials: int) -> pd.DataFrame:
    """One row per (scenario, rule): false alarms, then recall per error size."""
    rows = []
    for scenario in E.SCENARIOS:
        for r in E.recall_rows(scenario, range(seeds), trials):
            row = {"scenario": scenario, "rule": r["rule"],
                   "false alarms": f"{r['false_alarms']} of {r['healthy']}"}
            row.update({f"2^{int(np.log2(size))}": r[size] / r["corrupted"]
                        for size in E.ERROR_SIZES})
            rows.append(row)
        print(f"{scenario}: done", file=sys.stderr, flush=True)
    return pd.DataFrame(rows)


def write_bounds(args) -> None:
    table = bound_table(args.seeds, args.trials)
    text = "\n".join([
        "## The rounding bound under emulated GPU arithmetic (tiny's shapes)", "",
        f"{args.seeds} draws of each shape; {args.trials} corrupted copies per draw and error "
        "size; recall per error size in row RMS.", "", markdown(table), ""])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "abft_bounds.md").write_text(text)
    with open(args.out / "abft_bounds.json", "w") as f:
        json.dump({"args": {k: str(v) for k, v in vars(args).items()},
                   "rows": table.to_dict("records")}, f, indent=1)
    print(text)
    print(f"results in {args.out}")


def check_arguments(p, args) -> None:
    """Refuse (exit 2, one sentence) what no trial can be made of, before anything runs."""
    counts = {"--repeats": args.repeats, "--batch": args.batch, "--seq-len": args.seq_len,
              "--seeds": args.seeds, "--trials": args.trials}
    if bad := [f"{k} {v}" for k, v in counts.items() if v < 1] + \
            ([f"--healthy {args.healthy}"] if args.healthy < 0 else []):
        p.error(f"{bad[0]}: --repeats, --batch, --seq-len, --seeds and --trials must be at "
                f"least 1, --healthy at least 0.")
    if args.plot is not None:
        if not args.plot.is_file():
            p.error(f"--plot {args.plot} is not a file; give an earlier run's "
                    f"abft_eval_checks.parquet.")
        return
    for dtype in args.dtypes.split(","):
        try:
            C.from_dict({"model": {"preset": args.preset, "dtype": dtype}})
        except ConfigError as e:
            p.error(f"--preset {args.preset} --dtypes {args.dtypes}: {e}")


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--repeats", type=int, default=3,
                   help="trials per site: this many times the bits of its values (default 3)")
    p.add_argument("--healthy", type=int, default=48, help="healthy trials per dtype")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/abft_eval"))
    p.add_argument("--bounds", action="store_true",
                   help="the rounding bound under emulated GPU arithmetic instead")
    p.add_argument("--seeds", type=int, default=4, help="--bounds: draws of each shape")
    p.add_argument("--trials", type=int, default=32,
                   help="--bounds: corrupted copies per draw and error size")
    p.add_argument("--plot", type=Path, default=None, metavar="CHECKS_PARQUET",
                   help="only draw the figure from an earlier run's abft_eval_checks.parquet")
    args = p.parse_args(argv)
    check_arguments(p, args)
    if args.plot is not None:
        out = args.plot.parent / "abft_eval_ratios.png"
        plot_ratios(pd.read_parquet(args.plot), out)
        print(f"wrote {out}")
        return 0
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        print(f"abft_eval: {str(args.out)!r} is not an empty folder; give a new --out.",
              file=sys.stderr)
        return 2
    if args.bounds:
        write_bounds(args)
        return 0
    frame = pd.concat([run_dtype(d, args) for d in args.dtypes.split(",")], ignore_index=True)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(args.out / "abft_eval_checks.parquet", index=False)
    detection, alarms = evaluate(frame)
    text = tables(detection, alarms)
    (args.out / "abft_eval.md").write_text(text)
    plot_ratios(frame, args.out / "abft_eval_ratios.png")
    with open(args.out / "abft_eval.json", "w") as f:
        json.dump({"args": {k: str(v) for k, v in vars(args).items()},
                   "detection": detection.to_dict("records"),
                   "false_alarms": alarms.to_dict("records")}, f, indent=1)
    print(text)
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
