"""Fault injection: seeded, replayable corruptions inside the jitted step, logged as ground truth.

What a fault is (`FaultSpec`, `Profile`): `faults/specs.py`, their YAML form
`faults/profile_yaml.py`, its `TimePattern` `faults/time_patterns.py`;
how one tensor is corrupted and recorded: `faults/corrupt.py`. The `Injector` turns a profile
into a `sites.Hook`: forward sites are corrupted where they are computed, backward sites
(`bwd/...`) through a custom VJP that corrupts the cotangent.

Every random draw derives from the run seed folded with (step, microstep, layer, site, spec,
tp rank), so a run replays the same faults. Every corruption that changes a bit is logged in
a fixed-size record per (site, layer, spec, microstep) that leaves the step without a host
sync: forward records through the loss function's aux output, backward records as the
cotangent of a zero "sink" input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core import sites as S
from sdcstudy.faults import hashing as H
from sdcstudy.faults.bits import to_bits
from sdcstudy.faults.corrupt import corrupt_and_record, corrupt_and_record_stacked
from sdcstudy.faults.records import RECORD_WIDTH, decode_record
from sdcstudy.faults.specs import (
    COLLECTIVE_SITES, MODEL_COLLECTIVES, TREE_SITES, FaultSpec, Profile, pattern_multiplier)


# --- the injector -----------------------------------------------------------------------------


@dataclass
class FaultContext:
    """What the injector needs from the step: where in the run we are, and where it records."""

    key: jax.Array  # the run's fault key (fold_in of the seed)
    step: jax.Array  # optimizer step being computed, counted from 1
    microstep: jax.Array
    sinks: dict | None = None  # backward record sinks (zeros), differentiated by the trainer
    records: dict = field(default_factory=dict)  # forward records, filled while tracing
    node_axis: str | None = None
    tp_axis: str | None = None
    dp_axis: str | None = None
    # Outside a node mesh axis: the node index of this computation (1 = the faulty device).
    node: jax.Array | None = None
    # Execution counter of this step on this device; transient specs fold it into their draws,
    # so re-executing a step draws new faults (None: every execution draws the same).
    attempt: jax.Array | None = None


def record_key(spec_index: int, site: str, layer: int) -> str:
    return f"{spec_index}|{site}|{layer}"


def parse_record_key(key: str) -> tuple[int, str, int]:
    index, site, layer = key.split("|")
    return int(index), site, int(layer)


class Injector:
    """Turns a profile into a hook. `Injector(profile).hook(ctx)` is used inside the step."""

    def __init__(self, profile: Profile, n_layers: int, limit: int = 64,
                 seed: int | None = None):
        self.profile = profile
        self.n_layers = n_layers
        self.limit = limit
        self.seed = seed  # suspect.fault_seed: folded into every draw when set
        self.model_specs = [(i, s) for i, s in enumerate(profile.specs)
                            if s.base_rate > 0 and s.direction in ("fwd", "bwd")]

        self.tree_specs = [(i, s) for i, s in enumerate(profile.specs)
                           if s.base_rate > 0 and s.direction == "tree"]

    @property
    def active(self) -> bool:
        return bool(self.model_specs)

    def corrupt_tree(self, tree, ctx: FaultContext, site: str):
        """Apply the profile's specs for a pytree site ("grad", "update") leaf by leaf.

        Leaves of one shape, dtype and set of varying mesh axes are corrupted as one stack
        (`corrupt_and_record_stacked`, bitwise each leaf's own corruption), so the program
        holds one copy of the draws per such group, not one per leaf."""
        from sdcstudy.core.digest import path_name
        from sdcstudy.core.mesh import varying_axes

        specs = [(i, s) for i, s in self.tree_specs if s.site == site]
        if not specs:
            return tree
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [leaf for _, leaf in paths_leaves]
        groups: dict = {}
        for leaf_index, leaf in enumerate(leaves):
            shape_key = (leaf.shape, leaf.dtype, frozenset(varying_axes(leaf)))
            groups.setdefault(shape_key, []).append(leaf_index)
        site_base = 1000 + (TREE_SITES + COLLECTIVE_SITES).index(site) * 100_000
        names = [f"{site}/{path_name(path)}" for path, _ in paths_leaves]
        records = {}
        for i, spec in specs:
            for (_, _, varying), members in groups.items():
                # A leaf replicated over dp or tp must stay replicated: draw the same faults.
                leaf_ctx = dataclasses.replace(
                    ctx, tp_axis=ctx.tp_axis if ctx.tp_axis in varying else None,
                    dp_axis=ctx.dp_axis if ctx.dp_axis in varying else None, records={})
                # Each leaf's key: one vmapped chain of fold_ins for the group.
                data = jnp.stack([self._key_data(leaf_ctx, i, spec, site_base + m, 0,
                                                 leaves[m]) for m in members])
                key_data = jax.vmap(partial(H.fold_in, jax.random.key_data(ctx.key)))(data)
                rate = self._rate(leaf_ctx, i, spec)
                outs = _corrupt_leaves([leaves[m] for m in members], key_data, rate, spec,
                                       self.limit)
                for m, (leaf, record) in zip(members, outs):
                    leaves[m] = leaf
                    records[(m, i)] = record
        for m, name in enumerate(names):  # in leaf order, as one leaf at a time made them
            for i, _ in specs:
                ctx.records[record_key(i, name, 0)] = records[(m, i)]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _layers(self, spec: FaultSpec, site: str) -> tuple[int, ...]:
        if site in S.MODEL_SITES:
            return (0,)
        return spec.layers if spec.layers is not None else tuple(range(1, self.n_layers + 1))

    def sink_shapes(self) -> dict[str, tuple[int, int]]:
        """Shapes of the backward-record sinks the trainer must create (zeros) and differentiate."""
        shapes = {}
        for i, spec in self.model_specs:
            direction, site = spec.resolve()
            if direction == "bwd":
                for layer in self._layers(spec, site):
                    shapes[record_key(i, site, layer)] = (self.limit + 1, RECORD_WIDTH)
        return shapes

    def init_sinks(self) -> dict:
        return {k: jnp.zeros(s, jnp.float32) for k, s in self.sink_shapes().items()}

    def _prefix(self, ctx: FaultContext, index: int, spec: FaultSpec) -> list:
        """What every draw of spec `index` folds into the run's fault key first."""
        data = [index]
        if self.seed is not None:
            data.append(self.seed)
        if spec.transient and ctx.attempt is not None:
            data.append(ctx.attempt)  # every execution draws afresh
        return data

    def _key_data(self, ctx: FaultContext, index: int, spec: FaultSpec, site_id: int,
                  layer: int, x) -> jax.Array:
        """The data folded into the run's fault key, in order, for one site (or leaf) and
        layer: (spec, seed, attempt, when, layer, site, dp rank, tp rank), as uint32."""
        data = self._prefix(ctx, index, spec)
        if spec.repeatable:
            # The corruption is a function of the input's bits, not of when it is computed.
            data.append(jnp.sum(to_bits(x).astype(jnp.uint32) * jnp.uint32(2654435761),
                                dtype=jnp.uint32))
        else:
            data += [ctx.step, ctx.microstep]
        data += [layer, site_id]
        if ctx.dp_axis is not None:
            data.append(lax.axis_index(ctx.dp_axis))
        if ctx.tp_axis is not None:
            data.append(lax.axis_index(ctx.tp_axis))
        return jnp.stack([jnp.asarray(d, jnp.uint32) for d in data])

    def _rate(self, ctx: FaultContext, index: int, spec: FaultSpec):
        """The spec's rate at this step on this device (0 where it is not enabled)."""
        # One burst draw per step and spec.
        pattern_key = H.fold_in(jax.random.key_data(ctx.key),
                                [*self._prefix(ctx, index, spec), ctx.step])
        multiplier = pattern_multiplier(spec.pattern, ctx.step,
                                        jax.random.wrap_key_data(pattern_key))
        if spec.repeatable and spec.pattern.kind == "constant":
            multiplier = jnp.float32(1)
        enabled = jnp.bool_(True)
        if ctx.node_axis is not None:
            enabled &= lax.axis_index(ctx.node_axis) == spec.node
        elif ctx.node is not None:
            enabled &= ctx.node == spec.node
        if ctx.tp_axis is not None and spec.tp_ranks is not None:
            enabled &= jnp.isin(lax.axis_index(ctx.tp_axis), jnp.asarray(spec.tp_ranks))
        return jnp.where(enabled, jnp.minimum(spec.base_rate * multiplier, 1.0), 0.0)

    def _rate_and_key(self, ctx: FaultContext, index: int, spec: FaultSpec, site_id: int,
                      layer: int, x):
        """(key data, rate) of one site and layer. The key is the run's fault key with
        `_key_data` folded in, one `fold_in` after another (`hashing.fold_in`: one loop)."""
        data = self._key_data(ctx, index, spec, site_id, layer, x)
        return H.fold_in(jax.random.key_data(ctx.key), data), self._rate(ctx, index, spec)

    def hook(self, ctx: FaultContext) -> S.Hook:
        if not self.active:
            return S.identity_hook
        by_site: dict[tuple[str, str], list[tuple[int, FaultSpec]]] = {}
        for i, spec in self.model_specs:
            direction, site = spec.resolve()
            for model_site in MODEL_COLLECTIVES.get(site, (site,)):
                by_site.setdefault((direction, model_site), []).append((i, spec))

        def inject(site: str, x, layer: int):
            for direction in ("fwd", "bwd"):
                for i, spec in by_site.get((direction, site), ()):
                    if layer not in self._layers(spec, site):
                        continue
                    site_id = _site_id(site, direction)
                    key_data, rate = self._rate_and_key(ctx, i, spec, site_id, layer, x)
                    name = record_key(i, site, layer)
                    if direction == "fwd":
                        x, ctx.records[name] = inject_value(x, key_data, rate, spec,
                                                            self.limit)
                    else:
                        x = inject_cotangent(x, ctx.sinks[name], key_data, rate, spec,
                                             self.limit)
            return x

        return inject


def _site_id(site: str, direction: str) -> int:
    """The number a model site folds into its draws: its index among the sites, plus 100 in
    the backward; the collectives' output sites count from 200."""
    if site in S.COLLECTIVE_SITES:
        return 200 + S.COLLECTIVE_SITES.index(site)
    return S.ALL_SITES.index(site) + (100 if direction == "bwd" else 0)


# Same-shape leaves corrupted as one stack (False: one at a time, the reference the tests
# compare the stacks with bit for bit).
STACK_LEAVES = True


def _corrupt_leaves(leaves: list, key_data, rate, spec: FaultSpec, limit: int) -> list:
    """[(corrupted leaf, record)] of same-shape leaves, each with its row of `key_data`, at
    one `rate`."""
    if len(leaves) == 1 or not STACK_LEAVES:
        return [corrupt_and_record(leaf, key_data[j], rate, spec, limit)
                for j, leaf in enumerate(leaves)]
    rates = jnp.broadcast_to(rate, (len(leaves),))
    ys, records = corrupt_and_record_stacked(jnp.stack(leaves), key_data, rates, spec, limit)
    return [(ys[j], records[j]) for j in range(len(leaves))]


# Forward injection: the corrupted value goes on, and the backward passes the cotangent through
# unchanged (the fault is a perturbation that does not depend on x; the bit operations of
# `corrupt` would otherwise stop every gradient at the site).
@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _corrupt_value(x, key_data, rate, spec, limit):
    return corrupt_and_record(x, key_data, rate, spec, limit, skip_idle=True)


def _corrupt_value_fwd(x, key_data, rate, spec, limit):
    return _corrupt_value(x, key_data, rate, spec, limit), None


def _corrupt_value_bwd(spec, limit, residuals, cts):
    del spec, limit, residuals
    ct_y, _ = cts
    return ct_y, None, None


_corrupt_value.defvjp(_corrupt_value_fwd, _corrupt_value_bwd)


def inject_value(x, key_data, rate, spec: FaultSpec, limit: int):
    """(corrupted x, record) with a straight-through gradient."""
    with jax.named_scope(f"inject/{spec.site}"):
        return _corrupt_value(x, key_data, rate, spec, limit)


# Backward injection: identity forward; the backward corrupts the cotangent and returns the
# ground-truth record as the cotangent of `sink`.
@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _corrupt_ct(x, sink, key_data, rate, spec, limit):
    del sink, key_data, rate
    return x


def _corrupt_ct_fwd(x, sink, key_data, rate, spec, limit):
    del sink
    return x, (key_data, rate)


def _corrupt_ct_bwd(spec, limit, residuals, ct):
    key_data, rate = residuals
    y, record = corrupt_and_record(ct, key_data, rate, spec, limit, skip_idle=True)
    return y, record, None, None


_corrupt_ct.defvjp(_corrupt_ct_fwd, _corrupt_ct_bwd)


def inject_cotangent(x, sink, key_data, rate, spec: FaultSpec, limit: int):
    with jax.named_scope(f"inject_ct/{spec.site}"):
        return _corrupt_ct(x, sink, key_data, rate, spec, limit)


def record_rows(records: dict, step: int, microstep: int, profile: Profile, *, tp_rank: int = 0,
                dp_rank: int = 0, node: int | None = None) -> tuple[list[dict], int]:
    """faults.parquet rows from one microstep's records, and how many landed beyond the limit.
    A row names the spec's site; a tree site's the leaf, a model collective's the output site
    it struck (`attn_gather_out`, ...)."""
    rows, overflow = [], 0
    for key, record in records.items():
        index, site, layer = parse_record_key(key)
        spec = profile.specs[index]
        count, landed = decode_record(record)
        overflow += count - len(landed)
        name = site if spec.direction == "tree" or spec.site in MODEL_COLLECTIVES else spec.site
        for hit in landed:
            rows.append({"step": step, "microstep": microstep, "layer": layer, "site": name,
                         "tp_rank": tp_rank, "dp_rank": dp_rank,
                         "node": spec.node if node is None else node,
                         "kind": spec.kind, **hit})
    return rows, overflow
