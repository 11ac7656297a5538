"""`experiment.mode: train`: one node trains alone (data-parallel over `mesh.dp`), with the
faults of `suspect.profile` and ABFT when `abft.enabled`."""

from __future__ import annotations

from sdcstudy.faults.trainer import NodeTrainer
from sdcstudy.modes.base import Mode


class TrainMode(Mode):
    name = "train"
    description = "one node trains alone, with its fault profile"
    reads = ("suspect", "abft")
    metrics = {
        "loss/healthy": "mean next-token loss of the step",
        "grad/norm": "global L2 norm of the gradient, before clipping",
        "lr": "learning rate of the step",
        "faults/landed": "corruptions the injector made this step (logged and unlogged)",
        "faults/unlogged": "corruptions beyond suspect.log_limit, counted but not logged",
    }
    summary = {
        "faults/landed": "corruptions made over the run",
        "faults/unlogged": "corruptions made but not logged",
    }

    def build(self):
        return NodeTrainer.from_config(self.cfg)
