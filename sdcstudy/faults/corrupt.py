"""Corrupting one tensor and recording what changed: the bit operations, the corruption kinds
of a `FaultSpec` (bit flips, scaling, random values, zeros, NaN, Inf) drawn from a key, and the
fixed-size ground-truth record that carries every landed corruption out of the jitted step.

`inject.py` applies these at the model's sites and pytree sites; the golden and ABFT checks use
the bit helpers too.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdcstudy.faults.specs import FaultSpec, FaultSpecError

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


def corrupt_and_record(x, key_data, rate, spec: FaultSpec, limit: int):
    """(y, record): `corrupt` with the key's raw data, and the record of what landed.

    The draws happen even when `rate` is 0 at a step. Skipping them with `lax.cond` removes
    their cost but moves bits of the computation around the site (XLA compiles the surrounding
    fusions and products differently), so a run with an idle spec would no longer match one
    without it bit for bit (RESULTS.md, "faults").
    """
    y, landed, bit = corrupt(x, jax.random.wrap_key_data(key_data), spec, rate)
    return y, make_record(x, y, landed, bit, limit)


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
