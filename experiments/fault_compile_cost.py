"""python experiments/fault_compile_cost.py [--mode paramsync] [--layers 1] [--tp 2]

What fault sites cost XLA to compile: one paired step, with no faults and with more and more
of them.

`fault_draw_cost.py` times a firing site's draws at run time; this times the compile of the
whole step that carries them (`jit(train_step)`, as `sdcstudy run` compiles it), read from
JAX's own compile-time events, with the persistent compilation cache off. Every fault site
adds its draws, its fallback for a tensor with more hits than the sparse draw lists, and its
record to the program; a `grad` spec adds them once per group of same-shape parameter leaves
(once per leaf, the second column, before leaves were corrupted as stacks).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from jax import monitoring  # noqa: E402

from sdcstudy import modes, runner  # noqa: E402
from sdcstudy.core import config as C  # noqa: E402
from sdcstudy.core.errors import ArgumentParser, UserError  # noqa: E402
from sdcstudy.core import yamlsafe  # noqa: E402
from sdcstudy.faults import inject  # noqa: E402

ADDITIVE = {"kind": "additive", "scale": [2.0 ** -8, 1.0]}
MODEL_SITES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")
# name -> a fault profile: None (no injector), a zoo name, or the specs of a YAML profile.
PROFILES = {
    "no faults": None,
    "one model site (fwd/attn)": [{"site": "fwd/attn", "rate": 1e-5, **ADDITIVE}],
    "four model sites": [{"site": s, "rate": 1e-5, **ADDITIVE} for s in MODEL_SITES],
    "grad, every leaf": [{"site": "grad", "rate": 1e-2, **ADDITIVE}],
    "paper-node-1 (four sites and grad)": "paper-node-1",
}
# The profiles with a `grad` spec are compiled twice: same-shape leaves as one stack (what runs)
# and one leaf at a time (`inject.STACK_LEAVES = False`, as before stacks).
TREE_PROFILES = ("grad, every leaf", "paper-node-1 (four sites and grad)")


class StepCompiles:
    """Seconds XLA spent compiling `jit(train_step)`, summed, while listening."""

    def __init__(self):
        self.seconds = 0.0
        monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration: float, **kwargs) -> None:
        if event.endswith("backend_compile_duration") and \
                kwargs.get("fun_name") == "jit(train_step)":
            self.seconds += duration


def profile_arg(profile, folder: Path) -> dict:
    if profile is None:
        return {}
    if isinstance(profile, str):
        return {"suspect": {"profile": profile}}
    path = folder / f"profile-{len(list(folder.glob('profile-*')))}.yaml"
    path.write_text(yamlsafe.dump({"name": path.stem, "specs": profile}))
    return {"suspect": {"profile": str(path)}}


def step_config(args, profile: dict) -> C.Config:
    """The one-step config whose `jit(train_step)` is timed, with `profile_arg`'s suspect."""
    return C.from_dict({
        "experiment": {"mode": args.mode, "steps": 1, "batch_size": 8, "checkpoint_every": 0},
        "model": {"preset": "tiny", "n_layers": args.layers}, "mesh": {"tp": args.tp},
        "data": {"seq_len": 64}, **profile})


def step_compile_seconds(args, profile, folder: Path, listener: StepCompiles) -> float:
    cfg = step_config(args, profile_arg(profile, folder))
    before = listener.seconds
    out = folder / f"run-{len(list(folder.glob('run-*')))}"
    runner.run(cfg, out, progress=False, echo=lambda *a: None)
    return listener.seconds - before


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--mode", default="paramsync", help="paired mode (default paramsync)")
    p.add_argument("--layers", type=int, default=1, help="model.n_layers (default 1)")
    p.add_argument("--tp", type=int, default=2, help="mesh.tp (default 2)")
    args = p.parse_args(argv)
    try:  # --mode, --layers, --tp as the config checks them, before anything compiles
        modes.check(step_config(args, {}))
    except UserError as e:
        p.error(f"--mode {args.mode} --layers {args.layers} --tp {args.tp}: {e}")
    try:
        table(args)
    except UserError as e:  # e.g. a --tp the model's heads cannot be split over
        print(f"fault_compile_cost: error: {e}", file=sys.stderr)
        return 2
    return 0


def table(args) -> None:
    """Prints the table: each profile's step compile seconds (and one leaf at a time)."""
    jax.config.update("jax_enable_compilation_cache", False)
    listener = StepCompiles()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        step_compile_seconds(args, None, folder, listener)  # warm-up: the process's first compile
        print(f"| tiny, {args.layers} layer(s), tp {args.tp}, {args.mode} | step compile, s "
              f"| leaves one at a time, s |")
        print("|---|---:|---:|")
        for name, profile in PROFILES.items():
            stacked = step_compile_seconds(args, profile, folder, listener)
            alone = ""
            if name in TREE_PROFILES:
                inject.STACK_LEAVES = False
                alone = f"{step_compile_seconds(args, profile, folder, listener):.2f}"
                inject.STACK_LEAVES = True
            print(f"| {name} | {stacked:.2f} | {alone} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
