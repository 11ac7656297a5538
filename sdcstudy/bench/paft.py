"""`sdcstudy bench paft`: the step time of PAFT-Dyn with overlap, M workers side by side in one
run (bench_timing.py's compile, warm-up and rotation), against data-parallel training under the
same simulated error and against error-free plain data-parallel training.

Contenders, all on the same batch and mesh (M simulated devices):
- `dp`: the plain data-parallel step (`train.Trainer`, one replicated model, gradients
  all-reduced over `dp`), with no aggregation error;
- `noised`: PAFT mode with the aggregation error of Definition 2.1 and no mitigation: plain
  data-parallel training (gradients averaged by one all-reduce) in the simulator, each worker
  with its own copy, optimizer state and error draw; divergence not measured;
- `dyn-overlap`: the same error with PAFT-Dyn and overlapped averages, the divergence measured
  only when an average is applied (`paft.div_every=0`), as Algorithm 2 needs it.

The PAFT paper's Table 1 compares PAFT's iteration time with plain DSGD's. Here the error
is the environment, so the like-for-like baseline of PAFT's cost is `noised`: the goal is
dyn-overlap / noised <= 1.05 (the paper's Table 1: 1.12x at 32 workers), "PAFT's cost over
data-parallel training under the same simulated error". dyn-overlap / dp (error-free plain data
parallel) is reported beside it: it includes the simulator's cost, noised / dp.

The batch grows with M by default: each worker trains on the suite's sequences per worker
(`--worker-batch`), so the step's batch is M times that. This is how data parallelism is used;
the PAFT paper's Table 1 does not give its batch (its DSGD iteration time grows from 4 to 32
workers, as it would with each worker's batch fixed). PAFT's own cost is per parameter (an
all-reduce of the copies, the divergence) and does not grow with the tokens a worker trains on,
so its share shrinks as they grow: with a fixed global batch (`--batch B`, split over the
workers) it is largest. `--batch` must split over the M workers: a batch that does not is
rounded up to the next multiple of M (for every contender of that M), and the table says so.
"""

from __future__ import annotations

from sdcstudy.bench import common as B
from sdcstudy.bench import goals as G
from sdcstudy.bench import timing as BT
from sdcstudy.core import hostmem
from sdcstudy.core.config import UserError

GOAL = G.GOALS["paft.dyn_overlap_over_dp"].limit
GOAL_RATIO = "dyn-overlap / noised"
VARIANTS = ("dp", "noised", "dyn-overlap")
# Repetitions by default: tiny's per-repetition ratios spread by +-5-15% on a loaded 2-core
# machine, as wide as the goal's margin; 15 put the geometric mean's 95% interval within a few
# percent.
REPEATS = 15
# A contender whose system time exceeds this share of its step, with at least this many minor
# page faults a step (4 KiB each: tens of MiB faulted in again), gets a note under the table.
# Without the faults the kernel's time is the threads' scheduling, which no allocator changes.
KERNEL_NOTE, FAULTS_NOTE = 0.10, 10_000


def add_parser(sub) -> None:
    p = sub.add_parser("paft", help="step time of PAFT-Dyn with overlap against data-parallel "
                                    "training under the same simulated error (and without it)")
    per_worker = ", ".join(f"{k} {v[0]}" for k, v in B.SHAPES["paft"].items())
    B.add_common_args(p, "paft", repeats=REPEATS, presets="tiny",
                       batch_help="sequences per step, split over the workers (default: "
                       "--worker-batch sequences per worker)")
    p.add_argument("--worker-batch", type=int, default=None, metavar="N",
                   help=f"sequences per worker when --batch is not given (default: {per_worker})")
    p.add_argument("--workers", default="4,8", help="comma-separated worker counts (default 4,8)")
    p.add_argument("--sigma2", type=float, default=1e-3,
                   help="aggregation-error variance of the PAFT contenders (default 1e-3)")
    p.set_defaults(bench=run_paft_suite)


def _workers(args) -> list[int]:
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        raise UserError(f"--workers must be comma-separated integers, not {args.workers!r}.")
    if not workers or min(workers) < 2:
        raise UserError("--workers needs worker counts of at least 2, e.g. --workers 4,8.")
    return workers


