"""Run folders as pandas objects, for notebooks, reports and scripts. Imports no JAX.

    run = sdcstudy.load_run("runs/demo-20261122-210000/lockstep")
    run.mismatch.groupby("site")["mismatches"].sum()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import runfolder as RF
from .config import UserError

ABFT_COLUMNS = ("step", "microstep", "layer", "matmul", "direction", "tp_rank", "residual",
                "threshold", "flagged")
_TABLES = {"mismatch": (RF.MISMATCH, RF.MISMATCH_COLUMNS), "faults": (RF.FAULTS, RF.FAULT_COLUMNS),
           "abft": (RF.ABFT, ABFT_COLUMNS)}


@dataclass
class Run:
    """One run folder: `config` and `summary` as dicts, tables as DataFrames (empty if absent).

    `metrics` has one row per optimizer step; the non-finite values a run wrote as the strings
    "nan" / "inf" are floats again."""

    path: Path
    config: dict
    summary: dict
    metrics: object
    mismatch: object
    faults: object
    abft: object
    env: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name


def _metrics_frame(path: Path):
    import pandas as pd

    if not path.exists():
        return pd.DataFrame(columns=["step"])
    frame = pd.DataFrame(RF.read_jsonl(path))
    nonfinite = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
    return frame.replace(nonfinite).infer_objects()


def load_run(run_dir) -> Run:
    """The run folder `run_dir` (CONTRACT.md) as a `Run`."""
    import pandas as pd

    path = Path(run_dir)
    if not (path / RF.CONFIG).is_file():
        raise UserError(f"{str(path)!r} is not a run folder (it has no {RF.CONFIG}).")
    tables = {}
    for attr, (name, columns) in _TABLES.items():
        file = path / name
        tables[attr] = RF.read_parquet(file) if file.exists() else pd.DataFrame(
            columns=list(columns))
    summary = RF.json_load(path / RF.SUMMARY) if (path / RF.SUMMARY).exists() else {}
    env = RF.json_load(path / RF.ENV) if (path / RF.ENV).exists() else {}
    return Run(path=path, config=yaml.safe_load((path / RF.CONFIG).read_text()) or {},
               summary=summary, metrics=_metrics_frame(path / RF.METRICS), env=env, **tables)
