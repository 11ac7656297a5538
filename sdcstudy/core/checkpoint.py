"""orbax checkpoints that continue a run bit for bit.

A checkpoint holds the whole training state (parameters, optimizer state, step) and a JSON
record of what else continuing needs. Data position, RNG and fault-schedule position are all
pure functions of (seed, step), so the step number is enough; the record also keeps a hash
of the configuration so a checkpoint is never restored into a different experiment.

A save that fails (disk full, no permission, the folder gone) raises `CheckpointWriteError`
at the next save, wait or close, in the caller's thread; the caller turns it into one
sentence. orbax runs each save in an event loop of its own and closes that loop as soon as the
save has failed, while the save's other writes are still under way: the loops here finish
those writes and collect their errors before closing (`_SettlingLoop`), so none is reported
later as an exception "never retrieved". orbax's own error report of the failed save (the
same error, with its traceback) is not printed, nor is the report of a write that finished in
the instant its loop closed (`_LateWriteReports`: the write's outcome had no loop left to go
to, and the save's failure reaches the caller all the same).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.digest import path_name
from sdcstudy.core.errors import first_line, quoted

# What changes how a run is watched or kept, not what it computes: free to change on --resume
# and left out of the hash that ties a checkpoint to its configuration. Whole sections, then
# single settings.
WATCHING = ("logging",)
KEEPING = ("experiment.checkpoint_every", "experiment.checkpoint_keep", "experiment.name",
           "data.cache_dir")


def _hashed(cfg: Config, left_out: tuple[str, ...]) -> str:
    d = {k: v for k, v in C.to_dict(cfg).items() if k not in WATCHING}
    for key in left_out:
        section, name = key.split(".", 1)
        d[section] = {k: v for k, v in d[section].items() if k != name}
    return hashlib.sha256(RF.dumps(d, indent=None).encode()).hexdigest()[:16]


def config_hash(cfg: Config) -> str:
    """What a checkpoint's record names its configuration by: all but `WATCHING`, `KEEPING`
    and experiment.steps."""
    return _hashed(cfg, ("experiment.steps", *KEEPING))


def written_by(record: dict, cfg: Config) -> bool:
    """Whether a checkpoint's record names `cfg` (or one differing only in what may change on
    resume). Checkpoints written before `KEEPING` was left out hashed it in: theirs match
    while those settings are as they were."""
    return record.get("config_hash") in (config_hash(cfg), _hashed(cfg, ("experiment.steps",)))


def check_resumable(saved: Config, cfg: Config) -> None:
    """Refuse to continue a run folder written with `saved` under `cfg` unless the two differ
    only in what `config_hash` leaves out, and a changed step count keeps the schedule."""
    a, b = C.to_dict(saved), C.to_dict(cfg)
    differing = [f"{section}.{key}" for section in a if section not in WATCHING
                 for key in a[section] if a[section][key] != b[section][key]]
    if changed := [key for key in differing if key not in ("experiment.steps", *KEEPING)]:
        shown = "; ".join(f"{key} is {_value(b, key)} here, {_value(a, key)} in the run "
                          f"folder's config.yaml" for key in changed[:3])
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        raise UserError(f"cannot resume with another configuration: {shown}{more}; resume "
                        f"with the settings the run started with, or start a new run with "
                        f"another --out.")
    if ("experiment.steps" in differing and saved.optim.schedule != "constant"
            and saved.optim.decay_steps is None):
        steps = saved.experiment.steps
        raise UserError(f"cannot resume with experiment.steps={cfg.experiment.steps}: the run's "
                        f"cosine schedule decays over its experiment.steps={steps} (it left "
                        f"optim.decay_steps unset), so another step count would change every "
                        f"step's learning rate; resume with experiment.steps={steps}, or start "
                        f"a new run with another --out (with optim.decay_steps set, a run's "
                        f"experiment.steps may change on resume).")


def _value(config: dict, key: str) -> str:
    section, name = key.split(".", 1)
    return quoted(config[section][name])


class CheckpointWriteError(Exception):
    """A checkpoint could not be written; the message says why, in a few words."""


def write_reason(error: BaseException) -> str:
    """Why a write failed, in a few words: the operating system's reason where there is one
    (orbax reports a full disk as a ValueError naming the error code)."""
    if isinstance(error, CheckpointWriteError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if code := re.search(r"os_error_code='(\d+)'", str(error)):
        return os.strerror(int(code.group(1)))
    return first_line(error, 200)


def _reason(error: BaseException) -> str:
    """Why a restore failed, in a few words: TensorStore's messages trail a dump of their
    internals after "See full TensorStore details"."""
    return first_line(error, 200).split(" See full TensorStore details")[0]


def saved_steps(directory: Path) -> list[int]:
    """The steps whose checkpoint is whole on disk: orbax writes into a temporary folder and
    renames it to the step number only when every file is in."""
    try:
        return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())
    except (FileNotFoundError, NotADirectoryError):
        return []


def final_state(run_dir: Path) -> dict:
    """Every array of the run's last checkpoint, the whole training state (parameters, optimizer
    state, step), as numpy arrays keyed by path (`digest.path_name`), read as stored: whole
    arrays, also where each process of a multi-process run wrote its own shards."""
    steps = saved_steps(run_dir / RF.CHECKPOINTS)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {str(run_dir / RF.CHECKPOINTS)!r}")
    where = (run_dir / RF.CHECKPOINTS / str(steps[-1]) / "state").absolute()  # orbax wants it
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that a step's item has no step metadata
    try:
        with ocp.StandardCheckpointer() as reader:
            like = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype),
                                reader.metadata(where).item_metadata)
            state = reader.restore(where, like)
    finally:
        absl.setLevel(level)
    return {path_name(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


class _OrbaxFailureReports(logging.Filter):
    """Drops orbax's error reports (each with its traceback) of a failed save: the same error
    reaches the caller at the next save, wait or close."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


