"""`experiment.mode: finetune` (RQ3, Ma et al. section 6.1 experiment II): a pretrained model
fine-tuned on a multiple-choice QA task on a healthy and a suspect node, free-running, then
evaluated on the test questions."""

from __future__ import annotations

import dataclasses
import json

from sdcstudy.core import config as C
from sdcstudy.core.errors import ConfigError
from sdcstudy.finetune.trainer import FinetuneTrainer, init_dims
from sdcstudy.modes.base import changed, refuse_ignored
from sdcstudy.modes.paired import FREE_SUMMARY, PairedMode


class FinetuneMode(PairedMode):
    name = "finetune"
    description = "RQ3: fine-tune a pretrained model on QA on both nodes, then test them"
    reads = ("suspect", "abft", "collectives", "finetune")  # the pair is free mode's
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

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)  # abft; data.text_field
        task = cfg.finetune.task
        if task == "synthetic":
            refuse_ignored(cfg, ["data.source", "data.split", "data.hub_config"],
                           "finetune.task synthetic makes its own questions",
                           "remove it, or name a dataset task in finetune.task")
        else:
            refuse_ignored(cfg, ["finetune.synthetic_train", "finetune.synthetic_test"],
                           f"finetune.task {task} reads its questions from data.source",
                           "remove it, or set finetune.task synthetic")
        # finetune.init gives the model (finetune/trainer.py, initial_model): a model key
        # other than model.dtype is refused where it asks for another model than that.
        given = [(k, v) for k, v, _ in changed(cfg, ["model"]) if k != "model.dtype"]
        theirs = init_dims(cfg) if given else None  # None: the trainer says what init should be
        if theirs is None:
            return
        ours = C.model_dims(cfg.model)
        sizes = [f.name for f in dataclasses.fields(ours)
                 if f.name not in ("dtype", "param_dtype", "attention", "embedding_grad")]
        for key, value in given:
            name = key.split(".")[1]
            differ = [f for f in (sizes if name == "preset" else [name])  # preset: its sizes
                      if getattr(ours, f) != getattr(theirs, f)]
            if differ:
                raise ConfigError(f"{key}: {json.dumps(value)} would be ignored, since "
                                  f"finetune.init {cfg.finetune.init!r} gives the model "
                                  f"({differ[0]} {getattr(theirs, differ[0])!r} there); "
                                  f"remove it.")

    def build(self):
        return FinetuneTrainer.from_config(self.cfg)

    def batches(self):
        return self.trainer.data_batches()

    def evaluate(self, state, run_dir) -> dict:
        return self.trainer.evaluate(state, run_dir)
