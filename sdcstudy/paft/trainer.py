"""PAFT mode: data-parallel workers whose gradient aggregation goes wrong, and its mitigations.

"Identifying and mitigating errors in gradient aggregation of distributed data parallel
training" (PAFT) and "Distributed Training under Packet Loss" (Weintraub et al.). M = `mesh.dp`
workers run in `shard_map` over the `dp` axis; every state leaf carries a leading worker axis,
so each worker keeps its own parameters and optimizer state and they may drift apart.

One step, on every worker m:
1. the gradient of its own data shard at its own parameters;
2. aggregation: the exact mean, or, with packet loss (`paft.loss.p`), the mean of the packets
   that reached m (renormalized, zero-filled or stale; drops independent or in bursts along
   the packet sequence);
3. the per-worker error of Definition 2.1, eps_m ~ N(0, sigma2) per coordinate (with an
   accidental large variance every `large_every` steps; one threefry normal draw over all
   the gradient's coordinates), then the fault engine's `collective/grad_allreduce` site (bit
   corruption of the received gradient);
4. the optimizer update; with lossy owner broadcasts (`paft.loss.param_p`) each worker's copy
   of a packet it does not own is the owner's new value or, if the broadcast was lost, stale;
5. PAFT-Sync: every H steps the parameters (and with `sync_opt_state` the optimizer state) are
   averaged; with `overlap` the average launched at step t replaces the copies at step t+1
   (Algorithm 2: the update of step t+1 starts from it, with gradients taken at the old
   copies); PAFT-Dyn sets the next H from the error estimated from the divergence.

H, the next sync step and the estimates live in the state and decide through `lax.cond`: the
step compiles once and never waits for the host. Metrics leave as replicated scalars.
Definition 2.1's error, the average, the divergence and the schedule of averages are in
`paft/divergence.py`, packet loss in `paft/packets.py`; `paft/checks.py` refuses settings
that cannot work.

Collectives per step: the exact mean is one all-reduce that also carries the per-worker losses
and gradient norms (the metrics) and, with overlap, the divergence an applied average removed
(Algorithm 2's all-reduce for the next H, line 11). An overlapped average is one all-reduce of
the copies at the start of the step that applies it: it needs nothing from that step's
gradient, and the gradients' all-reduce waits for it, since it carries the divergence it
removed. PAFT-Dyn with overlap thus adds one all-reduce per step to data-parallel training
(none on the steps that apply no average). Without overlap an average follows the update and
its divergence needs an all-reduce of its own. A trainer that never averages (no
`sync_every`, not dynamic) compiles no average.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdcstudy.core import config as C
from sdcstudy.core import mesh as M
from sdcstudy.core import model
from sdcstudy.paft import divergence as DV
from sdcstudy.paft import packets
from sdcstudy.paft.checks import check_config
from sdcstudy import features as FT
from sdcstudy.core.compose import (accumulate_gradients, apply_update, feature_loss,
                                   init_sinks, open_step)
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.step import Place, Records, StepOut, Where, stream_key
from sdcstudy.core.train import learning_rate_schedule, make_optimizer

LOSS_KEY = "loss/mean"
REPORTED = ("faults",)  # the workers' fault counters, zeros when healthy
GRAD_SITE = "collective/grad_allreduce"
PAFT_SITES = ("grad", GRAD_SITE, "update")


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree):
    return jax.tree.map(lambda x: x[None], tree)


# --- the trainer ------------------------------------------------------------------------------


@dataclass
class PaftTrainer:
    cfg: Config
    dims: C.ModelDims
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    mesh: jax.sharding.Mesh
    faults: Any = None
    opt_floats: int = 0  # float elements of one worker's optimizer state
    loss_key: str = LOSS_KEY

    @classmethod
    def from_config(cls, cfg: Config, mesh=None) -> "PaftTrainer":
        check_config(cfg)
        dims = C.model_dims(cfg.model)
        graphdef, abstract = model.abstract_init(dims)
        steps = cfg.experiment.steps
        faults = FT.FEATURES["faults"].from_config(cfg, dims, fault_kind="profile")
        profile = None if faults is None else faults.profile
        bad = [] if profile is None else [s.site for s in profile.specs
                                          if s.base_rate > 0 and s.site not in PAFT_SITES]
        if bad:
            raise UserError(f"paft mode corrupts gradients in aggregation only, so profile "
                            f"{profile.name!r} may use the sites {', '.join(PAFT_SITES)}, "
                            f"not {bad[0]!r}.")
        tx = make_optimizer(cfg.optim, steps)
        opt_shapes = jax.eval_shape(tx.init, abstract)
        opt_floats = sum(math.prod(x.shape) for x in jax.tree.leaves(opt_shapes)
                         if jnp.issubdtype(x.dtype, jnp.floating))
        mesh = mesh or M.make_mesh(1, cfg.mesh.dp, 1)
        return cls(cfg, dims, graphdef, tx, learning_rate_schedule(cfg.optim, steps), mesh,
                   faults, opt_floats)

    @property
    def workers(self) -> int:
        return self.cfg.mesh.dp

    @property
    def averages(self) -> bool:
        """Whether the copies are ever averaged (PAFT-Sync or PAFT-Dyn): without, the step
        compiles no average at all."""
        c = self.cfg.paft
        return c.sync_every > 0 or c.dynamic

    @property
    def first_h(self) -> int:
        c = self.cfg.paft
        return c.sync_every if c.sync_every > 0 else (c.h_min if c.dynamic else 0)

    # --- state ---------------------------------------------------------------------------

    def init_state(self, seed: int | None = None) -> dict:
        """Every worker starts from the seed's parameters. `seed` replaces the run seed for
        the random draws of the step (noise, drops), not for the initial parameters."""
        seed = self.cfg.experiment.seed if seed is None else seed
        key = jax.random.key(self.cfg.experiment.seed)
        params = model.init_params(self.dims, stream_key(key, "params"))
        return self._init_fn(params, jax.random.key_data(jax.random.key(seed)),
                             self._paft_state())

    def _paft_state(self) -> dict:
        """The PAFT counters and error levels a run starts from: arguments of the initializer,
        not constants in it, so that runs which differ only in them share one compiled
        initializer (and XLA's persistent compilation cache)."""
        zero_f, zero_i = jnp.float32(0), jnp.int32(0)
        return {"next_sync": jnp.int32(self.first_h), "H": jnp.int32(self.first_h),
                "since": zero_i, "lr2": zero_f, "pending": zero_i, "div": zero_f,
                "div_max": zero_f, "sigma2_est": zero_f, **self._noise_state()}

    @functools.cached_property
    def _init_fn(self):
        """The state's initializer, compiled once per trainer (tests start many states)."""
        m = self.workers

        def init(params, key_data, paft):
            stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * m), t)  # noqa: E731
            state = {"params": stack(params), "opt_state": stack(self.tx.init(params)),
                     "step": jnp.int32(0), "key": key_data, "paft": paft}
            if self.cfg.paft.loss.p > 0 and self.cfg.paft.loss.aggregate == "stale":
                state["prev_grad"] = jax.tree.map(jnp.zeros_like, stack(params))
            return state

        key_shape = jax.ShapeDtypeStruct((2,), jnp.uint32)
        shapes = jax.eval_shape(init, model.abstract_init(self.dims)[1], key_shape,
                                self._paft_state())
        return jax.jit(init, out_shardings=self.state_shardings(shapes))

    def state_specs(self, state):
        worker = lambda t: jax.tree.map(lambda _: P(M.DATA), t)  # noqa: E731
        specs = {k: worker(v) for k, v in state.items() if k in ("params", "opt_state",
                                                                  "prev_grad")}
        specs.update(step=P(), key=P(), paft=jax.tree.map(lambda _: P(), state["paft"]))
        return specs

    def state_shardings(self, state):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs(state),
                            is_leaf=lambda x: isinstance(x, P))

    # --- pieces of the step --------------------------------------------------------------

    @property
    def features(self) -> list:
        """The workers' step features (faults at the tree sites only: `PAFT_SITES`)."""
        return FT.active(self)

    def _model_loss(self, params, batch, hook):
        return model.token_losses(self.graphdef, params, batch["tokens"], hook=hook)

    def _noise_state(self) -> dict:
        """The error levels as state, not constants: runs that differ only in them share one
        compiled step (and XLA's persistent compilation cache)."""
        n = self.cfg.paft.noise
        return {"sigma2": jnp.float32(n.sigma2), "large_sigma2": jnp.float32(n.large_sigma2),
                "large_every": jnp.int32(n.large_every),
                "loss_p": jnp.float32(self.cfg.paft.loss.p)}

    def _noise(self, tree, ctl, key, step, me):
        """Definition 2.1's error on this worker's aggregate (`divergence.add_noise`)."""
        if not DV.adds_noise(self.cfg.paft.noise):
            return tree
        key = jax.random.fold_in(jax.random.fold_in(stream_key(key, "paft/noise"), step), me)
        return DV.add_noise(tree, ctl, step, key)

    def _lossy_mean(self, grads, prev, loss_p, key, step, me):
        """Each worker's aggregate of the packets that reached it (and the new stale memory)."""
        key = jax.random.fold_in(jax.random.fold_in(stream_key(key, "paft/loss"), step), me)
        return packets.lossy_mean(grads, prev, self.cfg.paft.loss, loss_p, key, me)

    def _broadcast(self, new, old, key, step, me):
        """The owners' broadcast of the updated copies, lost with probability param_p."""
        key = jax.random.fold_in(jax.random.fold_in(stream_key(key, "paft/broadcast"), step),
                                 me)
        return packets.lossy_broadcast(new, old, self.cfg.paft.loss, key, me)

    # --- the step ------------------------------------------------------------------------

    def _local_step(self, state, batch):
        c, m = self.cfg.paft, self.workers
        me = lax.axis_index(M.DATA)
        params, opt = _squeeze(state["params"]), _squeeze(state["opt_state"])
        ctl = state["paft"]
        step = state["step"] + 1
        lr = self.schedule(state["step"])
        key = jax.random.wrap_key_data(state["key"])

        zero = jnp.float32(0)
        sync_opt = c.sync_opt_state
        # An average touches the optimizer state only with sync_opt_state; otherwise it stays
        # out of the branches (no copy of it through them).
        params_in, opt_in = params, (opt if sync_opt else ())
        # With overlap, the average launched last step replaces the copies before this step's
        # update, which starts from the mean. It needs nothing from this step's gradient. A
        # trainer that never averages has nothing to apply.
        average_before_update = c.overlap and self.averages
        applied = ctl["pending"] > 0

        where_of = lambda microstep: Where(key, step, microstep, dp_axis=M.DATA)  # noqa: E731
        loss, grads, records_M = accumulate_gradients(
            feature_loss(self.features, self._model_loss, where_of), params, batch,
            init_sinks(self.features))
        # Summed over the workers together with the gradients: each worker's loss in its own
        # slot, and the norm of its own gradient (before its faults).
        stats = {"loss_M": DV.in_slot(loss, m), "norm": optax.tree.norm(grads)}
        features = open_step(self.features, where_of(jnp.int32(-1)), records_M)
        grads = features.transform_grads(grads)

        # A conditional that holds collectives (an average, the divergence) must be ordered by
        # a data edge against every other collective of the step (core.mesh.after): a program
        # loaded from the compilation cache keeps data edges where XLA:CPU's order is lost.
        lossy, new_prev = c.loss.p > 0, None
        if lossy:  # each worker aggregates the packets that reached it, in all-gathers
            prev = _squeeze(state["prev_grad"]) if "prev_grad" in state else None
            grads, new_prev = self._lossy_mean(grads, prev, ctl["loss_p"], key, step, me)
            stats = lax.psum(stats, M.DATA)
        if average_before_update:
            # The average's all-reduce comes first, so the divergence it removed rides in the
            # gradients' all-reduce below (as Algorithm 2's all-reduce for H would): one
            # all-reduce more than data-parallel training, not two. With lost packets it
            # follows the gradients' all-gathers, and the divergence goes in a small one.
            go = M.after(applied, grads, stats) if lossy else applied
            params_in, opt_in, stats["sq_M"] = DV.average(go, params, opt_in, m, gather=False)
            if lossy:
                stats["sq_M"] = lax.psum(stats["sq_M"], M.DATA)
        if not lossy:  # one all-reduce for the exact mean and the statistics
            grads, stats = lax.psum((grads, stats), M.DATA)
            grads = jax.tree.map(lambda g: M.vary(g / m, (M.DATA,)), grads)
        if average_before_update:
            pre_div, pre_max = DV.divergence_stats(stats["sq_M"], m)
        grad_norm = stats["norm"] / m  # the mean over workers of ||g_m||
        grads = self._noise(grads, ctl, key, step, me)
        if self.faults is not None:  # this topology's own site: the received aggregate
            grads = self.faults.transform_grads(grads, features.context("faults"), GRAD_SITE)

        opt_in = opt_in if sync_opt else opt
        new = apply_update(self.tx, {"params": params_in, "opt_state": opt_in,
                                     "step": state["step"]}, grads, features.transform_updates)
        new_params, new_opt = new["params"], new["opt_state"]
        if c.loss.param_p is not None:
            # A lost broadcast leaves the copy the worker held before this step's update:
            # with overlap, the average this step applied (params_in), not the copy it replaced.
            new_params = self._broadcast(new_params, params_in, key, step, me)

        if c.overlap:
            if not average_before_update:  # never averages: pending stays 0
                applied, pre_div, pre_max = jnp.bool_(False), zero, zero
        else:
            applied = ctl["next_sync"] == step
            if self.averages:
                new_params, opt_avg, (pre_div, pre_max) = DV.average(
                    M.after(applied, stats), new_params, new_opt if sync_opt else (), m)
                new_opt = opt_avg if sync_opt else new_opt
            else:  # next_sync stays 0: never applied
                pre_div, pre_max = zero, zero
        sched = DV.next_schedule(c, ctl, step, lr, applied, pre_div, grad_norm, m,
                                 self.dims.n_params)
        h, sigma2_est = sched["H"], sched["sigma2_est"]

        measure = applied
        if c.div_every:
            measure = measure | (step % c.div_every == 0)
            div, div_max = lax.cond(M.after(measure, stats), DV.divergence,
                                    lambda _: (ctl["div"], ctl["div_max"]), new_params)
        else:  # only what the averages measure anyway: the divergence they removed
            div = jnp.where(applied, pre_div, ctl["div"])
            div_max = jnp.where(applied, pre_max, ctl["div_max"])

        out_state = {"params": _unsqueeze(new_params), "opt_state": _unsqueeze(new_opt),
                     "step": new["step"], "key": state["key"],
                     "paft": {"next_sync": sched["next_sync"].astype(jnp.int32),
                              "H": h.astype(jnp.int32), "since": sched["since"].astype(jnp.int32),
                              "lr2": sched["lr2"].astype(jnp.float32),
                              "pending": sched["pending"], "div": div, "div_max": div_max,
                              "sigma2_est": sigma2_est,
                              **{k: ctl[k] for k in ("sigma2", "large_sigma2", "large_every",
                                                     "loss_p")}}}
        if new_prev is not None:
            out_state["prev_grad"] = _unsqueeze(new_prev)
        losses_M = stats["loss_M"]
        metrics = {**{f"loss/w{w}": losses_M[w] for w in range(m)},
                   LOSS_KEY: jnp.mean(losses_M), "div/mean_sq": div, "div/max": div_max,
                   "div/measured": measure.astype(jnp.float32),
                   "paft/sync": applied.astype(jnp.float32), "paft/H": h.astype(jnp.float32),
                   "paft/sigma2_est": sigma2_est, "grad/norm": grad_norm, "lr": lr}
        flags = {"sync": applied.astype(jnp.int32)}
        records = Records((name, jax.tree.map(lambda x: M.vary(x, (M.DATA,))[None], r))
                          for name, r in features.records().items())
        records["paft"] = flags
        return StepOut(out_state, metrics, records)

    def train_step(self, state, batch):
        specs = self.state_specs(state)
        step = jax.shard_map(self._local_step, mesh=self.mesh,
                             in_specs=(specs, {"tokens": P(None, M.DATA)}),
                             out_specs=StepOut(specs, P(), Records(
                                 [*((f.name, P(M.DATA)) for f in self.features),
                                  ("paft", P())])),
                             check_vma=True)
        return step(state, batch)

    # --- host-loop interface (shared with train.Trainer and paired.PairedTrainer) ---------

    @property
    def TABLES(self):
        return FT.tables(self.features, REPORTED)

    def shardings(self, state, batch):
        return self.state_shardings(state), {k: NamedSharding(self.mesh, P(None, M.DATA))
                                             for k in batch}

    def make_batch(self, tokens_MBL1) -> dict:
        return {"tokens": tokens_MBL1}

    def bytes_per_step(self) -> dict:
        """Bytes each worker sends, by the algorithm (not by how the simulation computes it):
        a ring all-reduce sends 2(M-1)/M of the payload; with packet loss every worker sends its
        gradient to each of the M-1 others; an owner broadcast sends (M-1)/M."""
        m, d, c = self.workers, self.dims.n_params, self.cfg.paft
        ring = 2 * (m - 1) / m
        grad = (m - 1) * 4 * d if c.loss.p > 0 else ring * 4 * d
        sync = ring * 4 * (d + (self.opt_floats if c.sync_opt_state else 0))
        broadcast = (m - 1) / m * 4 * d if c.loss.param_p is not None else 0
        return {"grad": round(grad), "sync": round(sync), "broadcast": round(broadcast)}

    def host_tables(self, step: int, records: dict) -> tuple[dict, dict]:
        """Host side, one step: the workers' feature rows (node: the worker), bytes sent."""
        tables, counters = FT.host(self.features, step, records,
                                   [Place((m,), node=m) for m in range(self.workers)],
                                   self.cfg.experiment.microsteps, REPORTED)
        b = self.bytes_per_step()
        return tables, {
            "bytes/grad": b["grad"], "bytes/sync": b["sync"] * int(records["paft"]["sync"]),
            "bytes/broadcast": b["broadcast"], **counters}

    def summarize(self, rows: list[dict]) -> dict:
        """Run-level PAFT numbers for summary.json."""
        if not rows:
            return {}
        last = rows[-1]
        return {"paft/syncs": int(sum(r.get("paft/sync", 0) for r in rows)),
                "paft/H_last": last.get("paft/H"), "div/mean_sq_last": last.get("div/mean_sq"),
                "div/mean_sq_max": max(r.get("div/mean_sq", 0) for r in rows),
                "loss/per_worker_last": [last[f"loss/w{m}"] for m in range(self.workers)]}


__all__ = ["PaftTrainer", "LOSS_KEY"]
