"""`sdcstudy bench`: performance benchmarks, measured side by side in one run.

Every suite compiles each contender's step once (state donated; `build_runners` compiles the
distinct programs several at a time and lets identical ones share an executable), runs
`WARMUP_STEPS` untimed steps that also check the contenders compute what they should, then
times `repeats` repetitions of N steps of every contender in a rotating order, so load from
other processes falls on all of them alike. Ratios are taken per repetition (both sides timed
within seconds of each other) and reported as median (min-max), with their geometric mean
and its 95% confidence interval (Student's t on the logarithms of the per-repetition ratios).
Each contender's timed blocks also record the kernel's share: minor page faults and system CPU
seconds per step (`getrusage`, process-wide, so only what ran during that contender's block).
On the simulated devices a large step's cost can be page faults on XLA's per-step buffers
rather than arithmetic (docs/paft.md, section 7); these columns say so at once.

- `train`: our `Trainer.train_step` against the same Llama trained by transformers + torch on
  the CPU: the same initial weights (`torch_state_dict`), batch, next-token loss, global-norm
  clipping, AdamW and learning-rate schedule, all in float32.
- `faults`: the plain single-node step (no injector) against the step built from the
  `healthy` profile, from a profile of rate-0 specs, and from an `idle` profile whose specs
  have a non-zero rate at the paper's four sites but a time pattern that never fires (so the
  injection machinery is compiled in and runs, and changes nothing).
- `abft`: the single-node step without ABFT, with checksummed matmuls (`abft.enabled`) and
  with recomputation on a flag (`abft.recompute`).
- `paired`: the `PairedTrainer` step in modes free, lockstep and paramsync on a
  (node=2, dp, tp) mesh with the healthy profile, with XLA's compiled memory per device; with
  several tp degrees, all of them in one rotation.
- `paft` (bench_paft.py), `detect` (bench_detect.py); `plot` (bench_plot.py) draws the
  overhead ratios of saved results against the parameter count.
Each suite's JSON records the seconds spent per phase (initial states, lowering, compiling,
warm-up, timed steps), and `all` prints each suite's elapsed time.

JAX and torch are imported inside the functions that use them (the CLI builds its parser
without them); the CLI sets the simulated CPU device count before JAX starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from . import hostmem, roofline
from .config import UserError

# Per suite and preset: (sequences per step, sequence length, timed steps per repetition).
# The shapes keep `sdcstudy bench all` for tiny and small within 10 minutes on a 2-core CPU;
# medium (`--presets medium`, not in `all`'s default) takes a few seconds a step there.
SHAPES = {
    "train": {"tiny": (16, 64, 20), "small": (4, 128, 2), "medium": (2, 128, 1)},
    "faults": {"tiny": (16, 64, 20), "small": (4, 128, 2), "medium": (2, 128, 1)},
    "paired": {"tiny": (16, 64, 10), "small": (4, 128, 1), "medium": (2, 128, 1)},
    "abft": {"tiny": (16, 64, 20), "small": (4, 128, 2), "medium": (2, 128, 1)},
    # paft: sequences per worker (the step's batch is M times that; see bench_paft.py).
    "paft": {"tiny": (16, 64, 10), "small": (1, 128, 1), "medium": (1, 128, 1)},
    "detect": {"tiny": (16, 64, 10), "small": (4, 128, 1), "medium": (2, 128, 1)},
}
FALLBACK_SHAPE = (8, 64, 5)
# Untimed steps per contender after compilation. The benchmarks train without learning-rate
# warm-up, so the second step's loss already shows that the contenders update alike.
WARMUP_STEPS = 2
TORCH_ATTENTION = ("eager", "sdpa")
TARGET_RATIO = 2.0  # the project's goal: ours at least twice torch's tokens/s

FAULT_VARIANTS = ("plain", "healthy", "zero-rate", "idle")
IDLE_RATE = 1e-3  # any rate above 0 compiles a spec in; the pattern keeps it from firing
PAIRED_MODES = ("free", "lockstep", "paramsync")  # free first: the others are divided by it
# The project's goals for the paired step, as ratios to free running.
PAIRED_GOALS = {"lockstep": {"time": 1.3, "memory": 1.25}, "paramsync": {"time": 1.1}}
# ABFT contenders: the plain step, checks on every matmul, checks with recomputation on a flag.
ABFT_VARIANTS = {"off": [], "on": ["abft.enabled=true"],
                 "recompute": ["abft.enabled=true", "abft.recompute=true"]}
ABFT_GOAL = 1.10  # the project's goal: checked step time at most 1.10x the plain step's
# Contenders compiled at once (`--compile-threads`): XLA compiles without the GIL, and one
# compilation keeps the cores busy only part of the time.
MAX_COMPILE_THREADS = 4


def _add_common_args(p: argparse.ArgumentParser, suite: str | None, repeats: int = 5,
                     batch_help: str | None = None, presets: str = "tiny,small") -> None:
    """The options every suite takes; `suite` None: each suite keeps its own default shapes.
    `batch_help` replaces the help of --batch for a suite that reads it differently."""
    def default(i):
        if suite is None:
            return "each suite's own"
        return ", ".join(f"{k} {v[i]}" for k, v in SHAPES[suite].items())
    p.add_argument("--presets", default=presets,
                   help=f"comma-separated model presets (default {presets})")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help=batch_help or f"sequences per step (default: {default(0)})")
    p.add_argument("--seq-len", type=int, default=None, metavar="L",
                   help=f"predicted tokens per sequence (default: {default(1)})")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help=f"timed steps per contender and repetition (default: {default(2)})")
    p.add_argument("--repeats", type=int, default=repeats, metavar="R",
                   help=f"interleaved repetitions (default {repeats})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of every contender, e.g. --set model.n_layers=4")
    p.add_argument("--compile-threads", type=int, default=None, metavar="N",
                   help="contenders compiled at once (default: the CPU cores, at most "
                        f"{MAX_COMPILE_THREADS}; 1 compiles one after the other)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write results here")
    p.add_argument("--markdown", type=Path, default=None, metavar="FILE",
                   help="write the table here")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw each overhead ratio against the parameter count here")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="suite", metavar="SUITE")
    sub.required = True
    t = sub.add_parser("train", help="tokens/s of our training step against transformers+torch")
    _add_common_args(t, "train")
    t.add_argument("--torch-attention", default=",".join(TORCH_ATTENTION), metavar="LIST",
                   help="transformers attention implementations to time (default eager,sdpa); "
                        "the faster one is the baseline")
    t.add_argument("--no-torch", action="store_true", help="time only our step")
    t.set_defaults(bench=run_train_suite)

    f = sub.add_parser("faults", help="step time with the fault engine compiled in but idle, "
                                      "against the plain step")
    _add_common_args(f, "faults")
    f.set_defaults(bench=run_faults_suite)

    d = sub.add_parser("paired", help="step time and memory of lockstep and paramsync against "
                                      "free-running pairs")
    _add_common_args(d, "paired")
    d.add_argument("--tp", default="1", metavar="LIST",
                   help="tensor-parallel ranks per node, or several degrees timed in one run "
                        "(e.g. 1,2,4; ratios to free running at the same degree; default 1)")
    d.add_argument("--dp", type=int, default=1, help="data-parallel workers per node (default 1)")
    d.set_defaults(bench=run_paired_suite)

    b = sub.add_parser("abft", help="step time with checksummed matmuls (ABFT) on and off")
    _add_common_args(b, "abft")
    b.set_defaults(bench=run_abft_suite)

    from .bench_detect import add_parser as add_detect_parser
    from .bench_paft import add_parser as add_paft_parser
    from .bench_plot import add_parser as add_plot_parser

    add_paft_parser(sub)
    add_detect_parser(sub)
    add_plot_parser(sub)

    a = sub.add_parser("all", help="every suite in turn (train, faults, paired, abft, paft with "
                                   "4 workers), 3 repetitions each unless --repeats says "
                                   "otherwise")
    _add_common_args(a, None, repeats=3)
    a.set_defaults(bench=run_all_suites)


def main(args) -> int:
    return args.bench(args)


def run_all_suites(args) -> int:
    """Every suite in turn with the shared options (the suites' own at their defaults, paft
    with 4 workers, which the batch of every preset splits over); one table, and one JSON
    file holding each suite's results."""
    from . import runfolder as RF
    from .bench_paft import run_paft_suite

    suites = {"train": (run_train_suite, {"torch_attention": ",".join(TORCH_ATTENTION),
                                          "no_torch": False}),
              "faults": (run_faults_suite, {}),
              "paired": (run_paired_suite, {"tp": "1", "dp": 1}),
              "abft": (run_abft_suite, {}),
              "paft": (run_paft_suite, {"workers": "4", "sigma2": 1e-3})}
    check_args(args)
    tables, results, elapsed = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (run, extra) in suites.items():
            echo_stderr(f"== sdcstudy bench {name}")
            start = time.perf_counter()
            out = Path(tmp) / name
            sub = argparse.Namespace(**{**vars(args), **extra, "json": out.with_suffix(".json"),
                                        "markdown": out.with_suffix(".md"), "plot": None})
            run(sub)
            elapsed[name] = time.perf_counter() - start
            tables.append(f"## {name}\n\n" + out.with_suffix(".md").read_text())
            results[name] = RF.json_load(out.with_suffix(".json"))
    table = "\n".join(tables)
    total = sum(elapsed.values())
    echo_stderr("elapsed: " + ", ".join(f"{name} {s:.0f} s" for name, s in elapsed.items()) +
                f"; all {total:.0f} s ({total / 60:.1f} min)")
    report = {"suite": "all", "suites": results, "elapsed_s": elapsed}
    if args.json is not None:
        RF.atomic_write_json(args.json, report)
    if args.markdown is not None:
        RF.atomic_write_text(args.markdown, table)
    plot(args, report)
    return 0


