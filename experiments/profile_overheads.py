"""python experiments/profile_overheads.py [--preset tiny] [--matmuls] [--barriers] [--out F]

Where the extra time of each benchmark goal goes: the compiled programs of each goal's two
contenders (at the bench suites' own shapes), side by side.

For each contender: XLA's cost analysis of the compiled step (floating-point operations, bytes
accessed), its temporary memory, and what the optimized HLO holds (fusions, copies and
transposes, conditionals, loops, collectives, and the operations that generate random bits),
with each count's difference to the goal's baseline. The faults row also compiles the idle
engine as it was before its draws moved under a `lax.cond` (`idle-unconditional`), to show
what the conditional removed.

`--matmuls` times each matmul of the plain training step alone at its own shape (what the
train row's peak share can reach); `--barriers` times a lock-step tap on two simulated nodes
with and without matmuls between taps (what the paired row's barriers cost).

The time itself is `sdcstudy bench`'s to measure; this says what the extra time is made of.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from sdcstudy.core.errors import ArgumentParser  # noqa: E402

# Opcodes in the optimized HLO that each stand for a kind of work.
KINDS = {"fusion": ("fusion",), "copy/transpose": ("copy", "transpose"),
         "conditional": ("conditional",), "while": ("while",),
         "collective": ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                        "all-to-all"),
         "custom-call": ("custom-call",)}
# `%name = TYPE opcode(`, TYPE a shape or a tuple of shapes.
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^()]*\)|[^\s(]+)\s+"
                     r"([a-z][a-z0-9\-]*)\(", re.M)

# An instruction's source: a JAX random sampler (the threefry hash and what draws from it).
_RANDOM = re.compile(r'op_name="[^"]*(?:threefry|random_bits|jit\(_(?:uniform|bernoulli|randint|'
                     r'normal|choice|gamma)\))')


def hlo_counts(text: str) -> dict[str, int]:
    """Counts per kind of work in the optimized HLO: the entry computation and the
    computations it calls, without the bodies of fusions (a fusion counts once), except for
    matmuls and random-bit operations, which are counted wherever they are (XLA's CPU backend
    wraps most matmuls in a fusion of their own)."""
    bodies = re.split(r"\n(?=\S)", text)
    ops, everywhere = Counter(), Counter()
    for body in bodies:
        found = _OPCODE.findall(body)
        everywhere.update(found)
        name = body.lstrip().lstrip("%")
        if not name.startswith(("fused_", "wrapped_")):
            ops.update(found)
    out = {kind: sum(ops[o] for o in opcodes) for kind, opcodes in KINDS.items()}
    out["dot"] = everywhere["dot"]
    # Instructions (fused or not) that JAX's random samplers emitted.
    out["random-bit ops"] = len(_RANDOM.findall(text)) + everywhere["rng-bit-generator"]
    return out


def compiled_profile(trainer, tokens) -> dict:
    from sdcstudy.bench.timing import place
    from sdcstudy.core.train import compile_step

    state, batch, shardings = place(trainer, tokens)
    compiled, text, seconds = compile_step(trainer.train_step, state, batch, shardings)
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    return {"flops": float(cost.get("flops", 0.0)),
            "bytes": float(cost.get("bytes accessed", 0.0)),
            "temp_mib": (memory.temp_size_in_bytes / 2**20) if memory else None,
            "compile_s": seconds, **hlo_counts(text)}


@contextlib.contextmanager
def unconditional_draws():
    """The fault engine before its draws moved under a `lax.cond`: every draw at every step."""
    from sdcstudy.faults import inject as F

    original = F.corrupt_and_record
    F.corrupt_and_record = lambda *a, skip_idle=False: original(*a)
    try:
        yield
    finally:
        F.corrupt_and_record = original


def _args(suite: str, preset: str, *extra: str):
    from sdcstudy.bench.study import bench_args

    return bench_args(suite, "--presets", preset, *extra)


def faults_trainers(preset: str) -> tuple[dict, object]:
    """(contenders by name, a config of theirs)."""
    import dataclasses

    from sdcstudy.bench import common as B
    from sdcstudy.bench.faults import fault_profiles
    from sdcstudy.faults.trainer import NodeTrainer

    args = _args("faults", preset)
    folder = Path(tempfile.mkdtemp(prefix="sdcstudy-profile-"))
    profiles = fault_profiles(folder)
    out = {}
    for name, profile in (("plain", "healthy"), ("idle", profiles["idle"])):
        cfg, _ = B.preset_config("faults", preset, args, ["experiment.mode=train",
                                                          f"suspect.profile={profile}"])
        trainer = NodeTrainer.from_config(cfg)
        out[name] = trainer if name == "idle" else dataclasses.replace(trainer, faults=None)

    out["idle-unconditional"] = out["idle"]  # compiled under `unconditional_draws`
    return out, cfg


def paired_trainers(preset: str) -> tuple[dict, object]:
    from sdcstudy.bench.paired import paired_config
    from sdcstudy.paired.trainer import PairedTrainer

    args = _args("paired", preset)
    out = {}
    for mode in ("free", "lockstep"):
        cfg, _ = paired_config(preset, args, mode, 1)
        out[mode] = PairedTrainer.from_config(cfg)
    return out, cfg


def paft_trainers(preset: str) -> tuple[dict, object]:
    from sdcstudy.bench.paft import paft_configs
    from sdcstudy.faults.trainer import NodeTrainer
    from sdcstudy.paft.trainer import PaftTrainer

    configs, _, _ = paft_configs(preset, _args("paft", preset, "--workers", "4"), 4)
    return ({v: (NodeTrainer if v == "dp" else PaftTrainer).from_config(configs[v])
             for v in ("dp", "noised", "dyn-overlap")}, configs["dp"])


ROWS = {"faults.idle_over_plain": (faults_trainers, "plain"),
        "paired.lockstep_over_free": (paired_trainers, "free"),
        "paft.dyn_overlap_over_dp": (paft_trainers, "noised")}
COLUMNS = ("flops", "bytes", "temp_mib", "fusion", "copy/transpose", "conditional", "while",
           "collective", "dot", "random-bit ops")


def _cell(value, base) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.3g}"
        return text if base in (None, 0) or value == base else f"{text} ({value / base:.2f}x)"
    return str(value) if base is None or value == base else f"{value} ({value - base:+d})"


def profile_table(preset: str, rows=tuple(ROWS), echo=print) -> str:
    from sdcstudy.bench.timing import random_tokens

    lines = [f"| goal | contender | {' | '.join(COLUMNS)} |",
             "|---|---|" + "---:|" * len(COLUMNS)]
    for goal in rows:
        build, base = ROWS[goal]
        trainers, cfg = build(preset)
        tokens = random_tokens(cfg)
        profiles = {}
        for name, trainer in trainers.items():
            echo(f"{goal}: compiling {name}", file=sys.stderr)
            with (unconditional_draws() if name.endswith("-unconditional")
                  else contextlib.nullcontext()):
                profiles[name] = compiled_profile(trainer, tokens)
        for name, p in profiles.items():
            cells = [_cell(p[c], None if name == base else profiles[base][c]) for c in COLUMNS]
            lines.append(f"| {goal} | {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


# --- the train row: what the step's own matmul shapes can reach --------------------------------


def _dots(jaxpr, out: Counter) -> Counter:
    """Every dot_general of a jaxpr and the jaxprs inside it: (lhs, rhs, dimension numbers)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            out[(lhs.shape, rhs.shape, str(lhs.dtype), eqn.params["dimension_numbers"])] += 1
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # every branch of a conditional too
                if hasattr(inner, "eqns"):
                    _dots(inner, out)
    return out


