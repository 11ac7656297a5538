"""Gradient aggregation and parameter broadcasts without retransmission ("Distributed Training
under Packet Loss", Weintraub et al.), for PAFT mode's data-parallel workers in `shard_map`.

A tensor travels as packets of `paft.loss.packet_size` elements. In aggregation each receiver
sees the packets of the other workers that reached it (drops independent, or in bursts along
the packet sequence) and estimates the mean from them: renormalized over what arrived (exactly
unbiased, docs/paft.md section 5), lost packets as zeros, or lost packets replaced by the
receiver's previous aggregate. In a broadcast each packet has one owner worker, whose updated
value the others receive or, when it is lost, keep stale (section 4).

Functions of one worker's view: the caller runs them inside `shard_map` over `mesh.DATA` and
derives their keys.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core import mesh as M

AGGREGATES = ("renormalized", "zero", "stale")


def packetize(x, size: int):
    """A tensor as (packets, size), zero-padded at the end."""
    flat = x.reshape(-1)
    n = -(-flat.size // size)
    return jnp.pad(flat, (0, n * size - flat.size)).reshape(n, size)


def unpacketize(packets_NS, shape):
    return packets_NS.reshape(-1)[:math.prod(shape)].reshape(shape)


def arrival_mask(key, senders: int, packets: int, p: float, burst: float):
    """bool (senders, packets): which packets reach the receiver. Independent drops with
    probability p, or (burst > 0) a two-state chain along the packet sequence with loss rate p
    and mean run of lost packets `burst`: P(lost -> ok) = 1/burst, P(ok -> lost) chosen so the
    stationary loss rate is p, and the chain starts in its stationary state. `p` may be traced;
    `burst` is static (0 or not)."""
    if not burst:
        return ~jax.random.bernoulli(key, p, (senders, packets))
    recover = 1.0 / burst
    fall = p * recover / (1 - p)
    k0, k1 = jax.random.split(key)
    lost0 = jax.random.bernoulli(k0, p, (senders,))
    u_NS = jax.random.uniform(k1, (packets, senders))

    def advance(lost, u):
        lost = jnp.where(lost, u >= recover, u < fall)
        return lost, lost

    _, lost_rest = lax.scan(advance, lost0, u_NS[1:])
    lost_NS = jnp.concatenate([lost0[None], lost_rest], axis=0)
    return ~lost_NS.T


def aggregate_packets(g_MNS, arrived_MN, me, mode: str, prev_NS=None):
    """Receiver `me`'s estimate of the mean of the M senders' packets (M, N, S).

    Its own gradient never crosses the network (`arrived[me]` is ignored). renormalized: own
    gradient weight 1/M, the others' (M-1)/M spread over those that arrived, the own gradient
    alone when none did; exactly unbiased for the mean given at least one arrival
    (docs/paft.md). zero: lost packets count as zeros. stale: a lost packet is replaced by the
    receiver's previous aggregate `prev_NS`.
    """
    m = g_MNS.shape[0]
    is_me_M = jnp.arange(m) == me
    others_MN = arrived_MN & ~is_me_M[:, None]
    count_N = jnp.sum(others_MN, axis=0)
    if mode == "renormalized":
        some_N = count_N > 0
        w_other_N = jnp.where(some_N, (m - 1) / (m * jnp.maximum(count_N, 1)), 0.0)
        w_MN = jnp.where(is_me_M[:, None], jnp.where(some_N, 1.0 / m, 1.0)[None],
                         others_MN * w_other_N[None])
    else:
        w_MN = jnp.where(is_me_M[:, None], 1.0 / m, others_MN / m)
    out_NS = jnp.einsum("mn,mns->ns", w_MN.astype(g_MNS.dtype), g_MNS)
    if mode == "stale":
        out_NS = out_NS + ((m - 1 - count_N) / m).astype(g_MNS.dtype)[:, None] * prev_NS
    return out_NS


def lossy_mean(grads, prev, loss, loss_p, key, me):
    """(aggregate, new stale memory): worker `me`'s estimate of the workers' mean of `grads`
    from the packets that reached it, under `loss` (`paft.loss`) with drop rate `loss_p` (may
    be traced). `prev`, the previous aggregate, is the stale memory (None: not kept)."""
    workers = lax.axis_size(M.DATA)
    leaves, treedef = jax.tree.flatten(grads)
    prev_leaves = jax.tree.leaves(prev) if prev is not None else [None] * len(leaves)
    out = []
    for i, (g, pv) in enumerate(zip(leaves, prev_leaves)):
        pk_NS = packetize(g, loss.packet_size)
        all_MNS = lax.all_gather(pk_NS, M.DATA)
        arrived_MN = arrival_mask(jax.random.fold_in(key, i), workers, pk_NS.shape[0], loss_p,
                                  loss.burst)
        prev_NS = None if pv is None else packetize(pv, loss.packet_size)
        agg_NS = aggregate_packets(all_MNS, arrived_MN, me, loss.aggregate, prev_NS)
        out.append(unpacketize(agg_NS, g.shape))
    agg = jax.tree.unflatten(treedef, out)
    return agg, (agg if prev is not None else None)


def lossy_broadcast(new, old, loss, key, me):
    """Worker `me`'s copy after the owners broadcast `new`: packet k belongs to worker
    (k mod M) (numbered across leaves); its owner's new value reaches each other worker with
    probability 1 - `loss.param_p`, which otherwise keeps its copy `old` from before the step."""
    workers = lax.axis_size(M.DATA)
    new_leaves, treedef = jax.tree.flatten(new)
    out, offset = [], 0
    for i, (x, x_old) in enumerate(zip(new_leaves, jax.tree.leaves(old))):
        new_NS, old_NS = packetize(x, loss.packet_size), packetize(x_old, loss.packet_size)
        n = new_NS.shape[0]
        mine_N = (jnp.arange(n) + offset) % workers == me
        offset += n
        owner_NS = lax.psum(jnp.where(mine_N[:, None], new_NS, 0), M.DATA)
        got_N = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - loss.param_p, (n,)) | mine_N
        out.append(unpacketize(jnp.where(got_N[:, None], owner_NS, old_NS), x.shape))
    return jax.tree.unflatten(treedef, out)
