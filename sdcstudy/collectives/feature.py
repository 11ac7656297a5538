"""Checksums at the tensor-parallel collectives as a step feature ("collectives"): in a pair
of nodes, a lock-step mismatch attributed to communication or to computation.

Device half (`core.step.DeviceHalf`): `install` adds a `checksum.ChecksumHook` after the
faults and before the lock-step taps, so it sees each collective's input as the suspect
computed it (a fault included) and what it received; its forward records are one uint32
checksum per device, layer, collective and point. No sinks, no context, no transforms.
Host half: `host` turns one step's checksums into collectives.parquet rows and counters
(`verdicts.py`). Forward collectives only: the backward's (the transposes: a reduce-scatter
of the cotangent for each all-gather, and the reverse) are not checked.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from sdcstudy.collectives.checksum import ChecksumHook
from sdcstudy.collectives.verdicts import COLUMNS, TABLE, counters, verdict_rows
from sdcstudy.core import sites as S
from sdcstudy.core.errors import UserError
from sdcstudy.core.step import SiteHooks

# The modes whose step is the pair of nodes (`paired/trainer.py`), which this compares.
PAIRED_MODES = ("lockstep", "paramsync", "free")


class Collectives:
    """The collectives' checksums of one model, as a step feature."""

    name: ClassVar[str] = "collectives"
    tables: ClassVar[tuple[str, ...]] = (TABLE,)
    columns: ClassVar[dict[str, tuple[str, ...]]] = {TABLE: COLUMNS}

    @classmethod
    def from_config(cls, cfg, dims) -> "Collectives | None":
        """The feature when `collectives.enabled` (a paired mode with mesh.tp >= 2, else one
        sentence); None otherwise."""
        del dims
        if not cfg.collectives.enabled:
            return None
        if cfg.experiment.mode not in PAIRED_MODES:
            raise UserError(f"collectives.enabled compares the two nodes of a pair; "
                            f"experiment.mode {cfg.experiment.mode!r} has none: use one of "
                            f"{', '.join(PAIRED_MODES)}, or set collectives.enabled false.")
        if cfg.mesh.tp < 2:
            raise UserError(f"collectives.enabled checks the tensor-parallel collectives, which "
                            f"mesh.tp = {cfg.mesh.tp} does not have; set mesh.tp to 2 or more.")
        return cls()

    # --- device half ----------------------------------------------------------------------

    def init_sinks(self, axes: tuple[str, ...] = ()) -> dict:
        del axes
        return {}

    def context(self, where, sinks):
        del where, sinks
        return None

    def install(self, hooks: SiteHooks, ctx=None, sinks=None) -> tuple[SiteHooks, dict]:
        """The checksums after the faults installed before them, in `fault` too, where a
        lock-step tap (installed after) and a checked matmul look for the value as computed;
        and the forward records they fill while the model is traced."""
        del ctx, sinks
        checksums = ChecksumHook()
        return hooks._replace(full=S.compose(hooks.full, checksums),
                              fault=S.compose(hooks.fault, checksums)), checksums.records

    def transform_grads(self, grads, ctx):
        del ctx
        return grads

    def transform_updates(self, updates, ctx):
        del ctx
        return updates

    def records(self, ctx, fwd_M: dict, bwd_M: dict) -> dict:
        """The checksums, stacked per microstep, under "fwd" (nothing flows backward)."""
        del ctx, bwd_M
        return {"fwd": fwd_M}

    # --- host half ------------------------------------------------------------------------

    def host(self, step: int, records: dict, places, microsteps: int) -> tuple[dict, dict]:
        """collectives.parquet rows of one step's (node, dp, tp, microstep) checksums, and
        the verdicts counted."""
        del places, microsteps  # the arrays' own axes say where each block was computed
        rows = verdict_rows(step, {k: np.asarray(v) for k, v in records["fwd"].items()})
        return {TABLE: rows}, counters(rows)

    @staticmethod
    def idle() -> tuple[dict, dict]:
        """A step of a topology that reports the feature while it is off."""
        return {TABLE: []}, counters([])


__all__ = ["Collectives", "PAIRED_MODES"]
