"""The device half's arithmetic: an exact checksum of a tensor, and the hooks that take it at
every tensor-parallel collective of the model (`core.sites.COLLECTIVES`), forward and backward.

The checksum is a pair of wrapping uint32 sums over the tensor's bits cut into 16-bit halves
(a float32 gives two, a bfloat16 one): A, the sum of the halves, and B, the sum of each half
times its number h (a Fletcher sum; the element at position g has halves h = 2g + 1 and, for a
float32, 2g + 2). Every operation wraps
modulo 2**32, which is associative and commutative, so the checksums are exact and, when each
rank numbers its halves by where they land in the all-gather's output, an all-gather's output
on each rank sums to exactly the sum of every rank's input checksums: a received value that
differs from the one sent shows on one node alone. A reduce-scatter adds floats, whose sum the
bits do not predict: its checksums are compared between the two nodes of a pair instead.

What the pair catches: a half changes by some d with 0 < |d| < 2**16. One changed half moves A
by d, never 0 modulo 2**32. Changes in two halves that leave A alone are d and -d, and move B by
d (h - h'), 0 modulo 2**32 only when 2**32 divides it: with d = 2**v times an odd number (v at
most 15), when h - h' is a multiple of 2**(32 - v). So two elements must lie a multiple of
2**(31 - v) apart, 65,536 at the least: a flip of a half's top bit (v = 15: the sign of a
bfloat16, bit 15 or 31 of a float32) in one element and the opposite flip 65,536 elements
on cancel; lower bits need elements farther apart. Any change within one element is caught
too (for a float32, if its halves' changes cancel in A, B moves by the high half's). A single
wrapping sum of whole 32-bit patterns would miss far more: two sign-bit flips of float32
elements move it by 2**31 + 2**31 = 0 (mod 2**32), and any two flips of one bit, one 0 -> 1
and one 1 -> 0, cancel. Three or more changed halves can still cancel in both sums.

The backward pass runs each collective's transpose on the cotangents: a reduce-scatter for
each all-gather, an all-gather for each reduce-scatter. `BackwardChecksums` is the identity
forward; its custom VJP checksums the cotangent arriving at a point and returns the pair, as
four exact 16-bit halves, as the cotangent of a zero "sink" (as `paired/lockstep.py`'s
backward taps do), so backward checksums leave the step with no host sync.
"""

from __future__ import annotations

import math
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


def positions(shape: tuple[int, ...], rank=None, ranks: int = 1) -> jax.Array:
    """The uint32 position of each element of a tensor of `shape`, row-major: its own, or
    (`rank` of `ranks`) where it lands in the tiled all-gather along axis 1 of `ranks` such
    tensors, which stacks their axis-1 blocks rank by rank within each index of axis 0."""
    flat = lax.iota(jnp.uint32, max(1, math.prod(shape))).reshape(shape)
    if rank is None or ranks == 1:
        return flat
    block = math.prod(shape[1:])  # one rank's elements per index of axis 0
    outer = lax.broadcasted_iota(jnp.uint32, shape, 0)
    return flat + (outer * jnp.uint32(ranks - 1) + rank.astype(jnp.uint32)) * jnp.uint32(block)


def checksum(x: jax.Array, rank=None, ranks: int = 1) -> jax.Array:
    """(A, B), uint32: the wrapping sums of `x`'s 16-bit halves and of each half times its
    number h (from 1; a float32 element at position g has halves 2g + 1, low, and 2g + 2),
    positions as `positions` gives them."""
    bits = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    low, high = (bits & 0xFFFF, bits >> 16) if x.dtype.itemsize == 4 else (bits, None)
    h = positions(x.shape, rank, ranks) * jnp.uint32(2) + jnp.uint32(1)
    a = jnp.sum(low, dtype=jnp.uint32)
    b = jnp.sum(h * low, dtype=jnp.uint32)
    if high is not None:
        a = a + jnp.sum(high, dtype=jnp.uint32)
        b = b + jnp.sum((h + jnp.uint32(1)) * high, dtype=jnp.uint32)
    return jnp.stack([a, b])


def gathered(direction: str, collective: str, point: str) -> bool:
    """Whether a point is what a rank sends into an all-gather (in the backward, into the
    transpose of a reduce-scatter): its halves are numbered where they land in the output."""
    return point == SENT and (collective == S.ALL_GATHER) == (direction == FWD)


def _checksum_at(x, direction: str, point: tuple[str, str, str], tp_axis: str | None):
    _, collective, name = point
    if tp_axis is None or not gathered(direction, collective, name):
        return checksum(x)
    return checksum(x, lax.axis_index(tp_axis), lax.axis_size(tp_axis))


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


def encode(sums: jax.Array) -> jax.Array:
    """uint32s as float32 halves (..., (hi, lo)), each exact: a sink's cotangent."""
    return jnp.stack([(sums >> 16).astype(jnp.float32), (sums & 0xFFFF).astype(jnp.float32)],
                     axis=-1)


class ForwardChecksums:
    """A `sites.Hook` that checksums the value at each forward point and passes every value
    on unchanged. `.records` fills while the model is traced."""

    sites = frozenset(FWD_POINTS)  # what it reads (`sites.reads`): no attention internals

    def __init__(self, tp_axis: str | None = None):
        self.tp_axis = tp_axis
        self.records: dict[str, jax.Array] = {}

    def __call__(self, site: str, x, layer: int):
        point = FWD_POINTS.get(site)
        if point is not None and layer >= 1:
            self.records[record_key(layer, *point)] = _checksum_at(
                lax.stop_gradient(x), FWD, point, self.tp_axis)
        return x


class BackwardChecksums:
    """A `sites.Hook`, the identity forward, whose backward at each backward point returns
    the cotangent unchanged and its checksum as the cotangent of that point's sink."""

    sites = frozenset(BWD_POINTS)

    def __init__(self, sinks: dict, tp_axis: str | None = None):
        self.sinks, self.tp_axis = sinks, tp_axis

    def __call__(self, site: str, x, layer: int):
        point = BWD_POINTS.get(site)
        if point is None or layer < 1:
            return x
        sink = self.sinks[record_key(layer, *point)]
        with jax.named_scope("collectives_bwd"):
            return _backward_checksum(x, sink, (point, self.tp_axis),
                                      tuple(sorted(M.varying_axes(sink))))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _backward_checksum(x, sink, where, sink_axes):
    del sink, where, sink_axes
    return x


def _backward_checksum_fwd(x, sink, where, sink_axes):
    del sink, where, sink_axes
    return x, None


def _backward_checksum_bwd(where, sink_axes, residuals, ct):
    del residuals
    point, tp_axis = where
    return ct, M.vary(encode(_checksum_at(ct, BWD, point, tp_axis)), sink_axes)


_backward_checksum.defvjp(_backward_checksum_fwd, _backward_checksum_bwd)
