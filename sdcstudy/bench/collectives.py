"""`sdcstudy bench collectives`: the `PairedTrainer` step (lock-step unless `--mode` says
otherwise) on a (node=2, dp, tp >= 2) mesh with the healthy profile, with the collectives'
checksums (`collectives.enabled`, sdcstudy/collectives/) off and on, timed side by side in one
run (timing.py's rotation), with XLA's compiled memory per device; with several tp degrees, all
of them in one rotation, each "on" divided by "off" at its own degree. The shapes are the
paired suite's (common.SHAPES["paired"]). There is no project goal for the feature's cost: the
table states the ratio.

What shows the feature was on: the checksums the "on" step returned (points per step, forward
and backward, from its records), none from "off", and each contender a program of its own.
"""

from __future__ import annotations

from sdcstudy.bench import common as B
from sdcstudy.bench import timing as BT
from sdcstudy.bench.paired import contender_name, time_pairs, tp_degrees
from sdcstudy.core.config import UserError, tokens_per_step

# The contenders, "off" first: "on" is divided by it.
COLLECTIVES_VARIANTS = {"off": ["collectives.enabled=false"],
                        "on": ["collectives.enabled=true"]}
MODES = ("lockstep", "paramsync", "free")  # the paired modes the feature runs in
DEFAULT_TP = 2


def add_parser(sub) -> None:
    c = sub.add_parser("collectives", help="step time and memory of a pair at tp >= 2 with the "
                                           "collectives' checksums on and off")
    B.add_common_args(c, "paired")
    c.add_argument("--mode", default="lockstep", choices=MODES,
                   help="the paired mode both contenders run: lockstep, paramsync or free "
                        "(default lockstep)")
    c.add_argument("--tp", default=str(DEFAULT_TP), metavar="LIST",
                   help="tensor-parallel ranks per node, at least 2, or several degrees timed in "
                        f"one run (e.g. 2,4; on / off at the same degree; default {DEFAULT_TP})")
    c.add_argument("--dp", type=int, default=1, help="data-parallel workers per node (default 1)")
    c.set_defaults(bench=run_collectives_suite)


def degrees(args) -> list[int]:
    """`--tp` as a list of degrees, each at least 2 (tp 1 has no tensor-parallel collective)."""
    found = tp_degrees(args)
    if min(found) < 2:
        raise UserError(f"--tp {args.tp}: at tp 1 a node has no tensor-parallel collective to "
                        f"checksum; give degrees of 2 or more, e.g. --tp 2.")
    return found


def collectives_config(preset: str, args, variant: str, tp: int):
    return B.preset_config("paired", preset, args, [
        f"experiment.mode={args.mode}", "suspect.profile=healthy", f"mesh.tp={tp}",
        f"mesh.dp={args.dp}", *COLLECTIVES_VARIANTS[variant]])


def check_collectives(preset: str, args) -> None:
    """tp >= 2, and the mesh fits the devices and the model, before anything compiles."""
    from sdcstudy.paired.trainer import PairedTrainer

    for tp in degrees(args):
        for variant in COLLECTIVES_VARIANTS:
            PairedTrainer.from_config(collectives_config(preset, args, variant, tp)[0])


def checksum_points(records: dict) -> dict:
    """{"fwd": n, "bwd": n}: the checksum points (collective, layer, point) one step returned
    (`records["collectives"]`; none where the feature is off)."""
    mine = (records or {}).get("collectives", {})
    return {direction: len(mine.get(direction, {})) for direction in ("fwd", "bwd")}


