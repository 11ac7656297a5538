"""Corrupting one tensor and recording what changed: the corruption kinds of a `FaultSpec`
(bit flips, scaling, additive errors, random values, zeros, NaN, Inf) drawn from a key, exactly
at any rate, and the tensor's ground-truth record (`records.py`); a stack of same-shape tensors
corrupted at once, each as if alone.

`inject.py` applies these at the model's sites and pytree sites; the random draws are in
`draws.py`, the bit operations in `bits.py`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core.mesh import vary
from sdcstudy.faults.bits import bit_width, from_bits, to_bits
from sdcstudy.faults.draws import (_counted_draws, _dense_after_stacked, listed_draws,
                                   _no_draws, _shaped, _varying, draw)
from sdcstudy.faults.records import empty_record, make_record, record_at
from sdcstudy.faults.specs import FaultSpec

# --- corrupting one tensor --------------------------------------------------------------------


def corrupt_with_positions(x, key, spec: FaultSpec, rate, skip_idle: bool = False):
    """(y, bit, positions, complete): `x` with the hit elements replaced, the drawn bit (-1 for
    other kinds), and where the hits are (`draw`).

    The random draws depend only on the key, the rate and the shape. With `skip_idle` they run
    under a `lax.cond` that skips them when the rate is 0 (an idle spec costs a select, not a
    random-number generator); the select that reads `x` stays outside the conditional.
    """
    width = bit_width(x.dtype)
    if skip_idle:
        axes = _varying(key, rate)
        hit, aux, positions, complete = lax.cond(
            jnp.asarray(rate) > 0, lambda: vary(draw(key, spec, rate, x.shape, width), axes),
            lambda: vary(_no_draws(spec, x.shape), axes))
    else:
        hit, aux, positions, complete = draw(key, spec, rate, x.shape, width)
    return (*_apply(x, spec, hit, aux), positions, complete)


def _apply(x, spec: FaultSpec, hit, aux, rms=None):
    """(y, bit): `x` with the `hit` elements replaced as `spec` says, and the drawn bit (-1
    for kinds other than bit flips). `rms`: `row_rms` of `x`, where the caller has it."""
    x_bits = to_bits(x)
    bit = jnp.full(x.shape, -1, jnp.int32)
    if spec.kind == "bitflip":
        bit = aux
        bad_bits = x_bits ^ (jnp.ones((), x_bits.dtype) << bit.astype(x_bits.dtype))
    elif spec.kind == "scale":
        bad_bits = to_bits((x.astype(jnp.float32) * aux).astype(x.dtype))
    elif spec.kind == "additive":
        x32 = x.astype(jnp.float32)
        rms = row_rms(x32) if rms is None else rms
        # On the GPU the error is rounded to float32 before it is added. Left to it, XLA
        # contracts the multiply and the add into one FMA (rounded once) in some programs and
        # not in others: on an H100 the same draw landed an ulp apart in a stack of leaves and
        # in each leaf alone. XLA's CPU backend removes the barrier before it fuses and
        # contracts the two wherever they share a fusion (measured 2026-12-01), so there the
        # corruption must be written alike in the programs that must agree: a stack corrupts
        # each leaf as it reads alone, and in a compiled step XLA fuses that into the
        # optimizer's update (docs/developing.md, "Its cause").
        error = lax.optimization_barrier(aux * rms)
        bad_bits = to_bits((x32 + error).astype(x.dtype))
    elif spec.kind in ("random", "inf"):
        bad_bits = to_bits(aux.astype(x.dtype))
    else:
        fill = 0.0 if spec.kind == "zero" else jnp.nan
        bad_bits = to_bits(jnp.full(x.shape, fill, jnp.float32).astype(x.dtype))
    # Select in the integer domain: a float select may quieten a signalling NaN and so change
    # bits other than the ones the fault names.
    return from_bits(jnp.where(hit, bad_bits, x_bits), x.dtype), bit


def row_rms(x):
    """The root mean square of each row (the last axis) of `x`, kept as an axis of 1: the scale
    of the dot products that made the row, which an accumulator fault is a fraction of."""
    if x.ndim == 0:
        return jnp.abs(x)
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True))


def _landed(x, y, bit):
    landed = to_bits(y) != to_bits(x)
    return landed, jnp.where(landed, bit, -1)


def corrupt(x, key, spec: FaultSpec, rate):
    """Corrupt elements of `x` hit with probability `rate`: returns (y, landed, bit).

    `landed` marks elements whose bits changed; `bit` is the flipped bit (-1 for other kinds).
    """
    y, bit, _, _ = corrupt_with_positions(x, key, spec, rate)
    return (y, *_landed(x, y, bit))


def corrupt_and_record(x, key_data, rate, spec: FaultSpec, limit: int,
                       skip_idle: bool = False):
    """(y, record): `corrupt` with the key's raw data, and the record of what landed.

    `skip_idle`: at a rate of 0 neither the draws nor the search for landed elements run (the
    record is the empty one), and where the draw lists every hit only those are searched. The
    model's sites use it: their results are bitwise those of the unconditional draws
    (tests/test_faults.py pins it). The pytree sites (`grad`, `update`) draw unconditionally:
    there the conditional moved the last bits of the gradient norm of a
    corrupted node in a tensor-parallel program, as XLA fused the norm differently (RESULTS.md,
    "Performance goals", faults).
    """
    y, bit, positions, complete = corrupt_with_positions(
        x, jax.random.wrap_key_data(key_data), spec, rate, skip_idle)
    landed, bit = _landed(x, y, bit)
    if not skip_idle:
        return y, make_record(x, y, landed, bit, limit)
    axes = _varying(x, y, bit, rate, positions, complete)

    def record():
        return lax.cond(complete, lambda: vary(record_at(x, y, bit, positions, limit), axes),
                        lambda: vary(make_record(x, y, landed, bit, limit), axes))

    record = lax.cond(jnp.asarray(rate) > 0, record,
                      lambda: vary(empty_record(x.dtype, limit), axes))
    return y, record


def corrupt_and_record_stacked(xs, key_data, rates, spec: FaultSpec, limit: int):
    """`corrupt_and_record` (unconditional draws) of each of the same-shape tensors stacked on
    the first axis of `xs`, with its own key data and rate, bit for bit: (ys, records).

    The draws, the corruption and the record are `vmap`ped, so XLA compiles them once for the
    stack instead of once a tensor (the `grad` and `update` sites corrupt every parameter leaf,
    and a deep model's leaves come in a few shapes). The dense rest of a draw runs for the whole
    stack when any tensor needs it: for a tensor whose listed positions hold every hit it
    changes nothing, so each result is the one its own draw gives.
    """
    shape, width = xs.shape[1:], bit_width(xs.dtype)
    size = math.prod(shape)
    keys = jax.vmap(jax.random.wrap_key_data)(key_data)
    if spec.count is not None:
        hit, aux, _, _ = jax.vmap(
            lambda key, rate: _counted_draws(key, spec, rate, size, width))(keys, rates)
    else:
        hit, aux, positions, dense_keys = jax.vmap(
            lambda key, rate: listed_draws(key, spec, rate, size, width))(keys, rates)
        axes = _varying(key_data, rates)
        hit, aux = lax.cond(jnp.any(positions[:, -1] < size),
                            lambda: vary(_dense_after_stacked(dense_keys, spec, rates, width,
                                                              hit, aux, positions), axes),
                            lambda: vary((hit, aux), axes))

    def one(x, hit, aux, rms):
        y, bit = _apply(x, spec, *_shaped(spec, shape, hit, aux), rms)
        landed, bit = _landed(x, y, bit)
        return y, make_record(x, y, landed, bit, limit)

    # Each row's RMS is reduced tensor by tensor: a reduction over the stack may round apart.
    rms = None if spec.kind != "additive" else jnp.stack(
        [row_rms(x.astype(jnp.float32)) for x in xs])
    return jax.vmap(one)(xs, hit, aux, rms)
