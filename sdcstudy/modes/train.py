"""`experiment.mode: train`: one node trains alone (data-parallel over `mesh.dp`), with the
faults of `suspect.profile` and ABFT when `abft.enabled`."""

from __future__ import annotations

from sdcstudy.core.errors import ConfigError
from sdcstudy.faults.trainer import NodeTrainer
from sdcstudy.modes.base import ABFT_SETTINGS, Mode, refuse_ignored


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

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if cfg.mesh.tp > 1:  # before anything compiles (core.train.Trainer.shardings says so too)
            raise ConfigError(f"mesh.tp > 1 needs a paired mode (lockstep, paramsync, free); "
                              f"experiment.mode {cls.name!r} runs data-parallel only.")
        if not (cfg.abft.enabled or cls.name == "abft"):
            refuse_ignored(cfg, ABFT_SETTINGS, "abft.enabled is false",
                           "set abft.enabled true, or remove it")

    def build(self):
        return NodeTrainer.from_config(self.cfg)
