"""The thin host loop: one run folder per experiment, for every mode.

It dispatches step n+1 before it fetches step n's metrics, writes one JSON line per step,
keeps the Parquet tables (faults, mismatches), checkpoints with orbax, and resumes bit for bit:
data position, learning rate and every random draw are functions of (seed, step).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from sdcstudy import modes
from sdcstudy.core import config as C
from sdcstudy.core import determinism, digest, distributed
from sdcstudy.core import metrics as MX
from sdcstudy.core import runfolder as RF
from sdcstudy.core import runlock
from sdcstudy.core.checkpoint import Checkpointer, CheckpointWriteError, saved_steps, write_reason
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.train import STEP_ONLY, NonFiniteError, compile_step

# Sections that change how a run is watched, not what it computes: left out of the hash that
# ties a checkpoint to its configuration, and free to change on --resume.
WATCHING = ("logging",)


class WriteError(Exception):
    """The run folder could not be written (disk full, permission, the folder gone): the run
    stopped; the message names the folder, its last good checkpoint and how to continue."""


def config_hash(cfg: Config) -> str:
    d = {k: v for k, v in C.to_dict(cfg).items() if k not in WATCHING}
    d["experiment"] = {k: v for k, v in d["experiment"].items() if k != "steps"}
    return hashlib.sha256(RF.dumps(d, indent=None).encode()).hexdigest()[:16]


def check_resumable(saved: Config, cfg: Config) -> None:
    a, b = C.to_dict(saved), C.to_dict(cfg)
    differing = {f"{section}.{key}" for section in a if section not in WATCHING
                 for key in a[section] if a[section][key] != b[section][key]}
    if differing - {"experiment.steps"}:
        raise UserError(f"cannot resume with a different configuration: "
                        f"{', '.join(sorted(differing - {'experiment.steps'}))} differ from the "
                        f"run folder's config.yaml.")
    if differing and cfg.optim.schedule != "constant" and cfg.optim.decay_steps is None:
        raise UserError("changing experiment.steps on resume would change the cosine schedule; "
                        "set optim.decay_steps to the original step count to keep it.")


def _put(tree, shardings):
    if shardings is None:
        return tree
    if jax.process_count() > 1:  # each process fills its own devices' pieces
        return distributed.put(tree, shardings)
    return jax.device_put(tree, shardings)


def run(cfg: Config, out_dir: Path | None = None, *, resume: bool = False,
        stop_after: int | None = None, progress: bool = True, echo=print) -> dict:
    """Run `cfg` into a run folder; returns the summary written to `summary.json`.

    Process 0 holds the folder (`core.runlock`) from start to end: a second writer, at the same
    moment or later, is refused. A write that fails ends the run with `WriteError`.
    """
    if cfg.logging.tensorboard:
        from sdcstudy.core import tensorboard

        tensorboard.require()
    if out_dir is None and jax.process_count() > 1:
        raise UserError("a run on several processes needs --out RUN_DIR, the same on each.")
    # With several processes only process 0 writes the run folder (orbax has each process
    # write its own checkpoint shards); the others keep their logs in a scratch folder.
    if not distributed.is_writer():
        if resume:
            RF.open_run_dir(out_dir, resume=True)
        return _run(cfg, Path(out_dir), False, resume, stop_after, progress, echo)
    with contextlib.ExitStack() as held:
        run_dir = _claim(held, out_dir, cfg.experiment.name or cfg.experiment.mode, resume)
        with _writing(run_dir):
            return _run(cfg, run_dir, True, resume, stop_after, progress, echo)


def _claim(held: contextlib.ExitStack, out_dir: Path | None, name: str, resume: bool) -> Path:
    """Hold the run folder for this process until `held` closes: a new one, or the one to
    resume."""
    if resume:
        RF.open_run_dir(out_dir, resume=True)  # a run folder, with its config
        return held.enter_context(runlock.hold(out_dir, create=False))
    if out_dir is not None:
        return held.enter_context(runlock.hold(out_dir, create=True))
    for _ in range(9):  # two runs started in one second pick one name: the later takes the next
        try:
            return held.enter_context(runlock.hold(RF.default_run_dir(name), create=True))
        except (runlock.FolderHeld, runlock.FolderTaken):
            continue
    return held.enter_context(runlock.hold(RF.default_run_dir(name), create=True))


@contextlib.contextmanager
def _writing(run_dir: Path):
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
                if (run_dir / RF.CONFIG).is_file() else
                "its config.yaml is gone, so it cannot be resumed: run it again")
        raise WriteError(f"could not write run folder {str(run_dir)!r} ({doing}: "
                         f"{write_reason(error)}); {then}") from None


def _close_all(*closers) -> BaseException | None:
    """Call every closer, even after one failed; the first failure, if any."""
    failure = None
    for close in closers:
        try:
            close()
        except (OSError, CheckpointWriteError) as error:
            failure = failure or error
    return failure


def _run(cfg: Config, run_dir: Path, writes: bool, resume: bool, stop_after: int | None,
         progress: bool, echo) -> dict:
    e = cfg.experiment
    pinned = determinism.autotune_options(run_dir, jax.default_backend(), dump=writes)
    mode = modes.build(cfg)
    trainer, loss_key = mode.trainer, mode.loss_key  # the loss that must stay finite
    scratch = None if writes else tempfile.TemporaryDirectory(prefix="sdcstudy-peer-")
    files = run_dir if writes else Path(scratch.name)
    if resume:
        check_resumable(C.load(run_dir / RF.CONFIG), cfg)
    if writes:
        RF.atomic_write_text(run_dir / RF.CONFIG, C.dump(cfg))

    batches = mode.batches()
    if batches.seq_len != cfg.data.seq_len:
        raise UserError(f"prepared data has sequence length {batches.seq_len}, "
                        f"not data.seq_len={cfg.data.seq_len}.")

    state = trainer.init_state()
    example = trainer.make_batch(batches.batch(0))
    shardings = trainer.shardings(state, example)
    state = _put(state, None if shardings is None else shardings[0])
    step_fn, hlo, compile_s = compile_step(trainer.train_step, state, example, shardings, pinned)
    step_fn = mode.step(step_fn)

    ckpt = Checkpointer(run_dir / RF.CHECKPOINTS, keep=e.checkpoint_keep)
    start, carried = 0, {}
    if resume and ckpt.latest_step() is not None:
        start = ckpt.latest_step()
        state, record = ckpt.restore(start, state)
        if record.get("config_hash") != config_hash(cfg):
            raise UserError(f"checkpoint {start} in {str(run_dir)!r} was written by another "
                            f"configuration; it was left as it is.")
        carried = record.get("carried", {})
        mode.resume(carried.get("mode", {}))
        echo(f"resuming {run_dir} from step {start}")
    if writes:
        RF.atomic_write_json(run_dir / RF.ENV,
                           determinism.fingerprint(determinism.program_text(hlo), run_dir))
    writer = RF.MetricsWriter(files / RF.METRICS, keep_below_step=start + 1)
    board = None
    if cfg.logging.tensorboard and writes:
        from sdcstudy.core import tensorboard

        board = tensorboard.ScalarLog(run_dir, first_step=start + 1)
    tables = {name: RF.TableLog(files / name, cols, keep_below_step=start + 1)
              for name, cols in mode.tables.items()}
    counters = dict(carried.get("counters", {}))
    histograms = {k: np.asarray(v, np.int64) for k, v in carried.get("bit_histograms", {}).items()}
    end = e.steps if stop_after is None else min(e.steps, stop_after)

    def save(step):
        extra = {"counters": counters,
                 "bit_histograms": {k: v.tolist() for k, v in histograms.items()}}
        if carry := mode.carry():
            extra["mode"] = carry
        ckpt.save(step, state, {"config_hash": config_hash(cfg), "step": step, "carried": extra})

    def flush():
        if writes:
            runlock.check(run_dir)
        writer.flush()
        if board:
            board.flush()
        for table in tables.values():
            table.flush()

    tokens_per_step = C.tokens_per_step(cfg)
    bar = tqdm(total=e.steps, initial=start, desc=e.mode, unit="step", disable=not progress,
               dynamic_ncols=True)
    done_steps = 0
    wall_start = last_time = time.perf_counter()
    pending = None

    def record(step, metrics, records):
        nonlocal last_time, done_steps
        values = {k: float(v) for k, v in distributed.fetch(metrics).items()}
        rows, step_counters = trainer.host_tables(step, distributed.fetch(records))
        for name, table_rows in rows.items():
            tables[name].extend(table_rows)
        for key, value in step_counters.items():
            if key == "bit_histograms":
                MX.merge_histograms(histograms, value)
            elif key == STEP_ONLY:  # this step's values, not summed over the run
                values.update(value)
            else:
                counters[key] = counters.get(key, 0) + value
                values[key] = value
        now = time.perf_counter()
        values["time/step_s"] = now - last_time
        last_time = now
        if not math.isfinite(values[loss_key]):
            raise NonFiniteError(f"the loss became {values[loss_key]} at step {step}.")
        writer.write({"step": step, **values})
        if board:
            board.write({"step": step, **values})
        done_steps += 1
        bar.update(1)
        bar.set_postfix(loss=f"{values[loss_key]:.3f}")

    try:
        for step in range(start + 1, end + 1):
            batch = _put(trainer.make_batch(batches.batch(step - 1)),
                         None if shardings is None else shardings[1])
            out = step_fn(state, batch)  # a core.step.StepOut
            state = out.state
            if pending is not None:
                record(*pending)
            pending = (step, out.metrics, out.records)
            if step == end or (e.checkpoint_every and step % e.checkpoint_every == 0):
                record(*pending)
                pending = None
                flush()
                save(step)
    except KeyboardInterrupt:
        try:  # the state is whole unless the interrupt came while a step was being dispatched
            if pending is not None:
                record(*pending)
            flush()
            save(int(jax.device_get(state["step"])))
            ckpt.wait()
        except Exception:
            pass
        raise KeyboardInterrupt(f"interrupted; the latest checkpoint is step "
                                f"{ckpt.last_saved()}: continue with --resume --out {run_dir}")
    finally:  # after a failure, closing fails too: the first failure is the one to report
        bar.close()
        closing = _close_all(writer.close, *([board.close] if board else []), ckpt.close)
    if closing is not None:
        raise closing
    wall = time.perf_counter() - wall_start

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
        "param_digest": digest.tree_digest(distributed.fetch(state["params"])),
        "compile_s": compile_s,
        "wall_time_s": wall,
        "tokens_per_s": tokens_per_step * done_steps / wall if done_steps else None,
        **counters,
    }
    summary.update(mode.summarize(rows, tables, histograms))
    summary.update(mode.evaluate(state, run_dir if writes else None))
    if writes:
        RF.atomic_write_json(run_dir / RF.SUMMARY, summary)
    else:
        scratch.cleanup()
    summary["run_dir"] = str(run_dir)
    return summary