def plot(args, report: dict) -> None:
    """The overhead figure when `--plot` asks for it."""
    if getattr(args, "plot", None) is None:
        return
    from .bench_plot import overhead_figure

    if overhead_figure(report, args.plot) is None:
        echo_stderr(f"no overhead ratio to plot, so {args.plot} was not written (the train "
                    f"suite measures a speed-up).")
    else:
        echo_stderr(f"figure: {args.plot}")


# --- shared by the suites ---------------------------------------------------------------------


def echo_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_args(args) -> list[str]:
    """The presets asked for; one-sentence errors for numbers below 1 or no preset."""
    for name in ("batch", "seq_len", "steps", "repeats", "dp", "compile_threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {value}.")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if not presets:
        raise UserError("--presets names no preset; give e.g. --presets tiny,small.")
    return presets


def preset_config(suite: str, preset: str, args, suite_overrides: list[str] = ()):
    """(config, timed steps per repetition) of the default experiment at the suite's shape.

    `experiment.steps` covers warm-up and timed steps, so the cosine schedule never ends,
    and there is no learning-rate warm-up (a first step at learning rate 0 changes nothing);
    the suite's own overrides (mode, mesh, profile) come after the user's `--set`.
    """
    from . import config as C

    batch, seq_len, steps = SHAPES[suite].get(preset, FALLBACK_SHAPE)
    batch, seq_len = args.batch or batch, args.seq_len or seq_len
    steps = args.steps or steps
    base = {"model": {"preset": preset},
            "experiment": {"batch_size": batch, "steps": WARMUP_STEPS + args.repeats * steps,
                           "checkpoint_every": 0},
            "optim": {"warmup_steps": 0},
            "data": {"seq_len": seq_len}}
    return C.from_dict(base, list(args.overrides) + list(suite_overrides)), steps


