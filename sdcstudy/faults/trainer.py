"""One node's trainer: the plain single-replica step with the node's fault profile injected at
the model's sites, into its gradients and updates, and ABFT's checksums on its matmuls.

`core.train.Trainer` knows nothing of faults or checksums; this subclass composes them into
the step as hooks (`sites.compose`) and adds their ground-truth and check tables to the run
folder. With the `healthy` profile and ABFT off it traces exactly the plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from sdcstudy.abft import checker as A
from sdcstudy.core import model, runfolder as RF
from sdcstudy.core import config as C
from sdcstudy.core.config import Config
from sdcstudy.core.sites import Hook, compose, identity_hook
from sdcstudy.core.train import Trainer, accumulate_gradients, apply_update
from sdcstudy.faults import inject as F
from sdcstudy.faults import profiles


@dataclass
class NodeTrainer(Trainer):
    """`Trainer` on a node that may be faulty (`suspect.profile`), with ABFT when enabled."""

    injector: F.Injector | None = None
    abft: A.Checker | None = None

    @classmethod
    def from_config(cls, cfg: Config, hook: Hook = identity_hook) -> "NodeTrainer":
        dims = C.model_dims(cfg.model)
        profile = profiles.load_for(cfg)
        injector = None if profile.healthy else F.Injector(
            profile, dims.n_layers, cfg.suspect.log_limit, cfg.suspect.fault_seed)
        return super().from_config(cfg, hook, injector=injector,
                                   abft=A.Checker.from_config(cfg, dims.n_layers))

    def fault_context(self, step, microstep, sinks=None) -> F.FaultContext:
        return F.FaultContext(jax.random.fold_in(self.base_key, 1), step, microstep, sinks)

    def loss(self, params, sinks, batch, microstep, step=0):
        hook = self.hook
        records = {}
        inject = identity_hook
        if self.injector is not None:
            ctx = self.fault_context(step, microstep, sinks)
            inject = self.injector.hook(ctx)
            hook = compose(inject, hook)
            records = ctx.records
        if self.abft is not None:  # faults at a matmul's output land before its check
            hook = self.abft.hook(sinks, full=hook, fault=inject, after=self.hook)
        loss_sum, count = model.token_losses(self.graphdef, params, batch["tokens"],
                                             batch.get("mask"), hook=hook)
        if self.abft is not None:
            records = {**records, **hook.records}
        return loss_sum, (count, records)

    def init_sinks(self) -> dict:
        sinks = {} if self.injector is None else self.injector.init_sinks()
        return sinks if self.abft is None else {**sinks, **self.abft.init_sinks()}

    def train_step(self, state: dict, batch: dict):
        step = state["step"] + 1
        loss, grads, (fwd_M, bwd_M) = accumulate_gradients(
            partial(self.loss, step=step), state["params"], batch, self.init_sinks())
        if self.abft is not None:
            (fwd_M, abft_fwd), (bwd_M, abft_bwd) = A.split(fwd_M), A.split(bwd_M)
        faults = {}
        transform_updates = lambda u: u  # noqa: E731
        if self.injector is not None:
            ctx = self.fault_context(step, jnp.int32(-1))
            grads = self.injector.corrupt_tree(grads, ctx, "grad")
            transform_updates = partial(self.injector.corrupt_tree, ctx=ctx, site="update")
            faults = {"micro": {**fwd_M, **bwd_M}, "step": ctx.records}
        new_state = apply_update(self.tx, state, grads, transform_updates)
        metrics = self.step_metrics(state, loss, grads)
        if self.abft is not None:
            return new_state, metrics, faults, {"fwd": abft_fwd, "bwd": abft_bwd}
        return new_state, metrics, faults

    # --- host-loop interface ----------------------------------------------------------------

    @property
    def TABLES(self):
        return (RF.FAULTS,) if self.abft is None else (RF.FAULTS, RF.ABFT)

    def host_tables(self, step: int, extras) -> tuple[dict, dict]:
        """Host side, one step: rows for the run folder's tables, and counters."""
        faults, *checks = extras
        rows, overflow = self.fault_rows(faults, step)
        tables = {RF.FAULTS: rows}
        counters = {"faults/landed": len(rows) + overflow, "faults/unlogged": overflow}
        if self.abft is not None:
            (checks,) = checks
            tables[RF.ABFT] = [r for m in range(self.cfg.experiment.microsteps)
                               for r in self.abft.rows(
                                   {k: v[m] for k, v in checks["fwd"].items()},
                                   {k: v[m] for k, v in checks["bwd"].items()}, step, m)]
            counters.update(A.counters(tables[RF.ABFT]))
        return tables, counters

    def fault_rows(self, faults: dict, step: int) -> tuple[list[dict], int]:
        """Host side: ground-truth rows of one step's fault records (and the overflow count)."""
        if self.injector is None:
            return [], 0
        rows, overflow = F.record_rows(faults["step"], step, -1, self.injector.profile)
        micro = faults["micro"]
        for m in range(self.cfg.experiment.microsteps):
            r, o = F.record_rows({k: v[m] for k, v in micro.items()}, step, m,
                                 self.injector.profile)
            rows += r
            overflow += o
        return rows, overflow


__all__ = ["NodeTrainer"]
