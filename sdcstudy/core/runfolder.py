"""Run folders: created without clobbering, written atomically, metrics one JSON line a step.

Imports no JAX, so `report` and `load_run` can use it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

from sdcstudy.core.config import UserError
from sdcstudy.core.runlock import LOCK

CONFIG, ENV, METRICS, SUMMARY, CHECKPOINTS = (
    "config.yaml", "env.json", "metrics.jsonl", "summary.json", "checkpoints")
FAULTS, MISMATCH, ABFT = "faults.parquet", "mismatch.parquet", "abft.parquet"
# What a run writes beside config.yaml, any one of which makes a folder one to resume: a run
# killed before its first step leaves only its config.yaml and its lock file.
RUN_MARKS = (CHECKPOINTS, METRICS, ENV, SUMMARY, LOCK)

# Columns of the Parquet tables (README's run-folder table, docs/metrics.md).
FAULT_COLUMNS = ("step", "microstep", "layer", "site", "tp_rank", "dp_rank", "node", "kind",
                 "bit", "flat_index", "original", "corrupted")
MISMATCH_COLUMNS = ("step", "microstep", "layer", "site", "tp_rank", "mismatches", "elements",
                    "severity", "max_rel_err", "nonfinite")

# A table is a folder of part files, one per flush (TableLog); metrics.jsonl reaches the disk
# within FLUSH_SECONDS of a step's line while steps come.
PART, PART_GLOB = "part-{:06d}.parquet", "part-*.parquet"
MAX_PENDING_ROWS = 1 << 20
FLUSH_SECONDS = 2.0


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "wb"):
    """A file to write `path` through: a hidden temporary file beside it (readers of a table
    folder skip it), flushed, fsynced and renamed over `path` when the block ends; removed if
    the block raises. Its mode is 0666 less the umask, as `open` gives (mkstemp gives 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp"))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def dumps(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(obj, indent=indent, default=_json_default, allow_nan=True)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, dumps(obj) + "\n")


def default_run_dir(name: str, root: Path = Path("runs")) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"{name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = root / f"{name}-{stamp}-{n}"
    return path


def open_run_dir(path: Path, resume: bool) -> Path:
    """Create a new run folder, or check that `path` is one to resume. Never clobbers."""
    path = Path(path)
    if resume:
        if not (path / CONFIG).is_file():
            raise UserError(f"cannot resume {str(path)!r}: it is not a run folder "
                            f"(no {CONFIG}).")
        if not any((path / name).exists() for name in RUN_MARKS):
            raise UserError(f"cannot resume {str(path)!r}: it holds a {CONFIG} but nothing a "
                            f"run writes ({', '.join(RUN_MARKS[:-1])}), so it is not a run "
                            f"folder and a resume would overwrite its {CONFIG}; start the run "
                            f"without --resume and with another --out.")
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"run folder {str(path)!r} already exists and is not empty; pass "
                        f"--resume to continue it or choose another --out.")
    path.mkdir(parents=True, exist_ok=True)
    return path


class MetricsWriter:
    """Appends one flat JSON object per optimizer step to `metrics.jsonl`.

    A line reaches the file at the first `write` at least `FLUSH_SECONDS` after the last flush
    (so a run can be watched live), at every `flush` and at `close`. On resume the lines of
    steps from `keep_below_step` on are dropped, as the steps will be redone; the file is
    filtered line by line, never read whole."""

    def __init__(self, path: Path, keep_below_step: int | None = None):
        self.path = Path(path)
        if keep_below_step is not None and self.path.exists():
            with open(self.path) as lines, atomic_open(self.path, "w") as out:
                out.writelines(line for line in _complete_lines(lines)
                               if json.loads(line)["step"] < keep_below_step)
        self._file = open(self.path, "a")
        self._lines: list[str] = []
        self._flushed_at = time.monotonic()

    def write(self, row: dict) -> None:
        self._lines.append(dumps({k: _finite_or_str(v) for k, v in row.items()}, indent=None)
                           + "\n")
        if time.monotonic() - self._flushed_at >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """The waiting lines in one write: a kill during it leaves at most a last line without
        its newline, which `read_jsonl` and a resume leave out."""
        self._file.write("".join(self._lines))
        self._file.flush()
        self._lines.clear()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._file.close()


