"""python experiments/profile_step.py [--preset small] [--steps 3] [--top 15] [--torch] [--out F]

Where the plain training step's time goes, operation by operation.

Runs `Trainer.train_step` at the train bench's shape, times steps untraced (wall time, minor
page faults and system time from `getrusage`), then traces a few with the JAX profiler and
joins each XLA operation's time on the CPU runtime's threads with the optimized HLO: the
matmul FLOPs inside each fusion (so its GFLOP/s), the kind of work it does (matmul, layout
change, reduction, elementwise, gather/scatter) and the JAX operation it came from.

`--torch` also profiles the train bench's transformers + torch step on the same batch
(`torch.profiler`, each operator's own CPU time): its matmuls, layout copies and the rest.

Times are thread time: the runtime spreads an operation over its worker threads, so the
operations' sum is about the wall time times the threads kept busy. Page faults fall inside
whichever operation first touches a fresh page; the untraced counts say how many there are.
"""

from __future__ import annotations

import glob
import math
import os
import re
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from sdcstudy.core.errors import ArgumentParser  # noqa: E402

# `%name = TYPE opcode(rest`, TYPE a shape or a tuple of shapes.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\([^()]*\)|[^\s(]+)\s+"
                          r"([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\((.*)\)\s*->")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
# Opcodes that only hold other operations; the profiler times what they hold.
CONTAINERS = ("while", "conditional", "call")
LAYOUT = ("transpose", "copy")
INDEXING = ("gather", "scatter", "dynamic-slice", "dynamic-update-slice")
PREFIX = re.compile(r"^jit\([^)]*\)/(?:while/body/)?(?:closed_call/)?")


def _dims(shape: str) -> list[int]:
    m = _SHAPE.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def parse_hlo(text: str) -> dict[str, dict]:
    """The computations of an optimized HLO module: for each, its instructions as
    {name: (opcode, shape, rest of line)} and the shapes of its parameters."""
    comps, current = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            name, params = header.groups()
            shapes = {p: s for p, s in re.findall(r"([\w.\-]+): (\w+\[[\d,]*\])", params)}
            current = comps[name] = {"instructions": {}, "shapes": shapes}
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            name, shape, opcode, rest = m.groups()
            current["instructions"][name] = (opcode, shape, rest)
            current["shapes"][name] = shape
    return comps


def _dot_flops(comp: dict, shape: str, rest: str) -> float:
    lhs = re.match(r"\s*%([\w.\-]+)", rest).group(1)
    lhs_dims = _dims(comp["shapes"].get(lhs, ""))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
    k = math.prod(lhs_dims[int(d)] for d in contracting.split(",") if d)
    return 2.0 * math.prod(_dims(shape)) * k


def _called(rest: str) -> list[str]:
    return re.findall(r"calls=%([\w.\-]+)", rest)


def instruction_work(comps: dict, comp: dict, opcode: str, shape: str,
                     rest: str) -> tuple[float, set]:
    """(matmul FLOPs, opcodes) of one instruction and of the computations it calls."""
    flops, opcodes = (_dot_flops(comp, shape, rest) if opcode == "dot" else 0.0), {opcode}
    for inner in _called(rest):
        inner_comp = comps.get(inner, {"instructions": {}})
        for instruction in inner_comp["instructions"].values():
            f, o = instruction_work(comps, inner_comp, *instruction)
            flops, opcodes = flops + f, opcodes | o
    return flops, opcodes


def kind_of(opcodes: set) -> str:
    if "dot" in opcodes or "convolution" in opcodes:
        return "matmul"
    if opcodes & set(INDEXING):
        return "gather/scatter"
    if opcodes & set(LAYOUT):
        return "layout change"
    if opcodes & {"reduce", "reduce-window"}:
        return "reduction"
    if opcodes & {"all-reduce", "all-gather", "reduce-scatter", "collective-permute"}:
        return "collective"
    return "elementwise"


