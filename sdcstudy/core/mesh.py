"""Mesh axes, defined once, and the one function that builds a mesh.

`node` pairs a trusted healthy replica (index 0) with a suspect one (index 1); `dp` holds
data-parallel workers; `tp` tensor-parallel ranks. Every axis is Auto so that `shard_map`
accepts inputs that jit placed (`jax.make_mesh` makes Explicit axes unless told otherwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

NODE, DATA, TP = "node", "dp", "tp"
AXES = (NODE, DATA, TP)
HEALTHY, SUSPECT = 0, 1


def _count(n: int, one: str, many: str | None = None) -> str:
    """"1 node", "2 nodes"; `many` for an irregular plural ("1 is", "2 are")."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def make_mesh(nodes: int = 1, dp: int = 1, tp: int = 1, devices=None) -> Mesh:
    """A (node, dp, tp) mesh over the first nodes*dp*tp devices (all processes' devices)."""
    devices = list(jax.devices() if devices is None else devices)
    need = nodes * dp * tp
    if len(devices) < need:
        from sdcstudy.core.config import UserError

        raise UserError(f"the mesh needs {need} devices (node={nodes} x dp={dp} x tp={tp}) but "
                        f"only {_count(len(devices), 'is', 'are')} visible; on CPU set "
                        f"XLA_FLAGS=--xla_force_host_platform_device_count={need}.")
    grid = np.array(devices[:need], dtype=object).reshape(nodes, dp, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def make_node_mesh(nodes: int = 1, dp: int = 1, tp: int = 1) -> Mesh:
    """`make_mesh`, but with several processes node i is process i's first dp*tp devices.

    Then every collective over `node` crosses between processes and none over `dp` or `tp`
    does: a pair of real hosts, each a whole training replica.
    """
    processes = jax.process_count()
    if processes == 1:
        return make_mesh(nodes, dp, tp)
    from sdcstudy.core.config import UserError

    if processes != nodes:
        raise UserError(f"a run on {processes} processes needs one node per process, but the "
                        f"mesh has {_count(nodes, 'node')}; start "
                        f"{_count(nodes, 'process', 'processes')}.")
    if short := devices_short(dp, tp):
        raise UserError(short)
    local = [sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)
             for process in range(processes)]
    return make_mesh(nodes, dp, tp, [d for devices in local for d in devices[:dp * tp]])


def devices_short(dp: int, tp: int) -> str | None:
    """The sentence for the first process of the run that holds fewer devices than one node
    needs (dp x tp; more are left unused), or None. Every process sees every process's
    devices, so every process finds the same one."""
    per_node = dp * tp
    for process in range(jax.process_count()):
        held = sum(d.process_index == process for d in jax.devices())
        if held < per_node:
            return (f"process {process} has {_count(held, 'device')} but a node needs "
                    f"{per_node} (dp={dp} x tp={tp}); on CPU set XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={per_node} on every process.")
    return None


def inside_shard_map() -> bool:
    """Whether the code being traced runs inside `shard_map` (its mesh has manual axes)."""
    return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def varying_axes(x) -> frozenset:
    """The manual mesh axes a value varies over inside `shard_map` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10 keeps them here; earlier versions on `.vma`
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary(tree, axes):
    """Every array of `tree` marked as varying over `axes` too: a no-op at run time. With
    check_vma=True it decides what out_specs may name and what autodiff sums."""
    def one(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def broadcast_from(x, index: int, axis: str):
    """Every device along `axis` gets the value of the device at `index`, bit for bit.

    A masked integer psum: exact for every bit pattern (a float psum would turn -0.0 into
    +0.0), and its result is invariant over `axis`, which `check_vma` needs for replicated
    outputs (an all-gather's result still counts as varying).
    """
    mine = jax.lax.axis_index(axis) == index
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis)
    uint = _UINT[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)
    total = jax.lax.psum(jnp.where(mine, bits, jnp.uint32(0)), axis)
    return jax.lax.bitcast_convert_type(total.astype(uint), x.dtype)


def after(pred, *trees):
    """`pred`, as a value XLA computes only once every float array of `trees` is computed.

    Gate a `lax.cond` whose branches hold collectives with it, `trees` the results of the
    step's other collectives that the branch does not already depend on. In a program
    compiled afresh, XLA:CPU keeps every device's collectives in one order through a
    scheduling edge between any two of them; a program loaded from JAX's persistent
    compilation cache loses the edges between a conditional's collectives and those outside
    it, so devices can enter different collectives, which meet in one rendezvous and abort
    the process (docs/developing.md, "A crash in programs loaded from the compilation
    cache"). A data edge survives loading. `(p & s) | (p & ~s)` is `p` for any `s`, and
    `s = x == x` reads `x` (a float may be NaN, so XLA cannot fold it away)."""
    for x in jax.tree.leaves(trees):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"after() reads float arrays; got {x.dtype}")
        first = jnp.ravel(x)[0]
        same = first == first
        pred = (pred & same) | (pred & ~same)
    return pred
