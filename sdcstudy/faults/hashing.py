"""The fault engine's random numbers, several draws to one hash: bit for bit the keys, bits,
uniforms, Bernoulli draws and int32 `randint`s `jax.random` makes from threefry keys (JAX's
default key, with `jax_threefry_partitionable`, its default), with far fewer hashes in the
compiled step.

Every one of those draws is the threefry2x32 hash H(key, counter) of 64-bit counters: `split(key,
n)[i]` and `fold_in(key, i)` are the two words of H(key, i), and element i of `bits(key, shape)`
is their exclusive or. On the CPU, XLA compiles each hash as a loop of its own, some ten kernels;
a fault site made about twenty of them (a chain of `fold_in`s for its key, then a dozen splits
and draws), most of what a site costs to compile. Here draws that do not depend on one another
are one hash over their counters laid end to end, and a chain of `fold_in`s is one loop over its
data. `tests/test_fault_hashing.py` holds each function to `jax.random`'s own, bit for bit.

Keys are raw key data: uint32 arrays of shape (2,).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.extend.random import threefry2x32_p

from sdcstudy.core.mesh import vary, varying_axes

MANTISSA_SHIFT = 9  # float32: 32 random bits less 23 mantissa bits
ONE_BITS = 0x3F800000  # the bits of 1.0 in float32


def hashes(requests):
    """[(key, n)] -> [(w1, w2)]: the two words of H(key, c) for the counters c = 0 .. n-1 of
    each request (where n is a uint32 vector, for the counters it holds: element i of a draw
    is the hash of counter i alone, so any of its elements can be drawn by itself), all
    requests in one hash."""
    counters = [jnp.arange(n, dtype=jnp.uint32) if isinstance(n, (int, np.integer)) else n
                for _, n in requests]
    k1 = jnp.concatenate([jnp.broadcast_to(key[0], c.shape)
                          for (key, _), c in zip(requests, counters)])
    k2 = jnp.concatenate([jnp.broadcast_to(key[1], c.shape)
                          for (key, _), c in zip(requests, counters)])
    low = jnp.concatenate(counters)
    # The hash keeps no record of the mesh axes its operands vary over (inside `shard_map`).
    axes = frozenset().union(*(varying_axes(key) for key, _ in requests),
                             *(varying_axes(c) for c in counters))
    w1, w2 = vary(_threefry(k1, k2, low), axes)
    out, start = [], 0
    for c in counters:
        n = c.shape[0]
        out.append((w1[start:start + n], w2[start:start + n]))
        start += n
    return out


@custom_vmap
def _threefry(k1, k2, low):
    """The two words of H((k1, k2), low) for uint32 vectors, the counters' high words 0."""
    return tuple(threefry2x32_p.bind(k1, k2, jnp.zeros_like(low), low))


@_threefry.def_vmap
def _threefry_stack(size: int, batched, k1, k2, low):
    """A stack of hashes as one hash of their counters laid end to end: XLA's CPU backend
    unrolls the loops of a (stack, few counters) hash for each stacked row, which made the
    stacked draws of small keys (splits of 2 and 3) compile for seconds."""
    rows = [a if b else jnp.broadcast_to(a, (size, *a.shape)) for a, b in
            zip((k1, k2, low), batched)]
    w1, w2 = _threefry(*(a.reshape(-1) for a in rows))
    return (w1.reshape(rows[0].shape), w2.reshape(rows[0].shape)), (True, True)


def as_keys(words):
    """The keys `jax.random.split` gives from the same hash: (n, 2)."""
    return jnp.stack(words, axis=-1)


def as_bits(words, shape):
    """The bits `jax.random.bits(key, shape)` gives from the hash of its key."""
    return (words[0] ^ words[1]).reshape(shape)


def split(key, n: int):
    """`jax.random.split(key, n)`'s key data."""
    return as_keys(hashes([(key, n)])[0])


def bits(requests):
    """[(key, shape)] -> `jax.random.bits(key, shape)` of each (uint32), in one hash."""
    words = hashes([(key, math.prod(shape)) for key, shape in requests])
    return [as_bits(w, shape) for w, (_, shape) in zip(words, requests)]


def fold_in(key, data):
    """`jax.random.fold_in(key, d)` for each d of `data` (a list of scalars or a uint32
    vector) in turn, as one loop: the key data.
    (Inside `shard_map` the key varies over every mesh axis that a datum varies over.)"""
    data = (jnp.asarray(data, jnp.uint32) if hasattr(data, "shape")
            else jnp.stack([jnp.asarray(d, jnp.uint32) for d in data]))
    key = jnp.asarray(key, jnp.uint32)
    axes = varying_axes(data) | varying_axes(key)
    key = vary(key, axes)

    def fold(i, key):
        return vary(jnp.stack(threefry2x32_p.bind(key[0], key[1], jnp.uint32(0), data[i])), axes)

    return lax.fori_loop(0, data.shape[0], fold, key)


@partial(jax.jit, static_argnames=("lo", "hi"))
def uniform(bits, lo: float = 0.0, hi: float = 1.0):
    """`jax.random.uniform(key, shape, float32, lo, hi)` from `jax.random.bits(key, shape)`:
    the top 23 bits as the mantissa of a number in [1, 2), less 1, scaled to [lo, hi).
    Compiled as one program, as JAX's is: called outside `jit`, each operation would round
    alone, where a compiled program may contract the scaling's multiply and add."""
    ones = lax.bitcast_convert_type((bits >> jnp.uint32(MANTISSA_SHIFT)) | jnp.uint32(ONE_BITS),
                                    jnp.float32)
    lo, hi = np.float32(lo), np.float32(hi)  # their difference rounded to float32, as JAX's
    return lax.max(lo, (ones - np.float32(1.0)) * (hi - lo) + lo)


def bernoulli(bits, p: float):
    """`jax.random.bernoulli(key, p, shape)` from `jax.random.bits(key, shape)`."""
    return uniform(bits) < np.float32(p)


def randint(higher, lower, n: int):
    """`jax.random.randint(key, shape, 0, n)` (int32) from the bits of the two keys
    `jax.random.split(key)` gives, `higher` from the first: the two 32-bit draws as one
    64-bit number, reduced modulo n in 32-bit arithmetic as JAX reduces it."""
    span = np.uint32(n)
    multiplier = np.uint32((2 ** 16 % n) ** 2 % n)  # 2^32 mod n
    offset = ((higher % span) * multiplier + lower % span) % span
    return offset.astype(jnp.int32)
