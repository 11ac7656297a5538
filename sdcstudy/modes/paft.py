"""`experiment.mode: paft`: `mesh.dp` data-parallel workers whose gradient aggregation goes
wrong (noise, packet loss), with PAFT's periodic parameter averaging against it."""

from __future__ import annotations

from sdcstudy.core.errors import UserError
from sdcstudy.modes.base import Mode, refuse_ignored, refuse_sorted_embedding_grad
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
        super().check(cfg)  # abft, collectives, detect, finetune; suspect.fault_kind
        refuse_sorted_embedding_grad(cfg)
        c, loss = cfg.paft, cfg.paft.loss
        if not c.dynamic:
            refuse_ignored(cfg, ["paft.h_min", "paft.h_max"], "they bound PAFT-Dyn's H and "
                           "paft.dynamic is false", "set paft.dynamic true, or remove it")
        if not (c.sync_every or c.dynamic):
            refuse_ignored(cfg, ["paft.overlap", "paft.sync_opt_state"], "the workers never "
                           "average (paft.sync_every 0, paft.dynamic false)",
                           "set paft.sync_every or paft.dynamic, or remove it")
        if c.noise.large_every == 0:
            refuse_ignored(cfg, ["paft.noise.large_sigma2"], "paft.noise.large_every is 0 "
                           "(never)", "set paft.noise.large_every, or remove it")
        elif c.noise.sigma2 == 0 and c.noise.large_sigma2 == 0:
            refuse_ignored(cfg, ["paft.noise.large_every"], "no aggregation error is drawn "
                           "(paft.noise.sigma2 and large_sigma2 0)",
                           "set paft.noise.sigma2 or large_sigma2, or remove it")
        if loss.p == 0:
            refuse_ignored(cfg, ["paft.loss.burst", "paft.loss.aggregate"], "paft.loss.p is 0 "
                           "(no gradient packet is lost)", "set paft.loss.p, or remove it")
            if loss.param_p is None:
                refuse_ignored(cfg, ["paft.loss.packet_size"], "nothing travels in lossy "
                               "packets (paft.loss.p 0, paft.loss.param_p null)",
                               "set paft.loss.p or paft.loss.param_p, or remove it")

    def build(self):
        return PaftTrainer.from_config(self.cfg)

    def summarize(self, rows, tables, histograms) -> dict:
        return self.trainer.summarize(rows)