def measure_collectives(preset: str, args, echo=B.echo_stderr) -> list[dict]:
    """Off and on at each tp degree, warmed up, then timed in one rotation; one result per
    degree, "on" divided by "off" at the same degree."""
    from sdcstudy.core.config import model_dims

    tps = degrees(args)

    def name(variant, tp):
        return contender_name(variant, tp, tps)

    timed = time_pairs(preset, args, tps, COLLECTIVES_VARIANTS,
                       lambda variant, tp: collectives_config(preset, args, variant, tp),
                       f"{args.mode} collectives {{}}", echo)
    cfg, steps, runners, phases = timed.cfg, timed.steps, timed.runners, timed.phases
    warmup, seconds, kernel = timed.warmup, timed.seconds, timed.kernel
    dims, tokens = model_dims(cfg.model), tokens_per_step(cfg)
    results = []
    for tp in tps:
        off = name("off", tp)
        off_memory = runners[off].memory()
        off_losses = [w["loss/healthy"] for w in warmup[off]]
        variants = {}
        for variant in COLLECTIVES_VARIANTS:
            key = name(variant, tp)
            runner, memory = runners[key], runners[key].memory()
            losses = [w["loss/healthy"] for w in warmup[key]]
            variants[variant] = {
                **BT.timing(seconds[key], steps, tokens),
                "ratio": BT.ratio_spread(seconds[key], seconds[off]),
                "kernel": kernel[key], "compile_s": runner.compile_s, "memory": memory,
                "memory_ratio": (memory["peak"] / off_memory["peak"]
                                 if memory and off_memory and off_memory["peak"] else None),
                "checksum_points": checksum_points(runner.records),
                "verdicts": sum(w.get(f"collectives/{v}", 0) for w in warmup[key]
                                for v in ("communication", "computation")),
                "warmup_losses": losses, "losses_equal_off": losses == off_losses,
                "pair_agrees": all(w["loss/healthy"] == w["loss/suspect"]
                                   and w["grad/diff_l2"] == 0 for w in warmup[key]),
            }
            if runner.shares_program_of is not None:
                variants[variant]["shares_program_of"] = runner.shares_program_of
        results.append({"preset": preset, "n_params": dims.n_params, "mode": args.mode,
                        "batch": cfg.experiment.batch_size, "seq_len": cfg.data.seq_len,
                        "tokens_per_step": tokens, "steps": steps, "repeats": args.repeats,
                        "warmup_steps": B.WARMUP_STEPS,
                        "mesh": {"node": 2, "dp": args.dp, "tp": tp},
                        "variants": variants, "phases": phases})
    return results


def _geomean(ratio: dict) -> str:
    if ratio.get("ci95") is None:
        return f"{ratio['geomean']:.3f}x"
    low, high = ratio["ci95"]
    return f"{ratio['geomean']:.3f}x ({low:.3f}-{high:.3f})"


def collectives_table(results: list[dict]) -> str:
    lines = ["| preset | mode | node x dp x tp | collectives | ms/step | on / off | "
             "geometric mean (95% interval) | peak MiB per device | memory / off | "
             "checksum points fwd + bwd | verdicts | losses = off | compile s |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        m = r["mesh"]
        for variant, v in r["variants"].items():
            memory = v["memory"]["peak"] if v["memory"] else None
            memory_ratio = "-" if v["memory_ratio"] is None else f"{v['memory_ratio']:.2f}x"
            points = v["checksum_points"]
            lines.append(f"| {r['preset']} | {r['mode']} | {m['node']} x {m['dp']} x {m['tp']} "
                         f"| {variant} | {B._ms(v['seconds_per_step'])} | "
                         f"{B._ratio(v['ratio'])} | {_geomean(v['ratio'])} | {B._mib(memory)} "
                         f"| {memory_ratio} | {points['fwd']} + {points['bwd']} | "
                         f"{v['verdicts']} | {'yes' if v['losses_equal_off'] else 'no'} | "
                         f"{v['compile_s']:.1f} |")
    lines += ["", "Median (min-max) over interleaved repetitions; ratios per repetition, their "
              "geometric mean with a 95% interval (Student's t on the logarithms). on: "
              "checksums of every tensor-parallel collective's input and output, forward and "
              "backward (`collectives.enabled`); peak memory is XLA's buffer assignment for "
              "one device. Checksum points: what one step returned; verdicts: communication "
              "and computation verdicts over the warm-up steps (a healthy pair has none)."]
    for r in results:
        on = r["variants"]["on"]
        disagree = [k for k, v in r["variants"].items() if not v["pair_agrees"]]
        note = f"; healthy pairs disagree in {', '.join(disagree)}" if disagree else ""
        lines.append(f"- {r['preset']} at tp {r['mesh']['tp']}: the checksums cost "
                     f"{B._ratio(on['ratio'])} of the {r['mode']} step and compile in "
                     f"{on['compile_s']:.1f} s against {r['variants']['off']['compile_s']:.1f} "
                     f"s{note}.")
    return "\n".join(lines) + "\n"


def run_collectives_suite(args) -> int:
    return B.run_suite(args, "collectives", measure_collectives, collectives_table,
                       check=lambda preset: check_collectives(preset, args))
