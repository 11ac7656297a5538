"""Run tables: Parquet tables a run appends to as it goes (`TableLog`), and their readers.

A table (`mismatch.parquet`, `faults.parquet`, ...) is a folder of part files, one per flush,
each written atomically, so a run killed at any moment leaves it readable up to its last
flush; `read_table` reads it as one DataFrame, `table_frames` one part at a time. The run
folder around the tables (names, atomic writes, metrics.jsonl) is `core/runfolder.py`.

Imports no JAX, so `report` and `load_run` can use it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sdcstudy.core.runfolder import atomic_open

# Columns of the Parquet tables (README's run-folder table, docs/metrics.md).
FAULT_COLUMNS = ("step", "microstep", "layer", "site", "tp_rank", "dp_rank", "node", "kind",
                 "bit", "flat_index", "original", "corrupted")
MISMATCH_COLUMNS = ("step", "microstep", "layer", "site", "tp_rank", "mismatches", "elements",
                    "severity", "max_rel_err", "nonfinite")

# A table is a folder of part files, one per flush (TableLog).
PART, PART_GLOB = "part-{:06d}.parquet", "part-*.parquet"
MAX_PENDING_ROWS = 1 << 20


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
