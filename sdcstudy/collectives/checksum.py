"""The device half's arithmetic: an exact checksum of a tensor, and the hooks that take it at
every tensor-parallel collective of the model (`core.sites.COLLECTIVES`), forward and backward.

The checksum is the sum of the tensor's bit patterns as unsigned 32-bit integers, wrapping
modulo 2**32. Wrapping addition is associative and commutative, so an all-gather's output on
each rank sums to exactly the sum of every rank's input checksum: a received value that
differs from the one sent shows on one node alone. A bit flip changes the sum by 2**b
(mod 2**32, never 0). A reduce-scatter adds floats, whose sum the bits do not predict: its
checksums are compared between the two nodes of a pair instead.

The backward pass runs each collective's transpose on the cotangents: a reduce-scatter for
each all-gather, an all-gather for each reduce-scatter. `BackwardChecksums` is the identity
forward; its custom VJP sums the cotangent arriving at a point and returns the sum, as two
exact 16-bit halves, as the cotangent of a zero "sink" (as `paired/lockstep.py`'s backward
taps do), so backward checksums leave the step with no host sync.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core import mesh as M
from sdcstudy.core import sites as S

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}

# The points of a collective whose checksums leave the step, named for the collective of the
# forward pass (in the backward, its transpose moves the cotangents the other way). "in":
# what the rank sends; "out": what it receives; "computed": the input as the rank computed it
# (faults included), before a lock-step tap overwrites it with the healthy copy. A tap sits
# only at a submodule's output (forward) and input (backward): where there is none, the
# computed input is the sent one.
COMPUTED, SENT, RECEIVED = "computed", "in", "out"
FWD, BWD = "fwd", "bwd"
# Where a tap may overwrite a reduce-scatter's input: the submodule's output in the forward,
# the cotangent at its input in the backward (the transpose of the all-gather that fed it).
_TAPPED = {(FWD, S.REDUCE_SCATTER): {"attn": S.ATTN_OUT, "ffn": S.FFN_OUT},
           (BWD, S.ALL_GATHER): {"attn": S.ATTN_IN, "ffn": S.FFN_IN}}


def checksum(x: jax.Array) -> jax.Array:
    """The wrapping uint32 sum of the bit patterns of `x`'s elements (a scalar)."""
    bits = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    return jnp.sum(bits, dtype=jnp.uint32)


def record_key(layer: int, submodule: str, collective: str, point: str) -> str:
    """Key of one checksum in the records: "1|attn|all_gather|in"."""
    return f"{layer}|{submodule}|{collective}|{point}"


def parse_record_key(key: str) -> tuple[int, str, str, str]:
    layer, submodule, collective, point = key.split("|")
    return int(layer), submodule, collective, point


def points(direction: str) -> dict[str, tuple[str, str, str]]:
    """Model site -> (submodule, collective, point) of every checksum of one direction: in
    the forward the value at a site, in the backward the cotangent arriving at it."""
    out = {}
    for (submodule, collective), (site_in, site_out) in S.COLLECTIVES.items():
        sends, receives = (site_in, site_out) if direction == FWD else (site_out, site_in)
        out[sends] = (submodule, collective, SENT)
        out[receives] = (submodule, collective, RECEIVED)
        tapped = _TAPPED.get((direction, collective))
        if tapped is not None:
            out[tapped[submodule]] = (submodule, collective, COMPUTED)
    return out


FWD_POINTS, BWD_POINTS = points(FWD), points(BWD)


def sink_keys(n_layers: int) -> list[str]:
    """The backward checksums' keys, layers 1..n_layers: one sink each."""
    return [record_key(layer, *point) for layer in range(1, n_layers + 1)
            for point in BWD_POINTS.values()]


def encode(total: jax.Array) -> jax.Array:
    """A uint32 as two float32 halves (hi, lo), each exact: a sink's cotangent."""
    return jnp.stack([(total >> 16).astype(jnp.float32), (total & 0xFFFF).astype(jnp.float32)])


class ForwardChecksums:
    """A `sites.Hook` that checksums the value at each forward point and passes every value
    on unchanged. `.records` fills while the model is traced."""

    sites = frozenset(FWD_POINTS)  # what it reads (`sites.reads`): no attention internals

    def __init__(self):
        self.records: dict[str, jax.Array] = {}

    def __call__(self, site: str, x, layer: int):
        point = FWD_POINTS.get(site)
        if point is not None and layer >= 1:
            self.records[record_key(layer, *point)] = checksum(lax.stop_gradient(x))
        return x


class BackwardChecksums:
    """A `sites.Hook`, the identity forward, whose backward at each backward point returns
    the cotangent unchanged and its checksum as the cotangent of that point's sink."""

    sites = frozenset(BWD_POINTS)

    def __init__(self, sinks: dict):
        self.sinks = sinks

    def __call__(self, site: str, x, layer: int):
        point = BWD_POINTS.get(site)
        if point is None or layer < 1:
            return x
        sink = self.sinks[record_key(layer, *point)]
        with jax.named_scope("collectives_bwd"):
            return _backward_checksum(x, sink, tuple(sorted(M.varying_axes(sink))))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _backward_checksum(x, sink, sink_axes):
    del sink, sink_axes
    return x


def _backward_checksum_fwd(x, sink, sink_axes):
    del sink, sink_axes
    return x, None


def _backward_checksum_bwd(sink_axes, residuals, ct):
    del residuals
    return ct, M.vary(encode(checksum(ct)), sink_axes)


_backward_checksum.defvjp(_backward_checksum_fwd, _backward_checksum_bwd)
