"""What the collectives' checksum catches (sdcstudy/collectives/checksum.py), on real tensors.

A corruption the checksum misses is no verdict at all, or the wrong one: a wire fault the
all-gather's sum misses surfaces only in the attention it fed, as computation. These tests
corrupt tensors the way the fault engine does (flipped bits, NaN) and check the checksums and
the verdicts built from them. Each compiles only a few tiny reductions.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.collectives import checksum as CS
from sdcstudy.collectives import verdicts as V
from sdcstudy.core import sites as S

TP, SHAPE = 2, (2, 8, 16)  # (B, L per rank, D)


def _values(dtype, seed=0, shape=SHAPE) -> np.ndarray:
    """Normal values, half of them negative, as the bits of `dtype` (uint view)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return np.asarray(jnp.asarray(x, dtype)).view(np.uint16 if dtype == jnp.bfloat16
                                                   else np.uint32)


def _checksum(bits: np.ndarray, dtype, *args) -> np.ndarray:
    return np.asarray(CS.checksum(jnp.asarray(bits).view(dtype), *args))


def _flip(bits: np.ndarray, where: list[tuple[int, int]]) -> np.ndarray:
    """`bits` with bit b of flat element i flipped, for each (i, b)."""
    out = bits.copy().reshape(-1)
    for i, b in where:
        out[i] ^= out.dtype.type(1 << b)
    return out.reshape(bits.shape)


@pytest.mark.parametrize("dtype, sign", [(jnp.float32, 31), (jnp.bfloat16, 15)])
def test_two_sign_flips_change_the_checksum(dtype, sign):
    # A float32 sign flip moves a whole-word sum by 2**31: two of them by 2**32 = 0. Flips of
    # one bit in opposite directions (a positive and a negative element) cancel in any plain
    # sum. Either would leave a corrupted all-gather with the checksum of a clean one.
    bits = _values(dtype)
    signs = (bits.reshape(-1) >> sign) & 1
    positive, negative = np.flatnonzero(signs == 0), np.flatnonzero(signs == 1)
    clean = _checksum(bits, dtype)
    for pair in ((positive[0], positive[1]), (positive[0], negative[0])):
        assert (_checksum(_flip(bits, [(i, sign) for i in pair]), dtype) != clean).any(), pair


def test_opposite_flips_of_one_mantissa_bit_change_the_checksum():
    bits = _values(jnp.float32)
    ones = np.flatnonzero((bits.reshape(-1) >> 5) & 1)
    zeros = np.flatnonzero(((bits.reshape(-1) >> 5) & 1) == 0)
    flipped = _flip(bits, [(ones[0], 5), (zeros[0], 5)])
    assert (_checksum(flipped, jnp.float32) != _checksum(bits, jnp.float32)).any()


def test_a_change_that_cancels_between_an_elements_halves_is_caught():
    # +8 in the low half, -8 in the high half of one float32: the sum of halves stays, the
    # numbered sum moves by the high half's change.
    bits = _values(jnp.float32).reshape(-1)
    i = int(np.flatnonzero(((bits >> 3) & 1 == 0) & ((bits >> 19) & 1 == 1))[0])
    flipped = _flip(bits, [(i, 3), (i, 19)])
    a, b = _checksum(flipped, jnp.float32) - _checksum(bits, jnp.float32)
    assert a == 0 and b != 0


@pytest.mark.parametrize("bit, apart, caught", [
    (15, 2 ** 16, False),      # the docstring's blind spot, exactly: top bit, 65,536 apart
    (15, 2 ** 16 + 1, True),   # one element nearer or farther: caught
    (15, 2 ** 15, True),
    (14, 2 ** 16, True),       # a lower bit needs elements 2**(31 - bit) apart
])
def test_opposite_flips_cancel_only_where_the_docstring_says(bit, apart, caught):
    # A bfloat16 tensor with bit `bit` set at element 0; the flip moves it to `apart` (a
    # 1 -> 0 flip there and a 0 -> 1 flip here: d and -d).
    bits = np.zeros(2 ** 16 + 2, np.uint16)
    bits[0] = 1 << bit
    moved = _flip(bits, [(0, bit), (apart, bit)])
    assert (_checksum(moved, jnp.bfloat16) != _checksum(bits, jnp.bfloat16)).any() == caught


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_all_gather_receives_the_sum_of_its_ranks_numbered_checksums(dtype):
    # Each rank numbers its shard where the tiled all-gather along axis 1 puts it; the sum
    # over ranks is the gathered tensor's checksum, bit for bit (emulated by concatenation).
    shards = [_values(dtype, seed=r) for r in range(TP)]
    sent = sum(_checksum(s, dtype, jnp.int32(r), TP).astype(np.uint64)
               for r, s in enumerate(shards)) % 2 ** 32
    assert (sent == _checksum(np.concatenate(shards, axis=1), dtype)).all()


def _block(per_node_rank) -> np.ndarray:
    """[node][tp rank] checksums as a (node, dp=1, tp, microstep=1, 2) record."""
    return np.asarray(per_node_rank, np.uint32)[:, None, :, None, :]


def _records(shards: list, received: list) -> dict:
    """Forward checksums of one layer, {record key: record}: the attention's all-gather, whose
    ranks sent `shards` on both nodes and received `received[node][rank]` (the blocks that
    rank got, in rank order); every other collective alike on both nodes."""
    sent = [_checksum(s, jnp.float32, jnp.int32(r), TP) for r, s in enumerate(shards)]
    out = {CS.record_key(1, "attn", S.ALL_GATHER, CS.SENT): _block([sent, sent]),
           CS.record_key(1, "attn", S.ALL_GATHER, CS.RECEIVED): _block(
               [[_checksum(np.concatenate(blocks, axis=1), jnp.float32) for blocks in ranks]
                for ranks in received])}
    same = _checksum(_values(jnp.float32, seed=9), jnp.float32).astype(np.uint64)
    for submodule, collective in S.COLLECTIVES:
        gathers = collective == S.ALL_GATHER  # it receives what its ranks sent, summed
        tapped = () if gathers else (CS.COMPUTED,)
        for point in (CS.SENT, CS.RECEIVED) + tapped:
            value = TP * same % 2 ** 32 if gathers and point == CS.RECEIVED else same
            out.setdefault(CS.record_key(1, submodule, collective, point),
                           _block([[value] * TP] * 2))
    return out


def test_a_clean_all_gather_of_real_shards_has_no_verdict():
    shards = [_values(jnp.float32, seed=r) for r in range(TP)]
    assert V.verdict_rows(1, _records(shards, [[shards] * TP] * 2)) == []


def test_two_sign_flips_on_the_wire_are_communication_not_computation():
    # The suspect's tp rank 1 receives rank 0's block with two sign bits flipped, as the
    # engine's `collective/all_gather` faults do (the value sent left alone). A whole-word sum
    # does not move: a lock-step run then showed no communication row, and the attention the
    # block fed was blamed instead (computation, `first`).
    shards = [_values(jnp.float32, seed=r) for r in range(TP)]
    signs = (shards[0].reshape(-1) >> 31) & 1
    corrupted = _flip(shards[0], [(int(i), 31) for i in np.flatnonzero(signs == 0)[:2]])
    received = [[shards] * TP, [shards, [corrupted, shards[1]]]]
    rows = V.verdict_rows(1, _records(shards, received))
    assert [(r["collective"], r["tp_rank"], r["verdict"], r["found_by"], r["first"])
            for r in rows] == [(S.ALL_GATHER, 1, "communication", "sum", True)]
