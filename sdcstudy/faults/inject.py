"""Fault injection: seeded, replayable corruptions inside the jitted step, logged as ground truth.

What a fault is (`FaultSpec`, `TimePattern`, `Profile`, their YAML form): `faults/specs.py`.
The `Injector` turns a profile into a `sites.Hook`: forward sites are corrupted where they are
computed, backward sites (`bwd/...`) through a custom VJP that corrupts the cotangent.

Every random draw derives from the run seed folded with (step, microstep, layer, site, spec,
tp rank), so a run replays the same faults. Every corruption that changes a bit is logged in
a fixed-size record per (site, layer, spec, microstep) that leaves the step without a host
sync: forward records through the loss function's aux output, backward records as the
cotangent of a zero "sink" input.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdcstudy.core import sites as S
from sdcstudy.faults.specs import COLLECTIVE_SITES, TREE_SITES, FaultSpec, FaultSpecError, Profile

_UINT = {jnp.dtype(jnp.float32): jnp.uint32, jnp.dtype(jnp.bfloat16): jnp.uint16}
# (sign, exponent, mantissa) bit positions, bit 0 = least significant mantissa bit.
_LAYOUT = {32: (31, range(23, 31), range(0, 23)), 16: (15, range(7, 15), range(0, 7))}


# --- bits -------------------------------------------------------------------------------------


def bit_width(dtype) -> int:
    dtype = jnp.dtype(dtype)
    if dtype not in _UINT:
        raise FaultSpecError(f"faults support float32 and bfloat16 tensors, not {dtype}.")
    return dtype.itemsize * 8


def to_bits(x):
    return lax.bitcast_convert_type(x, _UINT[jnp.dtype(x.dtype)])


def from_bits(bits, dtype):
    return lax.bitcast_convert_type(bits, dtype)


def flip_bits(x, bit):
    """Flip bit `bit` (scalar or per-element array; 0 = lowest mantissa bit) of every element."""
    bits = to_bits(x)
    one = jnp.ones((), bits.dtype)
    return from_bits(bits ^ (one << jnp.asarray(bit).astype(bits.dtype)), x.dtype)


def bits_of_class(bit_class: str, width: int) -> tuple[int, ...]:
    sign, exponent, mantissa = _LAYOUT[width]
    return {"sign": (sign,), "exponent": tuple(exponent), "mantissa": tuple(mantissa),
            "any": tuple(range(width))}[bit_class]


# --- corrupting one tensor --------------------------------------------------------------------


def _draw_bits(key, spec: FaultSpec, width: int, shape):
    allowed = spec.bits if spec.bits is not None else bits_of_class(spec.bit_class, width)
    allowed = tuple(b for b in allowed if b < width)
    if not allowed:
        raise FaultSpecError(f"{spec.site}: none of bits {spec.bits} exist in a {width}-bit type.")
    if len(allowed) == 1:
        return jnp.full(shape, allowed[0], jnp.int32)
    return jnp.asarray(allowed, jnp.int32)[jax.random.randint(key, shape, 0, len(allowed))]


def corrupt(x, key, spec: FaultSpec, rate):
    """Corrupt elements of `x` hit with probability `rate`: returns (y, landed, bit).

    `landed` marks elements whose bits changed; `bit` is the flipped bit (-1 for other kinds).
    """
    width = bit_width(x.dtype)
    k_hit, k_bit, k_value, k_sign = jax.random.split(key, 4)
    if spec.count is not None:  # exactly `count` distinct elements, when the rate is on
        chosen = jax.random.choice(k_hit, x.size, (min(spec.count, x.size),), replace=False)
        hit = jnp.zeros(x.size, bool).at[chosen].set(rate > 0).reshape(x.shape)
    else:
        hit = jax.random.bernoulli(k_hit, rate, x.shape)
    if spec.lanes is not None:
        lane = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        hit &= jnp.isin(lane, jnp.asarray(spec.lanes))
    bit = jnp.full(x.shape, -1, jnp.int32)
    x_bits = to_bits(x)
    if spec.kind == "bitflip":
        bit = _draw_bits(k_bit, spec, width, x.shape)
        bad_bits = x_bits ^ (jnp.ones((), x_bits.dtype) << bit.astype(x_bits.dtype))
    else:
        if spec.kind == "scale":
            lo, hi = spec.scale
            log_r = jax.random.uniform(k_value, x.shape, jnp.float32, math.log(lo), math.log(hi))
            sign = jnp.where(jax.random.bernoulli(k_sign, 0.5, x.shape), 1.0, -1.0)
            bad = x.astype(jnp.float32) * (1 + sign * jnp.exp(log_r))
        elif spec.kind == "random":
            bad = spec.value_std * jax.random.normal(k_value, x.shape, jnp.float32)
        elif spec.kind == "zero":
            bad = jnp.zeros(x.shape, jnp.float32)
        elif spec.kind == "nan":
            bad = jnp.full(x.shape, jnp.nan, jnp.float32)
        else:
            bad = jnp.where(jax.random.bernoulli(k_sign, 0.5, x.shape), jnp.inf, -jnp.inf)
        bad_bits = to_bits(bad.astype(x.dtype))
    # Select in the integer domain: a float select may quieten a signalling NaN and so change
    # bits other than the ones the fault names.
    y_bits = jnp.where(hit, bad_bits, x_bits)
    y = from_bits(y_bits, x.dtype)
    landed = y_bits != x_bits
    return y, landed, jnp.where(landed, bit, -1)


# --- ground-truth records ---------------------------------------------------------------------
# A record is float32 (limit + 1, 8): row 0 holds the exact number of landed corruptions
# (split in 16-bit halves) and the tensor's bit width, rows 1.. one landed corruption each:
# [valid, index_hi, index_lo, original_hi, original_lo, corrupted_hi, corrupted_lo, bit].
# Integers are split into 16-bit halves so float32 carries them exactly (it holds every
# integer below 2^24), even through a cotangent.
RECORD_WIDTH = 8


def _split16(v):
    v = v.astype(jnp.uint32)
    return (v >> 16).astype(jnp.float32), (v & 0xFFFF).astype(jnp.float32)


def make_record(x, y, landed, bit, limit: int):
    flat = landed.reshape(-1)
    count = jnp.sum(flat, dtype=jnp.int32)
    (index,) = jnp.nonzero(flat, size=limit, fill_value=0)
    valid = jnp.arange(limit) < count
    orig = to_bits(x).reshape(-1)[index].astype(jnp.uint32)
    corr = to_bits(y).reshape(-1)[index].astype(jnp.uint32)
    cols = [valid.astype(jnp.float32), *_split16(index), *_split16(orig), *_split16(corr),
            bit.reshape(-1)[index].astype(jnp.float32)]
    rows = jnp.stack(cols, axis=-1) * valid[:, None]
    width = jnp.float32(bit_width(x.dtype))
    head = jnp.zeros((1, RECORD_WIDTH), jnp.float32).at[0, :3].set(
        jnp.stack([*_split16(count), width]))
    return jnp.concatenate([head, rows], axis=0)


def decode_record(record: np.ndarray) -> tuple[int, list[dict]]:
    """Host side: (number landed, [{flat_index, bit, original, corrupted}, ...])."""
    record = np.asarray(record, np.float64)
    join = lambda hi, lo: (int(hi) << 16) | int(lo)  # noqa: E731
    count = join(record[0, 0], record[0, 1])
    if count == 0:
        return 0, []
    uint, np_dtype = (np.uint32, np.float32) if record[0, 2] == 32 else (np.uint16, jnp.bfloat16)
    out = []
    for row in record[1:]:
        if row[0] != 1:
            continue
        as_float = lambda b: float(np.array([b], uint).view(np_dtype)[0])  # noqa: E731
        out.append({"flat_index": join(row[1], row[2]), "bit": int(row[7]),
                    "original": as_float(join(row[3], row[4])),
                    "corrupted": as_float(join(row[5], row[6]))})
    return count, out


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

    def __init__(self, profile: Profile, n_layers: int, limit: int = 64):
        self.profile = profile
        self.n_layers = n_layers
        self.limit = limit
        self.model_specs = [(i, s) for i, s in enumerate(profile.specs)
                            if s.base_rate > 0 and s.direction in ("fwd", "bwd")]

        self.tree_specs = [(i, s) for i, s in enumerate(profile.specs)
                           if s.base_rate > 0 and s.direction == "tree"]

    @property
    def active(self) -> bool:
        return bool(self.model_specs)

    def corrupt_tree(self, tree, ctx: FaultContext, site: str):
        """Apply the profile's specs for a pytree site ("grad", "update") leaf by leaf."""
        from sdcstudy.core.digest import path_name

        specs = [(i, s) for i, s in self.tree_specs if s.site == site]
        if not specs:
            return tree
        from sdcstudy.core.mesh import varying_axes

        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        out = []
        for leaf_index, (path, leaf) in enumerate(leaves):
            # A leaf replicated over dp or tp must stay replicated: draw the same faults there.
            varying = varying_axes(leaf)
            leaf_ctx = dataclasses.replace(
                ctx, tp_axis=ctx.tp_axis if ctx.tp_axis in varying else None,
                dp_axis=ctx.dp_axis if ctx.dp_axis in varying else None, records={})
            for i, spec in specs:
                site_id = 1000 + (TREE_SITES + COLLECTIVE_SITES).index(site) * 100_000 + leaf_index
                key, rate = self._rate_and_key(leaf_ctx, i, spec, site_id, 0, leaf)
                y, landed, bit = corrupt(leaf, key, spec, rate)
                ctx.records[record_key(i, f"{site}/{path_name(path)}", 0)] = make_record(
                    leaf, y, landed, bit, self.limit)
                leaf = y
            out.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, out)

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

    def _rate_and_key(self, ctx: FaultContext, index: int, spec: FaultSpec, site_id: int,
                      layer: int, x):
        key = jax.random.fold_in(ctx.key, index)
        if spec.transient and ctx.attempt is not None:
            key = jax.random.fold_in(key, ctx.attempt)  # every execution draws afresh
        pattern_key = jax.random.fold_in(key, ctx.step)  # one burst draw per step and spec
        multiplier = spec.pattern.multiplier(ctx.step, pattern_key)
        if spec.repeatable:
            # The corruption is a function of the input's bits, not of when it is computed.
            digest = jnp.sum(to_bits(x).astype(jnp.uint32) * jnp.uint32(2654435761),
                             dtype=jnp.uint32)
            key = jax.random.fold_in(key, digest)
            multiplier = jnp.float32(1) if spec.pattern.kind == "constant" else multiplier
        else:
            key = jax.random.fold_in(jax.random.fold_in(key, ctx.step), ctx.microstep)
        key = jax.random.fold_in(jax.random.fold_in(key, layer), site_id)
        enabled = jnp.bool_(True)
        if ctx.node_axis is not None:
            enabled &= lax.axis_index(ctx.node_axis) == spec.node
        elif ctx.node is not None:
            enabled &= ctx.node == spec.node
        if ctx.dp_axis is not None:
            key = jax.random.fold_in(key, lax.axis_index(ctx.dp_axis))
        if ctx.tp_axis is not None:
            rank = lax.axis_index(ctx.tp_axis)
            key = jax.random.fold_in(key, rank)
            if spec.tp_ranks is not None:
                enabled &= jnp.isin(rank, jnp.asarray(spec.tp_ranks))
        rate = jnp.where(enabled, jnp.minimum(spec.base_rate * multiplier, 1.0), 0.0)
        return key, rate

    def hook(self, ctx: FaultContext) -> S.Hook:
        if not self.active:
            return S.identity_hook
        by_site: dict[tuple[str, str], list[tuple[int, FaultSpec]]] = {}
        for i, spec in self.model_specs:
            by_site.setdefault(spec.resolve(), []).append((i, spec))

        def inject(site: str, x, layer: int):
            for direction in ("fwd", "bwd"):
                for i, spec in by_site.get((direction, site), ()):
                    if layer not in self._layers(spec, site):
                        continue
                    site_id = S.ALL_SITES.index(site) + (100 if direction == "bwd" else 0)
                    key, rate = self._rate_and_key(ctx, i, spec, site_id, layer, x)
                    name = record_key(i, site, layer)
                    if direction == "fwd":
                        x, ctx.records[name] = inject_value(x, key, rate, spec, self.limit)
                    else:
                        x = inject_cotangent(x, ctx.sinks[name], key, rate, spec, self.limit)
            return x

        return inject