def random_tokens(cfg):
    """int32 tokens (microsteps, B, L+1), the same numpy draw for every contender."""
    import numpy as np

    from .config import model_dims

    e = cfg.experiment
    shape = (e.microsteps, e.batch_size, cfg.data.seq_len + 1)
    return np.random.default_rng(e.seed).integers(0, model_dims(cfg.model).vocab_size, shape,
                                                  dtype=np.int32)


def tokens_per_step(cfg) -> int:
    e = cfg.experiment
    return e.microsteps * e.batch_size * cfg.data.seq_len


class StepRunner:
    """A trainer's step (`Trainer` or `PairedTrainer`), compiled once with its state donated,
    run again and again on one batch placed as the host loop places it.

    `compiled` (step, HLO text, seconds) is a step compiled elsewhere for the same program
    and `placed` its (state, batch, shardings) (`build_runners` compiles several at once);
    without them the runner places its state and batch and compiles its own step."""

    shares_program_of: str | None = None  # the contender whose executable it runs, if not its own

    def __init__(self, trainer, tokens_MBL1, compiled=None, placed=None):
        from .train import compile_step

        self.trainer = trainer
        self.state, self.batch, shardings = placed or place(trainer, tokens_MBL1)
        if compiled is None:
            compiled = compile_step(trainer.train_step, self.state, self.batch, shardings)
        self.step_fn, self.hlo, self.compile_s = compiled
        self.metrics, self.extras = None, []

    def run(self, n: int) -> None:
        """n steps, dispatched back to back (as the host loop does), then waited for."""
        import jax

        for _ in range(n):
            self.state, self.metrics, *self.extras = self.step_fn(self.state, self.batch)
        jax.block_until_ready((self.state, self.metrics, self.extras))

    def warm_up(self, n: int) -> list[dict]:
        """n steps one at a time; per step its metrics and the trainer's host counters
        (faults landed, lock-step mismatches)."""
        import jax

        out = []
        for _ in range(n):
            self.run(1)
            step = int(jax.device_get(self.state["step"]))
            _, counters = self.trainer.host_tables(step, jax.device_get(self.extras))
            counters.pop("bit_histograms", None)
            out.append({**{k: float(v) for k, v in jax.device_get(self.metrics).items()},
                        **counters})
        return out

    def memory(self) -> dict | None:
        """XLA's buffer assignment for one device, in bytes (None where the backend has none).

        `peak` = arguments + outputs + temporaries - aliased: the donated state's outputs
        reuse its argument buffers, so they count once. It bounds what one device holds while
        the step runs; the generated code is left out.
        """
        stats = self.step_fn.memory_analysis()
        if stats is None:
            return None
        out = {name: int(getattr(stats, f"{name}_size_in_bytes"))
               for name in ("argument", "output", "temp", "alias", "generated_code")}
        out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
        return out


def place(trainer, tokens_MBL1, initial_states: dict | None = None):
    """(state, batch, shardings): the initial state and one batch on the devices, placed as
    the host loop places them.

    With `initial_states` (a dict kept across contenders) the initial state is computed once
    per distinct initializer, told apart by its lowered program (source locations, constants
    such as the seed, and shardings included), and copied for every contender whose
    initializer lowers to the same one: the same operations on the same inputs give the same
    values, and each contender gets buffers of its own to donate.
    """
    import jax

    if initial_states is None:
        state = trainer.init_state()
    else:
        key = jax.jit(trainer.init_state).lower().as_text(debug_info=True)
        if key not in initial_states:
            initial_states[key] = trainer.init_state()
        state = jax.tree.map(lambda x: x.copy(), initial_states[key])
    batch = trainer.make_batch(tokens_MBL1)
    shardings = trainer.shardings(state, batch)
    if shardings is None:
        return state, jax.device_put(batch), None
    return jax.device_put(state, shardings[0]), jax.device_put(batch, shardings[1]), shardings


def compile_threads(args) -> int:
    """How many contenders compile at once (`--compile-threads`, default: the CPU cores)."""
    threads = getattr(args, "compile_threads", None)
    return threads or max(1, min(os.cpu_count() or 1, MAX_COMPILE_THREADS))


