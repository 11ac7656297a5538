"""The paired modes (Ma et al., section 3.2): a healthy and a suspect node side by side.

- `lockstep` (RQ1): compare and correct the suspect at every site; parameters also synced;
- `paramsync` (RQ2): copy the healthy parameters over after every step;
- `free` (RQ3): no synchronization.
"""

from __future__ import annotations

from sdcstudy.modes.base import (ABFT_SETTINGS, Mode, refuse_ignored,
                                 refuse_sorted_embedding_grad)
from sdcstudy.paired.summary import paired_summary
from sdcstudy.paired.trainer import PairedTrainer

METRICS = {
    "loss/healthy": "mean next-token loss of the healthy node",
    "loss/suspect": "mean next-token loss of the suspect node",
    "grad/norm": "||g||2 of the healthy gradient, after accumulation, before clipping",
    "grad/norm_suspect": "||g'||2 of the suspect gradient, likewise",
    "grad/diff_l2": "||g' - g||2 between the nodes' gradients",
    "grad/nts": "grad/diff_l2 / grad/norm (eq. 5 before its max over steps)",
    "param/diff_l2": "||theta' - theta||2 after the update (before any synchronization)",
    "lr": "learning rate of the step",
    "faults/landed": "corruptions the injector made this step, once per device that holds "
                     "each",
    "faults/unlogged": "corruptions beyond suspect.log_limit, counted but not logged",
}
SUMMARY = {
    "wcnts": "eq. (5): max over steps of grad/nts, steps where it is not finite left out",
    "grad/nonfinite_steps": "steps whose grad/nts is NaN or infinite (a suspect gradient "
                            "holding a NaN or an Inf), which wcnts leaves out",
    "grad/first_nonfinite_step": "the first of those steps (null when none)",
    "param/diff_l2": "the last step's parameter difference",
    "loss_spikes": "steps the loss-spike criterion flags (suspect loss over the healthy one "
                   "by more than 0.5 nats; core/metrics.py); a spike is 2 or more "
                   "consecutive",
    "faults/landed": "corruptions made over the run, once per device that holds each",
    "faults/unlogged": "corruptions made but not logged",
}
# Without synchronization the gradients of the two nodes differ by their drift as well as by
# the step's corruption: the same maximum, but not eq. (5)'s one-step noise (free, finetune).
FREE_SUMMARY = {**SUMMARY, "wcnts": "max over steps of finite grad/nts as in eq. (5), but "
                                    "between nodes whose parameters have drifted apart, so not eq. "
                                    "(5)'s one-step noise (the report's WCNTS table leaves "
                                    "these runs out)"}
LOCKSTEP_SUMMARY = {
    "freq": "per site: mismatch frequency, eqs. (1)-(2), mean over microsteps",
    "max_severity": "per site: mismatch severity, eqs. (3)-(4), max over microsteps",
    "bit_histogram": "per site: mismatching elements per bit position, and differing bits "
                     "summed per field (sign, exponent, mantissa)",
    "mismatches": "per site: mismatching elements over the run",
    "nonfinite": "per site: mismatching elements whose suspect value is NaN or infinite, over "
                 "the run",
}


class PairedMode(Mode):
    reads = ("suspect", "abft", "collectives")
    pairs_processes = True
    metrics = METRICS
    summary = SUMMARY

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        refuse_sorted_embedding_grad(cfg)
        if not cfg.abft.enabled:
            refuse_ignored(cfg, ABFT_SETTINGS, "abft.enabled is false",
                           "set abft.enabled true, or remove it")

    def build(self):
        return PairedTrainer.from_config(self.cfg)

    @property
    def shown(self) -> dict[str, str]:
        """The suspect's loss beside the healthy one: a suspect gone NaN shows as it happens."""
        return {"loss": self.loss_key, "suspect": "loss/suspect"}

    def summarize(self, rows, tables, histograms) -> dict:
        return paired_summary(rows, tables, histograms, self.cfg.model.dtype)


class LockstepMode(PairedMode):
    name = "lockstep"
    description = "RQ1: compare the suspect with the healthy node at every site, then correct it"
    metrics = {**METRICS, "mismatches": "mismatching elements over every site this step",
               "freq/<site>": "mismatch frequency of the site this step, eqs. (1)-(2): "
                              "mismatching elements / elements compared, over microsteps, "
                              "layers and tp ranks"}
    summary = {**SUMMARY, **LOCKSTEP_SUMMARY}


class ParamsyncMode(PairedMode):
    name = "paramsync"
    description = "RQ2: copy the healthy parameters over after every step"


class FreeMode(PairedMode):
    name = "free"
    description = "RQ3: no synchronization; the nodes drift apart"
    summary = FREE_SUMMARY
