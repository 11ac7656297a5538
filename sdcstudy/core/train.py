"""The training step, the optimizer, and the thin host loop that writes a run folder.

`train_step(state, batch)` is pure and jitted once, ahead of time, with the state donated; it
returns a `core.step.StepOut` (state, metrics, records by feature name). The step itself is
`core.compose`'s (accumulate -> features -> corrupt -> update); `Trainer` is its single-replica
topology, with no features (subclasses add them: `faults.trainer.NodeTrainer`).
Everything random derives from `experiment.seed`; the data position, the learning rate and
any schedule are functions of the step number, so a checkpoint needs only the state.
Steps count from 1 in metrics and files: step k is the k-th optimizer update.
"""

from __future__ import annotations

import time
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdcstudy.core import config as C
from sdcstudy.core import mesh as M, model, runfolder as RF
from sdcstudy.core.checkpoint import Checkpointer
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.sites import Hook, identity_hook
from sdcstudy.core.compose import (  # noqa: F401  (accumulate_gradients, apply_update: here too)
    accumulate_gradients, apply_update, feature_loss, feature_step, init_sinks)
from sdcstudy.core.step import StepOut, Where, stream_key


STEP_ONLY = "step_only"  # a host_tables counter: values of this step, not summed (see there)


class NonFiniteError(RuntimeError):
    """The loss became NaN or Inf."""


# --- optimizer --------------------------------------------------------------------------------


def learning_rate_schedule(o: C.OptimConfig, steps: int) -> optax.Schedule:
    """Linear warm-up then cosine to `min_lr_ratio * lr` (Ma et al., B.3), or constant."""
    if o.schedule == "constant":
        return optax.constant_schedule(o.lr)
    decay = max(o.decay_steps or steps, o.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, decay,
                                              end_value=o.lr * o.min_lr_ratio)


def make_optimizer(o: C.OptimConfig, steps: int, clip: bool = True
                   ) -> optax.GradientTransformation:
    """Clipping, then the optimizer. adam and sgd apply weight decay as L2 on the gradient;
    adamw decouples it (Loshchilov and Hutter). Sharded steps clip themselves (`clip=False`):
    optax's global norm would see only this device's shards."""
    lr = learning_rate_schedule(o, steps)
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm and clip else []
    if o.name == "adamw":
        parts.append(optax.adamw(lr, o.beta1, o.beta2, o.eps, weight_decay=o.weight_decay))
    else:
        if o.weight_decay:
            parts.append(optax.add_decayed_weights(o.weight_decay))
        if o.name == "adam":
            parts.append(optax.adam(lr, o.beta1, o.beta2, o.eps))
        else:
            parts.append(optax.sgd(lr, momentum=o.momentum if o.name == "sgdm" else None))
    return optax.chain(*parts)


# --- the step ---------------------------------------------------------------------------------


