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
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdcstudy.core import config as C
from sdcstudy.faults import inject as F
from sdcstudy.core import mesh as M
from sdcstudy.core import model
from sdcstudy.paft import packets
from sdcstudy.faults import profiles
from sdcstudy.core.config import Config, UserError
from sdcstudy.core.train import (
    accumulate_gradients, apply_update, learning_rate_schedule, make_optimizer)

LOSS_KEY = "loss/mean"
GRAD_SITE = "collective/grad_allreduce"
PAFT_SITES = ("grad", GRAD_SITE, "update")
# Streams folded into the run key: one per kind of randomness.
NOISE_STREAM, LOSS_STREAM, BROADCAST_STREAM, FAULT_STREAM = 2, 3, 4, 1


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree):
    return jax.tree.map(lambda x: x[None], tree)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _flatten_floats(tree):
    """(vectors, rebuild): the float leaves of `tree` raveled into one vector per dtype, and
    the function that gives the tree back from such vectors (other leaves as they were).

    One vector per dtype makes an average a handful of kernels instead of a few per tensor:
    on the simulated devices each kernel is paid per worker, one after the other. The
    slices that `rebuild` takes fuse into the consumers of the leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    order: dict[str, list[int]] = {}
    for i, x in enumerate(leaves):
        if _is_float(x):
            order.setdefault(jnp.dtype(x.dtype).name, []).append(i)
    vectors = {dtype: jnp.concatenate([leaves[i].reshape(-1) for i in idx])
               for dtype, idx in order.items()}

    def rebuild(vectors):
        out = list(leaves)
        for dtype, idx in order.items():
            offset = 0
            for i in idx:
                out[i] = lax.slice_in_dim(vectors[dtype], offset, offset + leaves[i].size
                                          ).reshape(leaves[i].shape)
                offset += leaves[i].size
        return jax.tree.unflatten(treedef, out)

    return vectors, rebuild


# --- the trainer ------------------------------------------------------------------------------


@dataclass
class PaftTrainer:
    cfg: Config
    dims: C.ModelDims
    graphdef: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    mesh: jax.sharding.Mesh
    injector: F.Injector | None = None
    opt_floats: int = 0  # float elements of one worker's optimizer state
    loss_key: str = LOSS_KEY

    @classmethod
    def from_config(cls, cfg: Config, mesh=None) -> "PaftTrainer":
        check_config(cfg)
        dims = C.model_dims(cfg.model)
        graphdef, abstract = model.abstract_init(dims)
        steps = cfg.experiment.steps
        profile = profiles.load(cfg.suspect.profile)
        injector = None
        if not profile.healthy:
            bad = [s.site for s in profile.specs if s.base_rate > 0 and s.site not in PAFT_SITES]
            if bad:
                raise UserError(f"paft mode corrupts gradients in aggregation only, so profile "
                                f"{profile.name!r} may use the sites {', '.join(PAFT_SITES)}, "
                                f"not {bad[0]!r}.")
            injector = F.Injector(profile, dims.n_layers, cfg.suspect.log_limit)
        tx = make_optimizer(cfg.optim, steps)
        opt_shapes = jax.eval_shape(tx.init, abstract)
        opt_floats = sum(math.prod(x.shape) for x in jax.tree.leaves(opt_shapes)
                         if jnp.issubdtype(x.dtype, jnp.floating))
        mesh = mesh or M.make_mesh(1, cfg.mesh.dp, 1)
        return cls(cfg, dims, graphdef, tx, learning_rate_schedule(cfg.optim, steps), mesh,
                   injector, opt_floats)

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
        return self._init_fn(jax.random.key_data(jax.random.key(seed)))

    @functools.cached_property
    def _init_fn(self):
        """The state's initializer, compiled once per trainer (tests start many states)."""
        m = self.workers

        def init(key_data):
            key = jax.random.key(self.cfg.experiment.seed)
            _, params = model.init(self.dims, jax.random.fold_in(key, 0))
            stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * m), t)  # noqa: E731
            state = {"params": stack(params), "opt_state": stack(self.tx.init(params)),
                     "step": jnp.int32(0), "key": key_data,
                     "paft": {"next_sync": jnp.int32(self.first_h), "H": jnp.int32(self.first_h),
                              "since": jnp.int32(0), "lr2": jnp.float32(0),
                              "pending": jnp.int32(0),
                              "div": jnp.float32(0), "div_max": jnp.float32(0),
                              "sigma2_est": jnp.float32(0), **self._noise_state()}}
            if self.cfg.paft.loss.p > 0 and self.cfg.paft.loss.aggregate == "stale":
                state["prev_grad"] = jax.tree.map(jnp.zeros_like, stack(params))
            return state

        key_shape = jax.ShapeDtypeStruct((2,), jnp.uint32)
        shapes = jax.eval_shape(init, key_shape)
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

    def _loss(self, params, sinks, batch, microstep):
        del sinks, microstep
        total, count = model.token_losses(self.graphdef, params, batch["tokens"])
        return total, (count, {})

    def _average(self, applied, params, opt, gather: bool = True):
        """Where `applied`, one all-reduce gives every worker the workers' mean of `params`
        and `opt` (the optimizer state with `sync_opt_state`, else `()`; non-float leaves such
        as step counts are kept). Returns (params, opt, divergence): the divergence the
        average removed, ||theta_bar - theta_m||^2 before it, 0 without one. With `gather`
        it is (mean over workers, max over workers), from a second all-reduce; without, this
        worker's value in its slot of an M-vector (`_in_slot`), for the caller to sum over
        the workers in an all-reduce it makes anyway."""
        p_vecs, p_tree = _flatten_floats(params)
        o_vecs, o_tree = _flatten_floats(opt)

        def average(p_vecs, o_vecs):
            p_sums, o_sums = lax.psum((p_vecs, o_vecs), M.DATA)
            mean = lambda x: M.vary(x / self.workers, (M.DATA,))  # noqa: E731
            p_means = jax.tree.map(mean, p_sums)
            sq = sum(jnp.sum(jnp.square((p_means[k] - p_vecs[k]).astype(jnp.float32)))
                     for k in p_vecs)
            sq_M = self._in_slot(sq)
            div = self._divergence_stats(lax.psum(sq_M, M.DATA)) if gather else sq_M
            return p_means, jax.tree.map(mean, o_sums), div

        def keep(p_vecs, o_vecs):
            zero = jnp.float32(0)
            return p_vecs, o_vecs, ((zero, zero) if gather
                                    else M.vary(jnp.zeros(self.workers), (M.DATA,)))

        p_vecs, o_vecs, div = lax.cond(applied, average, keep, p_vecs, o_vecs)
        return p_tree(p_vecs), o_tree(o_vecs), div

    def _in_slot(self, x):
        """This worker's scalar `x` in its own slot of an M-vector: summed over the workers,
        the vector holds every worker's value."""
        return jnp.where(jnp.arange(self.workers) == lax.axis_index(M.DATA), x, 0.0)

    def _divergence_stats(self, sq_M):
        """(mean over workers, max over workers) of the workers' `sq`, from `_in_slot`
        vectors summed over the workers."""
        return jnp.sum(sq_M) / self.workers, jnp.max(sq_M)

    def _divergence(self, params):
        """(mean over workers, max over workers) of ||theta_bar - theta_m||^2, computed from
        the deviations from worker 0's copy, ||(x - ref) - mean(x - ref)||^2: copies that agree
        bit for bit give exactly 0, for any M, and small divergences do not cancel against
        the parameters' size."""
        sq = jnp.float32(0)
        for x in jax.tree.leaves(params):
            dev = x - M.broadcast_from(x, 0, M.DATA)
            sq = sq + jnp.sum(jnp.square((dev - lax.pmean(dev, M.DATA)).astype(jnp.float32)))
        return lax.pmean(sq, M.DATA), lax.pmax(sq, M.DATA)

    def _noise_state(self) -> dict:
        """The error levels as state, not constants: runs that differ only in them share one
        compiled step (and XLA's persistent compilation cache)."""
        n = self.cfg.paft.noise
        return {"sigma2": jnp.float32(n.sigma2), "large_sigma2": jnp.float32(n.large_sigma2),
                "large_every": jnp.int32(n.large_every),
                "loss_p": jnp.float32(self.cfg.paft.loss.p)}

    def _noise(self, tree, ctl, key, step, me):
        """Definition 2.1: this worker's error, N(0, sigma2) per coordinate (the large variance
        on every `large_every`-th step)."""
        n = self.cfg.paft.noise
        if n.sigma2 == 0 and not (n.large_every and n.large_sigma2):
            return tree
        every = ctl["large_every"]
        large = (every > 0) & (step % jnp.maximum(every, 1) == 0)
        std = jnp.sqrt(jnp.where(large, ctl["large_sigma2"], ctl["sigma2"]))
        key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, NOISE_STREAM),
                                                    step), me)
        # One draw for the whole tree, cut into the leaves: a single generator kernel instead
        # of one per leaf (the draws are independent across coordinates either way). Threefry
        # with its sequential counter layout (`threefry_partitionable` off): the draw is local
        # to one worker and never sharded, and on CPU this layout makes the bits about twice
        # as fast as the partitionable one, which hashes two words per output.
        leaves, treedef = jax.tree.flatten(tree)
        with jax.threefry_partitionable(False):
            eps = std * jax.random.normal(key, (sum(x.size for x in leaves),))
        out, offset = [], 0
        for x in leaves:
            out.append(x + lax.slice_in_dim(eps, offset, offset + x.size).reshape(x.shape)
                       .astype(x.dtype))
            offset += x.size
        return jax.tree.unflatten(treedef, out)

    def _lossy_mean(self, grads, prev, loss_p, key, step, me):
        """Each worker's aggregate of the packets that reached it (and the new stale memory)."""
        key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, LOSS_STREAM), step),
                                 me)
        return packets.lossy_mean(grads, prev, self.cfg.paft.loss, loss_p, key, me)

    def _broadcast(self, new, old, key, step, me):
        """The owners' broadcast of the updated copies, lost with probability param_p."""
        key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, BROADCAST_STREAM),
                                                    step), me)
        return packets.lossy_broadcast(new, old, self.cfg.paft.loss, key, me)

    def _next_h(self, pre_div, lr2, grad_norm):
        """PAFT-Dyn (Algorithm 2, lines 10-12): the error estimated from the divergence, then
        H = ||g|| / ||eps||, the gradient's norm over the estimated error's, within bounds.

        For plain SGD, E[div] = sum_s lr_s^2 d sigma2 (M-1)/M over the noisy steps since the
        copies agreed (docs/paft.md), so sigma2 = div M / (sum lr^2 d (M-1));
        ||eps|| = sqrt(d sigma2)."""
        c, m, d = self.cfg.paft, self.workers, self.dims.n_params
        denom = lr2 * d * (m - 1)
        sigma2 = jnp.where(denom > 0, pre_div * m / jnp.maximum(denom, 1e-30), 0.0)
        noise_norm = jnp.sqrt(d * sigma2)
        h = jnp.where(noise_norm > 0, jnp.ceil(grad_norm / jnp.maximum(noise_norm, 1e-30)),
                      c.h_max)
        return jnp.clip(h, c.h_min, c.h_max).astype(jnp.int32), sigma2.astype(jnp.float32)

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

        loss, grads, _ = accumulate_gradients(self._loss, params, batch)
        # Summed over the workers together with the gradients: each worker's loss in its own
        # slot, and the norm of its own gradient.
        stats = {"loss_M": self._in_slot(loss), "norm": optax.tree.norm(grads)}
        records = {}
        transform_updates = lambda u: u  # noqa: E731
        ctx = None
        if self.injector is not None:
            ctx = F.FaultContext(jax.random.fold_in(key, FAULT_STREAM), step, jnp.int32(-1),
                                 dp_axis=M.DATA)
            grads = self.injector.corrupt_tree(grads, ctx, "grad")

        if average_before_update:
            # The average's all-reduce comes first, so the divergence it removed rides in the
            # gradients' all-reduce below (as Algorithm 2's all-reduce for H would): one
            # all-reduce more than data-parallel training, not two.
            params_in, opt_in, stats["sq_M"] = self._average(applied, params, opt_in,
                                                             gather=False)
        new_prev = None
        if c.loss.p > 0:  # each worker aggregates the packets that reached it
            prev = _squeeze(state["prev_grad"]) if "prev_grad" in state else None
            grads, new_prev = self._lossy_mean(grads, prev, ctl["loss_p"], key, step, me)
            stats = lax.psum(stats, M.DATA)
        else:  # one all-reduce for the exact mean and the statistics
            grads, stats = lax.psum((grads, stats), M.DATA)
            grads = jax.tree.map(lambda g: M.vary(g / m, (M.DATA,)), grads)
        if average_before_update:
            pre_div, pre_max = self._divergence_stats(stats["sq_M"])
        grad_norm = stats["norm"] / m  # the mean over workers of ||g_m||
        grads = self._noise(grads, ctl, key, step, me)
        if ctx is not None:
            grads = self.injector.corrupt_tree(grads, ctx, GRAD_SITE)
            transform_updates = partial(self.injector.corrupt_tree, ctx=ctx, site="update")
            records = ctx.records

        next_sync, h, sigma2_est = ctl["next_sync"], ctl["H"], ctl["sigma2_est"]
        if c.overlap:
            lr2_pre = ctl["lr2"]
        opt_in = opt_in if sync_opt else opt
        new = apply_update(self.tx, {"params": params_in, "opt_state": opt_in,
                                     "step": state["step"]}, grads, transform_updates)
        new_params, new_opt = new["params"], new["opt_state"]
        if c.loss.param_p is not None:
            new_params = self._broadcast(new_params, params, key, step, me)

        if c.overlap:
            if not average_before_update:  # never averages: pending stays 0
                applied, pre_div, pre_max = jnp.bool_(False), zero, zero
            pending = jnp.int32(0)
            since = jnp.where(applied, 1, ctl["since"] + 1)
            lr2 = jnp.where(applied, lr ** 2, ctl["lr2"] + lr ** 2)
        else:
            applied = next_sync == step
            if self.averages:
                new_params, opt_avg, (pre_div, pre_max) = self._average(
                    applied, new_params, new_opt if sync_opt else ())
                new_opt = opt_avg if sync_opt else new_opt
            else:  # next_sync stays 0: never applied
                pre_div, pre_max = zero, zero
            since_pre, lr2_pre = ctl["since"] + 1, ctl["lr2"] + lr ** 2
            since = jnp.where(applied, 0, since_pre)
            lr2 = jnp.where(applied, 0.0, lr2_pre)
        if c.dynamic:
            h_new, s2 = self._next_h(pre_div, lr2_pre, grad_norm)
            h = jnp.where(applied, h_new, h)
            sigma2_est = jnp.where(applied, s2, sigma2_est)
            if c.overlap:  # launched at step - 1, so the next launch is H after that
                next_sync = jnp.where(applied, step - 1 + h, next_sync)
        launch = next_sync == step
        if c.overlap:
            pending = launch.astype(jnp.int32)
            if not c.dynamic:
                next_sync = jnp.where(launch, step + h, next_sync)
        else:
            next_sync = jnp.where(applied, step + h, next_sync)

        measure = applied
        if c.div_every:
            measure = measure | (step % c.div_every == 0)
            div, div_max = lax.cond(measure, self._divergence,
                                    lambda _: (ctl["div"], ctl["div_max"]), new_params)
        else:  # only what the averages measure anyway: the divergence they removed
            div = jnp.where(applied, pre_div, ctl["div"])
            div_max = jnp.where(applied, pre_max, ctl["div_max"])

        out_state = {"params": _unsqueeze(new_params), "opt_state": _unsqueeze(new_opt),
                     "step": new["step"], "key": state["key"],
                     "paft": {"next_sync": next_sync.astype(jnp.int32), "H": h.astype(jnp.int32),
                              "since": since.astype(jnp.int32),
                              "lr2": lr2.astype(jnp.float32), "pending": pending if c.overlap
                              else ctl["pending"], "div": div, "div_max": div_max,
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
        blocks = jax.tree.map(lambda x: M.vary(x, (M.DATA,))[None], records)
        return out_state, metrics, blocks, flags

    def train_step(self, state, batch):
        specs = self.state_specs(state)
        step = jax.shard_map(self._local_step, mesh=self.mesh,
                             in_specs=(specs, {"tokens": P(None, M.DATA)}),
                             out_specs=(specs, P(), P(M.DATA), P()), check_vma=True)
        return step(state, batch)

    # --- host-loop interface (shared with train.Trainer and paired.PairedTrainer) ---------

    TABLES = ("faults.parquet",)

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

    def host_tables(self, step: int, extras) -> tuple[dict, dict]:
        records, flags = extras
        rows, overflow = [], 0
        if self.injector is not None:
            for m in range(self.workers):
                r, o = F.record_rows(jax.tree.map(lambda a: a[m], records), step, -1,
                                     self.injector.profile, node=m)
                rows += r
                overflow += o
        b = self.bytes_per_step()
        counters = {"bytes/grad": b["grad"], "bytes/sync": b["sync"] * int(flags["sync"]),
                    "bytes/broadcast": b["broadcast"], "faults/landed": len(rows) + overflow,
                    "faults/unlogged": overflow}
        return {"faults.parquet": rows}, counters

    def summarize(self, rows: list[dict]) -> dict:
        """Run-level PAFT numbers for summary.json."""
        if not rows:
            return {}
        last = rows[-1]
        return {"paft/syncs": int(sum(r.get("paft/sync", 0) for r in rows)),
                "paft/H_last": last.get("paft/H"), "div/mean_sq_last": last.get("div/mean_sq"),
                "div/mean_sq_max": max(r.get("div/mean_sq", 0) for r in rows),
                "loss/per_worker_last": [last[f"loss/w{m}"] for m in range(self.workers)]}


def check_config(cfg: Config) -> None:
    """One-sentence errors for PAFT settings that cannot work."""
    c, loss = cfg.paft, cfg.paft.loss
    if cfg.mesh.dp < 2:
        raise UserError(f"paft mode needs at least 2 workers (mesh.dp), not {cfg.mesh.dp}.")
    if cfg.mesh.tp != 1:
        raise UserError("paft mode runs data-parallel workers only; set mesh.tp=1.")
    checks = [("paft.noise.sigma2", c.noise.sigma2 >= 0, "non-negative"),
              ("paft.noise.large_sigma2", c.noise.large_sigma2 >= 0, "non-negative"),
              ("paft.noise.large_every", c.noise.large_every >= 0, "non-negative"),
              ("paft.sync_every", c.sync_every >= 0, "non-negative"),
              ("paft.div_every", c.div_every >= 0, "non-negative"),
              ("paft.h_min", c.h_min >= 1, "at least 1"),
              ("paft.h_max", c.h_max >= c.h_min, "at least paft.h_min"),
              ("paft.loss.p", 0 <= loss.p < 1, "in [0, 1)"),
              ("paft.loss.param_p", loss.param_p is None or 0 <= loss.param_p < 1,
               "in [0, 1) or null"),
              ("paft.loss.packet_size", loss.packet_size >= 1, "at least 1"),
              ("paft.loss.burst", loss.burst == 0 or loss.burst >= max(1.0, loss.p / (1 - loss.p)),
               "0 (independent drops) or a mean run length of at least 1 packet")]
    for key, ok, what in checks:
        if not ok:
            raise UserError(f"{key} must be {what}.")
    if loss.aggregate not in packets.AGGREGATES:
        raise UserError(f"paft.loss.aggregate {loss.aggregate!r} is not one of "
                        f"{', '.join(packets.AGGREGATES)}.")
    if c.dynamic and c.sync_every == 0 and c.h_min < 1:
        raise UserError("paft.dynamic needs paft.h_min >= 1.")


__all__ = ["PaftTrainer", "check_config", "LOSS_KEY"]
