"""`sdcstudy bench paired`: the `PairedTrainer` step in modes free, lockstep and paramsync on a
(node=2, dp, tp) mesh with the healthy profile, with XLA's compiled memory per device, timed side
by side in one run (bench_timing.py's rotation); with several tp degrees, all of them in one
rotation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdcstudy.bench import common as B
from sdcstudy.bench import goals as G
from sdcstudy.bench import timing as BT
from sdcstudy.core.config import UserError, tokens_per_step

PAIRED_MODES = ("free", "lockstep", "paramsync")  # free first: the others are divided by it
# The project's goals for the paired step, as ratios to free running.
# Lock-step time is also a project goal (goals.py: paired.lockstep_over_free).
PAIRED_GOALS = {"lockstep": {"time": G.GOALS["paired.lockstep_over_free"].limit, "memory": 1.25},
                "paramsync": {"time": 1.1}}


def add_parser(sub) -> None:
    d = sub.add_parser("paired", help="step time and memory of lockstep and paramsync against "
                                      "free-running pairs")
    B.add_common_args(d, "paired")
    d.add_argument("--tp", default="1", metavar="LIST",
                   help="tensor-parallel ranks per node, or several degrees timed in one run "
                        "(e.g. 1,2,4; ratios to free running at the same degree; default 1)")
    d.add_argument("--dp", type=int, default=1, help="data-parallel workers per node (default 1)")
    d.set_defaults(bench=run_paired_suite)


def tp_degrees(args) -> list[int]:
    """`--tp` as a list of degrees: an int, or a comma-separated list such as "1,2,4"."""
    text = str(args.tp)
    try:
        degrees = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--tp must be a degree or comma-separated degrees such as 1,2,4, "
                        f"not {text!r}.")
    if not degrees or min(degrees) < 1 or len(set(degrees)) != len(degrees):
        raise UserError(f"--tp needs distinct degrees of at least 1, e.g. --tp 1,2,4, not "
                        f"{text!r}.")
    return degrees


def paired_config(preset: str, args, mode: str, tp: int):
    return B.preset_config("paired", preset, args, [
        f"experiment.mode={mode}", "suspect.profile=healthy", f"mesh.tp={tp}",
        f"mesh.dp={args.dp}"])


def check_paired(preset: str, args) -> None:
    """The mesh fits the devices and the model (tp divides heads, FFN and sequence)."""
    from sdcstudy.paired.trainer import PairedTrainer

    for tp in tp_degrees(args):
        PairedTrainer.from_config(paired_config(preset, args, PAIRED_MODES[0], tp)[0])


@dataclasses.dataclass
class TimedPairs:
    """Paired steps compiled, warmed up and timed in one rotation (`time_pairs`), by contender
    name (`contender_name`)."""
    cfg: Any  # a contender's config: every contender has the same shapes
    steps: int  # timed steps per contender and repetition
    runners: dict
    warmup: dict
    seconds: dict
    kernel: dict
    phases: dict


def contender_name(variant: str, tp: int, degrees: list[int]) -> str:
    return variant if len(degrees) == 1 else f"{variant}@tp{tp}"


def time_pairs(preset: str, args, degrees: list[int], variants, config_of, label: str,
               echo=B.echo_stderr) -> TimedPairs:
    """A `PairedTrainer` for each of `variants` at each tp degree (`config_of(variant, tp)`:
    its config and timed steps), compiled, warmed up and timed in one rotation (timing.py);
    `label` names a contender in progress lines ("{}" its name), the mesh appended."""
    from sdcstudy.paired.trainer import PairedTrainer

    trainers, cfg, steps = {}, None, 0
    for tp in degrees:
        for variant in variants:
            cfg, steps = config_of(variant, tp)
            trainers[contender_name(variant, tp, degrees)] = PairedTrainer.from_config(cfg)
    mesh = f" (node 2 x dp {args.dp}{' x tp ' + str(degrees[0]) if len(degrees) == 1 else ''})"
    runners, phases = BT.build_runners(trainers, BT.random_tokens(cfg), BT.compile_threads(args),
                                       label + mesh, preset, echo)
    warmup, seconds, kernel = BT.warm_up_and_time(runners, steps, args.repeats,
                                                  tokens_per_step(cfg), preset, phases, echo)
    return TimedPairs(cfg, steps, runners, warmup, seconds, kernel, phases)


def measure_paired(preset: str, args, echo=B.echo_stderr) -> list[dict]:
    """The three paired modes of one preset at each tp degree, warmed up, then timed in one
    rotation; one result per degree, its ratios to free running at the same degree."""
    from sdcstudy.core.config import model_dims

    degrees = tp_degrees(args)

    def name(mode, tp):
        return contender_name(mode, tp, degrees)

    timed = time_pairs(preset, args, degrees, PAIRED_MODES,
                       lambda mode, tp: paired_config(preset, args, mode, tp), "{}", echo)
    cfg, steps, runners, phases = timed.cfg, timed.steps, timed.runners, timed.phases
    warmup, seconds, kernel = timed.warmup, timed.seconds, timed.kernel
    dims, tokens = model_dims(cfg.model), tokens_per_step(cfg)
    results = []
    for tp in degrees:
        free = runners[name("free", tp)]
        free_memory = free.memory()
        modes = {}
        for mode in PAIRED_MODES:
            key = name(mode, tp)
            runner, memory = runners[key], runners[key].memory()
            memory_ratio = (memory["peak"] / free_memory["peak"]
                            if memory and free_memory and free_memory["peak"] else None)
            modes[mode] = {
                **BT.timing(seconds[key], steps, tokens),
                "ratio": BT.ratio_spread(seconds[key], seconds[name("free", tp)]),
                "kernel": kernel[key], "compile_s": runner.compile_s, "memory": memory,
                "memory_ratio": memory_ratio,
                "warmup": warmup[key],
                "pair_agrees": all(w["loss/healthy"] == w["loss/suspect"]
                                   and w["grad/diff_l2"] == 0 for w in warmup[key]),
            }
        goals = {}
        for mode, limits in PAIRED_GOALS.items():
            measured = {"time": modes[mode]["ratio"]["median"],
                        "memory": modes[mode]["memory_ratio"]}
            goals[mode] = {what: {"limit": limit, "measured": measured[what],
                                  "met": measured[what] is not None and measured[what] <= limit}
                           for what, limit in limits.items()}
        result = {"preset": preset, "n_params": dims.n_params,
                  "batch": cfg.experiment.batch_size, "seq_len": cfg.data.seq_len,
                  "tokens_per_step": tokens, "steps": steps, "repeats": args.repeats,
                  "warmup_steps": B.WARMUP_STEPS, "mesh": {"node": 2, "dp": args.dp, "tp": tp},
                  "modes": modes, "goals": goals, "phases": phases}
        if len(degrees) > 1:
            # Free running at this degree against free running at the first degree, timed in
            # the same repetitions: what splitting the model over tp ranks costs (or saves).
            result["free_ratio_to_tp"] = {
                "tp": degrees[0],
                **BT.ratio_spread(seconds[name("free", tp)], seconds[name("free", degrees[0])])}
        results.append(result)
    return results


def paired_table(results: list[dict]) -> str:
    lines = ["| preset | node x dp x tp | mode | s/step | tokens/s | time / free | "
             "peak MiB per device | memory / free | compile s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        m = r["mesh"]
        for mode, v in r["modes"].items():
            memory = v["memory"]["peak"] if v["memory"] else None
            memory_ratio = "-" if v["memory_ratio"] is None else f"{v['memory_ratio']:.2f}x"
            s = v["seconds_per_step"]
            lines.append(f"| {r['preset']} | {m['node']} x {m['dp']} x {m['tp']} | {mode} | "
                         f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | "
                         f"{B._rate(v['tokens_per_s'])} | {B._ratio(v['ratio'])} | "
                         f"{B._mib(memory)} | {memory_ratio} | {v['compile_s']:.1f} |")
    lines += ["", "Median (min-max) over interleaved repetitions; time ratios per repetition. "
              "tokens/s counts each token once (both nodes train on it); peak memory is XLA's "
              "buffer assignment for one device (arguments + outputs + temporaries - aliased)."]
    for r in results:
        verdicts = []
        for mode, goal in r["goals"].items():
            for what, g in goal.items():
                measured = "-" if g["measured"] is None else f"{g['measured']:.3f}x"
                verdicts.append(f"{mode}/free {what} {measured} (goal <= {g['limit']:g}x: "
                                f"{'met' if g['met'] else 'NOT met'})")
        disagree = [mode for mode, v in r["modes"].items() if not v["pair_agrees"]]
        note = f"; healthy pairs disagree in {', '.join(disagree)}" if disagree else ""
        if "free_ratio_to_tp" in r and r["mesh"]["tp"] != r["free_ratio_to_tp"]["tp"]:
            note += (f"; free at tp {r['mesh']['tp']} / free at tp "
                     f"{r['free_ratio_to_tp']['tp']}: {B._ratio(r['free_ratio_to_tp'])}")
        where = r["preset"] if "free_ratio_to_tp" not in r else \
            f"{r['preset']} at tp {r['mesh']['tp']}"
        lines.append(f"- {where}: {', '.join(verdicts)}{note}.")
    return "\n".join(lines) + "\n"


def paired_goals(results: list[dict]) -> list[dict]:
    return [G.goal("paired.lockstep_over_free", r["modes"]["lockstep"]["ratio"]["median"],
                   preset=r["preset"], tp=r["mesh"]["tp"]) for r in results]


def run_paired_suite(args) -> int:
    return B.run_suite(args, "paired", measure_paired, paired_table,
                       check=lambda preset: check_paired(preset, args), goals=paired_goals,
                       mode_limits={mode: dict(g) for mode, g in PAIRED_GOALS.items()})
