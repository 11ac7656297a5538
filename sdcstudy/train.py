"""The training step, the optimizer, and the thin host loop that writes a run folder.

`train_step(state, batch)` is pure and jitted once, ahead of time, with the state donated.
Everything random derives from `experiment.seed`; the data position, the learning rate and
any schedule are functions of the step number, so a checkpoint needs only the state.
Steps count from 1 in metrics and files: step k is the k-th optimizer update.
"""

from __future__ import annotations

import math
import time
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from . import config as C
from . import data as D
from . import determinism, digest, mesh as M, model, profiles, runfolder as RF
from . import faults as F
from .checkpoint import Checkpointer
from .config import Config, UserError
from .sites import Hook, compose, identity_hook


class NonFiniteError(RuntimeError):
    """The loss became NaN or Inf."""


# --- optimizer --------------------------------------------------------------------------------


def learning_rate_schedule(o: C.OptimConfig, steps: int) -> optax.Schedule:
    """Linear warm-up then cosine to `min_lr_ratio * lr` (Ma et al., B.3), or constant."""
    if o.schedule == "constant":
        return optax.constant_schedule(o.lr)
    decay = max(o.decay_steps or steps, o.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, decay,
                                              end_value=o.lr * o.min_lr_ratio)


def make_optimizer(o: C.OptimConfig, steps: int) -> optax.GradientTransformation:
    """Clipping, then the optimizer. adam and sgd apply weight decay as L2 on the gradient;
    adamw decouples it (Loshchilov and Hutter)."""
    lr = learning_rate_schedule(o, steps)
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm else []
    if o.name == "adamw":
        parts.append(optax.adamw(lr, o.beta1, o.beta2, o.eps, weight_decay=o.weight_decay))
    else:
        if o.weight_decay:
            parts.append(optax.add_decayed_weights(o.weight_decay))
        if o.name == "adam":
            parts.append(optax.adam(lr, o.beta1, o.beta2, o.eps))
        else:
            parts.append(optax.sgd(lr, momentum=o.momentum if o.name == "sgdm" else None))
    return optax.chain(*parts)


# --- the step ---------------------------------------------------------------------------------


def accumulate_gradients(loss_fn: Callable, params, tokens_MBL1, mask_MBL=None, sinks=None):
    """Mean next-token loss and its gradient over all microsteps' tokens.

    `loss_fn(params, sinks, tokens_BL1, mask_BL, microstep)` returns
    (sum of losses, (token count, aux)). Gradients of the sums accumulate in float32 and are
    divided by the total count once. `sinks` are zero inputs whose gradients carry backward
    records out of the step (see `faults.py`); they and `aux` come back stacked per microstep.
    """
    sinks = {} if sinks is None else sinks
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def micro(carry, xs):
        loss_acc, count_acc, grads_acc = carry
        tokens, mask, microstep = xs
        (loss, (count, aux)), (grads, sink_grads) = grad_fn(params, sinks, tokens, mask,
                                                            microstep)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        return (loss_acc + loss, count_acc + count, grads_acc), (aux, sink_grads)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    microsteps = jnp.arange(tokens_MBL1.shape[0], dtype=jnp.int32)
    (loss_sum, count, grads), records_M = jax.lax.scan(
        micro, (jnp.float32(0), jnp.float32(0), zeros), (tokens_MBL1, mask_MBL, microsteps))
    return loss_sum / count, jax.tree.map(lambda g: g / count, grads), records_M


def apply_update(tx: optax.GradientTransformation, state: dict, grads,
                 transform_updates: Callable = lambda u: u) -> dict:
    params = state["params"]
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    return {"params": optax.apply_updates(params, transform_updates(updates)),
            "opt_state": opt_state, "step": state["step"] + 1}


