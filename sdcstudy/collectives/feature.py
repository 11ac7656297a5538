"""Checksums at the tensor-parallel collectives as a step feature ("collectives"): in a pair
of nodes, a lock-step mismatch attributed to communication or to computation.

Device half (`core.step.DeviceHalf`): `install` places the checksums (`checksum.py`) after
the faults and before the lock-step taps, so they see each collective's input as the suspect
computed it (a fault included) and what it received, in the forward and, for the transposed
collectives, in the backward. A forward checksum is two uint32 (`checksum.checksum`) per
device, layer, collective and point; a backward one leaves as the cotangent of its zero sink.
Its context is the topology's tp axis (where an all-gather's input is numbered by rank); no
transforms, the records as they came (`core.step.StepFeature`'s defaults).
Host half: `host` turns one step's checksums into collectives.parquet rows and counters
(`verdicts.py`).
"""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from sdcstudy.collectives import checksum as CS
from sdcstudy.collectives.verdicts import COLUMNS, TABLE, counters, decode, verdict_rows
from sdcstudy.core import mesh as M
from sdcstudy.core import sites as S
from sdcstudy.core.errors import UserError
from sdcstudy.core.step import SiteHooks, StepFeature

# The modes whose step is the pair of nodes (`paired/trainer.py`), which this compares.
PAIRED_MODES = ("lockstep", "paramsync", "free")


class Collectives(StepFeature):
    """The collectives' checksums of a model of `n_layers` blocks, as a step feature."""

    name: ClassVar[str] = "collectives"
    tables: ClassVar[tuple[str, ...]] = (TABLE,)
    columns: ClassVar[dict[str, tuple[str, ...]]] = {TABLE: COLUMNS}

    def __init__(self, n_layers: int):
        self.n_layers = n_layers

    @classmethod
    def from_config(cls, cfg, dims) -> "Collectives | None":
        """The feature when `collectives.enabled` (a paired mode with mesh.tp >= 2, else one
        sentence); None otherwise."""
        if not cfg.collectives.enabled:
            return None
        if cfg.experiment.mode not in PAIRED_MODES:
            raise UserError(f"collectives.enabled compares the two nodes of a pair; "
                            f"experiment.mode {cfg.experiment.mode!r} has none: use one of "
                            f"{', '.join(PAIRED_MODES)} or finetune (whose pair runs free), or "
                            f"set collectives.enabled false.")
        if cfg.mesh.tp < 2:
            raise UserError(f"collectives.enabled checks the tensor-parallel collectives, which "
                            f"mesh.tp = {cfg.mesh.tp} does not have; set mesh.tp to 2 or more.")
        return cls(dims.n_layers)

    # --- device half ----------------------------------------------------------------------

    def init_sinks(self, axes: tuple[str, ...] = ()) -> dict:
        """Zero sinks, one per backward checksum ((A, B) as (hi, lo) halves), varying over
        `axes` (inside shard_map)."""
        return {k: M.vary(jnp.zeros((2, 2), jnp.float32), axes)
                for k in CS.sink_keys(self.n_layers)}

    def context(self, where, sinks=None) -> str | None:
        """The tensor-parallel mesh axis the model's collectives run over."""
        del sinks
        return where.tp_axis

    def install(self, hooks: SiteHooks, ctx=None, sinks=None) -> tuple[SiteHooks, dict]:
        """The checksums around the faults installed before them, in `fault` too, where a
        lock-step tap (installed after) and a checked matmul look for the value as computed;
        the forward records they fill while the model is traced. The backward checksums
        come first in forward order, so that their VJPs run after the faults' (a corrupted
        cotangent is seen as computed) and before a tap's."""
        forward, backward = CS.ForwardChecksums(ctx), CS.BackwardChecksums(sinks, ctx)
        around = lambda hook: S.compose(backward, hook, forward)  # noqa: E731
        return hooks._replace(full=around(hooks.full), fault=around(hooks.fault)), \
            forward.records

    # --- host half ------------------------------------------------------------------------

    def host(self, step: int, records: dict, places, microsteps: int) -> tuple[dict, dict]:
        """collectives.parquet rows of one step's (node, dp, tp, microstep) checksums, and
        the verdicts counted."""
        del places, microsteps  # the arrays' own axes say where each block was computed
        rows = verdict_rows(step, {k: np.asarray(v) for k, v in records["fwd"].items()},
                            {k: decode(v) for k, v in records["bwd"].items()})
        return {TABLE: rows}, counters(rows)

    @staticmethod
    def idle() -> tuple[dict, dict]:
        """A step of a topology that reports the feature while it is off."""
        return {TABLE: []}, counters([])


__all__ = ["Collectives", "PAIRED_MODES"]
