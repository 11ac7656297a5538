"""Run folders: created without clobbering, written atomically, metrics one JSON line a step.

The Parquet tables a run appends to (mismatch.parquet, ...) are `core/tablelog.py`. Imports no
JAX, so `report` and `load_run` can use it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
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

# metrics.jsonl reaches the disk within FLUSH_SECONDS of a step's line while steps come.
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
            with open(self.path, "rb") as lines, atomic_open(self.path) as out:
                out.writelines(line for number, line, row in _json_lines(self.path, lines)
                               if _step(self.path, number, row) < keep_below_step)
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


class NotJsonLine(UserError, ValueError):
    """A line of a JSON-lines file that is not JSON (or not UTF-8), or not the `kind` of JSON
    the file holds: the file is damaged. `line` counts the file's lines from 1; `reason` is
    what was found."""

    def __init__(self, path: Path, line: int, reason: str, kind: str = "JSON"):
        self.path, self.line, self.reason = Path(path), line, reason
        super().__init__(f"{str(path)!r} line {line} is not {kind} ({reason}): the file is "
                         f"damaged; mend or delete that line.")


def _step(path: Path, number: int, row) -> int:
    """The step of metrics line `number`, or NotJsonLine if it names none."""
    step = row.get("step") if isinstance(row, dict) else None
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    raise NotJsonLine(path, number, 'no whole-number "step"', kind="a metrics row")


def _json_lines(path: Path, lines: Iterable[bytes]) -> Iterable[tuple[int, bytes, Any]]:
    """(number, line, its JSON value) for each non-blank line of `path` that ends with a
    newline: only the last line of a file can lack it, when a kill cut its write short. The
    first other line that is not JSON raises NotJsonLine with its number in the file."""
    for number, line in enumerate(lines, start=1):
        if not line.endswith(b"\n") or not line.strip():
            continue
        try:
            value = json.loads(line.decode())
        except UnicodeDecodeError:
            raise NotJsonLine(path, number, "not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise NotJsonLine(path, number, e.msg) from None
        yield number, line, value


def read_jsonl(path: Path) -> list[dict]:
    """The JSON value of each complete line of `path` (one dict a step for metrics.jsonl); a
    damaged line raises NotJsonLine, which names the file and the line."""
    with open(path, "rb") as f:
        return [row for _, _, row in _json_lines(path, f)]


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
    if not isinstance(summary, dict):
        return False
    done, asked = summary.get("steps_done"), summary.get("steps")
    # Whole numbers, both: a summary without them (None == None) says nothing of the steps.
    return all(isinstance(n, int) and not isinstance(n, bool) for n in (done, asked)) \
        and done == asked