def _overrides(variant: str, workers: int, sigma2: float) -> list[str]:
    """A constant learning rate: under warm-up the first steps' rate is ~0, the error moves
    nothing, PAFT-Dyn measures no divergence and would pick h_max, which is not its cost."""
    common = [f"mesh.dp={workers}", "optim.schedule=constant"]
    if variant == "dp":
        return ["experiment.mode=train", *common]
    paft = ["experiment.mode=paft", *common, f"paft.noise.sigma2={sigma2}", "paft.div_every=0"]
    if variant == "dyn-overlap":
        paft += ["paft.dynamic=true", "paft.overlap=true"]
    return paft


def _batch(preset: str, args, workers: int) -> tuple[int, int]:
    """(sequences per step asked for, per step used): --batch rounded up to a multiple of
    `workers`, else --worker-batch (or the suite's sequences per worker) times `workers`."""
    if args.batch:
        return args.batch, -(-args.batch // workers) * workers
    per_worker = getattr(args, "worker_batch", None)
    if per_worker is None:
        per_worker = B.SHAPES["paft"].get(preset, B.FALLBACK_SHAPE)[0]
    if per_worker < 1:
        raise UserError(f"--worker-batch must be at least 1, not {per_worker}.")
    return per_worker * workers, per_worker * workers


def paft_configs(preset: str, args, workers: int) -> tuple[dict, int, int]:
    """Per variant its config, the timed steps, and the batch asked for (see `_batch`): what
    `sdcstudy bench paft` times at `workers` workers."""
    asked, batch = _batch(preset, args, workers)
    configs, steps = {}, 0
    for variant in VARIANTS:
        configs[variant], steps = B.preset_config(
            "paft", preset, args, [*_overrides(variant, workers, args.sigma2),
                                   f"experiment.batch_size={batch}"])
    return configs, steps, asked


def measure_paft(preset: str, args, echo=B.echo_stderr) -> dict:
    from sdcstudy.paft.trainer import PaftTrainer
    from sdcstudy.faults.trainer import NodeTrainer

    results = []
    for workers in _workers(args):
        hostmem.release()  # the previous worker count's buffers are free by now
        configs, steps, asked = paft_configs(preset, args, workers)
        trainers = {variant: (NodeTrainer if variant == "dp" else PaftTrainer).from_config(cfg)
                    for variant, cfg in configs.items()}
        # The runners (and their buffers) are not kept: the next worker count releases them.
        warmup, variants, result = BT.time_variants(preset, args, configs["dp"], steps, trainers,
                                                    "dp", f"M={workers} {{}}", echo)[1:]
        seconds = {v: variants[v]["seconds_per_step"]["runs"] for v in VARIANTS}
        for variant in VARIANTS[1:]:
            variants[variant]["H"] = [w.get("paft/H") for w in warmup[variant]]
            variants[variant]["syncs"] = sum(w.get("paft/sync", 0) for w in warmup[variant])
        for variant in VARIANTS:
            variants[variant]["ratio_to_noised"] = BT.ratio_spread(seconds[variant],
                                                                   seconds["noised"])
        goal = BT.ratio_spread(seconds["dyn-overlap"], seconds["noised"])
        # PAFT's own time, dyn-overlap minus noised, per repetition as a share of the
        # error-free data-parallel step: the paper's "extra cost over DSGD", without the
        # simulator's share that both PAFT contenders pay.
        share = BT.spread([(d - n) / p for d, n, p in zip(seconds["dyn-overlap"],
                                                          seconds["noised"], seconds["dp"])])
        results.append({**result, "workers": workers, "sigma2": args.sigma2,
                        "batch_asked": asked, "batch_rounded": result["batch"] != asked,
                        "worker_batch": result["batch"] // workers,
                        "batch_per": "step" if args.batch else "worker",
                        "variants": variants, "goal": GOAL, "goal_ratio": GOAL_RATIO,
                        "goal_met": goal["median"] <= GOAL, "dyn_over_noised": goal,
                        "dyn_over_dp": variants["dyn-overlap"]["ratio"],
                        "noised_over_dp": variants["noised"]["ratio"], "paft_share": share})
    return {"preset": preset, "by_workers": results}


def paft_table(results: list[dict]) -> str:
    lines = ["| preset | M | batch (per worker) | variant | ms/step | ratio to noised (goal) | "
             "ratio to dp | H (warm-up) | page faults/step | system ms/step | goal |",
             "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---|"]
    notes = []
    for r in results:
        for w in r["by_workers"]:
            batch = (f"{w['batch']}" + ("*" if w.get("batch_rounded") else "")
                     + f" ({w['worker_batch']})")
            if w.get("batch_rounded"):
                notes.append(f"{r['preset']}, M = {w['workers']}: batch {w['batch_asked']} does "
                             f"not split over {w['workers']} workers, rounded up to {w['batch']}.")
            for variant, v in w["variants"].items():
                goal = ""
                if variant == "dyn-overlap":
                    goal = (("met" if w["goal_met"] else "NOT met")
                            + f" (<= {GOAL:.2f}x of noised)")
                h = ", ".join(f"{x:g}" for x in v.get("H", []) if x is not None) or "-"
                kernel = v.get("kernel")
                in_kernel = kernel and kernel["system_s_per_step"] / v["seconds_per_step"]["median"]
                if (in_kernel and in_kernel > KERNEL_NOTE
                        and kernel["minor_faults_per_step"] >= FAULTS_NOTE):
                    notes.append(f"{r['preset']}, M = {w['workers']}, {variant}: {in_kernel:.0%}"
                                 " of the step in the kernel, mostly faulting in memory that the "
                                 "allocator gave back; an allocator that keeps it (jemalloc, "
                                 "docs/paft.md section 7) removes that share.")
                faults, system = ((f"{kernel['minor_faults_per_step']:,.0f}",
                                   f"{kernel['system_s_per_step'] * 1e3:,.1f}") if kernel
                                  else ("-", "-"))
                lines.append(f"| {r['preset']} | {w['workers']} | {batch} | {variant} | "
                             f"{B._ms(v['seconds_per_step'])} | {B._ratio(v['ratio_to_noised'])} "
                             f"| {B._ratio(v['ratio'])} | {h} | {faults} | {system} | {goal} |")
    lines += ["", "Median (min-max) over interleaved repetitions; ratios per repetition. dp: "
              "plain data-parallel step without aggregation error; noised: data-parallel "
              "training under the simulated aggregation error (PAFT workers, no mitigation); "
              "dyn-overlap: the same error with PAFT-Dyn and overlapped averages (divergence "
              "measured at averages only). Batch: sequences per step, and per worker in "
              "parentheses; PAFT's own cost is per parameter, so its share falls as a worker's "
              "batch grows. The goal is dyn-overlap / noised <= "
              f"{GOAL:.2f}x: PAFT's cost over data-parallel training under the same simulated "
              "error. dyn-overlap / dp compares with error-free plain data parallel and includes "
              "the simulator's cost (noised / dp). Page faults and system time: the process's, "
              "per step, over each contender's timed blocks."]
    for r in results:
        for w in r["by_workers"]:
            lines.append(f"- {r['preset']}, M = {w['workers']}: dyn-overlap / noised "
                         f"{B._ratio(w['dyn_over_noised'])}{_geomean(w['dyn_over_noised'])} "
                         f"(goal: PAFT's cost over data-parallel "
                         f"training under the same simulated error); dyn-overlap / dp "
                         f"{B._ratio(w['dyn_over_dp'])} (error-free plain data parallel), of which "
                         f"the simulator, noised / dp, is {B._ratio(w['noised_over_dp'])}"
                         f"{_own_time(w)}.")
    lines += [f"- * {note}" for note in notes]
    return "\n".join(lines) + "\n"


def _own_time(w: dict) -> str:
    """"; PAFT's own time ... is P% (low% to high%) of the dp step" where the result has it."""
    share = w.get("paft_share")
    if share is None:
        return ""
    return (f"; PAFT's own time, dyn-overlap minus noised, is {share['median']:.1%} "
            f"({share['min']:.1%} to {share['max']:.1%}) of the dp step")


def _geomean(ratio: dict) -> str:
    """", geometric mean G (95% interval low-high)" where the ratio has them."""
    if ratio.get("ci95") is None:
        return ""
    low, high = ratio["ci95"]
    return f", geometric mean {ratio['geomean']:.3f}x (95% interval {low:.3f}-{high:.3f})"


def paft_goals(results: list[dict]) -> list[dict]:
    return [G.goal("paft.dyn_overlap_over_dp", w["dyn_over_noised"]["median"],
                   preset=r["preset"], workers=w["workers"])
            for r in results for w in r["by_workers"]]


def run_paft_suite(args) -> int:
    def check(preset):
        for workers in _workers(args):
            paft_configs(preset, args, workers)
    return B.run_suite(args, "paft", measure_paft, paft_table, check=check, goals=paft_goals)
