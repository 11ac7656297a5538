"""A mode's training step compiled ahead of time for its mesh, with no parameter allocated.

The mode builds its trainer as `sdcstudy run` does; the state is `jax.eval_shape` of its
`init_state` and the batch a `jax.ShapeDtypeStruct` of the data's shape, both placed with the
trainer's own shardings, so `jit(train_step).lower(...).compile()` sees the run's program
without a byte of it on a device. What a device holds comes from two places:

- parameter and optimizer-state bytes: each leaf's shard shape under its sharding, times its
  itemsize (every device of these meshes holds equal shards);
- arguments, outputs, donated (aliased) and temporary bytes: XLA's `memory_analysis()` of the
  compiled program, for the backend that compiled it (CPU: simulated devices; GPU: the GPU
  compiler). A device needs arguments + outputs - aliased + temporaries + generated code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdcstudy import modes
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.train import compile_step
from sdcstudy.plan.devices import devices_needed

@dataclass
class Shards:
    """One device's share of an abstract tree."""

    elements: int
    bytes: int


def shards(tree) -> Shards:
    """Elements and bytes of one device's shards of `tree` (ShapeDtypeStruct leaves, with or
    without a sharding)."""
    elements = nbytes = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
        n = int(np.prod(shape, dtype=np.int64))
        elements += n
        nbytes += n * jnp.dtype(leaf.dtype).itemsize
    return Shards(elements, nbytes)


@dataclass
class Program:
    """The compiled step and what it was compiled from."""

    trainer: Any
    state: dict  # ShapeDtypeStruct leaves, placed
    batch: dict
    compiled: Any
    compile_s: float

    def memory(self) -> dict[str, int]:
        """Bytes per device from XLA's memory analysis, and what a device needs in all."""
        stats = self.compiled.memory_analysis()
        if stats is None:
            return {}
        out = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in
               ("argument", "output", "alias", "temp", "generated_code")}
        out["total"] = (out["argument"] + out["output"] - out["alias"] + out["temp"]
                        + out["generated_code"])
        return out

    def xla_flops(self) -> float | None:
        """FLOPs per device by XLA's cost analysis, when the backend gives one."""
        try:
            cost = self.compiled.cost_analysis()
        except Exception:  # backends without a cost model raise rather than return None
            return None
        if isinstance(cost, (list, tuple)):
            cost = cost[0] if cost else None
        return float(cost["flops"]) if cost and "flops" in cost else None


def _placed(tree, shardings):
    """`tree`'s ShapeDtypeStructs carrying `shardings` (a matching tree, or None)."""
    if shardings is None:
        return tree
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        tree, shardings)


def check_devices(cfg: Config) -> None:
    """One sentence when the backend has fewer devices than the mesh."""
    need, have = devices_needed(cfg), jax.device_count()
    if have >= need:
        return
    if jax.default_backend() == "cpu":
        raise UserError(f"the mesh needs {need} devices but JAX started with {have} simulated "
                        f"CPU devices; run sdcstudy plan in a fresh process, which starts "
                        f"{need}.")
    raise UserError(f"the mesh needs {need} devices but this machine has {have} "
                    f"{jax.default_backend().upper()}s; plan it on simulated CPU devices with "
                    f"JAX_PLATFORMS=cpu.")


def compile_program(cfg: Config) -> Program:
    """The configured mode's step, lowered and compiled for its mesh from abstract values."""
    check_devices(cfg)
    trainer = modes.build(cfg).trainer
    e = cfg.experiment
    tokens = jax.ShapeDtypeStruct((e.microsteps, e.batch_size, cfg.data.seq_len + 1), jnp.int32)
    state = jax.eval_shape(trainer.init_state)
    batch = jax.eval_shape(trainer.make_batch, tokens)
    shardings = trainer.shardings(state, batch)
    if shardings is not None:
        state, batch = _placed(state, shardings[0]), _placed(batch, shardings[1])
    compiled, _, seconds = compile_step(trainer.train_step, state, batch, shardings)
    return Program(trainer, state, batch, compiled, seconds)
