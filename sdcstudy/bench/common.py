"""What every `sdcstudy bench` suite shares: each suite's shapes per preset, the common
options, checking them, a preset's config, the machine's description, and writing the table
and the JSON file. The command line (cli.py) and the suites build on this module; it imports
neither."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sdcstudy.core import hostmem
from sdcstudy.core.errors import UserError

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
# Contenders compiled at once (`--compile-threads`): XLA compiles without the GIL, and one
# compilation keeps the cores busy only part of the time.
MAX_COMPILE_THREADS = 4


def add_common_args(p: argparse.ArgumentParser, suite: str | None, repeats: int = 5,
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


def plot(args, report: dict) -> Path | None:
    """The overhead figure when `--plot` asks for it: the path written (`publish`), or None."""
    if getattr(args, "plot", None) is None:
        return None
    from sdcstudy.bench.plot import overhead_figure
    from sdcstudy.core import reports

    written = reports.publish(args.plot, lambda tmp: overhead_figure(report, tmp))
    if written is None:
        echo_stderr(f"no overhead ratio to plot, so {args.plot} was not written (the train "
                    f"suite measures a speed-up).")
    else:
        echo_stderr(f"figure: {written}")
    return written


def contenders(n: int) -> str:
    return f"{n} contender" + ("" if n == 1 else "s")


def echo_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def live_line() -> bool:
    """Whether to keep a line of seconds on stderr while contenders compile: only on a
    terminal (a bench writing to a log file, as the GPU acceptance's children do, gets its
    lines alone)."""
    return sys.stderr.isatty()


def check_args(args) -> list[str]:
    """The presets asked for; one-sentence errors for numbers below 1 or no preset, and for
    output files that would be overwritten or cannot be written (`check_outputs`)."""
    for name in ("batch", "seq_len", "steps", "repeats", "dp", "compile_threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {value}.")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if not presets:
        raise UserError("--presets names no preset; give e.g. --presets tiny,small.")
    check_outputs(args)
    return presets


OUTPUT_OPTIONS = ("json", "markdown", "plot")


def check_outputs(args) -> None:
    """Before anything is measured: each file `--json`, `--markdown` or `--plot` names must not
    exist yet nor be named by another of them (a user's file is never overwritten, nor one of
    the command's files by another: exit 2), and its folder, or the nearest
    folder above it that exists (the missing ones are made), must be one that can be written
    (else the sentence `reports.unwritten` gives, exit 3, as when the file fails at the end)."""
    from sdcstudy.core import reports
    from sdcstudy.core.errors import ReportWriteError

    given = {option: Path(getattr(args, option)) for option in OUTPUT_OPTIONS
             if getattr(args, option, None) is not None}
    for option, path in given.items():
        same = [o for o, p in given.items() if o != option and p.resolve() == path.resolve()]
        if same:
            raise UserError(f"--{option} and --{same[0]} name the same file {str(path)!r}; "
                            f"give each its own.")
        if path.is_dir():
            raise ReportWriteError(reports.unwritten(path, IsADirectoryError(21, "Is a folder"),
                                                     "benchmark file") + ".")
        if path.exists() or path.is_symlink():
            raise UserError(f"--{option} {str(path)!r} already exists; sdcstudy bench does not "
                            f"overwrite it: remove it or give a new file name.")
        reports.check_writable(path, path.parent, "benchmark file")


def preset_config(suite: str, preset: str, args, suite_overrides: list[str] = ()):
    """(config, timed steps per repetition) of the default experiment at the suite's shape.

    `experiment.steps` covers warm-up and timed steps, so the cosine schedule never ends,
    and there is no learning-rate warm-up (a first step at learning rate 0 changes nothing);
    the suite's own overrides (mode, mesh, profile) come after the user's `--set`.
    """
    from sdcstudy.core import config as C

    batch, seq_len, steps = SHAPES[suite].get(preset, FALLBACK_SHAPE)
    batch, seq_len = args.batch or batch, args.seq_len or seq_len
    steps = args.steps or steps
    base = {"model": {"preset": preset},
            "experiment": {"batch_size": batch, "steps": WARMUP_STEPS + args.repeats * steps,
                           "checkpoint_every": 0},
            "optim": {"warmup_steps": 0},
            "data": {"seq_len": seq_len}}
    return C.from_dict(base, list(args.overrides) + list(suite_overrides)), steps


def _rate(s: dict) -> str:
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def _ratio(s: dict) -> str:
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def _ms(s: dict) -> str:
    return f"{s['median'] * 1e3:,.1f} ({s['min'] * 1e3:,.1f}-{s['max'] * 1e3:,.1f})"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


VERSIONED = ("sdcstudy", "jax", "jaxlib", "flax", "optax", "torch", "transformers", "numpy",
             "scipy", "pyarrow")


def host() -> dict:
    """The machine and the package versions, without importing JAX (the logging suite's)."""
    import platform

    from sdcstudy.core.determinism import cpu_info, package_versions

    return {"cpu": cpu_info(), "hostname": platform.node(), "os": platform.platform(),
            "versions": package_versions(VERSIONED), "load_average": list(os.getloadavg()),
            "allocator": hostmem.describe()}


def environment() -> dict:
    """`host()` with XLA's flags and JAX's devices."""
    import jax

    return {**host(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind}


def command(args) -> dict:
    """The command that wrote a bench JSON: the process's command line (`argv`) and the
    options it was parsed into, defaults included (`options`; also right where the suite was
    called from Python, as `bench all` and the tests do)."""
    options = {}
    for key, value in sorted(vars(args).items()):
        if callable(value):
            continue
        options[key] = str(value) if isinstance(value, Path) else value
    return {"argv": list(sys.argv), "options": options}


def finish(args, suite: str, results: list[dict], table: str, goals: list[dict] = (),
           **extra) -> int:
    """Print the table and the goals; write the JSON and Markdown files when asked
    (atomically)."""
    from sdcstudy.bench.goals import goals_table

    if goals:
        table += "\nGoals (sdcstudy/bench/goals.py):\n\n" + goals_table(goals)
    print(table, end="")
    write(args, {"suite": suite, "goals": list(goals), "results": results, **extra}, table)
    return 0


def write(args, report: dict, table: str) -> None:
    """The JSON and Markdown files (atomically) and the figure, where the options ask, each a new
    file (`publish`); a file that cannot be written, or that had to take another name, ends
    the command with one sentence naming it (exit 3)."""
    from sdcstudy.core import reports
    from sdcstudy.core import runfolder as RF
    from sdcstudy.core.errors import ReportWriteError

    def text(content: str):
        return lambda tmp: RF.atomic_write_text(tmp, content) or tmp

    written = {}
    if args.json is not None:
        with reports.writing(args.json, "benchmark file"):
            written["json"] = reports.publish(args.json, text(
                RF.dumps({**report, "command": command(args)}) + "\n"))
    if args.markdown is not None:
        with reports.writing(args.markdown, "benchmark file"):
            written["markdown"] = reports.publish(args.markdown, text(table))
    written["plot"] = plot(args, report)
    moved = [f"--{option} {str(getattr(args, option))!r} appeared while measuring and is kept; "
             f"this command's file is {str(path)!r}" for option, path in written.items()
             if path is not None and path != Path(getattr(args, option))]
    if moved:  # a script reading the name it gave must not read another command's file
        raise ReportWriteError("; ".join(moved) + ".")


def run_suite(args, suite: str, measure, table, check=None, goals=None, **extra) -> int:
    """Check every preset first (a typo fails at once, not after minutes of measuring the
    presets before it), then measure them in turn; `goals(results)` gives the suite's
    `goals` list (goals.py)."""
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
    return finish(args, suite, results, table(results), goals=goals(results) if goals else (),
                  environment=env, **extra)
