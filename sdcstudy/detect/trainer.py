"""SDC detectors side by side on the same faults: `experiment.mode: detect`.

One jitted step runs every execution that the chosen detectors need (`detect/plan.py`): the
data-parallel ranks' microbatches, and again on spare devices (shadow replica, lock-step
mirror, localization replicas) or on the same device (re-execution). Executions are batched
with `vmap`; each carries the node index of its device (1 on the faulty rank's device, 0
elsewhere), its device number (folded into the fault key) and its attempt number (folded in
by transient faults), so a spare device never draws a fault, a re-execution of a repeatable
fault reproduces it, and one of a transient fault draws afresh.

The comparisons are bitwise, on the accumulated weight gradients. Host side, per step, a
`Verdict` holds each detector's flag, the localized device and the ground truth: the step's
result changed when a rank's gradient differs from its healthy mirror's. With
`detect.advance: reference` the state advances on the mirror's (clean) gradient, so every
step's faults are independent events, as in lock-step; with `primary` it advances on what the
ranks computed, and `detect.rollback` (rollback.py) re-runs flagged steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdcstudy import features as FT
from sdcstudy.core.compose import apply_update, feature_grads
from sdcstudy.core.config import Config
from sdcstudy.core.errors import ConfigError
from sdcstudy.core.step import Place, Records, StepOut, Where
from sdcstudy.detect import detectors as DD
from sdcstudy.detect import tables as DT
from sdcstudy.detect.detectors import Monitor, mismatch_matrix, odd_one_out  # noqa: F401
from sdcstudy.detect.plan import (DETECTORS, executions, needs_reference, parse_detectors,
                                  validate)
from sdcstudy.detect.rollback import DetectionError, VerifiedRollback
from sdcstudy.faults.trainer import REPORTED, NodeTrainer

# --- the trainer ------------------------------------------------------------------------------

# Fault sites a detect step never applies: the ranks' gradients are averaged exactly (there is
# no all-reduce to corrupt) and the update comes after every comparison. A profile's spec at
# one of them would inject nothing, and the run would read as if the detectors had no work.
UNAPPLIED_SITES = ("update", "collective/grad_allreduce")


def _check_sites(faults) -> None:
    profile = None if faults is None else faults.profile
    unapplied = [] if profile is None else [s.site for s in profile.specs
                                            if s.base_rate > 0 and s.site in UNAPPLIED_SITES]
    if unapplied:
        raise ConfigError(f"experiment.mode detect injects faults only while the ranks compute "
                          f"their gradients (the model's sites and grad), so profile "
                          f"{profile.name!r} may not use the site {unapplied[0]!r}, which it "
                          f"would never apply.")


def _abft_checker(cfg: Config, n_layers: int, detectors):
    """The ABFT detector's checker (the registry's "abft" feature), as `abft.*` configures
    it (docs/config.md); None without the detector, whatever `abft.enabled` says."""
    if "abft" not in detectors:
        return None
    a = cfg.abft
    return FT.FEATURES["abft"](n_layers, a.threshold, a.recompute,
                               operand_rounding=a.operand_rounding,
                               output_partials=a.output_partials)


@dataclass
class DetectTrainer(NodeTrainer):
    """`NodeTrainer` whose step runs the detectors' executions and returns their comparisons."""

    detectors: tuple[str, ...] = DETECTORS
    plan: tuple = ()
    execution: tuple | None = None  # (node, device, attempt) while one execution is traced
    monitor: Monitor | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> "DetectTrainer":
        validate(cfg)
        trainer = super().from_config(cfg)
        _check_sites(trainer.faults)
        d = cfg.detect
        trainer.detectors = parse_detectors(d.detectors)
        trainer.plan = tuple(executions(trainer.detectors, cfg.mesh.dp, d.replicas, d.advance))
        trainer.abft = _abft_checker(cfg, trainer.dims.n_layers, trainer.detectors)
        trainer.monitor = Monitor(d.spike_window, d.spike_loss, d.spike_grad)
        return trainer

    def variant(self, detectors: tuple[str, ...]) -> "DetectTrainer":
        """The same run with other detectors (for overhead measurements)."""
        d = self.cfg.detect
        return dataclasses.replace(
            self, detectors=detectors,
            plan=tuple(executions(detectors, self.cfg.mesh.dp, d.replicas, d.advance)),
            abft=_abft_checker(self.cfg, self.dims.n_layers, detectors),
            monitor=Monitor(d.spike_window, d.spike_loss, d.spike_grad))

    def where(self, step, microstep=-1) -> Where:
        if self.execution is None:
            return super().where(step, microstep)
        node, device, attempt = self.execution  # each device draws its own faults
        return Where(self.base_key, step, microstep, fold=(device,), node=node, attempt=attempt)

    @property
    def dp(self) -> int:
        return self.cfg.mesh.dp

    def roles(self, role: str, replica: int = 0) -> list[int]:
        """Indices of the plan's executions of one role (by rank for replicas)."""
        return [i for i, e in enumerate(self.plan) if e.role == role and e.replica == replica]

    def _execute(self, params, step, tokens_M, node, device, attempt, sinks):
        """One execution: mean loss, gradient (with the features' transforms), records."""
        ex = dataclasses.replace(self, execution=(node, device, attempt))
        loss, grads, features = feature_grads(ex.features, partial(ex.loss, step=step), params,
                                              {"tokens": tokens_M}, sinks,
                                              partial(ex.where, step))
        return loss, grads, features.records()

    def train_step(self, state: dict, batch: dict):
        step = state["step"] + 1
        tokens = batch["tokens"]  # (M, B, L + 1)
        n_micro, batch_size, length = tokens.shape
        shards_D = jnp.moveaxis(tokens.reshape(n_micro, self.dp, batch_size // self.dp, length),
                                1, 0)
        shadow = self.cfg.detect.shadow_rank
        shadow_rank = jnp.int32(shadow) if shadow >= 0 else (step - 1) % self.dp
        rank_E = jnp.asarray([e.rank for e in self.plan], jnp.int32)
        rank_E = jnp.where(rank_E < 0, shadow_rank, rank_E)
        device_E = jnp.asarray([e.device for e in self.plan], jnp.int32)
        node_E = (device_E == batch["suspect"]).astype(jnp.int32)
        attempt_E = batch["attempt"] + jnp.asarray([e.attempt for e in self.plan], jnp.int32)
        n = len(self.plan)
        sinks_E = jax.tree.map(lambda z: jnp.zeros((n, *z.shape), z.dtype), self.init_sinks())
        loss_E, grads_E, records_E = jax.vmap(partial(self._execute, state["params"], step))(
            shards_D[rank_E], node_E, device_E, attempt_E, sinks_E)

        primary = self.roles("primary")
        mean_of = lambda idx: jax.tree.map(  # noqa: E731
            lambda g: jnp.mean(g[jnp.asarray(idx)], axis=0), grads_E)
        grads = mean_of(primary)
        out = {"loss": jnp.mean(loss_E[jnp.asarray(primary)]), "grad_norm": optax.tree.norm(grads)}
        metrics = {"loss/suspect": out["loss"], "grad/norm_suspect": out["grad_norm"]}
        ex = DD.Executions(DD.flat_bits(grads_E), records_E, self.roles, None,
                           shadow_rank, FT.by_name(self.features),
                           [primary] + [self.roles("replica", j)
                                        for j in range(1, self.cfg.detect.replicas)])
        if needs_reference(self.detectors, self.cfg.detect.advance):
            mirror = self.roles("replica", 1)
            ex.truth_D = out["truth_rank"] = jnp.stack([ex.differ(i, j)
                                                        for i, j in zip(primary, mirror)])
            reference = mean_of(mirror)
            ref_norm = optax.tree.norm(reference)
            diff = optax.tree.norm(jax.tree.map(lambda a, b: a - b, grads, reference))
            metrics.update({"loss/healthy": jnp.mean(loss_E[jnp.asarray(mirror)]),
                            "grad/norm": ref_norm, "grad/diff_l2": diff,
                            "grad/nts": diff / ref_norm})
            if self.cfg.detect.advance == "reference":
                grads = reference
        else:
            metrics.update({"loss/healthy": out["loss"], "grad/norm": out["grad_norm"]})
        detectors = DD.build(self.detectors)
        for detector in detectors:
            out.update(detector.device(ex))
        new_state = apply_update(self.tx, state, grads)  # no update faults in this topology
        metrics["lr"] = self.schedule(state["step"])
        consumed = {d.consumes for d in detectors}
        records = Records((name, jax.tree.map(lambda r: r[jnp.asarray(primary)], r_E))
                          for name, r_E in records_E.items() if name not in consumed)
        records["detect"] = out
        return StepOut(new_state, metrics, records)

    def make_batch(self, tokens_MBL1) -> dict:
        # The faulty device is data, so one compiled step serves any choice of it (a device
        # number no execution has, e.g. -1, makes a healthy run).
        return {"tokens": tokens_MBL1, "attempt": jnp.int32(0),
                "suspect": jnp.int32(self.cfg.detect.suspect_rank)}

    def shardings(self, state, batch):
        return None

    # --- host side -----------------------------------------------------------------------

    def replica_device(self, rank: int, replica: int) -> int:
        for e in self.plan:
            if e.role == ("primary" if replica == 0 else "replica") and e.rank == rank \
                    and e.replica == replica:
                return e.device
        raise ValueError(f"no replica {replica} of rank {rank} in the plan.")

    def judge(self, out: dict) -> dict:
        """Host side: each detector's flag for one step (0/1), from the step's comparisons."""
        out = jax.device_get(out)
        verdict = {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"])}
        for detector in DD.build(self.detectors):
            verdict.update(detector.judge(out, self))
        if "truth_rank" in out:
            ranks = np.flatnonzero(out["truth_rank"])
            verdict["truth"] = int(len(ranks) > 0)
            verdict["truth_device"] = int(ranks[0]) if len(ranks) == 1 else \
                (-2 if len(ranks) else -1)
        return verdict

    def flagged(self, verdict: dict) -> bool:
        return any(verdict.get(name) for name in self.detectors)

    def accept(self, verdict: dict) -> None:
        self.monitor.accept(verdict["loss"], verdict["grad_norm"])

    def wrap_step(self, compiled):
        """The host loop's step: judge each step on the host; with `detect.rollback`, re-run
        flagged steps from the last verified state (rollback.py)."""
        if self.cfg.detect.rollback:
            rollback = VerifiedRollback(compiled, self, self.cfg.detect.max_retries)

            def step(state, batch):
                out = rollback(state, batch)
                return out._replace(metrics={**out.metrics, **per_step(out.records["detect"])})

            return step

        def step(state, batch):
            out = compiled(state, batch)
            self.accept(verdict := self.judge(out.records["detect"]))
            return StepOut(out.state, {**out.metrics, **per_step(verdict)},
                           {**out.records, "detect": verdict})

        return step

    @property
    def TABLES(self):
        consumed = {d.consumes for d in DD.build(self.detectors)}
        written = [f for f in self.features if f.name not in consumed]
        return FT.tables(written, REPORTED) + (DT.DETECTIONS,)

    def host_tables(self, step: int, records: dict) -> tuple[dict, dict]:
        """Host side: the primaries' feature rows (only the faulty device's faults land), the
        verdict's detections row, counters."""
        verdict = records["detect"]
        kind = DT.injected_kind(None if self.faults is None else self.faults.profile)
        detection = DT.detection_row(step, verdict, self.detectors, kind)
        primaries = [Place((i,)) for i in range(len(self.roles("primary")))]
        tables, step_counters = FT.host(self.features, step, records, primaries,
                                        self.cfg.experiment.microsteps, REPORTED)
        for key, value in verdict.items():
            if key not in ("loss", "grad_norm") and key not in PER_STEP:
                step_counters[f"detect/{key}"] = value
        return {**tables, DT.DETECTIONS: [detection] * bool(detection)}, step_counters


# Verdict entries that are per-step values, not counts: metrics.jsonl only, not summed.
PER_STEP = ("localized", "truth_device", "shadow_rank")


def per_step(verdict: dict) -> dict:
    return {f"detect/{k}": verdict[k] for k in PER_STEP if k in verdict}


__all__ = ["DetectTrainer", "DetectionError", "Monitor", "mismatch_matrix",
           "odd_one_out"]
