"""The thin host loop: one run folder per experiment, for every mode.

It dispatches step n+1 before it fetches step n's metrics, writes one JSON line per step,
keeps the Parquet tables (faults, mismatches), checkpoints with orbax, and resumes bit for bit:
data position, learning rate and every random draw are functions of (seed, step). A checkpoint
is saved only once every row and counter up to its step is written, and a resume drops what was
written after it, so a run stopped at any moment, even by SIGKILL, resumes to the same bits.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from sdcstudy import modes
from sdcstudy.core import config as C
from sdcstudy.core import data as D
from sdcstudy.core import determinism, digest, distributed, errors, hostarrays
from sdcstudy.core import metrics as MX
from sdcstudy.core import runfolder as RF
from sdcstudy.core import runlock
from sdcstudy.core import tablelog as TL
from sdcstudy.core.checkpoint import (Checkpointer, CheckpointWriteError, check_resumable,
                                     config_hash, saved_steps, write_reason, written_by)
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.interrupts import Interrupted, Signals
from sdcstudy.core.ticker import ticking
from sdcstudy.core.train import STEP_ONLY, NonFiniteError, compile_step

class WriteError(errors.CouldNotRun):
    """The run folder could not be written (disk full, permission, the folder gone): the run
    stopped; the message names the folder, its last good checkpoint and how to continue."""


def _put(tree, shardings):
    if shardings is None:
        return tree
    if jax.process_count() > 1:  # each process fills its own devices' pieces
        return hostarrays.put(tree, shardings)
    return jax.device_put(tree, shardings)


def run(cfg: Config, out_dir: Path | None = None, *, resume: bool = False,
        stop_after: int | None = None, progress: bool = True, echo=print) -> dict:
    """Run `cfg` into a run folder; returns the summary written to `summary.json`.

    Process 0 holds the folder (`core.runlock`) from start to end: a second writer, at the same
    moment or later, is refused. A write that fails ends the run with `WriteError`; SIGINT or
    SIGTERM with `Interrupted`. Resuming a run that holds the steps asked for changes nothing;
    a new run that fails before its first step leaves no folder (or an empty one) behind."""
    if cfg.logging.tensorboard:
        from sdcstudy.core import tensorboard

        tensorboard.require()
    # Every process reaches these refusals alike (their settings were compared when they met):
    # they leave together (`distributed.SharedRefusal`), none ended first by another's exit.
    if out_dir is None and jax.process_count() > 1:
        raise distributed.SharedRefusal("a run on several processes needs --out RUN_DIR, the "
                                        "same on each.")
    try:
        modes.check_processes(cfg, jax.process_count())
    except C.ConfigError as refusal:
        raise distributed.SharedRefusal(str(refusal)) from None
    run_dir = None
    with Signals() as signals:
        try:
            with contextlib.ExitStack() as held:
                # With several processes only process 0 writes the run folder (orbax has each
                # process write its own checkpoint shards); the others log in a scratch folder.
                writes = distributed.is_writer()
                run_dir = (_claim(held, out_dir, cfg.experiment.name or cfg.experiment.mode,
                                  resume) if writes else
                           RF.open_run_dir(out_dir, resume=True) if resume else Path(out_dir))
                if resume:
                    check_resumable(C.load(run_dir / RF.CONFIG), cfg)
                    if (summary := _already_done(cfg, run_dir, stop_after)) is not None:
                        echo(f"{run_dir} already finished at step {summary['steps_done']} of "
                             f"{summary['steps']}; nothing to do")
                        return {**summary, "run_dir": str(run_dir)}
                # The others' scratch folder goes however the run ends.
                files = run_dir if writes else held.enter_context(distributed.scratch_folder())
                with _writing(run_dir, new=not resume) if writes else contextlib.nullcontext():
                    return _run(cfg, run_dir, files, writes, resume, stop_after, progress,
                                echo, signals)
        except KeyboardInterrupt as stop:  # what the folder holds now, the lock given back
            raise Interrupted(getattr(stop, "signum", signal.SIGINT), run_dir) from None


def _already_done(cfg: Config, run_dir: Path, stop_after: int | None) -> dict | None:
    """The summary of a run folder that ran and checkpointed every step asked for, or None."""
    try:
        summary = RF.json_load(run_dir / RF.SUMMARY)
    except (OSError, ValueError):
        return None
    done = summary.get("steps_done") if isinstance(summary, dict) else None
    wanted = min(cfg.experiment.steps, stop_after or cfg.experiment.steps)
    if not isinstance(done, int) or done < wanted:
        return None
    return summary if saved_steps(run_dir / RF.CHECKPOINTS)[-1:] == [done] else None


def _claim(held: contextlib.ExitStack, out_dir: Path | None, name: str, resume: bool) -> Path:
    """Hold the run folder until `held` closes: the one to resume, or a new one, emptied again
    if the run fails before its first step (`_holds_a_step`)."""
    if resume:
        RF.open_run_dir(out_dir, resume=True)  # a run folder, with its config
        return held.enter_context(runlock.hold(out_dir, create=False))

    def new(path):
        return held.enter_context(runlock.hold(path, create=True, keep=_holds_a_step))

    if out_dir is not None:
        return new(out_dir)
    for _ in range(9):  # two runs started in one second pick one name: the later takes the next
        try:
            return new(RF.default_run_dir(name))
        except (runlock.FolderHeld, runlock.FolderTaken):
            continue
    return new(RF.default_run_dir(name))


def _holds_a_step(run_dir: Path) -> bool:
    """A checkpoint or a metrics line: something a user may want to see or continue."""
    if saved_steps(run_dir / RF.CHECKPOINTS):
        return True
    with contextlib.suppress(OSError), open(run_dir / RF.METRICS) as lines:
        return any(line.endswith("\n") and line.strip() for line in lines)
    return False


@contextlib.contextmanager
def _writing(run_dir: Path, new: bool):
    """Turn a write that fails into one sentence: the folder, its last good checkpoint and the
    command that continues the run."""
    try:
        yield
    except (OSError, CheckpointWriteError) as error:
        where = getattr(error, "filename", None)
        if where and not Path(where).resolve().is_relative_to(Path(run_dir).resolve()):
            raise  # another folder's file, e.g. the data's: not the run folder's failure
        doing = ("saving a checkpoint" if isinstance(error, CheckpointWriteError) else
                 f"writing {Path(where).resolve().relative_to(Path(run_dir).resolve())}"
                 if where else "writing its files")
        steps = saved_steps(run_dir / RF.CHECKPOINTS)
        last = (f"its last good checkpoint is step {steps[-1]}" if steps else
                "it has no checkpoint yet (--resume starts it over)")
        then = (f"{last}: make room or fix the folder, then continue with: sdcstudy run "
                f"{run_dir / RF.CONFIG} --out {run_dir} --resume"
                if (run_dir / RF.CONFIG).is_file() and not (new and not _holds_a_step(run_dir))
                else "it cannot be resumed (it had run no step, so nothing was kept, or its "
                     "config.yaml is gone): run it again")
        raise WriteError(f"could not write run folder {str(run_dir)!r} ({doing}: "
                         f"{write_reason(error)}); {then}") from None


class _Log:
    """What a run writes step by step: metrics.jsonl (and TensorBoard), the mode's Parquet
    tables, and the counters and bit histograms its checkpoints carry. On resume the rows of
    steps after `start` are dropped, as those steps will be redone."""

    def __init__(self, mode, files: Path, start: int, carried: dict, board_dir: Path | None,
                 bar):
        self.trainer, self.loss_key, self.bar = mode.trainer, mode.loss_key, bar
        self.shown = mode.shown
        self.lines = [RF.MetricsWriter(files / RF.METRICS, keep_below_step=start + 1)]
        if board_dir is not None:  # TensorBoard's events, beside metrics.jsonl
            from sdcstudy.core import tensorboard

            self.lines.append(tensorboard.ScalarLog(board_dir, first_step=start + 1))
        self.tables = {name: TL.TableLog(files / name, cols, keep_below_step=start + 1)
                       for name, cols in mode.tables.items()}
        self.counters = dict(carried.get("counters", {}))
        self.histograms = {k: np.asarray(v, np.int64)
                           for k, v in carried.get("bit_histograms", {}).items()}
        self.steps_written = 0
        self.last_time = time.perf_counter()

    def record(self, step: int, metrics, records) -> None:
        """Step `step`'s metrics line, table rows and counters."""
        values = {k: float(v) for k, v in hostarrays.fetch(metrics).items()}
        rows, step_counters = self.trainer.host_tables(step, hostarrays.fetch(records))
        for name, table_rows in rows.items():
            self.tables[name].extend(table_rows)
        for key, value in step_counters.items():
            if key == "bit_histograms":
                MX.merge_histograms(self.histograms, value)
            elif key == STEP_ONLY:  # this step's values, not summed over the run
                values.update(value)
            else:
                self.counters[key] = self.counters.get(key, 0) + value
                values[key] = value
        now = time.perf_counter()
        values["time/step_s"] = now - self.last_time
        self.last_time = now
        loss = values[self.loss_key]
        if not math.isfinite(loss):
            raise NonFiniteError(f"the loss became {loss} at step {step}.")
        for out in self.lines:
            out.write({"step": step, **values})
        self.steps_written += 1
        self.bar.update(1)
        self.bar.set_postfix({label: f"{values[key]:.3f}" for label, key in self.shown.items()
                              if key in values})

    def carried(self) -> dict:
        """What a checkpoint keeps of this log: the counters and histograms so far."""
        return {"counters": dict(self.counters),
                "bit_histograms": {k: v.tolist() for k, v in self.histograms.items()}}

    def flush(self) -> None:
        for out in [*self.lines, *self.tables.values()]:
            out.flush()