def dot_ceiling(preset: str, repeats: int = 3) -> dict:
    """Each matmul of the plain training step (forward and backward) timed alone at its own
    shape: their FLOPs over their summed best times is the rate the step's matmuls reach on
    this machine with nothing else running, against the square-matmul peak the train bench
    measures. A step cannot beat its own matmuls: if they reach less than the peak-share
    goal, so must the step."""
    import math

    import jax
    import numpy as np
    from jax import lax

    from sdcstudy.bench import common as B
    from sdcstudy.bench import roofline
    from sdcstudy.bench.timing import place, random_tokens
    from sdcstudy.core.train import Trainer

    cfg, _ = B.preset_config("train", preset, _args("train", preset), ["experiment.mode=train"])
    trainer = Trainer.from_config(cfg)
    state, batch, _ = place(trainer, random_tokens(cfg))
    dots = _dots(jax.make_jaxpr(trainer.train_step)(state, batch).jaxpr, Counter())
    rng = np.random.default_rng(0)
    total_flops = total_s = 0.0
    rows = []
    for (lhs, rhs, dtype, dims), count in dots.items():
        (contract, _), (batch_dims, _) = dims
        a = jax.device_put(rng.standard_normal(lhs, np.float32).astype(dtype))
        b = jax.device_put(rng.standard_normal(rhs, np.float32).astype(dtype))
        product = jax.jit(lambda u, v, d=dims: lax.dot_general(u, v, d))
        out_shape = product.eval_shape(a, b).shape
        flops = 2.0 * math.prod(out_shape) * math.prod(lhs[i] for i in contract)
        rate = roofline.best_rate(lambda: product(a, b).block_until_ready(), flops, repeats)
        total_flops += count * flops
        total_s += count * flops / rate
        rows.append({"lhs": lhs, "rhs": rhs, "count": count, "gflops": flops / 1e9,
                     "gflop_per_s": rate / 1e9})
    peak = roofline.matmul_peak(repeats, with_torch=False)["jax"]
    return {"preset": preset, "dots": rows, "rate": total_flops / total_s, "peak": peak,
            "share": total_flops / total_s / peak}


