"""The bits of a float32 or bfloat16 value: its width, its bits as an unsigned integer and
back, flipping one, and the bits of a class (sign, exponent, mantissa, the ones a bfloat16
result keeps). The fault engine (`corrupt.py`), its records and the golden checks use them."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sdcstudy.faults.specs import FaultSpecError

_UINT = {jnp.dtype(jnp.float32): jnp.uint32, jnp.dtype(jnp.bfloat16): jnp.uint16}
# (sign, exponent, mantissa) bit positions, bit 0 = least significant mantissa bit.
_LAYOUT = {32: (31, range(23, 31), range(0, 23)), 16: (15, range(7, 15), range(0, 7))}


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
    """The bits of `bit_class` in a `width`-bit float. "bf16-mantissa" and "bf16-result" are
    the bits a bfloat16 result keeps, however wide the value at the site: its 7 mantissa bits
    (bits 16-22 of a float32, 0-6 of a bfloat16), and with them its exponent's lowest bit and
    its sign (23 and 31; 7 and 15)."""
    sign, exponent, mantissa = _LAYOUT[width]
    kept = tuple(mantissa)[-7:]
    return {"sign": (sign,), "exponent": tuple(exponent), "mantissa": tuple(mantissa),
            "any": tuple(range(width)), "bf16-mantissa": kept,
            "bf16-result": (*kept, exponent[0], sign)}[bit_class]
