"""`experiment.mode: finetune` (RQ3, Ma et al. section 6.1 experiment II): a pretrained model
fine-tuned on a multiple-choice QA task on a healthy and a suspect node, free-running, then
evaluated on the test questions."""

from __future__ import annotations

from sdcstudy.finetune.trainer import FinetuneTrainer
from sdcstudy.modes.paired import FREE_SUMMARY, PairedMode


class FinetuneMode(PairedMode):
    name = "finetune"
    description = "RQ3: fine-tune a pretrained model on QA on both nodes, then test them"
    reads = ("suspect", "abft", "finetune")
    summary = {**FREE_SUMMARY,  # free-running: its wcnts is not eq. (5) either
               "qa/ta/<node>": "TA, per cent of test questions answered right: `initial` (the "
                               "model before fine-tuning), `healthy`, `suspect`",
               "qa/dp/<node>": "DP, per cent of test questions answered otherwise than the "
                               "healthy node after fine-tuning: `initial`, `suspect`",
               "qa/chance": "per cent right by guessing (the mean of 1 / choices)",
               "qa/task": "finetune.task",
               "qa/predict": "finetune.predict",
               "qa/shuffle_seed": "the seed of the training questions' order",
               "qa/train_questions": "training questions",
               "qa/test_questions": "test questions",
               "qa/truncated_<split>": "questions of `train` or `test` cut to data.seq_len"}

    def build(self):
        return FinetuneTrainer.from_config(self.cfg)

    def batches(self):
        return self.trainer.data_batches()

    def evaluate(self, state, run_dir) -> dict:
        return self.trainer.evaluate(state, run_dir)