def _close_all(*closers) -> BaseException | None:
    """Call every closer, even after one failed; the first failure, if any."""
    failure = None
    for close in closers:
        try:
            close()
        except (OSError, CheckpointWriteError) as error:
            failure = failure or error
    return failure


def _same_data(was: str | None, now: str | None, cfg: Config, run_dir: Path, step: int) -> None:
    """Refuse a resume whose prepared rows differ from those the checkpoint trained on (a
    corpus edited since): the batch of every step follows from the rows. A checkpoint or a
    prepared folder from before the rows were fingerprinted passes."""
    if was and now and was != now:
        raise UserError(f"the data of {str(run_dir)!r} changed since checkpoint {step}: "
                        f"data.source {cfg.data.source!r} now gives other rows; restore the "
                        f"corpus the run started with, or start a new run with another --out.")


def _run(cfg: Config, run_dir: Path, files: Path, writes: bool, resume: bool,
         stop_after: int | None, progress: bool, echo, signals: Signals) -> dict:
    e = cfg.experiment
    pinned = determinism.autotune_options(run_dir, jax.default_backend(), dump=writes)
    if writes:
        RF.atomic_write_text(run_dir / RF.CONFIG, C.dump(cfg))
    # The data, the initial state (its own compile) and the step's compile: seconds to minutes
    # before the first step, on one line.
    with ticking(f"{e.mode}: preparing and compiling the step", enabled=progress), \
            D.datasets_progress(progress):
        mode = modes.build(cfg)
        trainer = mode.trainer
        batches = mode.batches()
        if batches.seq_len != cfg.data.seq_len:
            raise UserError(f"prepared data has sequence length {batches.seq_len}, "
                            f"not data.seq_len={cfg.data.seq_len}.")
        state = trainer.init_state()
        example = trainer.make_batch(batches.batch(0))
        shardings = trainer.shardings(state, example)
        state = _put(state, None if shardings is None else shardings[0])
        step_fn, hlo, compile_s = compile_step(trainer.train_step, state, example, shardings,
                                               pinned)
    step_fn = mode.step(step_fn)
    ckpt = Checkpointer(run_dir / RF.CHECKPOINTS, keep=e.checkpoint_keep)
    log = None
    try:
        start, carried = 0, {}
        if resume and (start := ckpt.latest_step() or 0):
            state, record = ckpt.restore(start, state)
            if not written_by(record, cfg):
                raise UserError(f"checkpoint {start} in {str(run_dir)!r} was written by another "
                                f"configuration; it was left as it is.")
            _same_data(record.get("data"), getattr(batches, "fingerprint", None), cfg, run_dir,
                       start)
            carried = record.get("carried", {})
            mode.resume(carried.get("mode", {}))
            echo(f"resuming {run_dir} from step {start}")
        if writes:
            RF.atomic_write_json(run_dir / RF.ENV,
                                 determinism.fingerprint(determinism.program_text(hlo), run_dir))
        bar = tqdm(total=e.steps, initial=start, desc=e.mode, unit="step", disable=not progress,
                   dynamic_ncols=True)
        log = _Log(mode, files, start, carried,
                   run_dir if cfg.logging.tensorboard and writes else None, bar)
        end = e.steps if stop_after is None else min(e.steps, stop_after)

        def save(step):  # only once every row and counter up to `step` is written
            if writes:
                runlock.check(run_dir)
            log.flush()
            kept = log.carried()
            if carry := mode.carry():
                kept["mode"] = carry
            ckpt.save(step, state, {"config_hash": config_hash(cfg), "step": step,
                                    "carried": kept,
                                    "data": getattr(batches, "fingerprint", None)})

        wall_start = time.perf_counter()
        pending = None  # the step dispatched last, recorded once the next one is dispatched
        stopped = False
        signals.deferring = True
        try:
            for step in range(start + 1, end + 1):
                batch = _put(trainer.make_batch(batches.batch(step - 1)),
                             None if shardings is None else shardings[1])
                out = step_fn(state, batch)  # a core.step.StepOut
                state = out.state
                if pending is not None:
                    log.record(*pending)
                pending = (step, out.metrics, out.records)
                # Safe points: the state is whole, every earlier step (after the save, this one
                # too) recorded. A signal after a look is seen at the next; the last step ends.
                stopped = step < end and signals.agreed() is not None
                if stopped or step == end or (e.checkpoint_every and
                                              step % e.checkpoint_every == 0):
                    log.record(*pending)
                    pending = None
                    save(step)
                    stopped = step < end and signals.agreed() is not None
                if stopped:
                    break
        finally:
            signals.deferring = False
            bar.close()
        if stopped:
            ckpt.wait()  # the checkpoint the message names is on disk
            raise Interrupted(signals.received)
        wall = time.perf_counter() - wall_start
    finally:  # after a failure, closing fails too: the first failure is the one to report
        closing = _close_all(*(out.close for out in (log.lines if log else [])), ckpt.close)
    if closing is not None:
        raise closing
    summary = _summary(cfg, mode, state, log, files, compile_s, wall)
    summary.update(mode.evaluate(state, run_dir if writes else None))
    if writes:
        RF.atomic_write_json(run_dir / RF.SUMMARY, summary)
    summary["run_dir"] = str(run_dir)
    return summary


def _summary(cfg: Config, mode, state, log: _Log, files: Path, compile_s: float,
             wall: float) -> dict:
    """summary.json's fields from the metrics and tables on disk and the final state."""
    e, trainer, loss_key = cfg.experiment, mode.trainer, mode.loss_key
    rows = RF.read_jsonl(files / RF.METRICS)
    losses = [r[loss_key] for r in rows]
    summary = {
        "mode": e.mode,
        "steps_done": int(jax.device_get(state["step"])),
        "steps": e.steps,
        "n_params": trainer.dims.n_params,
        "suspect_profile": cfg.suspect.profile,
        "loss/first": losses[0] if losses else None,
        "loss/last": losses[-1] if losses else None,
        "loss/uniform": math.log(trainer.dims.vocab_size),
        "param_digest": digest.tree_digest(hostarrays.fetch(state["params"])),
        "compile_s": compile_s,
        "wall_time_s": wall,
        "tokens_per_s": (C.tokens_per_step(cfg) * log.steps_written / wall
                         if log.steps_written else None),
        **log.counters,
    }
    summary.update(mode.summarize(rows, log.tables, log.histograms))
    return summary
