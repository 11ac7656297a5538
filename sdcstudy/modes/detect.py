"""`experiment.mode: detect`: SDC detectors side by side on the same faults, on `mesh.dp`
data-parallel ranks, judged on the host every step (and rolled back with `detect.rollback`)."""

from __future__ import annotations

from sdcstudy.detect.plan import parse_detectors, validate
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.detect.tables import DETECTION_COLUMNS, DETECTIONS, run_scores
from sdcstudy.detect.trainer import DetectTrainer
from sdcstudy.modes.base import ABFT_SETTINGS, Mode, refuse_ignored
from sdcstudy.paired.summary import paired_summary


class DetectMode(Mode):
    name = "detect"
    description = "SDC detectors side by side on the same faults"
    reads = ("suspect", "abft", "detect")
    metrics = {
        "loss/healthy": "mean loss of the healthy mirror's executions when the run has one "
                        "(lockstep, localize, or detect.advance reference), else loss/suspect",
        "loss/suspect": "mean loss of the primary executions (the ranks, one on the faulty "
                        "device)",
        "grad/norm": "norm of the mirror's mean gradient (else of the primaries')",
        "grad/norm_suspect": "norm of the primaries' mean gradient",
        "grad/diff_l2": "||g' - g||2, primaries' mean gradient against the mirror's (with a "
                        "mirror)",
        "grad/nts": "grad/diff_l2 / grad/norm (with a mirror)",
        "lr": "learning rate of the step",
        "faults/landed": "corruptions the injector made this step on the faulty device",
        "faults/unlogged": "corruptions beyond suspect.log_limit, counted but not logged",
        "detect/<detector>": "1 when the detector flagged the step",
        "detect/truth": "1 when the fault changed a rank's gradient (the lock-step mirror)",
        "detect/truth_device": "the rank whose gradient differed (-1 none, -2 several)",
        "detect/localized": "the device localize named (-1 none, -2 no single one)",
        "detect/shadow_rank": "the rank the shadow replica recomputed this step",
        "detect/rollbacks": "with detect.rollback: re-runs the step took (the other detect "
                            "fields are of its first execution)",
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
                                           "with detect.advance reference or rollback "
                                           "(module doc)",
        "detect/<detector>/latency_steps_max": "most steps from an event to its first flag",
        "faults/landed": "corruptions made over the run",
        "faults/unlogged": "corruptions made but not logged",
        "wcnts": "eq. (5): max over steps of grad/nts (null without a mirror)",
        "param/diff_l2": "null: a detect run has no second node",
        "loss_spikes": "steps the loss-spike criterion flags (loss/suspect over loss/healthy "
                       "by more than 0.5 nats; core/metrics.py); a spike is 2 or more "
                       "consecutive",
    }

    @classmethod
    def check(cls, cfg) -> None:
        validate(cfg)
        super().check(cfg)
        named = parse_detectors(cfg.detect.detectors)
        # Settings of one detector mean nothing where detect.detectors leaves it out.
        for keys, detector in ((ABFT_SETTINGS, "abft"), (["detect.shadow_rank"], "shadow"),
                               (["detect.replicas"], "localize"),
                               (["detect.spike_window", "detect.spike_loss", "detect.spike_grad"],
                                "monitor")):
            if detector not in named:
                refuse_ignored(cfg, keys, f"detect.detectors does not name {detector}",
                               f"add {detector} to detect.detectors, or remove it")
        if not cfg.detect.rollback:
            refuse_ignored(cfg, ["detect.max_retries"], "detect.rollback is false",
                           "set detect.rollback true, or remove it")

    def build(self):
        return DetectTrainer.from_config(self.cfg)

    def step(self, compiled):
        return self.trainer.wrap_step(compiled)

    @property
    def tables(self) -> dict[str, tuple[str, ...]]:
        return {RF.FAULTS: TL.FAULT_COLUMNS, DETECTIONS: DETECTION_COLUMNS}

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
