"""`sdcstudy bench detect`: the step time of each SDC detector against the step without one,
side by side in one run (bench_timing.py's compile, warm-up and rotation).

The step is `experiment.mode: detect` (detect.py) on `mesh.dp` = 2 ranks with the healthy
profile, training on what the ranks computed (`detect.advance: primary`), so the contender
`none` runs the ranks' executions and nothing else. Each other contender adds one detector:
- `monitor`: the same device program as `none` (it adds no execution); its cost is the host
  reading the loss and gradient norm after every step, which stops the next step from being
  dispatched before this one ends;
- `abft`: checksummed matmuls in every execution;
- `shadow`: one rank's microbatch again on a spare device;
- `reexec`: every rank's microbatch again on its own device;
- `lockstep`: every rank mirrored on a healthy device;
- `localize`: `detect.replicas` (3) copies of every rank's step.
On the CPU the simulated devices share the cores, so an added execution costs its full
compute: the ratios are what the detectors ask of the hardware, not what spare devices
running in parallel would add to the wall time.
"""

from __future__ import annotations

from sdcstudy.bench import common as B
from sdcstudy.bench import timing as BT

RANKS = 2
BASE = "none"


def add_parser(sub) -> None:
    p = sub.add_parser("detect", help="step time of each SDC detector (monitor, abft, shadow, "
                                      "reexec, lockstep, localize) against no detector")
    B.add_common_args(p, "detect")
    p.set_defaults(bench=run_detect_suite)


def detect_config(preset: str, args):
    return B.preset_config("detect", preset, args, [
        "experiment.mode=detect", f"mesh.dp={RANKS}", "mesh.tp=1", "suspect.profile=healthy",
        "detect.detectors=all", "detect.advance=primary", "detect.rollback=false"])


class DetectRunner(BT.StepRunner):
    """A detect step: the monitor's contender judges every step on the host, as the host
    loop does; warm-up steps are judged for every contender and their flags counted."""

    def run(self, n: int) -> None:
        import jax

        judged = "monitor" in self.trainer.detectors
        for _ in range(n):
            self.state, self.metrics, self.records = self.step_fn(self.state, self.batch)
            if judged:
                self.trainer.accept(self.trainer.judge(self.records["detect"]))
        jax.block_until_ready((self.state, self.metrics, self.records))

    def warm_up(self, n: int) -> list[dict]:
        import jax

        out = []
        for _ in range(n):
            self.state, self.metrics, self.records = self.step_fn(self.state, self.batch)
            verdict = self.trainer.judge(self.records["detect"])
            self.trainer.accept(verdict)
            out.append({**{k: float(v) for k, v in jax.device_get(self.metrics).items()},
                        "flags": sum(int(verdict.get(d, 0)) for d in self.trainer.detectors)})
        return out


def measure_detect(preset: str, args, echo=B.echo_stderr) -> dict:
    cfg, steps = detect_config(preset, args)
    return time_detectors(cfg, steps, args, preset, echo)


def time_detectors(cfg, steps: int, args, label: str, echo=B.echo_stderr) -> dict:
    """Each detector of `cfg`'s detect step alone against none, compiled, warmed up and timed
    in rotation (`args.repeats` repetitions of `steps` steps), with its executions, warm-up
    flags and compiled memory. `cfg` should advance on the primary ranks without rollback, so
    that `none` runs the ranks' executions and nothing else."""
    from sdcstudy.detect.trainer import DetectTrainer
    from sdcstudy.detect.plan import DETECTORS

    full = DetectTrainer.from_config(cfg)
    trainers = {BASE: full.variant(())} | {name: full.variant((name,)) for name in DETECTORS}
    runners, warmup, variants, result = BT.time_variants(label, args, cfg, steps, trainers, BASE,
                                                         "{}", echo, DetectRunner)
    base_memory = runners[BASE].memory()
    for name, runner in runners.items():
        memory = runner.memory()
        variants[name].update({
            "executions": len(runner.trainer.plan),
            "flags": sum(w["flags"] for w in warmup[name]),
            "memory": memory,
            "memory_ratio": (memory["peak"] / base_memory["peak"]
                             if memory and base_memory and base_memory["peak"] else None),
        })
    return {**result, "ranks": cfg.mesh.dp, "replicas": cfg.detect.replicas,
            "variants": variants}


def overheads(result: dict) -> dict:
    """Per detector, from a `time_detectors` result, its cost against none as the detectors
    study records it (`detect_overhead.json`): the median step time and ratio to none, and the
    compiled step's peak memory and its ratio."""
    return {name: {"step_s": v["seconds_per_step"]["median"],
                   "time_ratio": v["ratio"]["median"],
                   "memory_bytes": v["memory"]["peak"] if v["memory"] else None,
                   "memory_ratio": v["memory_ratio"]}
            for name, v in result["variants"].items() if name != BASE}


def detect_table(results: list[dict]) -> str:
    lines = ["| preset | batch x seq | detector | executions | ms/step | ratio to none | "
             "peak MiB | memory / none | flags | compile s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for name, v in r["variants"].items():
            memory = v["memory"]["peak"] if v["memory"] else None
            memory_ratio = "-" if v["memory_ratio"] is None else f"{v['memory_ratio']:.2f}x"
            lines.append(f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {name} | "
                         f"{v['executions']} | {B._ms(v['seconds_per_step'])} | "
                         f"{B._ratio(v['ratio'])} | {B._mib(memory)} | {memory_ratio} | "
                         f"{v['flags']} | {v['compile_s']:.1f} |")
    lines += ["", f"Median (min-max) over interleaved repetitions; ratios per repetition. "
              f"{RANKS} data-parallel ranks on the healthy profile, one device program with "
              f"every execution (vmapped): none runs the ranks only; monitor shares its "
              f"program and reads the loss on the host every step. executions: the step's "
              f"copies of a rank's forward and backward; flags: raised over the warm-up "
              f"steps (a healthy run raises none); peak memory: XLA's buffer assignment."]
    return "\n".join(lines) + "\n"


def run_detect_suite(args) -> int:
    return B.run_suite(args, "detect", measure_detect, detect_table,
                       check=lambda preset: detect_config(preset, args))
