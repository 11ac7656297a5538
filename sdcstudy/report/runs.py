"""Run folders as pandas objects: what `sdcstudy report`, the notebooks and the experiments read.

    run = sdcstudy.load_run("runs/demo-20261122-210000/lockstep")
    run.mismatch.groupby("site")["mismatches"].sum()
    runs = label_runs([load_run(p) for p in expand_run_dirs("runs/sweep")])  # {label: Run}

`load_run` reads one run folder (README.md, "Run folders") into a `Run`: config and summary
as dicts, metrics and the Parquet tables as DataFrames. A missing or damaged file is a
one-sentence UserError, or, with `strict=False`, an empty table and a sentence in
`run.problems`, so that a report can still show what the other files allow. `label_runs`
names runs as the tables and figures show them. Writing the report is `report/writer.py`.
Imports no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sdcstudy.core import runfolder as RF
from sdcstudy.core.config import UserError
from sdcstudy.core.errors import first_line

ABFT_COLUMNS = ("step", "microstep", "layer", "matmul", "direction", "tp_rank", "residual",
                "threshold", "flagged")
_TABLES = {"mismatch": (RF.MISMATCH, RF.MISMATCH_COLUMNS), "faults": (RF.FAULTS, RF.FAULT_COLUMNS),
           "abft": (RF.ABFT, ABFT_COLUMNS)}


@dataclass
class Run:
    """One run folder: `config` and `summary` as dicts, tables as DataFrames (empty if absent).

    `metrics` has one row per optimizer step; the non-finite values a run wrote as the strings
    "nan" / "inf" are floats again. `problems` holds {file name: one sentence} for each file of
    the folder that is missing or could not be read (`load_run(..., strict=False)`); what
    needs that file is empty."""

    path: Path
    config: dict
    summary: dict
    metrics: object
    mismatch: object
    faults: object
    abft: object
    env: dict = field(default_factory=dict)
    problems: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def usable(self) -> bool:
        """Whether anything beyond config.yaml could be read."""
        return bool(len(self.metrics) or len(self.mismatch) or len(self.abft) or self.summary)


class DamagedFile(UserError):
    """A file of a run folder that exists but can not be read."""


def _metrics_frame(path: Path):
    import pandas as pd

    if not path.exists():
        return pd.DataFrame(columns=["step"])
    frame = pd.DataFrame(RF.read_jsonl(path))
    if len(frame) and "step" not in frame:
        raise ValueError("its rows have no 'step'")
    nonfinite = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
    return frame.replace(nonfinite).infer_objects()


def _summary(path: Path) -> dict:
    summary = RF.json_load(path)
    if not isinstance(summary, dict):
        raise ValueError("it is not a JSON object")
    return summary


def _read(path: Path, reader, default):
    """`reader(path)`, `default` when the file is absent; a damaged file is a DamagedFile."""
    if not path.exists():
        return default
    try:
        return reader(path)
    except Exception as e:  # pyarrow, json and yaml each raise their own kinds
        reason = first_line(e)
        if str(path) in reason:  # pyarrow repeats the path: keep what it found wrong
            reason = reason.rsplit(": ", 1)[-1]
        reason = reason.split(". ")[0].rstrip(".")
        raise DamagedFile(f"{str(path)!r} is damaged and can not be read ({reason}).") from None


def expected_files(config: dict) -> tuple[str, ...]:
    """The files every finished run of this configuration writes."""
    mode = str((config.get("experiment") or {}).get("mode", "train"))
    return (RF.METRICS, RF.SUMMARY) + ((RF.MISMATCH,) if mode == "lockstep" else ())


def load_run(run_dir, strict: bool = True) -> Run:
    """The run folder `run_dir` as a `Run`. A damaged file raises a UserError
    naming it; with `strict=False` it is read as absent instead and named in `run.problems`,
    as is a missing file that a finished run of its mode has."""
    import pandas as pd

    path = Path(run_dir)
    if not (path / RF.CONFIG).is_file():
        raise UserError(f"{str(path)!r} is not a run folder (it has no {RF.CONFIG}).")
    config = _read(path / RF.CONFIG, lambda p: yaml.safe_load(p.read_text()), None) or {}
    if not isinstance(config, dict):
        raise DamagedFile(f"{str(path / RF.CONFIG)!r} is damaged: it is not a YAML mapping.")
    problems = {name: f"{str(path / name)!r} is missing." for name in expected_files(config)
                if not (path / name).exists()}

    def read(name, reader, default):
        try:
            return _read(path / name, reader, default)
        except DamagedFile as e:
            if strict:
                raise
            problems[name] = str(e)
            return default

    tables = {attr: read(name, RF.read_table, pd.DataFrame(columns=list(columns)))
              for attr, (name, columns) in _TABLES.items()}
    return Run(path=path, config=config, summary=read(RF.SUMMARY, _summary, {}),
               metrics=read(RF.METRICS, _metrics_frame, _metrics_frame(path / "-")),
               env=read(RF.ENV, RF.json_load, {}), problems=problems, **tables)


def expand_run_dirs(path) -> list[Path]:
    """[path] for a run folder; for a folder of run folders (a sweep, a demo) the run folders
    in it, by name; a folder that is neither stays as given, for load_run to refuse."""
    path = Path(path)
    if (path / RF.CONFIG).is_file() or not path.is_dir():
        return [path]
    children = sorted(p for p in path.iterdir() if (p / RF.CONFIG).is_file())
    return children or [path]


def label_runs(runs: list[Run]) -> dict[str, Run]:
    """{label: run}: "Node N" for Ma et al.'s node profiles, else the profile's name, and the
    folder's name for PAFT runs (they differ in settings, not in nodes); runs that share a
    label get their mode, then their folder, added. Paper nodes come first, by number."""
    from sdcstudy.faults import published as PB
    from sdcstudy.report import tables as T

    def base(run):
        if T.run_mode(run) == "paft":
            return run.name
        profile = T.run_profile(run)
        node = PB.paper_node_number(profile)
        if node is not None:
            return f"Node {node}"
        return Path(profile).stem if profile.endswith((".yaml", ".yml")) else profile

    bases = [base(r) for r in runs]
    labels = list(bases)
    for name in {b for b in bases if bases.count(b) > 1}:
        group = [i for i, b in enumerate(bases) if b == name]
        for extra in (T.run_mode, lambda r: r.name, lambda r: str(r.path)):
            tags = [extra(runs[i]) for i in group]
            if len(set(tags)) == len(tags):
                break
        for i, tag in zip(group, tags):
            labels[i] = f"{name} ({tag})"
    order = sorted(range(len(runs)), key=lambda i: (
        PB.paper_node_number(T.run_profile(runs[i])) or 10**6, i))
    return {labels[i]: runs[i] for i in order}
