"""Ground-truth records: the fixed-size float32 array that carries every landed corruption of
one tensor out of the jitted step (`make_record`, `empty_record`), and its reading on the
host (`decode_record`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sdcstudy.faults.bits import bit_width, to_bits

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
    """The record of the `landed` elements of `x` (`bit`: -1 where none landed), searched over
    the whole tensor."""
    flat = landed.reshape(-1)
    (index,) = jnp.nonzero(flat, size=limit, fill_value=0)
    return _record(x, y, bit, index, jnp.sum(flat, dtype=jnp.int32), limit)


def record_at(x, y, bit, positions, limit: int):
    """`make_record`'s record, bit for bit, where every changed element is at one of
    `positions` (increasing; the size past the last): only those are searched, which costs the
    hits, where a search of the whole tensor costs more than drawing them."""
    size = x.size
    at = jnp.minimum(positions, size - 1).astype(jnp.int32)
    landed = (positions < size) & (to_bits(x).reshape(-1)[at] != to_bits(y).reshape(-1)[at])
    (pick,) = jnp.nonzero(landed, size=limit, fill_value=0)
    count = jnp.sum(landed, dtype=jnp.int32)
    return _record(x, y, bit, jnp.where(jnp.arange(limit) < count, at[pick], 0), count, limit)


def _record(x, y, bit, index, count, limit: int):
    """The record of `count` landed elements, the first `limit` of them at flat `index` (0 in
    the unused rows)."""
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


def empty_record(dtype, limit: int):
    """The record of a tensor in which nothing landed, bit for bit `make_record`'s: its unused
    rows hold the bit -1 times 0, which is -0."""
    record = jnp.zeros((limit + 1, RECORD_WIDTH), jnp.float32).at[1:, 7].set(-0.0)
    return record.at[0, 2].set(bit_width(dtype))


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
