"""The device half's arithmetic: an exact checksum of a tensor, and the hook that takes it at
every tensor-parallel collective of the model (`core.sites.COLLECTIVES`).

The checksum is the sum of the tensor's bit patterns as unsigned 32-bit integers, wrapping
modulo 2**32. Wrapping addition is associative and commutative, so an all-gather's output on
each rank sums to exactly the sum of every rank's input checksum: a received value that
differs from the one sent shows on one node alone. A bit flip changes the sum by 2**b
(mod 2**32, never 0). A reduce-scatter adds floats, whose sum the bits do not predict: its
checksums are compared between the two nodes of a pair instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core import sites as S

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}

# The points of a collective whose checksums leave the step. "computed": the input as the
# submodule computed it (faults included), before a lock-step tap overwrites it with the
# healthy copy; "in": what the rank sends; "out": what it receives. An all-gather's input is
# a norm's output, which no tap touches: its "computed" is its "in".
COMPUTED, SENT, RECEIVED = "computed", "in", "out"
# The site whose value is a reduce-scatter's computed input: the submodule's output.
SUBMODULE_OUTPUT = {"attn": S.ATTN_OUT, "ffn": S.FFN_OUT}


def checksum(x: jax.Array) -> jax.Array:
    """The wrapping uint32 sum of the bit patterns of `x`'s elements (a scalar)."""
    bits = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    return jnp.sum(bits, dtype=jnp.uint32)


def record_key(layer: int, submodule: str, collective: str, point: str) -> str:
    """Key of one checksum in the forward records: "1|attn|all_gather|in"."""
    return f"{layer}|{submodule}|{collective}|{point}"


def parse_record_key(key: str) -> tuple[int, str, str, str]:
    layer, submodule, collective, point = key.split("|")
    return int(layer), submodule, collective, point


def _points() -> dict[str, tuple[str, str, str]]:
    """Model site -> (submodule, collective, point) of every checksum the hook takes."""
    points = {}
    for (submodule, collective), (site_in, site_out) in S.COLLECTIVES.items():
        points[site_in] = (submodule, collective, SENT)
        points[site_out] = (submodule, collective, RECEIVED)
        if collective == S.REDUCE_SCATTER:
            points[SUBMODULE_OUTPUT[submodule]] = (submodule, collective, COMPUTED)
    return points


POINTS = _points()


class ChecksumHook:
    """A `sites.Hook` that checksums the value at each collective point (`POINTS`) and passes
    every value on unchanged. `.records` fills while the model is traced."""

    sites = frozenset(POINTS)  # what it reads (`sites.reads`): not the attention's internals

    def __init__(self):
        self.records: dict[str, jax.Array] = {}

    def __call__(self, site: str, x, layer: int):
        point = POINTS.get(site)
        if point is not None and layer >= 1:
            self.records[record_key(layer, *point)] = checksum(lax.stop_gradient(x))
        return x