@dataclass
class Trainer:
    """Everything static about a single-replica run: model, optimizer, schedule, faults."""

    cfg: Config
    dims: C.ModelDims
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    injector: F.Injector | None = None
    hook: Hook = identity_hook

    @classmethod
    def from_config(cls, cfg: Config, hook: Hook = identity_hook) -> "Trainer":
        dims = C.model_dims(cfg.model)
        graphdef, _ = model.abstract_init(dims)
        steps = cfg.experiment.steps
        profile = profiles.load(cfg.suspect.profile)
        injector = None if profile.healthy else F.Injector(profile, dims.n_layers,
                                                           cfg.suspect.log_limit)
        return cls(cfg, dims, graphdef, make_optimizer(cfg.optim, steps),
                   learning_rate_schedule(cfg.optim, steps), injector, hook)

    @property
    def base_key(self):
        return jax.random.key(self.cfg.experiment.seed)

    def init_state(self) -> dict:
        _, params = model.init(self.dims, jax.random.fold_in(self.base_key, 0))
        return {"params": params, "opt_state": self.tx.init(params), "step": jnp.int32(0)}

    def fault_context(self, step, microstep, sinks=None) -> F.FaultContext:
        return F.FaultContext(jax.random.fold_in(self.base_key, 1), step, microstep, sinks)

    def loss(self, params, sinks, tokens_BL1, mask_BL, microstep, step=0):
        hook = self.hook
        records = {}
        if self.injector is not None:
            ctx = self.fault_context(step, microstep, sinks)
            hook = compose(self.injector.hook(ctx), hook)
            records = ctx.records
        loss_sum, count = model.token_losses(self.graphdef, params, tokens_BL1, mask_BL, hook=hook)
        return loss_sum, (count, records)

    def init_sinks(self) -> dict:
        return {} if self.injector is None else self.injector.init_sinks()

    def train_step(self, state: dict, batch: dict):
        step = state["step"] + 1
        loss, grads, (fwd_M, bwd_M) = accumulate_gradients(
            partial(self.loss, step=step), state["params"], batch["tokens"], batch.get("mask"),
            self.init_sinks())
        faults = {}
        transform_updates = lambda u: u  # noqa: E731
        if self.injector is not None:
            ctx = self.fault_context(step, -1)
            grads = self.injector.corrupt_tree(grads, ctx, "grad")
            transform_updates = partial(self.injector.corrupt_tree, ctx=ctx, site="update")
            faults = {"micro": {**fwd_M, **bwd_M}, "step": ctx.records}
        new_state = apply_update(self.tx, state, grads, transform_updates)
        metrics = {"loss/healthy": loss, "grad/norm": optax.tree.norm(grads),
                   "lr": self.schedule(state["step"])}
        return new_state, metrics, faults

    def fault_rows(self, faults: dict, step: int) -> tuple[list[dict], int]:
        """Host side: ground-truth rows of one step's fault records (and the overflow count)."""
        if self.injector is None:
            return [], 0
        rows, overflow = F.record_rows(faults["step"], step, -1, self.injector.profile)
        micro = faults["micro"]
        for m in range(self.cfg.experiment.microsteps):
            r, o = F.record_rows({k: v[m] for k, v in micro.items()}, step, m,
                                 self.injector.profile)
            rows += r
            overflow += o
        return rows, overflow


def compile_step(step_fn, state, batch, shardings=None):
    """Lower and compile once, donating the state; returns (compiled, HLO text, seconds)."""
    start = time.perf_counter()
    jitted = jax.jit(step_fn, donate_argnums=0,
                     **({} if shardings is None else dict(in_shardings=shardings)))
    compiled = jitted.lower(state, batch).compile()
    return compiled, compiled.as_text(), time.perf_counter() - start


# --- the host loop ----------------------------------------------------------------------------


def _config_hash(cfg: Config) -> str:
    import hashlib

    d = C.to_dict(cfg)
    d["experiment"] = {k: v for k, v in d["experiment"].items() if k != "steps"}
    return hashlib.sha256(RF.dumps(d, indent=None).encode()).hexdigest()[:16]


