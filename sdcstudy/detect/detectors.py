"""The SDC detectors of `experiment.mode: detect`, one small class each, and their registry.

A detector has a device half, `device(ex) -> {entry: array}`, which computes its part of the
step's comparisons from the executions (`Executions`: every execution's gradient bits, the
plan's roles, the ground truth and the features' records), and a host half,
`judge(out, trainer) -> {verdict entry: value}`, which turns the fetched comparisons into its
flag (0/1) for the step. Adding a detector is one class here and one line in `DETECTORS`
(and its name and executions in `detect/plan.py`, which the config validates against).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# --- the bitwise comparisons ------------------------------------------------------------------


def flat_bits(grads_E) -> jax.Array:
    """(E, N) uint32: every execution's gradient leaves as one row of bit patterns."""
    return jnp.concatenate([lax.bitcast_convert_type(g.astype(jnp.float32), jnp.uint32)
                            .reshape(g.shape[0], -1) for g in jax.tree.leaves(grads_E)], axis=1)


def mismatch_matrix(bits_RN) -> jax.Array:
    """(R, R) bool: do replicas i and j differ in any bit?"""
    return jnp.any(bits_RN[:, None, :] != bits_RN[None, :, :], axis=-1)


def odd_one_out(matrix: np.ndarray) -> int:
    """The replica that differs from every other while the others all agree; -1 when all
    agree, -2 when there is a mismatch but no single culprit (a pair, or two faulty)."""
    matrix = np.asarray(matrix, bool)
    if not matrix.any():
        return -1
    n = len(matrix)
    if n < 3:  # two disagreeing replicas: either could be the faulty one
        return -2
    for i in range(n):
        others = [j for j in range(n) if j != i]
        if matrix[i, others].all() and not matrix[np.ix_(others, others)].any():
            return i
    return -2


# --- the loss / gradient-norm monitor (host side) ---------------------------------------------


@dataclass
class Monitor:
    """Flags a non-finite loss or gradient norm, a loss more than `loss_margin` nats above the
    median of the last `window` accepted steps, or a gradient norm more than `grad_factor`
    times theirs. Only accepted (verified) steps enter the history."""

    window: int = 8
    loss_margin: float = 0.5
    grad_factor: float = 4.0
    losses: deque = field(default_factory=deque)
    norms: deque = field(default_factory=deque)

    def flags(self, loss: float, grad_norm: float) -> bool:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return True
        if not self.losses:
            return False
        return (loss > statistics.median(self.losses) + self.loss_margin
                or grad_norm > self.grad_factor * statistics.median(self.norms))

    def accept(self, loss: float, grad_norm: float) -> None:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.losses.append(loss)
            self.norms.append(grad_norm)
            while len(self.losses) > self.window:
                self.losses.popleft()
                self.norms.popleft()


# --- what a detector reads on the device --------------------------------------------------------


@dataclass
class Executions:
    """One step's executions, on the device: `bits_E` (E, N) gradient bits, `records_E` each
    feature's records by name (leading axis E), `roles(role, replica)` the plan's indices of a
    role, `truth_D` whether each rank's gradient differs from its healthy mirror's (None
    without a mirror), the step's shadow rank, the step features by name, and `copies`: the
    rank-indexed executions of the primary and of each replica."""

    bits_E: jax.Array
    records_E: dict
    roles: Callable[..., list[int]]
    truth_D: Any
    shadow_rank: Any
    features: dict
    copies: list

    @property
    def primary(self) -> list[int]:
        return self.roles("primary")

    def differ(self, i: int, j: int):
        return jnp.any(self.bits_E[i] != self.bits_E[j])


class Detector:
    """A detector that flags the step when its device entry under its `name` is true."""

    name: ClassVar[str]
    consumes: ClassVar[str | None] = None  # a step feature whose records only it reads

    def device(self, ex: Executions) -> dict:
        del ex
        return {}

    def judge(self, out: dict, trainer) -> dict:
        del trainer
        return {self.name: int(bool(out[self.name]))}


class MonitorDetector(Detector):
    """Loss and gradient-norm spikes (`Monitor`): host work only."""

    name = "monitor"

    def judge(self, out: dict, trainer) -> dict:
        return {self.name: int(trainer.monitor.flags(float(out["loss"]),
                                                     float(out["grad_norm"])))}


class AbftDetector(Detector):
    """Any ABFT check flagged on a primary execution (its records leave no table)."""

    name = "abft"
    consumes = "abft"

    def device(self, ex: Executions) -> dict:
        primary = jnp.asarray(ex.primary)
        records = jax.tree.map(lambda r: r[primary], ex.records_E[self.consumes])
        return {self.name: ex.features[self.consumes].flagged(records)}


class ShadowDetector(Detector):
    """One rank's microbatch again on a spare healthy device (Ma et al. section 7.2)."""

    name = "shadow"

    def device(self, ex: Executions) -> dict:
        (s,) = ex.roles("shadow")
        return {self.name: jnp.any(ex.bits_E[jnp.asarray(ex.primary)][ex.shadow_rank]
                                   != ex.bits_E[s]),
                "shadow_rank": ex.shadow_rank}

    def judge(self, out: dict, trainer) -> dict:
        return {**super().judge(out, trainer), "shadow_rank": int(out["shadow_rank"])}


class ReexecDetector(Detector):
    """Every rank's microbatch again on its own device, the next attempt."""

    name = "reexec"

    def device(self, ex: Executions) -> dict:
        return {self.name: jnp.stack([ex.differ(i, j) for i, j in
                                      zip(ex.primary, ex.roles("reexec"))]).any()}


class LockstepDetector(Detector):
    """Every rank against its healthy mirror (the ground truth): detects, cannot localize."""

    name = "lockstep"

    def device(self, ex: Executions) -> dict:
        return {self.name: ex.truth_D.any()}


class LocalizeDetector(Detector):
    """`detect.replicas` copies of every rank: the one that disagrees with all the others."""

    name = "localize"

    def device(self, ex: Executions) -> dict:
        return {self.name: jnp.stack([mismatch_matrix(ex.bits_E[jnp.asarray(
            [c[d] for c in ex.copies])]) for d in range(len(ex.primary))])}

    def judge(self, out: dict, trainer) -> dict:
        named = [odd_one_out(m) for m in out[self.name]]
        flag = int(any(k != -1 for k in named))
        located = [trainer.replica_device(d, k) for d, k in enumerate(named) if k >= 0]
        return {self.name: flag,
                "localized": located[0] if len(located) == 1 else (-2 if flag else -1)}


# detect.detectors name -> its class, in `detect/plan.py`'s DETECTORS order.
DETECTORS = {
    "monitor": MonitorDetector,
    "abft": AbftDetector,
    "shadow": ShadowDetector,
    "reexec": ReexecDetector,
    "lockstep": LockstepDetector,
    "localize": LocalizeDetector,
}


def build(names) -> list[Detector]:
    """The detectors named, in the order given."""
    return [DETECTORS[name]() for name in names]


__all__ = ["DETECTORS", "Detector", "Executions", "Monitor", "build", "flat_bits",
           "mismatch_matrix", "odd_one_out"]
