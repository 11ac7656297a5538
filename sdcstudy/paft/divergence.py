"""How PAFT mode's worker copies drift apart and are brought back together, on one worker's
view inside `shard_map` over `mesh.DATA`.

"Identifying and mitigating errors in gradient aggregation of distributed data parallel
training" (PAFT): Definition 2.1's error, eps_m ~ N(0, sigma2) per coordinate (`add_noise`),
moves each worker's copy of the parameters away from the others'; the divergence
||theta_bar - theta_m||^2 measures how far (`divergence`); PAFT-Sync averages the copies, and
with `sync_opt_state` the optimizer states, in one all-reduce (`average`); the schedule says
when (`next_schedule`): every H steps, with PAFT-Dyn's H set on each average from the error
estimated from the divergence that average removed (Algorithm 2, lines 10-12, `next_h`).
`paft/trainer.py` composes them into the step and derives their keys.

An average with `gather=False` leaves the divergence it removed in this worker's slot of an
M-vector (`in_slot`), for the caller to sum in an all-reduce it makes anyway (the
gradients'): that is how an overlapped average saves Algorithm 2's all-reduce for the next H.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core import mesh as M


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


def in_slot(x, workers: int):
    """This worker's scalar `x` in its own slot of an M-vector: summed over the workers,
    the vector holds every worker's value."""
    return jnp.where(jnp.arange(workers) == lax.axis_index(M.DATA), x, 0.0)


def divergence_stats(sq_M, workers: int):
    """(mean over workers, max over workers) of the workers' `sq`, from `in_slot`
    vectors summed over the workers."""
    return jnp.sum(sq_M) / workers, jnp.max(sq_M)


def average(applied, params, opt, workers: int, gather: bool = True):
    """Where `applied`, one all-reduce gives every worker the workers' mean of `params`
    and `opt` (the optimizer state with `sync_opt_state`, else `()`; non-float leaves such
    as step counts are kept). Returns (params, opt, divergence): the divergence the
    average removed, ||theta_bar - theta_m||^2 before it, 0 without one. With `gather`
    it is (mean over workers, max over workers), from a second all-reduce; without, this
    worker's value in its slot of an M-vector (`in_slot`), for the caller to sum over
    the workers in an all-reduce it makes anyway."""
    p_vecs, p_tree = _flatten_floats(params)
    o_vecs, o_tree = _flatten_floats(opt)

    def average(p_vecs, o_vecs):
        p_sums, o_sums = lax.psum((p_vecs, o_vecs), M.DATA)
        mean = lambda x: M.vary(x / workers, (M.DATA,))  # noqa: E731
        p_means = jax.tree.map(mean, p_sums)
        sq = sum(jnp.sum(jnp.square((p_means[k] - p_vecs[k]).astype(jnp.float32)))
                 for k in p_vecs)
        sq_M = in_slot(sq, workers)
        div = divergence_stats(lax.psum(sq_M, M.DATA), workers) if gather else sq_M
        return p_means, jax.tree.map(mean, o_sums), div

    def keep(p_vecs, o_vecs):
        zero = jnp.float32(0)
        return p_vecs, o_vecs, ((zero, zero) if gather
                                else M.vary(jnp.zeros(workers), (M.DATA,)))

    p_vecs, o_vecs, div = lax.cond(applied, average, keep, p_vecs, o_vecs)
    return p_tree(p_vecs), o_tree(o_vecs), div


def divergence(params):
    """(mean over workers, max over workers) of ||theta_bar - theta_m||^2, computed from
    the deviations from worker 0's copy, ||(x - ref) - mean(x - ref)||^2: copies that agree
    bit for bit give exactly 0, for any M, and small divergences do not cancel against
    the parameters' size."""
    sq = jnp.float32(0)
    for x in jax.tree.leaves(params):
        dev = x - M.broadcast_from(x, 0, M.DATA)
        sq = sq + jnp.sum(jnp.square((dev - lax.pmean(dev, M.DATA)).astype(jnp.float32)))
    return lax.pmean(sq, M.DATA), lax.pmax(sq, M.DATA)


def adds_noise(noise) -> bool:
    """Whether the error settings `paft.noise` add any error (else the step draws none)."""
    return noise.sigma2 != 0 or bool(noise.large_every and noise.large_sigma2)


def add_noise(tree, ctl, step, key):
    """Definition 2.1: this worker's error, N(0, sigma2) per coordinate (the large variance
    on every `large_every`-th step), with the levels from the state `ctl` and `key` this
    worker's key for this step."""
    every = ctl["large_every"]
    large = (every > 0) & (step % jnp.maximum(every, 1) == 0)
    std = jnp.sqrt(jnp.where(large, ctl["large_sigma2"], ctl["sigma2"]))
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


def next_h(pre_div, lr2, grad_norm, paft, workers: int, n_params: int):
    """PAFT-Dyn (Algorithm 2, lines 10-12): the error estimated from the divergence, then
    H = ||g|| / ||eps||, the gradient's norm over the estimated error's, within bounds
    (`paft.h_min`, `paft.h_max`).

    For plain SGD, E[div] = sum_s lr_s^2 d sigma2 (M-1)/M over the noisy steps since the
    copies agreed (docs/paft.md), so sigma2 = div M / (sum lr^2 d (M-1));
    ||eps|| = sqrt(d sigma2)."""
    c, m, d = paft, workers, n_params
    denom = lr2 * d * (m - 1)
    sigma2 = jnp.where(denom > 0, pre_div * m / jnp.maximum(denom, 1e-30), 0.0)
    noise_norm = jnp.sqrt(d * sigma2)
    h = jnp.where(noise_norm > 0, jnp.ceil(grad_norm / jnp.maximum(noise_norm, 1e-30)),
                  c.h_max)
    return jnp.clip(h, c.h_min, c.h_max).astype(jnp.int32), sigma2.astype(jnp.float32)


def next_schedule(paft, ctl, step, lr, applied, pre_div, grad_norm, workers: int,
                  n_params: int) -> dict:
    """The averaging schedule after `step`, from the control state `ctl` before it: `applied`
    says whether the step averaged the copies and `pre_div` is the divergence that removed.

    Returns the new `next_sync` (the step that applies the next average; with `overlap`, the
    one that launches it), `H`, `since` and `lr2` (steps and sum of lr^2 since the copies last
    agreed), `pending` (with overlap: an average launched now, for the next step to apply)
    and `sigma2_est` (PAFT-Dyn's estimate of the error, with which it sets H on each average)."""
    c = paft
    next_sync, h, sigma2_est = ctl["next_sync"], ctl["H"], ctl["sigma2_est"]
    pending = ctl["pending"]
    if c.overlap:  # the average replaced the copies before this step's update
        lr2_pre = ctl["lr2"]
        since = jnp.where(applied, 1, ctl["since"] + 1)
        lr2 = jnp.where(applied, lr ** 2, ctl["lr2"] + lr ** 2)
    else:
        since_pre, lr2_pre = ctl["since"] + 1, ctl["lr2"] + lr ** 2
        since = jnp.where(applied, 0, since_pre)
        lr2 = jnp.where(applied, 0.0, lr2_pre)
    if c.dynamic:
        h_new, s2 = next_h(pre_div, lr2_pre, grad_norm, c, workers, n_params)
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
    return {"next_sync": next_sync, "H": h, "since": since, "lr2": lr2, "pending": pending,
            "sigma2_est": sigma2_est}
