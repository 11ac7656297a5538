"""`experiment.mode: abft`: the single-node trainer with checksummed matmuls on every linear
layer (whatever `abft.enabled` says), scored against the injector's ground truth."""

from __future__ import annotations

from sdcstudy.abft import checker as A
from sdcstudy.core import runfolder as RF
from sdcstudy.modes.train import TrainMode

COUNTERS = {
    "abft/checks": "checks made (one per checked product and direction)",
    "abft/flags": "checks whose residual exceeded the threshold",
    "abft/flags/<matmul>": "flags per projection (q, k, v, o, gate, up, down, head)",
    "abft/flags/<direction>": "flags per direction (fwd, bwd_input, bwd_weight)",
}


class AbftMode(TrainMode):
    name = "abft"
    description = "one node with ABFT checksums on every matmul, scored against the faults"
    metrics = {**TrainMode.metrics, **COUNTERS}
    summary = {**TrainMode.summary, **COUNTERS,
               "abft/detection": "ABFT's flags against the injected faults: corrupted and "
                                 "detected products, faults outside the matmuls, flags, "
                                 "recall and precision"}

    def summarize(self, rows, tables, histograms) -> dict:
        return {"abft/detection": A.detection_summary(
            tables[RF.ABFT].frame().to_dict("records"),
            tables[RF.FAULTS].frame().to_dict("records"))}
