"""Compiling, warming up and timing the contenders of a `sdcstudy bench` suite side by side.

Every suite compiles each contender's step once (state donated; `build_runners` compiles the
distinct programs several at a time and lets identical ones share an executable), runs
`bench.WARMUP_STEPS` untimed steps that also check the contenders compute what they should, then
times `repeats` repetitions of N steps of every contender in a rotating order, so load from
other processes falls on all of them alike. Ratios are taken per repetition (both sides timed
within seconds of each other) and reported as median (min-max), with their geometric mean
and its 95% confidence interval (Student's t on the logarithms of the per-repetition ratios).
Each contender's timed blocks also record the kernel's share: minor page faults and system CPU
seconds per step (`getrusage`, process-wide, so only what ran during that contender's block).
On the simulated devices a large step's cost can be page faults on XLA's per-step buffers
rather than arithmetic (docs/paft.md, section 7); these columns say so at once.
"""

from __future__ import annotations

import os
import time

from sdcstudy.bench import common as B
from sdcstudy.core.config import tokens_per_step
from sdcstudy.core.ticker import ticking


def random_tokens(cfg):
    """int32 tokens (microsteps, B, L+1), the same numpy draw for every contender."""
    import numpy as np

    from sdcstudy.core.config import model_dims

    e = cfg.experiment
    shape = (e.microsteps, e.batch_size, cfg.data.seq_len + 1)
    return np.random.default_rng(e.seed).integers(0, model_dims(cfg.model).vocab_size, shape,
                                                  dtype=np.int32)


class StepRunner:
    """A trainer's step (`Trainer` or `PairedTrainer`), compiled once with its state donated,
    run again and again on one batch placed as the host loop places it.

    `compiled` (step, HLO text, seconds) is a step compiled elsewhere for the same program
    and `placed` its (state, batch, shardings) (`build_runners` compiles several at once);
    without them the runner places its state and batch and compiles its own step."""

    shares_program_of: str | None = None  # the contender whose executable it runs, if not its own

    def __init__(self, trainer, tokens_MBL1, compiled=None, placed=None):
        from sdcstudy.core.train import compile_step

        self.trainer = trainer
        self.state, self.batch, shardings = placed or place(trainer, tokens_MBL1)
        if compiled is None:
            compiled = compile_step(trainer.train_step, self.state, self.batch, shardings)
        self.step_fn, self.hlo, self.compile_s = compiled
        self.metrics, self.records = None, {}

    def run(self, n: int) -> None:
        """n steps, dispatched back to back (as the host loop does), then waited for."""
        import jax

        for _ in range(n):
            self.state, self.metrics, self.records = self.step_fn(self.state, self.batch)
        jax.block_until_ready((self.state, self.metrics, self.records))

    def warm_up(self, n: int) -> list[dict]:
        """n steps one at a time; per step its metrics and the trainer's host counters
        (faults landed, lock-step mismatches)."""
        import jax

        from sdcstudy.core.train import STEP_ONLY

        out = []
        for _ in range(n):
            self.run(1)
            step = int(jax.device_get(self.state["step"]))
            _, counters = self.trainer.host_tables(step, jax.device_get(self.records))
            counters.pop("bit_histograms", None)
            out.append({**{k: float(v) for k, v in jax.device_get(self.metrics).items()},
                        **counters.pop(STEP_ONLY, {}), **counters})
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
    return threads or max(1, min(os.cpu_count() or 1, B.MAX_COMPILE_THREADS))


def build_runners(trainers: dict, tokens_MBL1, threads: int = 1, label: str = "{}",
                  preset: str = "", echo=B.echo_stderr, runner=None) -> tuple[dict, dict]:
    """One `StepRunner` per contender, compiled `threads` at a time; (runners, phase seconds:
    initial states, lowering, and from the first compilation to the last one's end).

    Initial states (shared where their initializers are identical, see `place`) and lowering
    run in this thread, one contender after the other (they hold the GIL); each distinct
    program goes to a thread pool as soon as it is lowered, so it compiles (XLA compiles
    without the GIL) while the next contender is set up. Contenders
    whose lowered programs are identical, source locations included, share one executable,
    since compiling the same module twice gives the same program; each still trains its own
    state. A contender's `compile_s` is its lowering plus its compilation's wall time, which is
    longer than alone while others compile beside it. Progress: on a terminal a line counts the
    seconds; elsewhere (a log file) each program says when it has compiled (`compiled_line`).
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
    # Not a `with`: its exit waits for the compiles under way, so a Ctrl-C or SIGTERM would
    # wait for them (seconds to minutes). An interrupt or error here returns at once: the
    # programs not started never start, and the command's exit ends the others.
    pool = ThreadPoolExecutor(threads)
    try:
        with ticking(f"{preset}: preparing and compiling", enabled=B.live_line()):
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
                    if not B.live_line():  # a log gets a line per program instead of the ticker
                        futures[variant].add_done_callback(compiled_line(
                            preset, label.format(variant), futures, echo))
            compiled = {variant: future.result() for variant, future in futures.items()}
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
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


def compiled_line(preset: str, name: str, futures: dict, echo):
    """The callback that says, when a program has compiled, how long it took and how many of
    the programs submitted so far are done (a log's progress while the programs compile)."""
    def done(future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        finished = sum(f.done() for f in list(futures.values()))
        echo(f"{preset}: compiled {name} in {future.result()[2]:.1f} s ({finished} of "
             f"{len(futures)} programs so far)")
    return done


def interleaved(runners: dict, steps: int, repeats: int, tokens: int, label: str,
                echo=B.echo_stderr) -> tuple[dict[str, list[float]], dict[str, dict]]:
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
                  echo=B.echo_stderr, runner=None):
    """Single-node variants of one step: compiled, warmed up, timed in rotation.

    Returns (runners, warm-up metrics, per variant its timing, ratio to `base`, compile time
    and warm-up losses, the result fields every suite shares). `label` formats a variant's
    name for the progress lines."""
    from sdcstudy.core.config import model_dims

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
              "warmup_steps": B.WARMUP_STEPS, "phases": phases}
    return runners, warmup, variants, result


def warm_up_and_time(runners: dict, steps: int, repeats: int, tokens: int, label: str,
                     phases: dict, echo=B.echo_stderr):
    """(warm-up metrics per runner, timed seconds per runner, the kernel's share per runner,
    see `interleaved`); adds both phases' wall time to `phases`."""
    echo(f"{label}: warming up {B.contenders(len(runners))}, {B.WARMUP_STEPS} steps each")
    t0 = time.perf_counter()
    warmup = {name: r.warm_up(B.WARMUP_STEPS) for name, r in runners.items()}
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


def geomean_ci(ratios: list[float]) -> dict:
    """{"geomean", "ci95": [low, high]}: the geometric mean of positive ratios and a
    confidence interval for it, from Student's t on their logarithms (repetitions taken as
    independent draws); `ci95` is None with fewer than two ratios."""
    import numpy as np
    from scipy import stats

    logs = np.log(np.asarray(ratios, np.float64))
    out = {"geomean": float(np.exp(logs.mean())), "ci95": None}
    if len(logs) > 1:
        half = (stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1)
                / np.sqrt(len(logs)))
        out["ci95"] = [float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))]
    return out
