"""Run folders: created without clobbering, written atomically, metrics one JSON line a step.

Imports no JAX, so `report` and `load_run` can use it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from sdcstudy.core.config import UserError

CONFIG, ENV, METRICS, SUMMARY, CHECKPOINTS = (
    "config.yaml", "env.json", "metrics.jsonl", "summary.json", "checkpoints")
FAULTS, MISMATCH, ABFT = "faults.parquet", "mismatch.parquet", "abft.parquet"

# Contract columns of the Parquet tables.
FAULT_COLUMNS = ("step", "microstep", "layer", "site", "tp_rank", "node", "kind", "bit",
                 "flat_index", "original", "corrupted")
MISMATCH_COLUMNS = ("step", "microstep", "layer", "site", "tp_rank", "mismatches", "elements",
                    "severity", "max_rel_err", "nonfinite")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"run folder {str(path)!r} already exists and is not empty; pass "
                        f"--resume to continue it or choose another --out.")
    path.mkdir(parents=True, exist_ok=True)
    return path


class MetricsWriter:
    """Appends one flat JSON object per optimizer step to `metrics.jsonl`."""

    def __init__(self, path: Path, keep_below_step: int | None = None):
        self.path = Path(path)
        if keep_below_step is not None and self.path.exists():
            kept = [line for line in read_jsonl(self.path) if line["step"] < keep_below_step]
            atomic_write_text(self.path, "".join(dumps(r, indent=None) + "\n" for r in kept))
        self._file = open(self.path, "a")

    def write(self, row: dict) -> None:
        self._file.write(dumps({k: _finite_or_str(v) for k, v in row.items()}, indent=None) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _finite_or_str(value):
    """JSON has no NaN or Inf: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def write_rows(path: Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(dumps(r, indent=None) + "\n" for r in rows))


def json_load(path: Path):
    with open(path) as f:
        return json.load(f)


class TableLog:
    """Rows of one Parquet table, kept in memory and rewritten atomically on `flush`.

    On resume the rows of steps after the checkpoint are dropped, as the steps will be redone.
    """

    def __init__(self, path: Path, columns: tuple[str, ...], keep_below_step: int | None = None):
        self.path, self.columns = Path(path), columns
        self.rows: list[dict] = []
        if keep_below_step is not None and self.path.exists():
            old = read_parquet(self.path)
            self.rows = old[old["step"] < keep_below_step].to_dict("records")

    def extend(self, rows: list[dict]) -> None:
        self.rows.extend(rows)

    def flush(self) -> None:
        import pandas as pd

        frame = pd.DataFrame(self.rows, columns=list(self.columns))
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, self.path)


def read_parquet(path: Path):
    import pandas as pd

    return pd.read_parquet(path)