def _check_resumable(saved: Config, cfg: Config) -> None:
    a, b = C.to_dict(saved), C.to_dict(cfg)
    differing = [f"{section}.{key}" for section in a for key in a[section]
                 if a[section][key] != b[section][key]]
    extendable = {"experiment.steps"}
    if set(differing) - extendable:
        raise UserError(f"cannot resume with a different configuration: "
                        f"{', '.join(sorted(set(differing) - extendable))} differ from the run "
                        f"folder's config.yaml.")
    if differing and cfg.optim.schedule != "constant" and cfg.optim.decay_steps is None:
        raise UserError("changing experiment.steps on resume would change the cosine schedule; "
                        "set optim.decay_steps to the original step count to keep it.")


def _shardings(cfg: Config, state, batch):
    """Data parallelism over `dp` devices: batch split along B, state replicated."""
    if cfg.mesh.tp > 1:
        raise UserError("mesh.tp > 1 is not available in experiment.mode 'train'; "
                        "set mesh.tp=1.")
    if cfg.mesh.dp == 1:
        return None
    mesh = M.make_mesh(1, cfg.mesh.dp, 1)
    replicated = NamedSharding(mesh, P())
    batch_sharding = {k: NamedSharding(mesh, P(None, M.DATA)) for k in batch}
    return (jax.tree.map(lambda _: replicated, state), batch_sharding)


def _put(tree, shardings):
    return tree if shardings is None else jax.device_put(tree, shardings)


