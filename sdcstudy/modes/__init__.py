"""Experiment modes as plug-ins: `experiment.mode` -> the class that runs it.

Adding a mode is one new file in this folder, holding a `modes.base.Mode` subclass, and one
line in `REGISTRY` below (docs/architecture.md, "Adding a mode"); a mode with report tables of
its own adds one line to `REPORT_SECTIONS`. Modules load on first use, so `sdcstudy run`
imports only the mode it runs, and `sdcstudy report` no mode at all. This module imports
nothing but core: the report reads it.
"""

from __future__ import annotations

import importlib

from sdcstudy.core.config import Config
from sdcstudy.core.errors import ConfigError, did_you_mean

# experiment.mode -> "module:Class" under sdcstudy.modes.
REGISTRY = {
    "train": "train:TrainMode",
    "lockstep": "paired:LockstepMode",
    "paramsync": "paired:ParamsyncMode",
    "free": "paired:FreeMode",
    "finetune": "finetune:FinetuneMode",
    "abft": "abft:AbftMode",
    "paft": "paft:PaftMode",
    "detect": "detect:DetectMode",
}


# experiment.mode -> "module:attribute" of the `report.sections.Section` its runs add to
# `sdcstudy report`, in the report's order. Only modes whose runs hold more than the report's
# own tables cover (paired, train and ABFT runs) have one. Names, not imports: the report
# loads these without a mode's class, whose trainer imports JAX.
REPORT_SECTIONS = {
    "paft": "sdcstudy.paft.report:SECTION",
    "detect": "sdcstudy.detect.tables:SECTION",
    "finetune": "sdcstudy.finetune.report:SECTION",
}


def get(name: str):
    """The `Mode` class registered as `name`, or a `ConfigError` naming the closest one."""
    if name not in REGISTRY:
        raise ConfigError(f"experiment.mode {name!r} is not one of {', '.join(REGISTRY)}"
                          f"{did_you_mean(name, REGISTRY)}.")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def check_processes(cfg: Config, processes: int) -> None:
    """Refuse a run of several processes in a mode whose nodes are not processes of their own
    (each process trained its own copy and the run failed at its first checkpoint)."""
    if processes > 1 and not get(cfg.experiment.mode).pairs_processes:
        paired = [name for name in REGISTRY if get(name).pairs_processes]
        raise ConfigError(f"experiment.mode {cfg.experiment.mode} runs in one process, not "
                          f"{processes}; only {', '.join(paired)} pair processes "
                          f"(docs/pairing.md).")


def check(cfg: Config) -> None:
    """Every check of `cfg`: its mode exists and accepts the mode's own sections."""
    get(cfg.experiment.mode).check(cfg)


def build(cfg: Config):
    """The mode of `cfg`, checked and with its trainer built."""
    return get(cfg.experiment.mode)(cfg)


def report_sections() -> dict:
    """{experiment.mode: its `report.sections.Section`}, in `REPORT_SECTIONS`'s order."""
    out = {}
    for mode, target in REPORT_SECTIONS.items():
        module, attribute = target.split(":")
        out[mode] = getattr(importlib.import_module(module), attribute)
    return out