def operations(text: str) -> dict[str, dict]:
    """The operations the CPU runtime runs (the instructions of every computation that is
    not a fusion's body), with their matmul FLOPs, kind, shape and source."""
    comps = parse_hlo(text)
    fused = {c for comp in comps.values()
             for opcode, _, rest in comp["instructions"].values() if opcode == "fusion"
             for c in _called(rest)}
    out = {}
    for cname, comp in comps.items():
        if cname in fused:
            continue
        for name, (opcode, shape, rest) in comp["instructions"].items():
            if opcode in CONTAINERS or opcode in ("parameter", "constant", "tuple",
                                                  "get-tuple-element", "bitcast"):
                continue
            flops, opcodes = instruction_work(comps, comp, opcode, shape, rest)
            source = re.search(r'op_name="([^"]*)"', rest)
            out[name] = {"flops": flops, "kind": kind_of(opcodes), "shape": shape,
                         "source": PREFIX.sub("", source.group(1)) if source else ""}
    return out


def traced_times(run, steps: int) -> dict[str, float]:
    """Thread nanoseconds per step of each event the profiler records while `run(steps)`."""
    import jax

    times = defaultdict(float)
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            run(steps)
        path = sorted(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True))[-1]
        data = jax.profiler.ProfileData.from_file(path)
    for plane in data.planes:
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                for event in line.events:
                    times[event.name] += event.duration_ns / steps
    return dict(times)


def join(ops: dict[str, dict], times: dict[str, float]) -> list[dict]:
    """One row per operation the trace timed, with its thread milliseconds per step."""
    rows = [{"name": name, **ops[name], "ms": ns / 1e6}
            for name, ns in times.items() if name in ops and ns > 0]
    return sorted(rows, key=lambda r: -r["ms"])


def by(rows: list[dict], key: str) -> list[dict]:
    groups = defaultdict(lambda: {"ms": 0.0, "flops": 0.0, "count": 0})
    for r in rows:
        g = groups[r[key]]
        g["ms"] += r["ms"]
        g["flops"] += r["flops"]
        g["count"] += 1
    return sorted(({key: k, **g} for k, g in groups.items()), key=lambda g: -g["ms"])


def profile_step(preset: str, steps: int) -> dict:
    import jax
    import numpy as np

    from sdcstudy.bench import common as B
    from sdcstudy.bench.study import train_config
    from sdcstudy.bench.timing import StepRunner, random_tokens
    from sdcstudy.core.train import Trainer

    cfg = train_config(preset)
    runner = StepRunner(Trainer.from_config(cfg), random_tokens(cfg))

    def run(n):
        runner.run(n)
        jax.block_until_ready(runner.state)

    run(B.WARMUP_STEPS)
    seconds, before = [], resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        start = time.perf_counter()
        run(1)
        seconds.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    rows = join(operations(runner.hlo), traced_times(run, steps))
    return {"preset": preset, "batch": cfg.experiment.batch_size, "seq_len": cfg.data.seq_len,
            "step_s": float(np.median(seconds)),
            "minor_faults": (after.ru_minflt - before.ru_minflt) / steps,
            "system_s": (after.ru_stime - before.ru_stime) / steps, "rows": rows}


# torch operators by kind; the rest is elementwise work, reductions and the optimizer.
TORCH_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")
TORCH_LAYOUT = ("aten::copy_", "aten::contiguous", "aten::clone", "aten::cat")


def profile_torch(preset: str, steps: int) -> dict:
    """The train bench's torch step (sdpa attention) on our initial weights: median wall time
    and each kind's own CPU time per step (matmuls run on torch's threads inside the call)."""
    import jax
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from sdcstudy.bench import common as B
    from sdcstudy.bench import train as BT
    from sdcstudy.bench.study import train_config
    from sdcstudy.bench.timing import random_tokens
    from sdcstudy.core.train import Trainer

    cfg = train_config(preset)
    trainer = Trainer.from_config(cfg)
    params = jax.tree.map(np.asarray, trainer.init_state()["params"])
    runner = BT.torch_runners(cfg, trainer, params, random_tokens(cfg), ("sdpa",))["sdpa"]
    runner.run(B.WARMUP_STEPS)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.run(1)
        seconds.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.run(steps)
    kinds = defaultdict(float)
    for event in prof.key_averages():
        kind = ("matmul" if event.key in TORCH_MATMULS else
                "layout change" if event.key in TORCH_LAYOUT else "other")
        kinds[kind] += event.self_cpu_time_total / 1e3 / steps
    return {"step_s": float(np.median(seconds)), "kinds": dict(kinds)}


