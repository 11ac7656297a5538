"""A golden record: what `golden record` keeps, written atomically, verified and loaded.

`golden record` runs a deterministic single-device training (`experiment.mode: train`, the
tiny model by default) and keeps, for every optimizer step k (counted from 1):
- the bit patterns of the loss and of the gradient norm (before clipping);
- a digest of every parameter tensor after the update of step k (step 0: initialisation);
- a digest of every named site's value (`fwd/<site>`) and of the gradient arriving at it
  (`bwd/<site>`), per microstep and layer (`core/sites.py` names them);
plus the input tokens (so a check needs no dataset), the full parameter values of every step
when they fit in `FULL_PARAMS_BUDGET` bytes (otherwise of the last step only), SHA-256 of
every final parameter tensor and of the rest of the final training state (the optimizer's
state, Adam's moments, and the step count: `final_state_sha256`), the config, the environment
fingerprint and a manifest. The final parameters also get SHA-256 on the host (the
`param_digest` of run folders).
"""

from __future__ import annotations

import io
import os
import socket
import time
from pathlib import Path

import jax
import numpy as np

from sdcstudy.core import config as C
from sdcstudy.core import data as D
from sdcstudy.core import determinism
from sdcstudy.core.ticker import ticking
from sdcstudy.core import runfolder as RF
from sdcstudy.core import runlock
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.errors import CouldNotRun
from sdcstudy.core.digest import tensor_digests, tree_digest
from sdcstudy.golden import coverage, telemetry
from sdcstudy.golden.contents import (  # noqa: F401  (the record's budgets, importable here)
    FULL_PARAMS_BUDGET, LAST_PARAMS_BUDGET, full_param_steps, open_record)
from sdcstudy.golden.digest import BLOCKS
from sdcstudy.golden.manifest import (  # noqa: F401  (the record's files, importable here)
    ARRAYS, CONFIG, ENV, FILES, FORMAT, MANIFEST, META, GoldenError, load_config, verify,
    write_manifest)
from sdcstudy.golden.sizing import MEMORY_SHARE, FullSizing, size_full
from sdcstudy.golden.workload import (
    _bits, _param_leaves, check_config, device_info, pick_device, workload)


# --- record -------------------------------------------------------------------------------------


def load_tokens(cfg: Config) -> np.ndarray:
    """int32 (steps, microsteps, batch, seq_len + 1): the inputs of every step."""
    e = cfg.experiment
    batches = D.TokenBatches(D.prepare(cfg.data, e.seed), e.batch_size, e.microsteps)
    return np.stack([batches.batch(step) for step in range(e.steps)]).astype(np.int32)


def record(cfg: Config | None, out_dir: Path, *, device_index: int = 0, progress: bool = True,
           memory_share: float | None = None) -> dict:
    """Run the golden workload and write GOLDEN_DIR, its manifest last; returns its metadata.
    `cfg` None: the full workload, sized for the device (`golden.sizing`, `memory_share`).

    The folder is held (core.runlock) from the start: a second recorder is refused at once.
    A record stopped before its manifest is written (Ctrl-C, SIGTERM, an error) leaves no
    folder behind, so the same command may run again.
    """
    if cfg is not None:
        check_config(cfg)
    with runlock.hold(out_dir, create=True, what="golden folder",
                      hint="a golden record is never overwritten: choose another --out",
                      keep=lambda folder: (folder / MANIFEST).is_file()):
        return _record(cfg, Path(out_dir), device_index, progress, memory_share)


def full_sizing(device, device_index: int, memory_share: float | None) -> FullSizing:
    """The full workload sized for `device` (its memory from nvidia-smi where there is one)."""
    description = coverage.describe(device, telemetry.smi_memory_bytes(device_index))
    return size_full(description, MEMORY_SHARE if memory_share is None else memory_share)


