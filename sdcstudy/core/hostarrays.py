"""Arrays of a run of several processes (`distributed`), as the host side needs them.

- `put` builds global arrays from host values that every process holds in full.
- `fetch` copies arrays to host numpy on every process, gathering the pieces that live on
  other processes' devices; every process must call it at the same point of the run.

In one process both are `jax.device_put` and `jax.device_get`.
"""

from __future__ import annotations

import functools

import numpy as np


def _is_sharding(x) -> bool:
    import jax

    return isinstance(x, jax.sharding.Sharding)


def put(tree, shardings):
    """`tree` (host values every process holds in full, or jax arrays) placed on `shardings`
    (a tree, or a prefix of it): each process fills only its own devices' pieces."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put_leaf(sharding, x):
        if isinstance(x, jax.Array):
            same = x.sharding.is_equivalent_to(sharding, x.ndim)
            return x if same else jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(lambda s, sub: jax.tree.map(functools.partial(put_leaf, s), sub),
                        shardings, tree, is_leaf=_is_sharding)


@functools.cache
def _replicator(shardings):
    import jax

    return jax.jit(lambda *xs: xs, out_shardings=shardings)


def fetch(tree):
    """Host numpy copies of `tree`'s arrays on every process, `jax.device_get` alike.

    Arrays held only in part by this process are gathered in one collective program, so every
    process must call `fetch` on the same tree at the same point of the run.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    if jax.process_count() == 1:
        return jax.device_get(tree)
    leaves, treedef = jax.tree.flatten(tree)
    spread = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)
              and not x.is_fully_addressable and not x.is_fully_replicated]
    named = [i for i in spread if isinstance(leaves[i].sharding, NamedSharding)]
    if named:
        replicated = tuple(NamedSharding(leaves[i].sharding.mesh, PartitionSpec())
                           for i in named)
        for i, x in zip(named, _replicator(replicated)(*(leaves[i] for i in named))):
            leaves[i] = x
    for i in set(spread) - set(named):
        from jax.experimental import multihost_utils

        leaves[i] = multihost_utils.process_allgather(leaves[i], tiled=True)

    def host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return jax.device_get(x)

    return jax.tree.unflatten(treedef, [host(x) for x in leaves])
