"""`experiment.mode: detect`: SDC detectors side by side on the same faults, on `mesh.dp`
data-parallel ranks, judged on the host every step (and rolled back with `detect.rollback`)."""

from __future__ import annotations

from sdcstudy.detect.plan import validate
from sdcstudy.core import runfolder as RF
from sdcstudy.detect.tables import DETECTION_COLUMNS, DETECTIONS, run_scores
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
    summary = {
        "detect/<detector>": "steps the detector flagged",
        "detect/truth": "steps whose result a fault changed (events)",
        "detect/<detector>/recall": "events flagged within the latency window, over events "
                                    "(null: no event)",
        "detect/<detector>/precision": "flags within some event's window, over flags "
                                       "(null: no flag)",
        "detect/<detector>/false_alarms": "flags within no event's window",
        "detect/<detector>/latency_steps": "mean steps from an event to its first flag; 0 "
                                           "with detect.advance reference (module doc)",
        "detect/<detector>/latency_steps_max": "most steps from an event to its first flag",
        "wcnts": "eq. (5) over the primary executions' gradients",
        "param/diff_l2": "null: a detect run has no second node",
        "loss_spikes": "steps whose loss exceeds the healthy one by 0.5 nats",
    }

    @classmethod
    def check(cls, cfg) -> None:
        validate(cfg)

    def build(self):
        return DetectTrainer.from_config(self.cfg)

    def step(self, compiled):
        return self.trainer.wrap_step(compiled)

    @property
    def tables(self) -> dict[str, tuple[str, ...]]:
        return {RF.FAULTS: RF.FAULT_COLUMNS, DETECTIONS: DETECTION_COLUMNS}

    def summarize(self, rows, tables, histograms) -> dict:
        return {**paired_summary(rows, tables, histograms, self.cfg.model.dtype),
                **run_scores(rows, self.trainer.detectors, self.cfg.detect.advance)}

    def carry(self) -> dict:
        """The loss monitor's history: a resumed run flags exactly as an unbroken one."""
        m = self.trainer.monitor
        return {"monitor": {"losses": list(m.losses), "norms": list(m.norms)}}

    def resume(self, carried: dict) -> None:
        m = self.trainer.monitor
        saved = carried.get("monitor", {})
        m.losses.extend(saved.get("losses", []))
        m.norms.extend(saved.get("norms", []))