def build_runners(trainers: dict, tokens_MBL1, threads: int = 1, label: str = "{}",
                  preset: str = "", echo=echo_stderr, runner=None) -> tuple[dict, dict]:
    """One `StepRunner` per contender, compiled `threads` at a time; (runners, phase seconds:
    initial states, lowering, and from the first compilation to the last one's end).

    Initial states (shared where their initializers are identical, see `place`) and lowering
    run in this thread, one contender after the other (they hold the GIL); each distinct
    program goes to a thread pool as soon as it is lowered, so it compiles (XLA compiles
    without the GIL) while the next contender is set up. Contenders
    whose lowered programs are identical, source locations included, share one executable,
    since compiling the same module twice gives the same program; each still trains its own
    state. A contender's `compile_s` is its lowering plus its compilation's wall time, which is
    longer than alone while others compile beside it.
    """
    from concurrent.futures import ThreadPoolExecutor

    import jax

    runner = runner or StepRunner
    echo(f"{preset}: compiling {', '.join(label.format(v) for v in trainers)}, {threads} at "
         f"a time")

    def compile_one(lowered):
        t0 = time.perf_counter()
        step = lowered.compile()
        return step, step.as_text(), time.perf_counter() - t0

    placed, lower_s, same_as, futures, by_text, initial_states = {}, {}, {}, {}, {}, {}
    init_s, first_compile = 0.0, None
    with ThreadPoolExecutor(threads) as pool:
        for variant, trainer in trainers.items():
            t0 = time.perf_counter()
            placed[variant] = place(trainer, tokens_MBL1, initial_states)
            init_s += time.perf_counter() - t0
            state, batch, shardings = placed[variant]
            t0 = time.perf_counter()
            jitted = jax.jit(trainer.train_step, donate_argnums=0,
                             **({} if shardings is None else dict(in_shardings=shardings)))
            lowered = jitted.lower(state, batch)
            lower_s[variant] = time.perf_counter() - t0
            same_as[variant] = by_text.setdefault(lowered.as_text(debug_info=True), variant)
            if same_as[variant] == variant:
                first_compile = first_compile or time.perf_counter()
                futures[variant] = pool.submit(compile_one, lowered)
        compiled = {variant: future.result() for variant, future in futures.items()}
    compile_s = time.perf_counter() - first_compile
    runners = {}
    for variant, trainer in trainers.items():
        step, hlo, seconds = compiled[same_as[variant]]
        shared = same_as[variant] != variant
        runners[variant] = runner(trainer, None, (step, hlo, lower_s[variant] +
                                                  (0.0 if shared else seconds)),
                                  placed=placed[variant])
        runners[variant].shares_program_of = same_as[variant] if shared else None
    return runners, {"init_s": init_s, "lower_s": sum(lower_s.values()),
                     "compile_s": compile_s, "threads": threads, "programs": len(futures),
                     "initializers": len(initial_states)}


def interleaved(runners: dict, steps: int, repeats: int, tokens: int, label: str,
                echo=echo_stderr) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """(seconds for `steps` steps of each runner per repetition, in a rotating order; per
    runner its minor page faults and system CPU seconds per step over its timed blocks)."""
    import resource

    names = list(runners)
    seconds = {name: [] for name in names}
    faults, system = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            runners[name].run(steps)
            seconds[name].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults[name] += after.ru_minflt - before.ru_minflt
            system[name] += after.ru_stime - before.ru_stime
        echo(f"{label} repetition {rep + 1}/{repeats}: " + ", ".join(
            f"{name} {tokens * steps / seconds[name][-1]:,.0f} tokens/s" for name in names))
    timed = max(1, repeats * steps)
    kernel = {name: {"minor_faults_per_step": faults[name] / timed,
                     "system_s_per_step": system[name] / timed} for name in names}
    return seconds, kernel


def spread(values: list[float]) -> dict:
    import numpy as np

    v = np.asarray(values, np.float64)
    q1, median, q3 = np.percentile(v, [25, 50, 75])
    return {"median": float(median), "min": float(v.min()), "max": float(v.max()),
            "q1": float(q1), "q3": float(q3), "runs": [float(x) for x in v]}


def time_variants(preset: str, args, cfg, steps: int, trainers: dict, base: str, label: str,
                  echo=echo_stderr, runner=None):
    """Single-node variants of one step: compiled, warmed up, timed in rotation.

    Returns (runners, warm-up metrics, per variant its timing, ratio to `base`, compile time
    and warm-up losses, the result fields every suite shares). `label` formats a variant's
    name for the progress lines."""
    from .config import model_dims

    tokens_MBL1, tokens = random_tokens(cfg), tokens_per_step(cfg)
    runners, phases = build_runners(trainers, tokens_MBL1, compile_threads(args), label, preset,
                                    echo, runner)
    warmup, seconds, kernel = warm_up_and_time(runners, steps, args.repeats, tokens, preset,
                                               phases, echo)
    loss = lambda v, w: w[getattr(trainers[v], "loss_key", "loss/healthy")]  # noqa: E731
    base_losses = [loss(base, w) for w in warmup[base]]
    variants = {}
    for variant, runner in runners.items():
        losses = [loss(variant, w) for w in warmup[variant]]
        variants[variant] = {**timing(seconds[variant], steps, tokens),
                             "ratio": ratio_spread(seconds[variant], seconds[base]),
                             "kernel": kernel[variant],
                             "compile_s": runner.compile_s, "warmup_losses": losses,
                             f"losses_equal_{base}": losses == base_losses}
        if runner.shares_program_of is not None:
            variants[variant]["shares_program_of"] = runner.shares_program_of
    result = {"preset": preset, "n_params": model_dims(cfg.model).n_params,
              "batch": cfg.experiment.batch_size, "seq_len": cfg.data.seq_len,
              "tokens_per_step": tokens, "steps": steps, "repeats": args.repeats,
              "warmup_steps": WARMUP_STEPS, "phases": phases}
    return runners, warmup, variants, result


def warm_up_and_time(runners: dict, steps: int, repeats: int, tokens: int, label: str,
                     phases: dict, echo=echo_stderr):
    """(warm-up metrics per runner, timed seconds per runner, the kernel's share per runner,
    see `interleaved`); adds both phases' wall time to `phases`."""
    t0 = time.perf_counter()
    warmup = {name: r.warm_up(WARMUP_STEPS) for name, r in runners.items()}
    t1 = time.perf_counter()
    seconds, kernel = interleaved(runners, steps, repeats, tokens, label, echo)
    phases.update({"warmup_s": t1 - t0, "timed_s": time.perf_counter() - t1})
    echo(f"{label}: seconds spent on initial states {phases['init_s']:.1f}, lowering "
         f"{phases['lower_s']:.1f}, compiling {phases['compile_s']:.1f} "
         f"({phases['programs']} programs), warm-up {phases['warmup_s']:.1f}, timed steps "
         f"{phases['timed_s']:.1f}")
    return warmup, seconds, kernel


