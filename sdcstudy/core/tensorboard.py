"""TensorBoard event files of a run's per-step scalars (`logging.tensorboard: true`).

    tensorboard --logdir runs/

shows every run under runs/ while it trains: the numeric fields of each metrics.jsonl line
(losses, gradient norms, mismatch frequencies, detector flags ...) become scalars of the same
name in RUN_DIR/tensorboard/, at most `FLUSH_SECS` seconds behind the run. tensorboardX is an
optional extra (`pip install 'sdcstudy[tensorboard]'`), imported only when a run asks for it.

Events are written in the caller's thread (tensorboardX's own writer thread would hide a full
disk and then block), so a failed write raises where the runner turns it into one sentence.
A resumed run starts a new event file that tells TensorBoard to drop the earlier files'
events from the resumed step on, as metrics.jsonl drops their lines.
"""

from __future__ import annotations

import importlib
import itertools
import os
import time
from pathlib import Path

from sdcstudy.core.errors import UserError

FOLDER = "tensorboard"  # inside the run folder
FLUSH_SECS = 2.0  # the longest a step's scalars wait before they reach the file
_files = itertools.count()  # with the pid, keeps two files of one second apart (a quick resume)


def require() -> None:
    """One sentence (exit 2) when tensorboardX is not installed."""
    try:
        importlib.import_module("tensorboardX")
    except ImportError:
        raise UserError("logging.tensorboard needs tensorboardX, which is not installed: "
                        "pip install 'sdcstudy[tensorboard]' (or tensorboardX), or set "
                        "logging.tensorboard=false.") from None


class ScalarLog:
    """Appends one step's numeric metrics at a time to an event file in RUN_DIR/tensorboard/."""

    def __init__(self, run_dir: Path, first_step: int = 1):
        require()
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2, summary_pb2

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        folder = Path(run_dir) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(folder / "events"),
                                    filename_suffix=f".{os.getpid()}.{next(_files)}")
        if first_step > 1:  # a resume: earlier files' events from first_step on are stale
            self._writer.write_event(self._event(
                step=first_step, wall_time=time.time(),
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        self._flushed_at = time.monotonic()

    def write(self, row: dict) -> None:
        """The scalars of one metrics.jsonl row (its `step` is the x axis; a flag is 0 or 1;
        text is skipped)."""
        values = [self._summary.Value(tag=key, simple_value=float(value))
                  for key, value in row.items()
                  if key != "step" and isinstance(value, (int, float))]
        self._writer.write_event(self._event(step=int(row["step"]), wall_time=time.time(),
                                             summary=self._summary(value=values)))
        if time.monotonic() - self._flushed_at >= FLUSH_SECS:
            self.flush()

    def flush(self) -> None:
        self._writer.flush()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        self._writer.close()
