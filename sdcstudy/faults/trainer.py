"""One node's trainer: the plain single-replica step with the node's fault profile injected at
the model's sites, into its gradients and updates, and ABFT's checksums on its matmuls.

`core.train.Trainer` knows nothing of faults or checksums; this subclass composes them into
the step as hooks (`sites.compose`) and adds their ground-truth and check tables to the run
folder. With the `healthy` profile and ABFT off it traces exactly the plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax.numpy as jnp

from sdcstudy.abft import checker as A
from sdcstudy.core import config as C
from sdcstudy.core import model, runfolder as RF
from sdcstudy.core.config import Config
from sdcstudy.core.sites import Hook, identity_hook
from sdcstudy.core.step import Place, Records, SiteHooks, StepOut
from sdcstudy.core.train import Trainer, accumulate_gradients, apply_update
from sdcstudy.faults import inject as F
from sdcstudy.faults.feature import Faults, counters


@dataclass
class NodeTrainer(Trainer):
    """`Trainer` on a node that may be faulty (`suspect.profile`), with ABFT when enabled."""

    faults: Faults | None = None
    abft: A.Checker | None = None

    @classmethod
    def from_config(cls, cfg: Config, hook: Hook = identity_hook) -> "NodeTrainer":
        dims = C.model_dims(cfg.model)
        return super().from_config(cfg, hook, faults=Faults.from_config(cfg, dims),
                                   abft=A.Checker.from_config(cfg, dims))

    def fault_context(self, step, microstep, sinks=None) -> F.FaultContext:
        return self.faults.context(self.base_key, step, microstep, sinks)

    def loss(self, params, sinks, batch, microstep, step=0):
        hooks, records = SiteHooks.around(self.hook), {}
        if self.faults is not None:
            ctx = self.fault_context(step, microstep, sinks)
            hooks, records = self.faults.install(hooks, ctx), ctx.records
        if self.abft is not None:  # faults at a matmul's output land before its check
            hooks = self.abft.install(hooks, sinks)
        loss_sum, count = model.token_losses(self.graphdef, params, batch["tokens"],
                                             batch.get("mask"), hook=hooks.full)
        if self.abft is not None:
            records = {**records, **hooks.full.records}
        return loss_sum, (count, records)

    def init_sinks(self) -> dict:
        sinks = {} if self.faults is None else self.faults.init_sinks()
        return sinks if self.abft is None else {**sinks, **self.abft.init_sinks()}

    def train_step(self, state: dict, batch: dict) -> StepOut:
        step = state["step"] + 1
        loss, grads, (fwd_M, bwd_M) = accumulate_gradients(
            partial(self.loss, step=step), state["params"], batch, self.init_sinks())
        if self.abft is not None:
            (fwd_M, abft_fwd), (bwd_M, abft_bwd) = A.split(fwd_M), A.split(bwd_M)
        records = Records()
        transform_updates = lambda u: u  # noqa: E731
        if self.faults is not None:
            ctx = self.fault_context(step, jnp.int32(-1))
            grads = self.faults.transform_grads(grads, ctx)
            transform_updates = self.faults.transform_updates(ctx)
            records[Faults.name] = Faults.records(ctx, fwd_M, bwd_M)
        new_state = apply_update(self.tx, state, grads, transform_updates)
        metrics = self.step_metrics(state, loss, grads)
        if self.abft is not None:
            records[A.Checker.name] = {"fwd": abft_fwd, "bwd": abft_bwd}
        return StepOut(new_state, metrics, records)

    # --- host-loop interface ----------------------------------------------------------------

    @property
    def TABLES(self):
        return (RF.FAULTS,) if self.abft is None else (RF.FAULTS, RF.ABFT)

    def host_tables(self, step: int, records: dict) -> tuple[dict, dict]:
        """Host side, one step: rows for the run folder's tables, and counters."""
        rows, overflow = self.fault_rows(records.get(Faults.name), step)
        tables = {RF.FAULTS: rows}
        step_counters = counters(len(rows), overflow)
        if self.abft is not None:
            rows, abft_counters = self.abft.host(step, records[A.Checker.name], [Place()],
                                                 self.cfg.experiment.microsteps)
            tables.update(rows)
            step_counters.update(abft_counters)
        return tables, step_counters

    def fault_rows(self, faults: dict | None, step: int) -> tuple[list[dict], int]:
        """Host side: ground-truth rows of one step's fault records (and the overflow count)."""
        if self.faults is None:
            return [], 0
        return self.faults.rows(faults, step, [Place()], self.cfg.experiment.microsteps)


__all__ = ["NodeTrainer"]
