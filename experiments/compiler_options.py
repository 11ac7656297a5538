"""python experiments/compiler_options.py [--preset small] [--repeats 6] [--out F] \\
        [--matmul-form] --option xla_cpu_experimental_enable_tiling_propagation=true \\
        [--option K=V,K2=V2 ...]

The plain training step under XLA's CPU compiler options: faster than the default, same bits?

Each `--option` (one `K=V`, or several joined by commas) is a contender: the train bench's step
(`sdcstudy.bench.study.train_config`) compiled with `.compile(compiler_options=...)` and
started from the same initial state and batch as the default. After two steps each
contender's parameters are compared with the default's, bit for bit; then interleaved
repetitions time one step of each in turn. The table gives the median step, the ratio to the
default's and the bits. An option the compiler does not know ends the run with one sentence
(exit 2).

`--matmul-form` adds a contender that changes the program instead of the compiler: every
weight gradient in `sites.matmul`'s form, (dy^T x)^T, which the model uses inside `shard_map`
only, where XLA's CPU backend transposes fewer operands for it; under `jax.jit` the model
keeps autodiff's x^T dy, whose bits every earlier run has.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from sdcstudy.core.errors import ArgumentParser  # noqa: E402

BITS_STEPS = 2  # steps before the parameters are compared (and the warm-up)


def parse_options(text: str) -> dict:
    """`K=V[,K2=V2]` as compiler options: true/false as booleans, integers as integers."""
    options = {}
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise ValueError(f"option {item!r} is not KEY=VALUE")
        raw = raw.strip()
        value = {"true": True, "false": False}.get(raw.lower(), raw)
        if isinstance(value, str) and raw.lstrip("-").isdigit():
            value = int(raw)
        options[key.strip()] = value
    return options


MATMUL_FORM = "weight gradients as (dy^T x)^T"


@contextlib.contextmanager
def matmul_form():
    """While tracing: the model's matmuls in `sites.matmul`'s form, as inside `shard_map`."""
    from sdcstudy.core import sites as S

    autodiff = S.linear

    def linear(hook, site, x, w, layer, out_dtype=None):
        if out_dtype is not None or getattr(hook, "linear", None) is not None:
            return autodiff(hook, site, x, w, layer, out_dtype)
        return hook(site, S.matmul(x, w), layer)

    S.linear = linear
    try:
        yield
    finally:
        S.linear = autodiff


def same_bits(a, b) -> bool:
    from sdcstudy.core.digest import tree_digest

    return tree_digest(a) == tree_digest(b)


def compare(preset: str, contenders: dict[str, dict], repeats: int,
            form: bool = False) -> list[dict]:
    """One row per contender ("default" first, then `MATMUL_FORM` with `form`): median step
    seconds, ratio to the default, same bits."""
    from sdcstudy.bench.study import train_config
    from sdcstudy.bench.timing import StepRunner, place, random_tokens
    from sdcstudy.core.train import Trainer, compile_step

    cfg = train_config(preset)
    trainer = Trainer.from_config(cfg)
    tokens, initial = random_tokens(cfg), {}
    contenders = {"default": {}, **({MATMUL_FORM: {}} if form else {}), **contenders}
    runners = {}
    for name, options in contenders.items():
        placed = place(trainer, tokens, initial)
        with matmul_form() if name == MATMUL_FORM else contextlib.nullcontext():
            compiled = compile_step(trainer.train_step, *placed, compiler_options=options)
        runners[name] = StepRunner(trainer, tokens, compiled, placed)
    for runner in runners.values():
        runner.run(BITS_STEPS)
    default = runners["default"].state["params"]
    bits = {name: same_bits(r.state["params"], default) for name, r in runners.items()}
    seconds = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.run(1)
            seconds[name].append(time.perf_counter() - start)
    base = statistics.median(seconds["default"])
    return [{"contender": name, "options": contenders[name],
             "step_s": statistics.median(s), "min_s": min(s),
             "ratio": statistics.median(s) / base, "same_bits": bits[name]}
            for name, s in seconds.items()]


def table(rows: list[dict], preset: str, repeats: int) -> str:
    lines = [f"{preset}: the train bench's step, median of {repeats} interleaved steps; bits "
             f"compared after {BITS_STEPS} steps from one initial state.", "",
             "| contender | ms / step (min) | / default | parameters' bits |",
             "|---|---:|---:|---|"]
    for r in rows:
        options = (", ".join(f"{k}={v}" for k, v in r["options"].items())
                   or ("(default)" if r["contender"] == "default" else r["contender"]))
        lines.append(f"| {options} | {1e3 * r['step_s']:,.1f} ({1e3 * r['min_s']:,.1f}) | "
                     f"{r['ratio']:.2f}x | {'same' if r['same_bits'] else 'DIFFERENT'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--preset", default="small")
    p.add_argument("--repeats", type=int, default=6, help="interleaved steps timed (default 6)")
    p.add_argument("--option", action="append", default=[], metavar="K=V[,K2=V2]",
                   help="compiler options of one contender (repeatable)")
    p.add_argument("--matmul-form", action="store_true",
                   help="also time every weight gradient in sites.matmul's form (other bits)")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this new file")
    args = p.parse_args(argv)
    if args.repeats < 1 or not (args.option or args.matmul_form):
        p.error("give --matmul-form or at least one --option, and --repeats of at least 1.")
    if args.out is not None and args.out.exists():
        p.error(f"--out {args.out} already exists; remove it or give a new file name.")
    try:
        contenders = {text: parse_options(text) for text in args.option}
    except ValueError as e:
        p.error(f"{e}.")
    from sdcstudy.core.errors import UserError, first_line

    try:
        rows = compare(args.preset, contenders, args.repeats, args.matmul_form)
    except UserError as e:  # e.g. an unknown --preset
        print(f"compiler_options: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # XLA rejects an unknown option with INVALID_ARGUMENT
        if "No such compile option" not in str(e):
            raise
        print(f"compiler_options: error: {first_line(e)}.", file=sys.stderr)
        return 2
    from sdcstudy.bench.study import emit

    emit(table(rows, args.preset, args.repeats), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
