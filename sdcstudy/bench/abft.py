"""`sdcstudy bench abft`: the single-node step without ABFT, with checksummed matmuls
(`abft.enabled`) and with recomputation on a flag (`abft.recompute`), timed side by side in one
run (bench_timing.py's rotation).
"""

from __future__ import annotations

from sdcstudy.bench import common as B
from sdcstudy.bench import goals as G
from sdcstudy.bench import timing as BT

# ABFT contenders: the plain step, checks on every matmul, checks with recomputation on a flag.
ABFT_VARIANTS = {"off": [], "on": ["abft.enabled=true"],
                 "recompute": ["abft.enabled=true", "abft.recompute=true"]}
ABFT_GOAL = G.GOALS["abft.on_over_off"].limit  # checked step time at most 1.10x the plain step's


def add_parser(sub) -> None:
    b = sub.add_parser("abft", help="step time with checksummed matmuls (ABFT) on and off")
    B.add_common_args(b, "abft")
    b.set_defaults(bench=run_abft_suite)


def measure_abft(preset: str, args, echo=B.echo_stderr, which=ABFT_VARIANTS) -> dict:
    """The single-node step without ABFT, with it, and with recomputation (or the variants
    `which` names, "off" among them), timed in rotation."""
    from sdcstudy.faults.trainer import NodeTrainer

    trainers, cfg, steps = {}, None, 0
    for variant, overrides in which.items():
        cfg, steps = B.preset_config("abft", preset, args, ["experiment.mode=train", *overrides])
        trainers[variant] = NodeTrainer.from_config(cfg)
    _, warmup, variants, result = BT.time_variants(preset, args, cfg, steps, trainers, "off",
                                                   "ABFT-{}", echo)
    for variant in variants:
        variants[variant].update({
            "flags": sum(w.get("abft/flags", 0) for w in warmup[variant]),
            "checks": sum(w.get("abft/checks", 0) for w in warmup[variant]),
        })
    return {**result, "goal": ABFT_GOAL, "variants": variants}


def abft_table(results: list[dict]) -> str:
    lines = ["| preset | batch x seq | ABFT | ms/step | ratio to off | goal | checks | flags | "
             "losses = off | compile s |",
             "|---|---|---|---:|---:|---|---:|---:|---|---:|"]
    for r in results:
        for variant, v in r["variants"].items():
            goal = "" if variant == "off" else (
                "met" if v["ratio"]["median"] <= ABFT_GOAL else "missed")
            lines.append(f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {variant} | "
                         f"{B._ms(v['seconds_per_step'])} | {B._ratio(v['ratio'])} | {goal} | "
                         f"{v['checks']} | {v['flags']} | "
                         f"{'yes' if v['losses_equal_off'] else 'no'} | {v['compile_s']:.1f} |")
    lines += ["", f"Median (min-max) over interleaved repetitions; ratios per repetition. Goal: "
              f"at most {ABFT_GOAL:.2f}x the step without ABFT. on: row and column checksums of "
              f"every forward and backward matmul (paper threshold); recompute: the same, "
              f"recomputing a flagged product. checks and flags: over the warm-up steps."]
    return "\n".join(lines) + "\n"


def abft_goals(results: list[dict]) -> list[dict]:
    """The ABFT goal (`ABFT_GOAL`, goals.py's `abft.on_over_off`) of each preset's checked
    step, recompute off: the table prints it per variant, the JSON's goals list held none."""
    return [G.goal("abft.on_over_off", r["variants"]["on"]["ratio"]["median"],
                   preset=r["preset"]) for r in results if "on" in r["variants"]]


def run_abft_suite(args) -> int:
    return B.run_suite(args, "abft", measure_abft, abft_table, goals=abft_goals)