def _finite_or_str(value):
    """JSON has no NaN or Inf: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _complete_lines(lines: Iterable[str]) -> Iterable[str]:
    """The non-blank lines that end with a newline: only the last line of a file can lack it,
    when a kill cut its write short."""
    return (line for line in lines if line.endswith("\n") and line.strip())


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in _complete_lines(f)]


def write_rows(path: Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(dumps(r, indent=None) + "\n" for r in rows))


def json_load(path: Path):
    with open(path) as f:
        return json.load(f)


def finished(run_dir: Path) -> bool:
    """A run folder whose summary.json says it ran every step (what `sweep --resume` and
    `reproduce --resume` keep); not one whose summary cannot be read (its resume rewrites it)."""
    try:
        summary = json_load(Path(run_dir) / SUMMARY)
    except (OSError, ValueError):  # none, or damaged
        return False
    return isinstance(summary, dict) and summary.get("steps_done") == summary.get("steps")


def table_parts(path: Path) -> list[Path]:
    """The part files of a table folder, in the order they were written (their numbers are
    zero-padded, so this is also the order `pd.read_parquet` reads them in)."""
    return sorted(Path(path).glob(PART_GLOB))


def read_table(path: Path, columns: list[str] | None = None):
    """A run table as one DataFrame: a folder of part files (`TableLog`) or, in run folders
    written before tables were appended, one Parquet file; `columns` reads only those."""
    import pandas as pd
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_dir():
        return pd.read_parquet(path, columns=columns)
    return _concat([pq.read_table(part, columns=columns) for part in table_parts(path)],
                   columns)


def table_frames(path: Path, columns: list[str] | None = None):
    """A run table one part file at a time, as DataFrames in the order written (one, for a
    table written as one file): what `read_table` gives, in the memory of one part."""
    import pandas as pd
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_dir():
        yield pd.read_parquet(path, columns=columns)
        return
    for part in table_parts(path):
        yield _concat([pq.read_table(part, columns=columns)], columns)


def _concat(tables: list, columns: list[str] | None):
    """Arrow tables as one DataFrame; parts share one schema, except while a kill has cut a
    widening short (TableLog.flush), which the promotion covers."""
    import pandas as pd
    import pyarrow as pa

    if not tables:
        return pd.DataFrame(columns=list(columns or []))
    return pa.concat_tables(tables, promote_options="permissive").to_pandas()


class TableLog:
    """One Parquet table of a run folder, appended as it grows.

    The table's name is a folder of part files (`mismatch.parquet/part-000000.parquet`, ...):
    each `flush` writes the rows given since the last one as the next part, atomically, so a
    kill at any moment leaves the table readable up to its last flush. Waiting rows are held
    as Arrow columns, at most `max_pending_rows` of them (more flush on their own), never the
    run's rows. All parts share one schema: when new rows need a wider one (a column that was
    all None gets a type, or integers meet floats), the parts already written are cast to it,
    so that `pd.read_parquet` on the folder reads what `read_table` reads.

    On resume (`keep_below_step`) the rows of steps from it on are dropped, as the steps will
    be redone: later parts are deleted, last first, and the one part that holds both kinds is
    rewritten; the earlier parts are not read. Without `keep_below_step` an
    existing table is replaced. A run folder's single-file table (written before tables were
    appended) becomes the folder's first part.
    """

    def __init__(self, path: Path, columns: tuple[str, ...], keep_below_step: int | None = None,
                 max_pending_rows: int = MAX_PENDING_ROWS):
        import pyarrow.parquet as pq

        self.path, self.columns = Path(path), tuple(columns)
        self.max_pending_rows = max_pending_rows
        self._pending: list = []  # one Arrow table per `extend`
        self.pending_rows = 0
        if keep_below_step is None:
            _remove_table(self.path)
        elif self.path.is_file():
            self._from_single_file(keep_below_step)
        elif self.path.is_dir():
            self._drop_steps_from(keep_below_step)
        parts = table_parts(self.path) if self.path.is_dir() else []
        self._next_part = _part_number(parts[-1]) + 1 if parts else 0
        self._schema = None
        if parts:  # one schema again, should a kill have cut a widening short
            schemas = [pq.read_schema(part).remove_metadata() for part in parts]
            self._schema = _widest(*schemas)
            for part, schema in zip(parts, schemas):
                if not schema.equals(self._schema):
                    _write_part(part, pq.read_table(part).cast(self._schema))

    def extend(self, rows: list[dict]) -> None:
        import pyarrow as pa

        if not rows:
            return
        self._pending.append(pa.table({c: [r.get(c) for r in rows] for c in self.columns}))
        self.pending_rows += len(rows)
        if self.pending_rows >= self.max_pending_rows:
            self.flush()

    def flush(self) -> None:
        """The waiting rows as the next part; the first flush writes one even without rows, so
        that the table exists with its columns."""
        import pyarrow.parquet as pq

        if not self._pending and self._schema is not None:
            return
        table = self._pending_table()
        schema = table.schema if self._schema is None else _widest(self._schema, table.schema)
        if self._schema is not None and not schema.equals(self._schema):
            for part in table_parts(self.path):
                _write_part(part, pq.read_table(part).cast(schema))
        self._schema = schema
        part = self.path / PART.format(self._next_part)
        if self.path.is_dir():
            _write_part(part, table.cast(schema))
        else:  # the first part: the folder appears with it, never empty
            staging = self.path.with_name(f".{self.path.name}.new")
            shutil.rmtree(staging, ignore_errors=True)
            _write_part(staging / part.name, table.cast(schema))
            os.rename(staging, self.path)
        self._next_part += 1
        self._pending.clear()
        self.pending_rows = 0

    def frame(self, columns: list[str] | None = None):
        """The whole table as a DataFrame: what was flushed and what waits."""
        return _concat(list(self._parts(columns)), columns or list(self.columns))

    def frames(self, columns: list[str] | None = None):
        """The table one part at a time, as DataFrames in the order written, then the rows that
        wait: what `frame` gives, without holding more than a part in memory."""
        for part in self._parts(columns):
            yield _concat([part], columns or list(self.columns))

    def _parts(self, columns: list[str] | None):
        """Arrow tables: each flushed part in the order written, then the waiting rows."""
        import pyarrow.parquet as pq

        for part in table_parts(self.path) if self.path.is_dir() else []:
            yield pq.read_table(part, columns=columns)
        if self._pending:
            waiting = self._pending_table()
            yield waiting if columns is None else waiting.select(columns)

    def _pending_table(self):
        import pyarrow as pa

        if not self._pending:
            return pa.table({c: pa.nulls(0) for c in self.columns})
        return pa.concat_tables(self._pending, promote_options="permissive")

    def _drop_steps_from(self, step: int) -> None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        for leftover in self.path.glob(".*.tmp"):  # a write that a kill cut short
            leftover.unlink(missing_ok=True)
        parts = table_parts(self.path)
        for i in reversed(range(len(parts))):
            steps = pq.read_table(parts[i], columns=["step"])["step"]
            if len(steps) == 0:
                continue
            kept = pc.sum(pc.less(steps, step)).as_py() or 0
            if kept == len(steps):  # parts hold steps in order: the earlier ones are kept too
                break
            if kept == 0 and i > 0:  # the first part stays, if empty, to hold the columns
                parts[i].unlink()
                continue
            table = pq.read_table(parts[i])
            _write_part(parts[i], table.filter(pc.fill_null(pc.less(table["step"], step), False)))

    def _from_single_file(self, step: int) -> None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        table = pq.read_table(self.path).replace_schema_metadata(None)
        if table.num_rows:
            table = table.filter(pc.fill_null(pc.less(table["step"], step), False))
        staging = self.path.with_name(f".{self.path.name}.new")
        shutil.rmtree(staging, ignore_errors=True)
        _write_part(staging / PART.format(0), table)
        aside = self.path.with_name(f".{self.path.name}.old")
        os.replace(self.path, aside)  # a kill before the next line leaves the old file here
        os.rename(staging, self.path)
        aside.unlink()


def _part_number(part: Path) -> int:
    return int(part.stem.split("-")[1])


def _widest(*schemas):
    """The schema that holds the rows of all `schemas` (null -> any type, int -> float)."""
    import pyarrow as pa

    return pa.unify_schemas(list(schemas), promote_options="permissive")


def _write_part(path: Path, table) -> None:
    import pyarrow.parquet as pq

    with atomic_open(path) as f:
        pq.write_table(table, f)


def _remove_table(path: Path) -> None:
    """Delete a table, at once to its readers: a folder is renamed out of sight first."""
    if path.is_dir():
        gone = path.with_name(f".{path.name}.{os.getpid()}.gone")
        os.rename(path, gone)
        shutil.rmtree(gone)
    elif path.exists():
        path.unlink()