def timing(seconds: list[float], steps: int, tokens: int) -> dict:
    return {"seconds_per_step": spread([s / steps for s in seconds]),
            "tokens_per_s": spread([tokens * steps / s for s in seconds])}


def ratio_spread(numerator: list[float], denominator: list[float]) -> dict:
    """The ratio per repetition, then its spread (both sides timed in the same repetition),
    its geometric mean and that mean's 95% confidence interval (`geomean_ci`)."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    return {**spread(ratios), **geomean_ci(ratios)}


def geomean_ci(ratios: list[float], level: float = 0.95) -> dict:
    """{"geomean", "ci95": [low, high]}: the geometric mean of positive ratios and a
    confidence interval for it, from Student's t on their logarithms (repetitions taken as
    independent draws); `ci95` is None with fewer than two ratios."""
    import numpy as np
    from scipy import stats

    logs = np.log(np.asarray(ratios, np.float64))
    out = {"geomean": float(np.exp(logs.mean())), "ci95": None}
    if len(logs) > 1:
        half = (stats.t.ppf(0.5 + level / 2, len(logs) - 1) * logs.std(ddof=1)
                / np.sqrt(len(logs)))
        out["ci95"] = [float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))]
    return out


def program_text(hlo: str) -> str:
    """Compiled HLO text without source locations (op metadata and the stack-frame tables),
    which name the Python lines that traced each operation."""
    lines, skipping = [], False
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            lines.append(re.sub(r",? metadata=\{[^{}]*\}", "", line))
    return "\n".join(lines)


def _rate(s: dict) -> str:
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def _ratio(s: dict) -> str:
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def _ms(s: dict) -> str:
    return f"{s['median'] * 1e3:,.1f} ({s['min'] * 1e3:,.1f}-{s['max'] * 1e3:,.1f})"


def environment() -> dict:
    from importlib import metadata

    import jax

    from .determinism import cpu_info

    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"cpu": cpu_info(), "versions": versions, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
            "load_average": list(os.getloadavg()), "allocator": hostmem.describe()}


def finish(args, suite: str, results: list[dict], table: str, **extra) -> int:
    """Print the table; write the JSON and Markdown files when asked (atomically)."""
    from . import runfolder as RF

    print(table, end="")
    report = {"suite": suite, "results": results, **extra}
    if args.json is not None:
        RF.atomic_write_json(args.json, report)
    if args.markdown is not None:
        RF.atomic_write_text(args.markdown, table)
    plot(args, report)
    return 0


def run_suite(args, suite: str, measure, table, check=None, **extra) -> int:
    """Check every preset first (a typo fails at once, not after minutes of measuring the
    presets before it), then measure them in turn."""
    presets = check_args(args)
    for preset in presets:
        (check or (lambda p: preset_config(suite, p, args)))(preset)
    env = environment()
    results = []
    for preset in presets:  # a suite measures one result per preset, or a list of them
        hostmem.release()  # the previous preset's buffers are free by now
        measured = measure(preset, args)
        results += measured if isinstance(measured, list) else [measured]
    env["load_average_end"] = list(os.getloadavg())
    return finish(args, suite, results, table(results), environment=env, **extra)


# --- train: our step against transformers + torch ---------------------------------------------


def torch_import_problem() -> str | None:
    """None when torch and transformers import, else one sentence saying what is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return (f"torch or transformers is not importable ({e.name or e}), so only our step "
                f"is measured; `pip install torch transformers` adds the comparison.")
    return None


def llama_config(dims, seq_len: int, attention: str):
    """A transformers `LlamaConfig` that computes what our `ModelDims` does."""
    import transformers

    if dims.dtype != "float32" or dims.param_dtype != "float32":
        raise UserError("the torch comparison runs in float32; use a float32 model preset.")
    rope = {}
    if dims.rope_scaling is not None:
        rope = {"rope_scaling": {"rope_type": "llama3", **dict(dims.rope_scaling)}}
    return transformers.LlamaConfig(
        vocab_size=dims.vocab_size, hidden_size=dims.d_model, intermediate_size=dims.ffn_dim,
        num_hidden_layers=dims.n_layers, num_attention_heads=dims.n_heads,
        num_key_value_heads=dims.n_kv_heads, head_dim=dims.head_dim,
        rope_theta=dims.rope_theta, rms_norm_eps=dims.norm_eps,
        tie_word_embeddings=dims.tie_embeddings, max_position_embeddings=max(seq_len, 1),
        hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        use_cache=False, attn_implementation=attention, **rope)


def torch_state_dict(params) -> dict:
    """Our parameter tree as a `LlamaForCausalLM` state dict: Linear weights transposed from
    our (in, out) to torch's (out, in), copied into fresh float32 tensors."""
    import jax
    import numpy as np
    import torch

    from .hf import _hf_name

    out = {}
    for key_path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(getattr(k, "key", k) for k in key_path)
        name, transpose = _hf_name(path)
        array = np.asarray(value, np.float32)
        array = array.T if transpose else array
        full = name if name.startswith("lm_head.") else f"model.{name}"
        out[full] = torch.from_numpy(np.ascontiguousarray(array).copy())
    return out