class _LateWriteReports(logging.Filter):
    """Drops the report of a thread's write that finished as its event loop was closing: the
    callback that carries the write's outcome to the loop checks that the loop is open, and
    the loop closes before the callback's next line reaches it (a race inside asyncio itself,
    `futures._chain_future`), so concurrent.futures reports "exception calling callback" with
    a traceback of RuntimeError('Event loop is closed'). Any other callback error is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed")


class _SettlingLoop(asyncio.SelectorEventLoop):
    """An event loop that, before it closes, cancels the tasks still under way and waits for
    them, collecting every outcome, as `asyncio.run` does; orbax closes its loops without that.
    """

    def close(self) -> None:
        if not (self.is_closed() or self.is_running() or asyncio._get_running_loop()):
            self.run_until_complete(_settle(asyncio.all_tasks(self)))
        super().close()


async def _settle(tasks) -> None:
    """Cancel `tasks` and wait for them, retrieving what each raised; the callbacks of tasks
    that finished just before the loop stopped run too, and retrieve what those raised."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _SettlingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _SettlingLoop()


def _orbax_failures_reach_the_caller_only() -> None:
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxFailureReports) for f in absl.filters):
        absl.addFilter(_OrbaxFailureReports())
    callbacks = logging.getLogger("concurrent.futures")
    if not any(isinstance(f, _LateWriteReports) for f in callbacks.filters):
        callbacks.addFilter(_LateWriteReports())
    if type(asyncio.get_event_loop_policy()) is asyncio.DefaultEventLoopPolicy:
        asyncio.set_event_loop_policy(_SettlingPolicy())


class Checkpointer:
    def __init__(self, directory: Path, keep: int = 2, asynchronous: bool = True):
        self.directory = Path(directory).resolve()
        _orbax_failures_reach_the_caller_only()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max(keep, 1),
                                                 enable_async_checkpointing=asynchronous,
                                                 create=True, cleanup_tmp_directories=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def last_saved(self) -> int | None:
        """The latest step whose checkpoint is whole on disk (after a failed save, the
        manager's own list may name the step that failed)."""
        steps = saved_steps(self.directory)
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, record: dict) -> None:
        try:  # orbax raises the previous save's failure here too
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(record)))
        except Exception as e:
            raise CheckpointWriteError(write_reason(e)) from e

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore `step` into the structure, shapes, dtypes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        where = self.directory / str(step)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many types for damaged or foreign files
            raise UserError(f"checkpoint {str(where)!r} is damaged or does not match this model "
                            f"({_reason(e)}); it was left as it is: "
                            f"{self._without(step)}.") from e
        return out.state, dict(out.meta)

    def _without(self, step: int) -> str:
        """How to continue without the checkpoint of `step`: from the one before it, if any."""
        earlier = [s for s in saved_steps(self.directory) if s < step]
        if earlier:
            return (f"move {str(self.directory / str(step))!r} out of "
                    f"{str(self.directory)!r} and run the same command again to resume from "
                    f"step {earlier[-1]}, the checkpoint before it")
        return "it is the run's only checkpoint, so start the run again with another --out"

    def wait(self) -> None:
        """Until the last save is on disk; `CheckpointWriteError` if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise CheckpointWriteError(write_reason(e)) from e

    def close(self) -> None:
        """Wait for the last save, then stop orbax's threads (also when that save failed)."""
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # the failure, if any, was raised by wait
                pass
