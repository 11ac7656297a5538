"""`experiment.mode: paft`: `mesh.dp` data-parallel workers whose gradient aggregation goes
wrong (noise, packet loss), with PAFT's periodic parameter averaging against it."""

from __future__ import annotations

from sdcstudy.core.errors import UserError
from sdcstudy.modes.base import Mode
from sdcstudy.paft.checks import check_config
from sdcstudy.paft.trainer import PaftTrainer


class PaftMode(Mode):
    name = "paft"
    description = "data-parallel workers under aggregation errors, with PAFT averaging"
    reads = ("suspect", "paft")
    metrics = {
        "loss/mean": "mean loss over the workers",
        "div/mean_sq": "mean squared distance of the workers' parameters to their mean",
        "div/max": "largest such distance",
    }
    summary = {}

    @classmethod
    def check(cls, cfg) -> None:
        check_config(cfg)
        if cfg.abft.enabled:  # the workers' step has no checksummed matmuls: never ignored
            raise UserError("experiment.mode paft does not run ABFT (its workers' step has no "
                            "checksummed matmuls); set abft.enabled false.")

    def build(self):
        return PaftTrainer.from_config(self.cfg)

    def summarize(self, rows, tables, histograms) -> dict:
        return self.trainer.summarize(rows)
