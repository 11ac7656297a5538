"""One node's trainer: the single-replica topology with the step features its config turns on
(the node's fault profile, ABFT's checksums on its matmuls; `sdcstudy/features.py`).

`core.train.Trainer` runs `core.compose`'s step over `features`; this subclass carries them
and adds their tables to the run folder. With the `healthy` profile and ABFT off it traces
exactly the plain step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdcstudy import features as FT
from sdcstudy.core import config as C
from sdcstudy.core.config import Config
from sdcstudy.core.sites import Hook, identity_hook
from sdcstudy.core.step import Place
from sdcstudy.core.train import Trainer

# Registered features a node reports on or off: its fault counters are zeros when healthy.
REPORTED = ("faults",)


@dataclass
class NodeTrainer(Trainer):
    """`Trainer` on a node that may be faulty (`suspect.profile`), with ABFT when enabled."""

    faults: Any = None
    abft: Any = None
    more: dict = field(default_factory=dict)  # features registered after these, by name

    @classmethod
    def from_config(cls, cfg: Config, hook: Hook = identity_hook) -> "NodeTrainer":
        built = FT.by_name(FT.from_config(cfg, C.model_dims(cfg.model)))
        return super().from_config(cfg, hook, faults=built.pop("faults", None),
                                   abft=built.pop("abft", None), more=built)

    @property
    def features(self) -> list:
        return FT.active(self)

    # --- host-loop interface ----------------------------------------------------------------

    @property
    def TABLES(self):
        return FT.tables(self.features, REPORTED)

    def host_tables(self, step: int, records: dict) -> tuple[dict, dict]:
        """Host side, one step: each feature's rows and counters from the step's records."""
        return FT.host(self.features, step, records, [Place()], self.cfg.experiment.microsteps,
                       REPORTED)

    def fault_rows(self, faults: dict | None, step: int) -> tuple[list[dict], int]:
        """Host side: ground-truth rows of one step's fault records (and the overflow count)."""
        if self.faults is None:
            return [], 0
        return self.faults.rows(faults, step, [Place()], self.cfg.experiment.microsteps)


__all__ = ["NodeTrainer"]
