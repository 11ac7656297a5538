"""The on-device digest of the golden-run checks: two 32-bit lanes per block of 1/64 of a
tensor, and a custom-VJP identity that digests the gradient arriving at a site.

Digests are computed on the device, inside the jitted step: fetching every activation and
every parameter to the host for SHA-256 would copy the whole model and all its activations
off the device at every step (32 GB a step for llama3-8b), while the digest reads each tensor
once where it lies and returns 2 x 64 words. A digest of a tensor of n elements with bits u_i
(float32 or bfloat16 read as unsigned integers) is, per block of ceil(n / 64) consecutive
elements and per lane,
    lane A = sum_i mix(u_i) * (2 i + 1),    lane B = sum_i mix(u_i ^ c) * (mix(i) | 1)
in uint32 wrap-around arithmetic, with `mix` an invertible integer hash and i the position in
the whole tensor. Integer addition modulo 2**32 is associative, so the digest is exact whatever
order XLA reduces in; the multipliers are odd, hence invertible modulo 2**32, so any change to
a single element always changes both lanes, and a change to several elements goes unseen with
probability about 2**-64. It is not a cryptographic hash: a hardware fault is not an adversary.
Gradients arriving at a site leave the step through a custom-VJP identity whose backward
digests the cotangent and returns the digest as the cotangent of a zero "sink" input (as
`paired/lockstep.py` does), split into 16-bit halves so that float32 carries them exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core import sites as S
from sdcstudy.golden.sizing import BLOCKS, block_range, n_blocks  # noqa: F401 (pure: no JAX)

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _mix(u):
    """An invertible 32-bit integer hash (xor-shift-multiply)."""
    u = u ^ (u >> 16)
    u = u * jnp.uint32(0x7FEB352D)
    u = u ^ (u >> 15)
    u = u * jnp.uint32(0x846CA68B)
    return u ^ (u >> 16)


def block_digest(x) -> jax.Array:
    """uint32 (blocks, 2): the two-lane digest of each block of `x` (see the module docstring)."""
    bits = lax.bitcast_convert_type(x, _UINT[jnp.dtype(x.dtype).itemsize])
    bits = bits.reshape(-1).astype(jnp.uint32)
    n = bits.size
    blocks = n_blocks(n)
    per = -(-n // blocks)
    bits = jnp.pad(bits, (0, blocks * per - n))
    i = jnp.arange(blocks * per, dtype=jnp.uint32)
    lane_a = _mix(bits) * (2 * i + 1)
    lane_b = _mix(bits ^ jnp.uint32(0x5BD1E995)) * (_mix(i) | 1)
    lanes = jnp.stack([lane_a, lane_b], axis=-1).reshape(blocks, per, 2)
    return jnp.sum(lanes, axis=1, dtype=jnp.uint32)


def _to_float(digest):
    """uint32 -> float32 pairs of exact 16-bit halves (a sink's cotangent must be float)."""
    return jnp.stack([digest >> 16, digest & 0xFFFF], axis=-1).astype(jnp.float32)


def _to_uint(halves):
    halves = halves.astype(jnp.uint32)
    return (halves[..., 0] << 16) | halves[..., 1]


# Backward digest: identity forward; the backward digests the cotangent into `sink`'s gradient.
@jax.custom_vjp
def _tap(x, sink):
    del sink
    return x


def _tap_fwd(x, sink):
    del sink
    return x, None


def _tap_bwd(residuals, ct):
    del residuals
    return ct, _to_float(block_digest(ct))


_tap.defvjp(_tap_fwd, _tap_bwd)


def backward_digest(x, sink):
    """Identity; in the backward, the block digest of the gradient at `x` goes to `sink`."""
    with jax.named_scope("golden_bwd_digest"):
        return _tap(x, sink)


def sink_shape(size: int) -> tuple[int, int, int]:
    return (n_blocks(size), 2, 2)


def site_key(site: str, layer: int) -> str:
    return f"{site}/{layer}"


class DigestHook:
    """A `sites.Hook` that digests every site's value and the gradient arriving at it.

    At one site: forward fault injection, the value digest, the backward digest, backward
    fault injection. The backward injector's VJP therefore runs before the backward digest's,
    so both directions see a fault at their own site, not at the next one.
    """

    def __init__(self, sinks: dict, inject_fwd: S.Hook = S.identity_hook,
                 inject_bwd: S.Hook = S.identity_hook):
        self.sinks, self.inject_fwd, self.inject_bwd = sinks, inject_fwd, inject_bwd
        self.values: dict[str, jax.Array] = {}

    def __call__(self, site: str, x, layer: int):
        key = site_key(site, layer)
        x = self.inject_fwd(site, x, layer)
        self.values[key] = block_digest(x)
        x = backward_digest(x, self.sinks[key])
        return self.inject_bwd(site, x, layer)
