"""`experiment.mode: detect`: SDC detectors side by side on the same faults, on `mesh.dp`
data-parallel ranks, judged on the host every step (and rolled back with `detect.rollback`)."""

from __future__ import annotations

from sdcstudy.detect.plan import validate
from sdcstudy.detect.trainer import DetectTrainer
from sdcstudy.modes.base import Mode
from sdcstudy.paired.summary import paired_summary


class DetectMode(Mode):
    name = "detect"
    description = "SDC detectors side by side on the same faults"
    reads = ("suspect", "abft", "detect")
    metrics = {
        "loss/healthy": "mean loss of the primary executions",
        "grad/norm": "norm of the gradient the step trains on",
        "detect/<detector>": "1 when the detector flagged the step",
        "detect/truth": "1 when the fault changed a rank's gradient (the lock-step mirror)",
    }
    summary = {"detect/<detector>": "steps the detector flagged",
               "detect/truth": "steps whose result a fault changed"}

    @classmethod
    def check(cls, cfg) -> None:
        validate(cfg)

    def build(self):
        return DetectTrainer.from_config(self.cfg)

    def step(self, compiled):
        return self.trainer.wrap_step(compiled)

    def summarize(self, rows, tables, histograms) -> dict:
        return paired_summary(rows, tables, histograms, self.cfg.model.dtype)