def _record(cfg: Config | None, out_dir: Path, device_index: int, progress: bool,
            memory_share: float | None) -> dict:
    started = time.perf_counter()
    device = pick_device(device_index)
    sizing = None
    if cfg is None:
        sizing = full_sizing(device, device_index, memory_share)
        cfg = C.from_dict(sizing.config())
    tokens = load_tokens(cfg)
    with ticking("golden record: preparing and compiling the workload", enabled=progress):
        work, _ = workload(cfg, tokens, device, sizing=sizing)
    steps, micro = work.steps, work.microsteps
    arrays = {"tokens": tokens, "loss": np.zeros(steps, np.uint32),
              "grad_norm": np.zeros(steps, np.uint32)}
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(work.initial["params"]))
    full_steps = full_param_steps(param_bytes, steps)
    with telemetry.Watch(device.platform, device_index) as watch:
        losses, final, final_state = _run(work, arrays, full_steps, progress)
    leaves = _param_leaves(work.initial["params"])
    meta = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "device": device_info(device, device_index),
        "steps": steps, "microsteps": micro,
        "blocks": BLOCKS,
        "site_order": work.site_order,
        "sites": work.sites,
        "params": {p: {"shape": list(v.shape), "dtype": str(v.dtype)} for p, v in leaves.items()},
        "full_param_steps": full_steps,
        "final_param_sha256": tensor_digests(final),
        "final_state_sha256": final_state,
        "param_digest": tree_digest(final),
        "loss": losses,
        "compile_s": work.compile_s,
        "record_s": time.perf_counter() - started,
        "workload": "tiny" if sizing is None else "full",
        "sizing": None if sizing is None else sizing.as_dict(),
        "coverage_digests": [] if sizing is None else list(coverage.digest_names()),
        "coverage": telemetry.coverage(work, device_index, watch),
    }
    env = determinism.fingerprint(determinism.program_text(work.hlo))
    # Each file is written atomically and the manifest last, so a folder is a golden record
    # only once it is whole: a check of an unfinished one finds no manifest (INCONCLUSIVE).
    written = []
    try:
        RF.atomic_write_text(out_dir / CONFIG, C.dump(cfg))
        written.append(out_dir / CONFIG)
        RF.atomic_write_json(out_dir / ENV, env)
        written.append(out_dir / ENV)
        RF.atomic_write_json(out_dir / META, meta)
        written.append(out_dir / META)
        npz = io.BytesIO()
        np.savez_compressed(npz, **arrays)
        RF.atomic_write_bytes(out_dir / ARRAYS, npz.getvalue())
        written.append(out_dir / ARRAYS)
        umask = os.umask(0)
        os.umask(umask)
        for path in written:  # atomic writes make private files; a golden record is shared
            path.chmod(0o666 & ~umask)
        manifest = write_manifest(out_dir)
        (out_dir / MANIFEST).chmod(0o666 & ~umask)
    except OSError as e:
        for path in written:  # nothing of an unfinished record is left
            path.unlink(missing_ok=True)
        raise CouldNotRun(f"could not write the golden record into {str(out_dir)!r} "
                          f"({e.strerror}); nothing of it was kept.") from None
    meta["manifest_sha256"] = manifest["sha256"]
    meta["bytes"] = sum(f["bytes"] for f in manifest["body"]["files"].values())
    meta["golden_dir"] = str(out_dir)
    return meta


def final_state_sha256(state) -> dict:
    """SHA-256 of every tensor of a final training state other than the parameters (which
    the step digests and `final_param_sha256` cover): the optimizer's state and the step
    count. A bit of Adam's moments may change no parameter's bits by the end of the run."""
    return tensor_digests(jax.device_get({"opt_state": state["opt_state"],
                                          "step": state["step"]}))


def _run(work, arrays: dict, full_steps: list[int], progress: bool) -> tuple[list, dict, dict]:
    """Run the workload once, storing its digests and full parameters into `arrays`; (the
    losses, the final parameters, `final_state_sha256` of the final state)."""
    steps = work.steps
    losses, final, final_state = [], None, None
    bar = _bar(progress, steps, "golden record")
    for step, out, state in work.run():
        store_digests(arrays, step, out, steps)
        if step == 0:
            continue
        loss = float(np.uint32(out["loss"]).view(np.float32))
        if not np.isfinite(loss):
            raise UserError(f"the golden run's loss became {loss} at step {step}; a golden "
                            f"record needs a finite run (lower optim.lr).")
        losses.append(loss)
        if step in full_steps or step == steps:
            params = jax.device_get(state["params"])
            for path, leaf in _param_leaves(params).items():
                if step in full_steps:
                    arrays[f"full/{step}/{path}"] = _bits(leaf)
            if step == steps:
                final, final_state = params, final_state_sha256(state)
        bar.update(1)
    bar.close()
    return losses, final, final_state


def store_digests(arrays: dict, step: int, out: dict, steps: int) -> None:
    """Put one step's digests (what `Workload.run` yields) into a record's arrays."""
    for path, digest in out["params"].items():
        arrays.setdefault(f"params/{path}", np.zeros((steps + 1,) + digest.shape, np.uint32))
        arrays[f"params/{path}"][step] = digest
    if step == 0:
        return
    for direction in ("fwd", "bwd"):
        for key, digest in out[direction].items():
            name = f"{direction}/{key}"
            arrays.setdefault(name, np.zeros((steps,) + digest.shape, np.uint32))
            arrays[name][step - 1] = digest
    for name, digest in out.get("coverage", {}).items():
        arrays.setdefault(f"coverage/{name}", np.zeros((steps,) + digest.shape, np.uint32))
        arrays[f"coverage/{name}"][step - 1] = digest
    for name in ("loss", "grad_norm"):
        arrays.setdefault(name, np.zeros(steps, np.uint32))[step - 1] = out[name]


def _bar(progress: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not progress, dynamic_ncols=True)


# --- loading a golden record --------------------------------------------------------------------


def load(golden_dir: Path, expect_sha: str | None = None) -> tuple[Config, dict, dict, dict]:
    """(config, env, meta, arrays) of a golden folder, read once and checked
    (`contents.open_record`)."""
    golden = open_record(golden_dir, expect_sha)
    return golden.cfg, golden.env, golden.meta, golden.arrays