def torch_report(result: dict) -> str:
    total = sum(result["kinds"].values())
    lines = [f"torch (sdpa): {result['step_s'] * 1e3:.0f} ms a step (median, unprofiled); "
             f"its operators' own CPU time, {total:.0f} ms a step:", "",
             "| kind | ms / step | share |", "|---|---:|---:|"]
    for kind, ms in sorted(result["kinds"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {ms:.1f} | {ms / total:.1%} |")
    return "\n".join(lines) + "\n"


def _rate(flops: float, ms: float) -> str:
    return f"{flops / ms / 1e6:.1f}" if flops else "-"


def report(result: dict, top: int = 15) -> str:
    rows = result["rows"]
    total = sum(r["ms"] for r in rows)
    flops = sum(r["flops"] for r in rows)
    lines = [f"{result['preset']}, {result['batch']} x {result['seq_len']} tokens: "
             f"{result['step_s'] * 1e3:.0f} ms a step (median, untraced), "
             f"{result['minor_faults']:,.0f} minor page faults and "
             f"{result['system_s'] * 1e3:.0f} ms of system time a step; the operations take "
             f"{total:.0f} thread-ms a step, {flops / 1e9:.2f} GFLOP of it in matmuls.", "",
             "| kind | operations | thread-ms / step | share | GFLOP / step | GFLOP/s per thread |",
             "|---|---:|---:|---:|---:|---:|"]
    for g in by(rows, "kind"):
        lines.append(f"| {g['kind']} | {g['count']} | {g['ms']:.1f} | {g['ms'] / total:.1%} | "
                     f"{g['flops'] / 1e9:.2f} | {_rate(g['flops'], g['ms'])} |")
    lines += ["", "| from (JAX operation) | kind | operations | thread-ms / step | share | "
              "GFLOP/s per thread |", "|---|---|---:|---:|---:|---:|"]
    sources = by([{**r, "source": f"{r['source'] or '?'} | {r['kind']}"} for r in rows],
                 "source")
    for g in sources[:top]:
        lines.append(f"| {g['source']} | {g['count']} | {g['ms']:.1f} | "
                     f"{g['ms'] / total:.1%} | {_rate(g['flops'], g['ms'])} |")
    lines += ["", "| operation | kind | shape | thread-ms / step | GFLOP/s per thread | from |",
              "|---|---|---|---:|---:|---|"]
    for r in rows[:top]:
        lines.append(f"| {r['name']} | {r['kind']} | {r['shape'].split('{')[0]} | "
                     f"{r['ms']:.1f} | {_rate(r['flops'], r['ms'])} | {r['source']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=3, help="timed and traced steps (default 3)")
    p.add_argument("--top", type=int, default=15, help="rows of the detailed tables")
    p.add_argument("--torch", action="store_true",
                   help="also profile the transformers + torch step of `sdcstudy bench train`")
    p.add_argument("--out", type=Path, default=None, help="also write the tables to this new file")
    args = p.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        p.error("--steps and --top must be at least 1.")
    if args.out is not None and args.out.exists():
        p.error(f"--out {args.out} already exists; remove it or give a new file name.")
    from sdcstudy.bench.study import emit
    from sdcstudy.core.errors import UserError

    if args.torch:
        from sdcstudy.bench.train import torch_import_problem

        if torch_import_problem() is not None:
            p.error("--torch needs torch and transformers (pip install torch transformers).")
    try:
        text = report(profile_step(args.preset, args.steps), args.top)
        if args.torch:
            text += "\n" + torch_report(profile_torch(args.preset, args.steps))
    except UserError as e:  # e.g. an unknown --preset
        print(f"profile_step: error: {e}", file=sys.stderr)
        return 2
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
