"""Run folders as pandas objects: what `sdcstudy report`, the notebooks and the experiments read.

    run = sdcstudy.load_run("runs/demo-20261122-210000/lockstep")
    run.mismatch.groupby("site")["mismatches"].sum()
    runs = label_runs([load_run(p) for p in expand_run_dirs("runs/sweep")])  # {label: Run}

`load_run` reads one run folder (docs/guide.md, "Run folders") into a `Run`: config and summary
as dicts, metrics and the Parquet tables as DataFrames (the tables when first used; the
report reads their rollups, made one part file at a time: `report/rollups.py`). A missing
or damaged file is a one-sentence UserError, or, with `strict=False`, an empty table and a
sentence in `run.problems`, so that a report can still show what the other files allow.
`label_runs` names runs as the tables and figures show them. Writing the report is
`report/writer.py`. Imports no JAX.
"""

from __future__ import annotations

from pathlib import Path

from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.core import yamlsafe
from sdcstudy.core.config import UserError
from sdcstudy.core.errors import first_line
from sdcstudy.report import rollups as R

ABFT_COLUMNS = ("step", "microstep", "layer", "matmul", "direction", "tp_rank", "residual",
                "threshold", "flagged")
_TABLES = {"mismatch": (RF.MISMATCH, TL.MISMATCH_COLUMNS), "faults": (RF.FAULTS, TL.FAULT_COLUMNS),
           "abft": (RF.ABFT, ABFT_COLUMNS)}
# table -> (its rollup, the columns that reads)
_ROLLUPS = {"mismatch": (R.mismatch_rollup, R.MISMATCH_READ),
            "faults": (R.fault_rollup, R.FAULT_READ), "abft": (R.abft_rollup, R.ABFT_READ)}


class _Table:
    """A run table as a DataFrame, read whole when first asked for (`run.mismatch` in a
    notebook); the report reads the table's rollup instead. Setting one, as a Run made in
    memory does, drops the rollup made from the old one."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, run, owner=None):
        if run is None:
            return self
        if run._frames.get(self.name) is None:
            on_disk = run.on_disk.get(self.name)
            run._frames[self.name] = (TL.read_table(on_disk) if on_disk else
                                      _empty_frame(_TABLES[self.name][1]))
        return run._frames[self.name]

    def __set__(self, run, frame):
        run._frames[self.name] = frame
        run._rollups.pop(self.name, None)


class Run:
    """One run folder: `config` and `summary` as dicts, `metrics` and the tables as DataFrames.

    `metrics` has one row per optimizer step; the non-finite values a run wrote as the strings
    "nan" / "inf" are floats again. The tables (`mismatch`, `faults`, `abft`; empty where
    absent) are read whole on first use; the report reads their rollups instead
    (`mismatch_rollup`, `abft_by_step`, `fault_counts`; `report/rollups.py`), which
    `load_run` makes one part file at a time. `problems` holds {file name: one sentence} for
    each file of the folder that is missing or could not be read (`load_run(...,
    strict=False)`); what needs that file is empty."""

    mismatch = _Table()
    faults = _Table()
    abft = _Table()

    def __init__(self, path, config: dict, summary: dict, metrics, mismatch=None, faults=None,
                 abft=None, env: dict | None = None, problems: dict | None = None):
        self.path, self.config, self.summary, self.metrics = Path(path), config, summary, metrics
        self.env = {} if env is None else env
        self.problems = {} if problems is None else problems
        self.on_disk: dict[str, Path] = {}  # table -> its file, read when first asked for
        self._frames: dict = {}
        self._rollups: dict = {}
        self.mismatch, self.faults, self.abft = mismatch, faults, abft

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def usable(self) -> bool:
        """Whether anything beyond config.yaml could be read."""
        return bool(len(self.metrics) or len(self.mismatch_rollup) or len(self.abft_by_step)
                    or self.summary)

    @property
    def mismatch_rollup(self) -> R.MismatchRollup:
        return self.rollup("mismatch")

    @property
    def abft_by_step(self):
        return self.rollup("abft")

    @property
    def fault_counts(self):
        return self.rollup("faults")

    def rollup(self, table: str):
        """The rollup of `table` (`report/rollups.py`): from the DataFrame where it is in
        memory, else from the folder's file one part at a time; made once."""
        if table not in self._rollups:
            roll, columns = _ROLLUPS[table]
            frame = self._frames.get(table)
            parts = ([frame] if frame is not None else TL.table_frames(
                self.on_disk[table], columns) if table in self.on_disk else [])
            self._rollups[table] = roll(parts)
        return self._rollups[table]

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, problems={self.problems!r})"


def _empty_frame(columns):
    import pandas as pd

    return pd.DataFrame(columns=list(columns))


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
    except RF.NotJsonLine as e:  # metrics.jsonl: the line in the file, not in the line
        raise DamagedFile(f"{str(path)!r} is damaged and can not be read (line {e.line} is "
                          f"not JSON: {e.reason}).") from None
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
    path = Path(run_dir)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist; give a run folder (one with "
                        f"{RF.CONFIG}).")
    if not (path / RF.CONFIG).is_file():
        raise UserError(f"{str(path)!r} is not a run folder (it has no {RF.CONFIG}).")
    config = _read(path / RF.CONFIG, lambda p: yamlsafe.load_file(p, "run config"), None) or {}
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

    run = Run(path, config, summary=read(RF.SUMMARY, _summary, {}),
              metrics=read(RF.METRICS, _metrics_frame, _metrics_frame(path / "-")),
              env=read(RF.ENV, RF.json_load, {}), problems=problems)
    for table, (name, _) in _TABLES.items():
        if (path / name).exists():
            run.on_disk[table] = path / name
            if read(name, lambda _, t=table: run.rollup(t), None) is None:  # damaged
                del run.on_disk[table]
    return run


def expand_run_dirs(path) -> list[Path]:
    """[path] for a run folder; for a folder of run folders (a sweep, a demo) the run folders
    in it, by name; a folder that is neither stays as given, for load_run to refuse. A path
    that does not exist is a UserError."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist; give a run folder (one with "
                        f"{RF.CONFIG}) or a folder of them.")
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