def run(cfg: Config, out_dir: Path | None = None, *, resume: bool = False,
        stop_after: int | None = None, progress: bool = True, echo=print) -> dict:
    """Train per `cfg` into a run folder; returns the summary written to `summary.json`."""
    if cfg.experiment.mode != "train":
        raise UserError(f"experiment.mode {cfg.experiment.mode!r} is not available in this "
                        f"version; use 'train'.")
    e = cfg.experiment
    run_dir = RF.open_run_dir(out_dir or RF.default_run_dir(e.name or e.mode), resume)
    if resume:
        _check_resumable(C.load(run_dir / RF.CONFIG), cfg)
    RF.atomic_write_text(run_dir / RF.CONFIG, C.dump(cfg))

    data_path = D.prepare(cfg.data, e.seed)
    batches = D.TokenBatches(data_path, e.batch_size, e.microsteps)
    if batches.seq_len != cfg.data.seq_len:
        raise UserError(f"prepared data has sequence length {batches.seq_len}, "
                        f"not data.seq_len={cfg.data.seq_len}.")

    trainer = Trainer.from_config(cfg)
    state = trainer.init_state()
    example = {"tokens": batches.batch(0)}
    shardings = _shardings(cfg, state, example)
    state = _put(state, None if shardings is None else shardings[0])
    step_fn, hlo, compile_s = compile_step(trainer.train_step, state, example, shardings)

    ckpt = Checkpointer(run_dir / RF.CHECKPOINTS, keep=e.checkpoint_keep)
    start = 0
    if resume and ckpt.latest_step() is not None:
        start = ckpt.latest_step()
        state, record = ckpt.restore(start, state)
        if record.get("config_hash") != _config_hash(cfg):
            raise UserError(f"checkpoint {start} in {str(run_dir)!r} was written by another "
                            f"configuration; it was left as it is.")
        echo(f"resuming {run_dir} from step {start}")
    RF.atomic_write_json(run_dir / RF.ENV, determinism.fingerprint(hlo))
    writer = RF.MetricsWriter(run_dir / RF.METRICS, keep_below_step=start + 1)
    fault_log = RF.TableLog(run_dir / RF.FAULTS, RF.FAULT_COLUMNS, keep_below_step=start + 1)
    fault_overflow = 0
    end = e.steps if stop_after is None else min(e.steps, stop_after)
    record = {"config_hash": _config_hash(cfg)}

    def save(step):
        ckpt.save(step, state, {**record, "step": step})

    tokens_per_step = e.microsteps * e.batch_size * cfg.data.seq_len
    bar = tqdm(total=e.steps, initial=start, desc=f"{e.mode}", unit="step", disable=not progress,
               dynamic_ncols=True)
    losses = []
    wall_start = time.perf_counter()
    last_time = wall_start
    pending = None

    def record_metrics(step, metrics, faults):
        nonlocal last_time, fault_overflow
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        rows, overflow = trainer.fault_rows(jax.device_get(faults), step)
        fault_log.extend(rows)
        fault_overflow += overflow
        if trainer.injector is not None:
            values["faults/landed"] = len(rows) + overflow
        now = time.perf_counter()
        values["time/step_s"] = now - last_time
        last_time = now
        if not math.isfinite(values["loss/healthy"]):
            raise NonFiniteError(f"the loss became {values['loss/healthy']} at step {step}.")
        writer.write({"step": step, **values})
        losses.append(values["loss/healthy"])
        bar.update(1)
        bar.set_postfix(loss=f"{values['loss/healthy']:.3f}")

    try:
        for step in range(start + 1, end + 1):
            batch = _put({"tokens": batches.batch(step - 1)},
                         None if shardings is None else shardings[1])
            state, metrics, faults = step_fn(state, batch)
            if pending is not None:
                record_metrics(*pending)
            pending = (step, metrics, faults)
            if step == end or (e.checkpoint_every and step % e.checkpoint_every == 0):
                record_metrics(*pending)
                pending = None
                writer.flush()
                fault_log.flush()
                save(step)
    except KeyboardInterrupt:
        try:  # the state is whole unless the interrupt came while a step was being dispatched
            if pending is not None:
                record_metrics(*pending)
            writer.flush()
            fault_log.flush()
            save(int(jax.device_get(state["step"])))
        except Exception:
            pass
        ckpt.wait()
        raise KeyboardInterrupt(f"interrupted; the latest checkpoint is step "
                                f"{ckpt.latest_step()}: continue with --resume --out {run_dir}")
    finally:
        bar.close()
        writer.close()
        ckpt.close()
    wall = time.perf_counter() - wall_start

    params = state["params"]
    summary = {
        "mode": e.mode,
        "steps_done": int(jax.device_get(state["step"])),
        "steps": e.steps,
        "n_params": trainer.dims.n_params,
        "loss/first": losses[0] if losses else None,
        "loss/last": losses[-1] if losses else None,
        "loss/uniform": math.log(trainer.dims.vocab_size),
        "param_digest": digest.tree_digest(params),
        "compile_s": compile_s,
        "wall_time_s": wall,
        "tokens_per_s": tokens_per_step * len(losses) / wall if losses else None,
        "suspect_profile": cfg.suspect.profile,
        "faults/landed": len(fault_log.rows) + fault_overflow,
        "faults/unlogged": fault_overflow,
    }
    RF.atomic_write_json(run_dir / RF.SUMMARY, summary)
    summary["run_dir"] = str(run_dir)
    return summary


def final_params(run_dir: Path, cfg: Config | None = None):
    """The parameters of a run folder's latest checkpoint, as numpy arrays."""
    run_dir = Path(run_dir)
    cfg = cfg or C.load(run_dir / RF.CONFIG)
    trainer = Trainer.from_config(cfg)
    like = jax.eval_shape(trainer.init_state)
    like = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
    ckpt = Checkpointer(run_dir / RF.CHECKPOINTS, asynchronous=False)
    step = ckpt.latest_step()
    if step is None:
        raise UserError(f"run folder {str(run_dir)!r} has no checkpoint.")
    state, _ = ckpt.restore(step, like)
    ckpt.close()
    return jax.tree.map(np.asarray, state["params"])


__all__ = ["Trainer", "accumulate_gradients", "apply_update", "compile_step",
           "learning_rate_schedule", "make_optimizer", "run", "final_params", "NonFiniteError"]
