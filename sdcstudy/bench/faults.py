"""`sdcstudy bench faults`: the cost of the fault engine, idle and firing. The plain
single-node step (no injector) against the step built from the `healthy` profile, from a profile
of rate-0 specs, from an `idle` profile whose specs have a non-zero rate at the paper's four
sites but a time pattern that never fires (so the injection machinery is compiled in and runs,
and changes nothing), and from two profiles that fire at every step at those sites: `active`
with the paper nodes' `additive` kind and `active-scale` with the multiplicative `scale` kind,
at one rate and magnitude, timed side by side in one run (bench_timing.py's rotation).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from sdcstudy.bench import common as B
from sdcstudy.bench import goals as G
from sdcstudy.bench import timing as BT
from sdcstudy.core import determinism as D

FAULT_VARIANTS = ("plain", "healthy", "zero-rate", "idle", "active-scale", "active")
IDLE_RATE = 1e-3  # any rate above 0 compiles a spec in; the pattern keeps it from firing
ACTIVE_RATE = 1e-3  # per element and step: every step of every preset lands faults


def add_parser(sub) -> None:
    f = sub.add_parser("faults", help="step time with the fault engine compiled in but idle, "
                                      "against the plain step")
    B.add_common_args(f, "faults")
    f.set_defaults(bench=run_faults_suite)


def fault_profiles(folder: Path) -> dict[str, str]:
    """`suspect.profile` per variant; the profiles with specs are written to `folder`.

    Each puts one spec with magnitudes in [2^-8, 1] at each of the paper's four sites, of the
    `additive` kind (the paper nodes', docs/faults.md), or of the `scale` kind in
    `active-scale`.
    Rate 0 makes `Profile.healthy` true, so no injector is built; the idle specs have a rate
    but a `steps` pattern listing no step, so every draw happens and none lands; the active
    specs have no pattern and land at every step.
    """
    from sdcstudy.core import yamlsafe
    from sdcstudy.faults.profiles import SITES

    def write(name: str, rate: float, pattern: dict | None, kind: str = "additive") -> str:
        specs = [{"site": site, "kind": kind, "rate": rate, "scale": [2.0 ** -8, 1.0],
                  **({"pattern": pattern} if pattern else {})} for site in SITES]
        path = folder / f"{name}.yaml"
        path.write_text(yamlsafe.dump({"name": name, "specs": specs}, sort_keys=False))
        return str(path)

    return {"plain": "healthy", "healthy": "healthy", "zero-rate": write("zero-rate", 0.0, None),
            "idle": write("idle", IDLE_RATE, {"kind": "steps", "steps": []}),
            "active-scale": write("active-scale", ACTIVE_RATE, None, kind="scale"),
            "active": write("active", ACTIVE_RATE, None)}


def measure_faults(preset: str, args, echo=B.echo_stderr) -> dict:
    """The variants of one preset's single-node step, warmed up, then timed in rotation."""
    from sdcstudy.faults.trainer import NodeTrainer

    trainers, cfg, steps = {}, None, 0
    with tempfile.TemporaryDirectory(prefix="sdcstudy-bench-") as folder:
        for variant, profile in fault_profiles(Path(folder)).items():
            cfg, steps = B.preset_config("faults", preset, args, [
                "experiment.mode=train", f"suspect.profile={profile}"])
            trainer = NodeTrainer.from_config(cfg)
            # plain: no fault engine at all, whatever the profile would build.
            trainers[variant] = (dataclasses.replace(trainer, faults=None)
                                 if variant == "plain" else trainer)
    runners, warmup, variants, result = BT.time_variants(preset, args, cfg, steps, trainers,
                                                         "plain", "{}", echo)
    plain = runners["plain"]
    for variant, runner in runners.items():
        variants[variant].update({
            "injector": runner.trainer.faults is not None,
            "hlo_identical": runner.hlo == plain.hlo,
            "program_identical": D.program_text(runner.hlo) == D.program_text(plain.hlo),
            "hlo_chars": len(runner.hlo),
            # Each runs on a GPU as a thunk that reads its predicate on the host.
            "conditionals": conditionals(runner.hlo),
            "faults_landed": sum(w.get("faults/landed", 0) for w in warmup[variant]),
        })
    return {**result, "idle_rate": IDLE_RATE, "active_rate": ACTIVE_RATE,
            "active_over_scale": over(variants, "active", "active-scale"),
            "active_over_idle": over(variants, "active", "idle"), "variants": variants}


def conditionals(hlo_text: str) -> int:
    """How many `conditional` instructions a compiled program holds (each `lax.cond` left)."""
    return hlo_text.count(" conditional(")


def over(variants: dict, top: str, bottom: str) -> dict:
    """Variant `top`'s step over `bottom`'s: per repetition the ratio of their ratios to plain
    (timed in the same repetition, so plain cancels), then its spread."""
    return BT.spread([a / b for a, b in zip(variants[top]["ratio"]["runs"],
                                            variants[bottom]["ratio"]["runs"])])


def faults_table(results: list[dict]) -> str:
    lines = ["| preset | batch x seq | variant | ms/step | ratio to plain | HLO = plain | "
             "conditionals | faults landed | compile s |",
             "|---|---|---|---:|---:|---|---:|---:|---:|"]
    for r in results:
        for variant, v in r["variants"].items():
            same = "yes" if v["hlo_identical"] else (
                "ops only" if v["program_identical"] else "no")
            lines.append(f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {variant} | "
                         f"{B._ms(v['seconds_per_step'])} | {B._ratio(v['ratio'])} | {same} | "
                         f"{v['conditionals']} | {v['faults_landed']} | {v['compile_s']:.1f} |")
    lines += ["", "Median (min-max) over interleaved repetitions; ratios per repetition. "
              "plain: no injector; healthy: `suspect.profile: healthy` (its ratio is the "
              "measurement's noise floor); zero-rate: specs at rate 0 (no injector is built); "
              "idle: specs at the four paper sites with a pattern that never fires (the "
              "engine compiled in); active-scale and active: specs there that land at every "
              "step, multiplicative and additive. \"ops only\": equal apart from source "
              "locations. conditionals: `conditional` instructions in the compiled step (on a "
              "GPU each reads its predicate on the host). A variant whose lowered program is "
              "plain's, byte for byte, runs plain's executable (compiled once), so its compile "
              "s is its lowering alone."]
    for r in results:
        lines.append(f"- {r['preset']}: active / idle (a step whose faults land over one "
                     f"whose engine only runs) {B._ratio(r['active_over_idle'])}; active / "
                     f"active-scale (the additive kind's firing step over the multiplicative "
                     f"kind's) {B._ratio(r['active_over_scale'])}.")
        unequal = [k for k, v in r["variants"].items()
                   if not v["losses_equal_plain"] and not k.startswith("active")]
        if unequal:
            lines.append(f"- {r['preset']}: warm-up losses differ from plain's in "
                         f"{', '.join(unequal)}.")
    return "\n".join(lines) + "\n"


def faults_goals(results: list[dict]) -> list[dict]:
    return [g for r in results for g in (
        G.goal("faults.idle_over_plain", r["variants"]["idle"]["ratio"]["median"],
               preset=r["preset"]),
        G.goal("faults.additive_over_scale", r["active_over_scale"]["median"],
               preset=r["preset"]))]


def run_faults_suite(args) -> int:
    return B.run_suite(args, "faults", measure_faults, faults_table, goals=faults_goals)