# Forward injection: the corrupted value goes on, and the backward passes the cotangent through
# unchanged (the fault is a perturbation that does not depend on x; the bit operations of
# `corrupt` would otherwise stop every gradient at the site).
@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _corrupt_value(x, key_data, rate, spec, limit):
    y, landed, bit = corrupt(x, jax.random.wrap_key_data(key_data), spec, rate)
    return y, make_record(x, y, landed, bit, limit)


def _corrupt_value_fwd(x, key_data, rate, spec, limit):
    return _corrupt_value(x, key_data, rate, spec, limit), None


def _corrupt_value_bwd(spec, limit, residuals, cts):
    del spec, limit, residuals
    ct_y, _ = cts
    return ct_y, None, None


_corrupt_value.defvjp(_corrupt_value_fwd, _corrupt_value_bwd)


def inject_value(x, key, rate, spec: FaultSpec, limit: int):
    """(corrupted x, record) with a straight-through gradient."""
    with jax.named_scope(f"inject/{spec.site}"):
        return _corrupt_value(x, jax.random.key_data(key), rate, spec, limit)


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
    key = jax.random.wrap_key_data(key_data)
    y, landed, bit = corrupt(ct, key, spec, rate)
    return y, make_record(ct, y, landed, bit, limit), None, None


_corrupt_ct.defvjp(_corrupt_ct_fwd, _corrupt_ct_bwd)


def inject_cotangent(x, sink, key, rate, spec: FaultSpec, limit: int):
    with jax.named_scope(f"inject_ct/{spec.site}"):
        return _corrupt_ct(x, sink, jax.random.key_data(key), rate, spec, limit)


def record_rows(records: dict, step: int, microstep: int, profile: Profile, *, tp_rank: int = 0,
                node: int | None = None) -> tuple[list[dict], int]:
    """faults.parquet rows from one microstep's records, and how many landed beyond the limit."""
    rows, overflow = [], 0
    for key, record in records.items():
        index, site, layer = parse_record_key(key)
        spec = profile.specs[index]
        count, landed = decode_record(record)
        overflow += count - len(landed)
        name = site if spec.direction == "tree" else spec.site
        for hit in landed:
            rows.append({"step": step, "microstep": microstep, "layer": layer, "site": name,
                         "tp_rank": tp_rank, "node": spec.node if node is None else node,
                         "kind": spec.kind, **hit})
    return rows, overflow