@dataclass
class Trainer:
    """Everything static about a single-replica run: model, optimizer, schedule, and the hook
    through which a feature sees the model's sites (the identity by default).

    Features extend it from outside: `faults.trainer.NodeTrainer` composes a node's fault
    injection and ABFT checks into `loss` and `train_step`; the host loop reads the tables and
    counters a step adds through `TABLES` and `host_tables`.
    """

    cfg: Config
    dims: C.ModelDims
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    hook: Hook = identity_hook

    @classmethod
    def from_config(cls, cfg: Config, hook: Hook = identity_hook, **features) -> "Trainer":
        dims = C.model_dims(cfg.model)
        graphdef, _ = model.abstract_init(dims)
        steps = cfg.experiment.steps
        return cls(cfg, dims, graphdef, make_optimizer(cfg.optim, steps),
                   learning_rate_schedule(cfg.optim, steps), hook, **features)

    @property
    def base_key(self):
        return jax.random.key(self.cfg.experiment.seed)

    def init_state(self) -> dict:
        params = model.init_params(self.dims, stream_key(self.base_key, "params"))
        return {"params": params, "opt_state": self.tx.init(params), "step": jnp.int32(0)}

    @property
    def features(self) -> list:
        """The step features of this topology, in install order (none: the plain step)."""
        return []

    def where(self, step, microstep=-1) -> Where:
        """Where a (step, microstep) of this replica runs, as its features see it."""
        return Where(self.base_key, step, microstep)

    def model_loss(self, params, batch, hook):
        return model.token_losses(self.graphdef, params, batch["tokens"], batch.get("mask"),
                                  hook=hook)

    def loss(self, params, sinks, batch, microstep, step=0):
        """One microstep's loss with the features' hooks around `hook` (`core.compose`)."""
        return feature_loss(self.features, self.model_loss, partial(self.where, step),
                            self.hook)(params, sinks, batch, microstep)

    def init_sinks(self) -> dict:
        return init_sinks(self.features)

    def train_step(self, state: dict, batch: dict) -> StepOut:
        step = state["step"] + 1
        loss, grads, new_state, records = feature_step(
            self.features, self.tx, state, partial(self.loss, step=step), batch,
            self.init_sinks(), partial(self.where, step))
        return StepOut(new_state, self.step_metrics(state, loss, grads), records)

    def step_metrics(self, state: dict, loss, grads) -> dict:
        return {"loss/healthy": loss, "grad/norm": optax.tree.norm(grads),
                "lr": self.schedule(state["step"])}

    # --- host-loop interface (shared with paired.PairedTrainer) ---------------------------

    def shardings(self, state, batch):
        """(state, batch) shardings: data parallelism over `dp` devices, or None for one."""
        if self.cfg.mesh.tp > 1:
            raise UserError(f"mesh.tp > 1 needs a paired mode (lockstep, paramsync, free); "
                            f"experiment.mode {self.cfg.experiment.mode!r} runs data-parallel "
                            f"only.")
        if self.cfg.mesh.dp == 1:
            return None
        mesh = M.make_mesh(1, self.cfg.mesh.dp, 1)
        replicated = NamedSharding(mesh, P())
        return (jax.tree.map(lambda _: replicated, state),
                {k: NamedSharding(mesh, P(None, M.DATA)) for k in batch})

    def make_batch(self, tokens_MBL1) -> dict:
        return {"tokens": tokens_MBL1}

    TABLES: ClassVar[tuple[str, ...]] = ()

    def host_tables(self, step: int, records: dict) -> tuple[dict, dict]:
        """Host side, one step: rows for the run folder's tables from the step's records by
        feature name (`StepOut.records`, fetched), and counters (none here). The runner sums
        each counter over the run into summary.json and writes this step's in metrics.jsonl,
        but for `STEP_ONLY`, a dict of values that are this step's only (metrics.jsonl), and
        `bit_histograms`, which it merges."""
        del step, records
        return {}, {}


def compile_step(step_fn, state, batch, shardings=None, compiler_options=None):
    """Lower and compile once, donating the state; returns (compiled, HLO text, seconds).
    `compiler_options`: XLA options for this compile only (`experiments/compiler_options.py`)."""
    start = time.perf_counter()
    jitted = jax.jit(step_fn, donate_argnums=0,
                     **({} if shardings is None else dict(in_shardings=shardings)))
    compiled = jitted.lower(state, batch).compile(compiler_options=compiler_options)
    return compiled, compiled.as_text(), time.perf_counter() - start


# --- the host loop ----------------------------------------------------------------------------


def final_params(run_dir: Path, cfg: Config | None = None):
    """The parameters of a run folder's latest checkpoint, as numpy arrays."""
    run_dir = Path(run_dir)
    cfg = cfg or C.load(run_dir / RF.CONFIG)
    trainer = Trainer.from_config(cfg)
    like = jax.eval_shape(trainer.init_state)
    like = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
    ckpt = Checkpointer(run_dir / RF.CHECKPOINTS, asynchronous=False)
    step = ckpt.latest_step()
    if step is None:
        raise UserError(f"run folder {str(run_dir)!r} has no checkpoint.")
    state, _ = ckpt.restore(step, like)
    ckpt.close()
    return jax.tree.map(np.asarray, state["params"])


__all__ = ["Trainer", "accumulate_gradients", "apply_update", "compile_step",
           "learning_rate_schedule", "make_optimizer", "final_params", "NonFiniteError"]
