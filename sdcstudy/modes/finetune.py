"""`experiment.mode: finetune` (RQ3, Ma et al. section 6.1 experiment II): a pretrained model
fine-tuned on a multiple-choice QA task on a healthy and a suspect node, free-running, then
evaluated on the test questions."""

from __future__ import annotations

from sdcstudy.finetune.trainer import FinetuneTrainer
from sdcstudy.modes.paired import PairedMode


class FinetuneMode(PairedMode):
    name = "finetune"
    description = "RQ3: fine-tune a pretrained model on QA on both nodes, then test them"
    reads = ("suspect", "abft", "finetune")
    summary = {**PairedMode.summary,
               "finetune/<node>/accuracy": "test accuracy of each node (and of the model "
                                           "before fine-tuning)",
               "finetune/disagreement": "per cent of test questions the nodes answer "
                                        "differently"}

    def build(self):
        return FinetuneTrainer.from_config(self.cfg)

    def batches(self):
        return self.trainer.data_batches()

    def evaluate(self, state, run_dir) -> dict:
        return self.trainer.evaluate(state, run_dir)