def dot_ceiling_table(result: dict) -> str:
    lines = ["| lhs | rhs | per step | GFLOP each | GFLOP/s alone |", "|---|---|---:|---:|---:|"]
    for r in sorted(result["dots"], key=lambda r: -r["gflops"] * r["count"]):
        lines.append(f"| {r['lhs']} | {r['rhs']} | {r['count']} | {r['gflops']:.3f} | "
                     f"{r['gflop_per_s']:.1f} |")
    lines += ["", f"{result['preset']}: the step's matmuls alone reach {result['rate'] / 1e9:.1f} "
              f"GFLOP/s, {result['share']:.0%} of the {result['peak'] / 1e9:.1f} GFLOP/s square "
              f"matmul peak measured beside them."]
    return "\n".join(lines) + "\n"


# --- the paired row: what a lock-step barrier costs ------------------------------------------


def barrier_cost(rows: int = 512, width: int = 512, hidden: int = 1536, segments: int = 16,
                 repeats: int = 15) -> dict:
    """Seconds per lock-step tap on the two simulated nodes, with and without work between.

    Two programs on a (node=2) mesh run `segments` pieces of work (two matmuls, small's FFN
    shape by default, or nothing); one of them ends every piece with what a forward tap does (an
    all-gather over `node`, a bitwise comparison, the healthy copy kept). The difference per
    tap, with and without matmuls between the taps, separates the tap's own work from the cost
    of making the two device threads meet.
    """
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("node",))

    def program(tap: bool, work: bool):
        def local(x, w):
            for _ in range(segments):
                x = jnp.tanh(x @ w) @ w.T * 0.01 if work else x * 1.0001 + 1e-3
                if tap:
                    pair = jax.lax.all_gather(x, "node")
                    x = jnp.where(jnp.any(pair[0] != pair[1]), pair[1], pair[0])
            return x
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("node"), P()),
                                     out_specs=P("node")))

    x = jax.device_put(jnp.ones((2 * rows, width)), NamedSharding(mesh, P("node")))
    w = jax.device_put(jnp.full((width, hidden), 0.01), NamedSharding(mesh, P()))
    out = {}
    for work in (False, True):
        runs = {tap: program(tap, work) for tap in (False, True)}
        for run in runs.values():
            run(x, w).block_until_ready()
        pairs = []  # without and with taps back to back, so drift falls on both alike
        for _ in range(repeats):
            pair = []
            for tap in (False, True):
                start = time.perf_counter()
                runs[tap](x, w).block_until_ready()
                pair.append(time.perf_counter() - start)
            pairs.append(pair)
        plain = float(np.median([p[0] for p in pairs]))
        out["with matmuls" if work else "alone"] = {
            "step_s": plain,
            "per_tap_s": float(np.median([(t - p) / segments for p, t in pairs]))}
    return out


def barrier_table(result: dict) -> str:
    lines = ["| between taps | program without taps, ms | extra per tap, ms |", "|---|---:|---:|"]
    for what, r in result.items():
        lines.append(f"| {what} | {r['step_s'] * 1e3:.1f} | {r['per_tap_s'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rows", default=",".join(ROWS), help="goals to profile (default: all)")
    p.add_argument("--matmuls", action="store_true",
                   help="also time each matmul of the plain step alone (the train row's "
                        "ceiling on the share of the matmul peak)")
    p.add_argument("--barriers", action="store_true",
                   help="also time a lock-step tap on two simulated nodes, with and without "
                        "matmuls between taps (the paired row)")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this new file")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        p.error(f"--rows: {unknown[0]!r} is not one of {', '.join(ROWS)}.")
    if args.out is not None and args.out.exists():
        p.error(f"--out {args.out} already exists; remove it or give a new file name.")
    from sdcstudy.core.errors import UserError

    try:
        table = profile_table(args.preset, rows) if rows else ""
        if args.matmuls:
            table += "\n" + dot_ceiling_table(dot_ceiling(args.preset))
    except UserError as e:  # e.g. an unknown --preset
        print(f"profile_overheads: error: {e}", file=sys.stderr)
        return 2
    if args.barriers:
        table += "\n" + barrier_table(barrier_cost())
    print(table, end="")
    if args.out is not None:
        from sdcstudy.core import runfolder as RF

        RF.atomic_write_text(args.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