def torch_model(dims, params, seq_len: int, attention: str):
    """`LlamaForCausalLM` holding exactly our `params`, in training mode."""
    import transformers

    net = transformers.LlamaForCausalLM(llama_config(dims, seq_len, attention)).float()
    missing, unexpected = net.load_state_dict(torch_state_dict(params), strict=False)
    missing = [m for m in missing if not (dims.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"torch model and our parameters differ: missing {missing}, "
                           f"unexpected {unexpected}")
    return net.train()


class TorchRunner:
    """One transformers + torch training loop doing our step's work: next-token cross-entropy
    over tokens[:, 1:], global-norm clipping, AdamW(0.9, 0.99, wd) with our schedule."""

    def __init__(self, cfg, dims, params, tokens_MBL1, attention: str, learning_rates):
        import torch

        o = cfg.optim
        if cfg.experiment.microsteps != 1 or o.name != "adamw":
            raise UserError("the torch comparison covers one microstep and AdamW only.")
        self.torch = torch
        self.model = torch_model(dims, params, tokens_MBL1.shape[-1] - 1, attention)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=float(learning_rates[0]),
                                           betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.clip_norm = o.clip_norm
        self.learning_rates = learning_rates
        tokens_BL1 = torch.from_numpy(tokens_MBL1[0].astype("int64"))
        self.inputs_BL = tokens_BL1[:, :-1].contiguous()
        self.targets_BL = tokens_BL1[:, 1:].contiguous()
        self.steps_done = 0
        self.loss = None

    def step(self) -> None:
        torch = self.torch
        for group in self.optimizer.param_groups:
            group["lr"] = float(self.learning_rates[self.steps_done])
        self.optimizer.zero_grad(set_to_none=True)
        logits_BLV = self.model(input_ids=self.inputs_BL).logits
        self.loss = torch.nn.functional.cross_entropy(
            logits_BLV.reshape(-1, logits_BLV.shape[-1]).float(), self.targets_BL.reshape(-1))
        self.loss.backward()
        if self.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        self.steps_done += 1

    def run(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def warm_up(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            self.step()
            out.append({"loss/healthy": float(self.loss.detach())})
        return out


def measure_train(preset: str, args, attentions: tuple[str, ...], echo=echo_stderr) -> dict:
    """Our step and each torch attention, warmed up, then timed in rotation."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .config import model_dims
    from .train import Trainer

    cfg, steps = preset_config("train", preset, args, ["experiment.mode=train"])
    dims, tokens_MBL1, tokens = model_dims(cfg.model), random_tokens(cfg), tokens_per_step(cfg)
    e = cfg.experiment
    echo(f"{preset}: compiling our step ({dims.n_params:,} parameters, batch {e.batch_size} x "
         f"{cfg.data.seq_len})")
    ours = StepRunner(Trainer.from_config(cfg), tokens_MBL1)
    runners = {"ours": ours}
    if attentions:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        # Copied before our first step donates (and so may overwrite) the parameter buffers.
        params = jax.tree.map(lambda x: np.array(x, copy=True), ours.state["params"])
        lrs = np.asarray(jax.vmap(ours.trainer.schedule)(jnp.arange(e.steps)), np.float64)
        for attention in attentions:
            runners[f"torch-{attention}"] = TorchRunner(cfg, dims, params, tokens_MBL1,
                                                        attention, lrs)
    losses = {name: [r["loss/healthy"] for r in runner.warm_up(WARMUP_STEPS)]
              for name, runner in runners.items()}
    seconds, kernel = interleaved(runners, steps, args.repeats, tokens, preset)

    def contender(name):
        return {**timing(seconds[name], steps, tokens), "warmup_losses": losses[name],
                "kernel": kernel[name]}

    result = {"preset": preset, "n_params": dims.n_params, "batch": e.batch_size,
              "seq_len": cfg.data.seq_len, "tokens_per_step": tokens, "steps": steps,
              "repeats": args.repeats, "warmup_steps": WARMUP_STEPS,
              "ours": {**contender("ours"), "compile_s": ours.compile_s},
              "torch": {}, "torch_baseline": None, "ratio": None}
    for a in attentions:
        name = f"torch-{a}"
        result["torch"][a] = {**contender(name),
                              "ratio": ratio_spread(seconds[name], seconds["ours"]),
                              "max_loss_diff": max(abs(x - y) for x, y in
                                                   zip(losses[name], losses["ours"]))}
    if attentions:
        best = max(attentions, key=lambda a: result["torch"][a]["tokens_per_s"]["median"])
        result["torch_baseline"] = best
        result["ratio"] = result["torch"][best]["ratio"]
    echo(f"{preset}: timing a {roofline.PEAK_SIZE}x{roofline.PEAK_SIZE} float32 matmul "
         "for the machine's peak")
    rates = {name: steps / float(np.median(s)) for name, s in seconds.items()}
    result["roofline"] = roofline.summary(
        dims, e.microsteps * e.batch_size, cfg.data.seq_len, rates,
        roofline.matmul_peak(with_torch=bool(attentions)),
        f"torch-{result['torch_baseline']}" if attentions else None)
    return result


def train_table(results: list[dict]) -> str:
    """The results as a Markdown table, then one line per preset on the torch variants."""
    lines = ["| preset | params | batch x seq | ours tokens/s | torch tokens/s (attention) | "
             "ours / torch | ours compile s |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in results:
        torch_cell, ratio = "not measured", "-"
        if r["torch_baseline"]:
            best = r["torch_baseline"]
            torch_cell = f"{_rate(r['torch'][best]['tokens_per_s'])} ({best})"
            ratio = _ratio(r["ratio"])
        lines.append(f"| {r['preset']} | {r['n_params'] / 1e6:.2f}M | {r['batch']} x "
                     f"{r['seq_len']} | {_rate(r['ours']['tokens_per_s'])} | {torch_cell} | "
                     f"{ratio} | {r['ours']['compile_s']:.1f} |")
    lines += ["", "Median (min-max) over interleaved repetitions; ours / torch is taken per "
              f"repetition against the faster torch attention (goal: at least "
              f"{TARGET_RATIO:g}x)."]
    for r in results:
        if r["torch"]:
            variants = ", ".join(f"{a} {v['tokens_per_s']['median']:,.0f} tokens/s, warm-up "
                                 f"losses within {v['max_loss_diff']:.1e} of ours"
                                 for a, v in r["torch"].items())
            lines.append(f"- {r['preset']}: torch {variants}.")
    return "\n".join(lines) + "\n" + roofline_table(results)


def roofline_table(results: list[dict]) -> str:
    """Model FLOP/s of each contender against the matmul peak measured in the same run, and
    the ceiling that peak puts on ours / torch (sdcstudy/roofline.py)."""
    rows = [r for r in results if r.get("roofline")]
    if not rows:
        return ""
    lines = ["", "| preset | GFLOP / step | ours GFLOP/s (of peak) | torch GFLOP/s (of peak) | "
             "matmul peak GFLOP/s | ceiling on ours / torch |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = r["roofline"]
        cell = lambda name: (f"{f['gflops'][name]:.1f} ({f['fraction_of_peak'][name]:.0%})"  # noqa: E731
                             if name in f["gflops"] else "-")
        peaks = " / ".join(f"{v:.1f} ({k})" for k, v in f["peak_gflops"].items())
        torch_name = f"torch-{r['torch_baseline']}" if r["torch_baseline"] else ""
        ceiling = "-" if f["ceiling"] is None else f"{f['ceiling']:.2f}x"
        lines.append(f"| {r['preset']} | {f['step_gflop']:.2f} | {cell('ours')} | "
                     f"{cell(torch_name)} | {peaks} | {ceiling} |")
    lines += ["", f"Model FLOPs of the step's matmuls (forward and backward, full L x L attention "
              f"scores) at the median step time; the peak is a "
              f"{roofline.PEAK_SIZE}x{roofline.PEAK_SIZE} float32 matmul timed in the same "
              f"run. The ceiling, peak / torch's FLOP/s, is the highest ours / torch any "
              f"implementation of this step could reach on this machine."]
    beyond = [r["preset"] for r in rows
              if r["roofline"]["ceiling"] is not None and r["roofline"]["ceiling"] < TARGET_RATIO]
    if beyond:
        lines.append(f"The {TARGET_RATIO:g}x goal is beyond this machine's matmul peak for "
                     f"{', '.join(beyond)}.")
    return "\n".join(lines) + "\n"


def run_train_suite(args) -> int:
    attentions = tuple(a.strip() for a in args.torch_attention.split(",") if a.strip())
    unknown = sorted(set(attentions) - set(TORCH_ATTENTION))
    if unknown:
        raise UserError(f"--torch-attention {unknown[0]!r} is not one of "
                        f"{', '.join(TORCH_ATTENTION)}.")
    note = None
    if args.no_torch:
        attentions = ()
    elif (note := torch_import_problem()) is not None:
        echo_stderr(note)
        attentions = ()
    return run_suite(args, "train", lambda preset, a: measure_train(preset, a, attentions),
                     train_table, torch_note=note, target_ratio=TARGET_RATIO)


# --- faults: the cost of the fault engine when nothing fires ----------------------------------


def fault_profiles(folder: Path) -> dict[str, str]:
    """`suspect.profile` per variant; the rate-0 and idle profiles are written to `folder`.

    Both put one `scale` spec (the paper nodes' kind) at each of the paper's four sites.
    Rate 0 makes `Profile.healthy` true, so no injector is built; the idle specs have a rate
    but a `steps` pattern listing no step, so every draw happens and none lands.
    """
    import yaml

    from .profiles import SITES

    def write(name: str, rate: float, pattern: dict | None) -> str:
        specs = [{"site": site, "kind": "scale", "rate": rate, "scale": [0.25, 1.0],
                  **({"pattern": pattern} if pattern else {})} for site in SITES]
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"name": name, "specs": specs}, sort_keys=False))
        return str(path)

    return {"plain": "healthy", "healthy": "healthy", "zero-rate": write("zero-rate", 0.0, None),
            "idle": write("idle", IDLE_RATE, {"kind": "steps", "steps": []})}


def measure_faults(preset: str, args, echo=echo_stderr) -> dict:
    """The four variants of one preset's single-node step, warmed up, then timed in rotation."""
    from .train import Trainer

    trainers, cfg, steps = {}, None, 0
    with tempfile.TemporaryDirectory(prefix="sdcstudy-bench-") as folder:
        for variant, profile in fault_profiles(Path(folder)).items():
            cfg, steps = preset_config("faults", preset, args, [
                "experiment.mode=train", f"suspect.profile={profile}"])
            trainer = Trainer.from_config(cfg)
            # plain: no fault engine at all, whatever the profile would build.
            trainers[variant] = (dataclasses.replace(trainer, injector=None)
                                 if variant == "plain" else trainer)
    runners, warmup, variants, result = time_variants(preset, args, cfg, steps, trainers,
                                                      "plain", "{}", echo)
    plain = runners["plain"]
    for variant, runner in runners.items():
        variants[variant].update({
            "injector": runner.trainer.injector is not None,
            "hlo_identical": runner.hlo == plain.hlo,
            "program_identical": program_text(runner.hlo) == program_text(plain.hlo),
            "hlo_chars": len(runner.hlo),
            "faults_landed": sum(w.get("faults/landed", 0) for w in warmup[variant]),
        })
    return {**result, "idle_rate": IDLE_RATE, "variants": variants}


def faults_table(results: list[dict]) -> str:
    lines = ["| preset | batch x seq | variant | ms/step | ratio to plain | HLO = plain | "
             "faults landed | compile s |",
             "|---|---|---|---:|---:|---|---:|---:|"]
    for r in results:
        for variant, v in r["variants"].items():
            same = "yes" if v["hlo_identical"] else (
                "ops only" if v["program_identical"] else "no")
            lines.append(f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {variant} | "
                         f"{_ms(v['seconds_per_step'])} | {_ratio(v['ratio'])} | {same} | "
                         f"{v['faults_landed']} | {v['compile_s']:.1f} |")
    lines += ["", "Median (min-max) over interleaved repetitions; ratios per repetition. "
              "plain: no injector; healthy: `suspect.profile: healthy` (its ratio is the "
              "measurement's noise floor); zero-rate: specs at rate 0 (no injector is built); "
              "idle: specs at the four paper sites with a pattern that never fires (the "
              "engine compiled in). \"ops only\": equal apart from source locations. A variant "
              "whose lowered program is plain's, byte for byte, runs plain's executable "
              "(compiled once), so its compile s is its lowering alone."]
    for r in results:
        unequal = [k for k, v in r["variants"].items() if not v["losses_equal_plain"]]
        if unequal:
            lines.append(f"- {r['preset']}: warm-up losses differ from plain's in "
                         f"{', '.join(unequal)}.")
    return "\n".join(lines) + "\n"


def run_faults_suite(args) -> int:
    return run_suite(args, "faults", measure_faults, faults_table)


# --- abft: checksummed matmuls on and off ---------------------------------------------------


def measure_abft(preset: str, args, echo=echo_stderr, which=ABFT_VARIANTS) -> dict:
    """The single-node step without ABFT, with it, and with recomputation (or the variants
    `which` names, "off" among them), timed in rotation."""
    from .train import Trainer

    trainers, cfg, steps = {}, None, 0
    for variant, overrides in which.items():
        cfg, steps = preset_config("abft", preset, args, ["experiment.mode=train", *overrides])
        trainers[variant] = Trainer.from_config(cfg)
    _, warmup, variants, result = time_variants(preset, args, cfg, steps, trainers, "off",
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
                         f"{_ms(v['seconds_per_step'])} | {_ratio(v['ratio'])} | {goal} | "
                         f"{v['checks']} | {v['flags']} | "
                         f"{'yes' if v['losses_equal_off'] else 'no'} | {v['compile_s']:.1f} |")
    lines += ["", f"Median (min-max) over interleaved repetitions; ratios per repetition. Goal: "
              f"at most {ABFT_GOAL:.2f}x the step without ABFT. on: row and column checksums of "
              f"every forward and backward matmul (paper threshold); recompute: the same, "
              f"recomputing a flagged product. checks and flags: over the warm-up steps."]
    return "\n".join(lines) + "\n"


def run_abft_suite(args) -> int:
    return run_suite(args, "abft", measure_abft, abft_table)


# --- paired: lockstep and paramsync against free-running pairs --------------------------------


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
    return preset_config("paired", preset, args, [
        f"experiment.mode={mode}", "suspect.profile=healthy", f"mesh.tp={tp}",
        f"mesh.dp={args.dp}"])


def check_paired(preset: str, args) -> None:
    """The mesh fits the devices and the model (tp divides heads, FFN and sequence)."""
    from .paired import PairedTrainer

    for tp in tp_degrees(args):
        PairedTrainer.from_config(paired_config(preset, args, PAIRED_MODES[0], tp)[0])


def measure_paired(preset: str, args, echo=echo_stderr) -> list[dict]:
    """The three paired modes of one preset at each tp degree, warmed up, then timed in one
    rotation; one result per degree, its ratios to free running at the same degree."""
    from .config import model_dims
    from .paired import PairedTrainer

    degrees = tp_degrees(args)

    def name(mode, tp):
        return mode if len(degrees) == 1 else f"{mode}@tp{tp}"

    trainers, cfg, steps = {}, None, 0
    for tp in degrees:
        for mode in PAIRED_MODES:
            cfg, steps = paired_config(preset, args, mode, tp)
            trainers[name(mode, tp)] = PairedTrainer.from_config(cfg)
    dims, tokens = model_dims(cfg.model), tokens_per_step(cfg)
    runners, phases = build_runners(
        trainers, random_tokens(cfg), compile_threads(args),
        f"{{}} (node 2 x dp {args.dp}{' x tp ' + str(degrees[0]) if len(degrees) == 1 else ''})",
        preset, echo)
    warmup, seconds, kernel = warm_up_and_time(runners, steps, args.repeats, tokens, preset,
                                               phases, echo)
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
                **timing(seconds[key], steps, tokens),
                "ratio": ratio_spread(seconds[key], seconds[name("free", tp)]),
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
                  "warmup_steps": WARMUP_STEPS, "mesh": {"node": 2, "dp": args.dp, "tp": tp},
                  "modes": modes, "goals": goals, "phases": phases}
        if len(degrees) > 1:
            # Free running at this degree against free running at the first degree, timed in
            # the same repetitions: what splitting the model over tp ranks costs (or saves).
            result["free_ratio_to_tp"] = {
                "tp": degrees[0],
                **ratio_spread(seconds[name("free", tp)], seconds[name("free", degrees[0])])}
        results.append(result)
    return results


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


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
                         f"{_rate(v['tokens_per_s'])} | {_ratio(v['ratio'])} | {_mib(memory)} "
                         f"| {memory_ratio} | {v['compile_s']:.1f} |")
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
                     f"{r['free_ratio_to_tp']['tp']}: {_ratio(r['free_ratio_to_tp'])}")
        where = r["preset"] if "free_ratio_to_tp" not in r else \
            f"{r['preset']} at tp {r['mesh']['tp']}"
        lines.append(f"- {where}: {', '.join(verdicts)}{note}.")
    return "\n".join(lines) + "\n"


def run_paired_suite(args) -> int:
    return run_suite(args, "paired", measure_paired, paired_table,
                     check=lambda preset: check_paired(preset, args), goals={mode: dict(g) for mode, g in PAIRED_GOALS.items()})
