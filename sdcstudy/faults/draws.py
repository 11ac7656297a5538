"""The random decisions of one corruption, which do not depend on the tensor's values: which
elements are hit, exactly at any rate, and each hit's value (the flipped bit, the error's size
and sign, a replacement value), drawn from the site's key in a few hashes (`hashing.py`).

`corrupt.py` applies them to a tensor and records what changed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core.mesh import varying_axes, vary
from sdcstudy.faults import hashing as H
from sdcstudy.faults.bits import bits_of_class
from sdcstudy.faults.specs import FaultSpec, FaultSpecError

# --- the bit a bit flip flips ------------------------------------------------------------------


def _allowed_bits(spec: FaultSpec, width: int) -> tuple[int, ...]:
    """The bits a bit-flip spec may flip in `width`-bit values."""
    if spec.bits is None:
        return tuple(b for b in bits_of_class(spec.bit_class, width) if b < width)
    missing = [b for b in spec.bits if b >= width]
    if missing:  # flipping the others alone would inject less than the spec says
        which = ("none of bits" if len(missing) == len(spec.bits) else
                 f"bits {missing} of bits")
        raise FaultSpecError(f"{spec.site}: {which} {list(spec.bits)} exist in the "
                             f"{width}-bit values at this site; a {width}-bit float has bits "
                             f"0-{width - 1}.")
    return tuple(spec.bits)


def _draws_a_bit(spec: FaultSpec, width: int) -> bool:
    """Whether the flipped bit is drawn (a `randint` over the allowed bits), not fixed."""
    return spec.kind == "bitflip" and len(_allowed_bits(spec, width)) > 1


def _value_requests(spec: FaultSpec, keys, bit_keys, n: int) -> list:
    """The hash requests (key, n) of n hit values: the plain bits of the (bit, value, sign)
    `keys` that `_aux_bits` names, then, for a drawn bit, the two halves of its `randint`
    (`bit_keys`: `jax.random.split` of the bit key; None where the bit is not drawn)."""
    plain = [(keys[i], n) for i in _aux_bits(spec)]
    return plain + ([] if bit_keys is None else [(key, n) for key in bit_keys])


def _value_bits(spec: FaultSpec, words: list, shape) -> dict:
    """The `bits` that `_aux` reads, from the hash words of `_value_requests`, in order."""
    plain = _aux_bits(spec)
    bits = {i: H.as_bits(w, shape) for i, w in zip(plain, words)}
    if len(words) > len(plain):
        bits["bit"] = [H.as_bits(w, shape) for w in words[len(plain):]]
    return bits


# --- which elements are hit -------------------------------------------------------------------
# A rate is exact at any size: the hit elements of a flat tensor are the points of a Bernoulli
# process, drawn as geometric gaps between consecutive hits (`hit_positions`), so a draw costs
# the hits it makes, not the tensor's size. Uniforms on float32's 2^-23 grid cannot draw a
# gap of probability below 2^-23 (a float32 Bernoulli fires at 1.19e-7 for every smaller rate);
# `_fine` keeps 72 random bits, and each gap is a whole number of BLOCK elements plus a
# remainder, both drawn exactly, so every integer gap up to 2^31 can occur.
HIT_CAP = 1024  # hits drawn one by one per draw; past the cap-th, the rest is drawn densely
BLOCK = 256
MAX_ELEMENTS = 2 ** 31 - 2 * BLOCK  # the positions' uint32 sums stay below 2^32


def _fine(bits):
    """Uniform on [0, 1) from `words` x 24 random bits, `bits` of shape (words, *shape):
    P(u < t) = t to float32's relative precision for every t down to 2^(-24 words) (three
    words, 72 bits: 2e-22)."""
    parts = (bits >> 8).astype(jnp.float32)
    u = parts[-1]
    for part in parts[-2::-1]:
        u = part + u * 2.0 ** -24
    return jnp.minimum(u * 2.0 ** -24, 1 - 2.0 ** -24)  # float32 rounding may reach 1


def hit_positions(key, rate, size: int, cap: int):
    """The flat positions (uint32, increasing) of the first `cap` elements hit when each of
    `size` elements is hit independently with probability `rate`; `size` where fewer are hit.

    A gap of G unhit elements before a hit is geometric, P(G >= g) = (1 - rate)^g; it is drawn
    as G = BLOCK * A + B, A and B independent (a geometric's quotient and remainder by BLOCK
    are): A = floor(E / (BLOCK lam)) with E exponential and lam = -log(1 - rate), B the
    geometric truncated to [0, BLOCK) by inversion.
    """
    k_blocks, k_rest = H.split(jax.random.key_data(key), 2)
    return _positions(*H.bits([(k_blocks, (3, cap)), (k_rest, (cap,))]), rate, size, cap)


def _positions(block_bits, rest_bits, rate, size: int, cap: int):
    """`hit_positions` from the bits it draws: (3, cap) for the blocks, (cap,) for the rest."""
    if size > MAX_ELEMENTS:
        raise FaultSpecError(f"a fault site holds {size:,} elements; rates are drawn for at "
                             f"most {MAX_ELEMENTS:,} per tensor.")
    rate = jnp.asarray(rate, jnp.float32)
    lam = -jnp.log1p(-rate)  # inf at rate 1: every gap is 0
    on = lam > 0
    safe = jnp.where(on, lam, 1.0)
    exponential = -jnp.log1p(-_fine(block_bits))
    most = math.ceil(size / BLOCK)  # this many blocks already pass the last element
    blocks = jnp.where(on, jnp.minimum(jnp.floor(exponential / (safe * BLOCK)), most), most)
    in_block = -jnp.expm1(-safe * BLOCK)  # P(G < BLOCK)
    v = H.uniform(rest_bits)
    rest = jnp.minimum(jnp.floor(-jnp.log1p(-v * in_block) / safe), BLOCK - 1)
    gaps = blocks.astype(jnp.uint32) * BLOCK + jnp.where(on, rest, 0).astype(jnp.uint32)
    steps = gaps + (jnp.arange(cap) > 0).astype(jnp.uint32)  # each hit moves past the last
    return saturating_cumsum(steps, size)


def saturating_cumsum(steps, size: int):
    """min(cumsum(steps), size) of uint32 `steps`, without overflow: each step is clipped to
    `size` < 2^31, so the running sum cannot wrap before it first reaches `size`, and from
    there on the running maximum of "reached" holds it at `size`. Two native cumulative
    reductions, which compile in a fraction of a saturating associative scan's time."""
    clipped = jnp.minimum(steps, jnp.uint32(size))
    total = jnp.cumsum(clipped, dtype=jnp.uint32)
    reached = lax.cummax((total >= size).astype(jnp.uint32))
    return jnp.where(reached > 0, jnp.uint32(size), total)


AUX_KEYS = 3  # the keys of a hit's value: (bit, value, sign)


def _aux_bits(spec: FaultSpec) -> tuple[int, ...]:
    """Which of the value's keys (bit, value, sign) the kind draws plain bits from: these are
    drawn in the hash of the positions' bits; a normal value is JAX's own draw, and a drawn
    bit takes a hash more (the split of its key, then the two halves of its `randint`)."""
    return {"scale": (1, 2), "additive": (1, 2), "inf": (2,)}.get(spec.kind, ())


def _aux(spec: FaultSpec, keys, bits: dict, width: int, shape):
    """The per-element value of a hit: the flipped bit (bitflip), the factor 1 +/- r (scale),
    the signed error in units of the row's RMS (additive), the replacement value (random, inf)
    or nothing (zero, nan). `keys`: the (bit, value, sign) key data, `jax.random.split` of the
    value's key in 3; `bits`: the bits of the keys `_aux_bits` names, by index, and under
    "bit" the two halves of a drawn bit's `randint` (`_draws_a_bit`)."""
    if spec.kind == "bitflip":
        allowed = _allowed_bits(spec, width)
        if len(allowed) == 1:
            return jnp.full(shape, allowed[0], jnp.int32)
        return jnp.asarray(allowed, jnp.int32)[H.randint(*bits["bit"], len(allowed))]
    if spec.kind in ("scale", "additive"):
        lo, hi = spec.scale
        log_r = H.uniform(bits[1], math.log(lo), math.log(hi))
        sign = jnp.where(H.bernoulli(bits[2], 0.5), 1.0, -1.0)
        error = sign * jnp.exp(log_r)
        return 1 + error if spec.kind == "scale" else error
    if spec.kind == "random":
        return spec.value_std * jax.random.normal(jax.random.wrap_key_data(keys[1]), shape,
                                                  jnp.float32)
    if spec.kind == "inf":
        return jnp.where(H.bernoulli(bits[2], 0.5), jnp.inf, -jnp.inf)
    return None


def _scatter(size: int, positions, values, fill):
    """A flat array of `size` holding `values` at `positions` (those >= size dropped)."""
    return jnp.full(size, fill, values.dtype).at[positions].set(values, mode="drop")


def _sparse_draws(key, spec: FaultSpec, rate, size: int, width: int):
    """(hit, aux, positions, complete), flat: the first HIT_CAP hits one by one, then, if the
    cap-th hit lands, every element after it drawn densely (exact: the elements after a hit
    are independent of the ones before); `complete`: the positions hold every hit."""
    hit, aux, positions, dense_keys = listed_draws(key, spec, rate, size, width)
    axes = _varying(key, rate)
    hit, aux = lax.cond(positions[-1] < size,
                        lambda: vary(dense_after(dense_keys, spec, rate, width, hit, aux,
                                                  positions), axes),
                        lambda: vary((hit, aux), axes))
    return hit, aux, positions, positions[-1] >= size


def listed_draws(key, spec: FaultSpec, rate, size: int, width: int):
    """(hit, aux, positions, the keys of the dense rest): the first HIT_CAP hits, flat.

    Three hashes (`hashing.py`): the key's three keys (hits, their values, the dense rest);
    their splits; then every draw, with the split of the dense rest's value key, so that the
    dense rest is one hash more. `jax.random` would make the same numbers in a dozen."""
    k_hit, k_aux, k_dense = H.split(jax.random.key_data(key), 3)
    hit_words, aux_words, dense_words = H.hashes([(k_hit, 2), (k_aux, AUX_KEYS), (k_dense, 2)])
    (k_blocks, k_rest), aux_keys = H.as_keys(hit_words), H.as_keys(aux_words)
    k_uniform, k_dense_aux = H.as_keys(dense_words)
    cap = min(size, HIT_CAP)
    draws_a_bit = _draws_a_bit(spec, width)
    words = H.hashes([(k_blocks, 3 * cap), (k_rest, cap), (k_dense_aux, AUX_KEYS),
                      *_value_requests(spec, aux_keys, None, cap),
                      *([(aux_keys[0], 2)] if draws_a_bit else [])])
    block_bits, rest_bits = H.as_bits(words[0], (3, cap)), H.as_bits(words[1], (cap,))
    dense_keys = jnp.concatenate([k_uniform[None], H.as_keys(words[2])])
    value_words = words[3:3 + len(_aux_bits(spec))]
    if draws_a_bit:  # the bit key's split came with the draws: its halves take a hash more
        value_words += H.hashes([(key, cap) for key in H.as_keys(words[-1])])
    aux_bits = _value_bits(spec, value_words, (cap,))
    positions = _positions(block_bits, rest_bits, rate, size, cap)
    aux = _aux(spec, aux_keys, aux_bits, width, (cap,))
    hit = _scatter(size, positions, jnp.ones(cap, bool), False)
    aux = None if aux is None else _scatter(size, positions, aux, 0)
    return hit, aux, positions, dense_keys


# The dense rest in two passes, bit for bit the same draws: an element's uniform is two words
# (`_fine`), and its first word alone settles it unless the element is hit or within 2^-24 of
# the rate; so the first words are drawn for every element, and the second word and the hit's
# value only for the few it leaves (each word is the hash of its element's counter, drawable
# alone), gathered. Where they exceed size / GATHERED_SHARE, every element's words are drawn.
# The second pass is a conditional more to compile, so only a tensor that gains takes it: one of
# at least GATHERED_MIN_SIZE elements whose spec can expect HIT_CAP / 2 hits or more at its
# peak rate (a rarer dense rest keeps the one pass; the bits are the same either way). The two
# passes pay on the CPU only: on an H200 (2026-11-30) the gathered pass of a 512 x 1,536
# weight gradient took 253 us against the one pass's 52 us, so off the CPU the draw is one pass.
GATHERED_SHARE = 16
GATHERED_MIN_SIZE = 2 ** 16


def _gathers(spec: FaultSpec, size: int, platform: str | None = None) -> bool:
    """Whether the dense rest of a `size`-element tensor takes two passes on `platform` (by
    default JAX's backend): on the CPU only, where it is large enough, its spec's peak rate
    (the time pattern's largest multiplier) expects HIT_CAP / 2 hits or more, and the kind's
    hit values are drawn element by element from the hashes (a random value is JAX's own
    normal draw over the whole tensor)."""
    peak = min(1.0, spec.base_rate * spec.pattern.peak_multiplier())
    return ((platform or jax.default_backend()) == "cpu" and size >= GATHERED_MIN_SIZE
            and peak * size >= HIT_CAP / 2 and spec.kind != "random")


def _gathered_size(size: int) -> int:
    """How many undecided elements the gathered pass takes at most."""
    return max(1, size // GATHERED_SHARE)


def dense_after(dense_keys, spec: FaultSpec, rate, width: int, hit, aux, positions,
                two_passes: bool | None = None):
    """(hit, aux) with every element after the last listed position drawn densely; where the
    positions hold every hit (the last one is the size), `hit` and `aux` as they were.
    `dense_keys`: the key of the hits' uniforms, then the (bit, value, sign) keys. Drawn in two
    passes (`_undecided`, `_undecided_drawn`) where few elements are left undecided, else at
    once (`dense_after_one_pass`); `two_passes` overrides `_gathers`'s choice of whether to
    try the two (the bits are the same either way)."""
    if not (_gathers(spec, hit.size) if two_passes is None else two_passes):
        return dense_after_one_pass(dense_keys, spec, rate, width, hit, aux, positions)
    first, undecided = _undecided(dense_keys[0], rate, positions, hit.size)
    axes = _varying(dense_keys, rate, hit, positions)
    return lax.cond(
        jnp.sum(undecided) <= _gathered_size(hit.size),
        lambda: vary(_undecided_drawn(dense_keys, spec, rate, width, hit, aux, first,
                                      undecided), axes),
        lambda: vary(dense_after_one_pass(dense_keys, spec, rate, width, hit, aux, positions),
                     axes))


def _dense_after_stacked(dense_keys, spec: FaultSpec, rates, width: int, hit, aux, positions):
    """`dense_after` of each tensor of a stack (the first axis of every argument), with one
    choice between the passes for the whole stack: under `vmap`, a `lax.cond` on each tensor's
    own count would run both."""
    every = jax.vmap(lambda k, r, h, a, p: dense_after_one_pass(k, spec, r, width, h, a, p))
    size = hit.shape[1]
    if not _gathers(spec, size):
        return every(dense_keys, rates, hit, aux, positions)
    first, undecided = jax.vmap(lambda k, r, p: _undecided(k[0], r, p, size))(
        dense_keys, rates, positions)
    gathered = jax.vmap(
        lambda k, r, h, a, f, u: _undecided_drawn(k, spec, r, width, h, a, f, u))
    axes = _varying(dense_keys, rates, hit, positions)
    return lax.cond(jnp.all(jnp.sum(undecided, axis=1) <= _gathered_size(size)),
                    lambda: vary(gathered(dense_keys, rates, hit, aux, first, undecided), axes),
                    lambda: vary(every(dense_keys, rates, hit, aux, positions), axes))


def _undecided(key, rate, positions, size: int):
    """(first, undecided): the bits of every element's first word (counter i), and the
    elements after the last listed position that it leaves undecided or hit. An element whose
    first word's part p0 2^-24 is at least the rate is not hit: `_fine` gives it at least that
    (the second word adds under 2^-24, and its clip stays above)."""
    (words,) = H.hashes([(key, size)])
    first = H.as_bits(words, (size,))
    after = jnp.arange(size, dtype=jnp.uint32) > positions[-1]
    return first, after & ((first >> 8).astype(jnp.float32) * 2.0 ** -24 < rate)


def _undecided_drawn(dense_keys, spec: FaultSpec, rate, width: int, hit, aux, first,
                     undecided):
    """`dense_after`'s (hit, aux) from the `_undecided` elements alone (at most
    `_gathered_size`): their second words (counter size + i) and hit values (counter i)."""
    size = hit.size
    (index,) = jnp.nonzero(undecided, size=_gathered_size(size), fill_value=size)
    index = index.astype(jnp.uint32)  # the fill, size, is dropped below
    bit_keys = H.split(dense_keys[1], 2) if _draws_a_bit(spec, width) else None
    words = H.hashes([(dense_keys[0], index + jnp.uint32(size)),
                      *_value_requests(spec, dense_keys[1:], bit_keys, index)])
    n = index.shape[0]
    uniform = _fine(jnp.stack([first.at[index].get(mode="fill", fill_value=0),
                               H.as_bits(words[0], (n,))]))
    at = jnp.where((index < size) & (uniform < rate), index, jnp.uint32(size))
    hit = hit.at[at].set(True, mode="drop")
    if aux is None:
        return hit, None
    more_aux = _aux(spec, dense_keys[1:], _value_bits(spec, words[1:], (n,)), width, (n,))
    return hit, aux.at[at].set(more_aux, mode="drop")


def dense_after_one_pass(dense_keys, spec: FaultSpec, rate, width: int, hit, aux, positions):
    """`dense_after` in one pass: every element's uniform and hit value drawn."""
    size = hit.size
    bit_keys = H.split(dense_keys[1], 2) if _draws_a_bit(spec, width) else None
    words = H.hashes([(dense_keys[0], 2 * size),
                      *_value_requests(spec, dense_keys[1:], bit_keys, size)])
    aux_bits = _value_bits(spec, words[1:], (size,))
    after = jnp.arange(size, dtype=jnp.uint32) > positions[-1]
    more = after & (_fine(H.as_bits(words[0], (2, size))) < rate)
    more_aux = _aux(spec, dense_keys[1:], aux_bits, width, (size,))
    return hit | more, None if aux is None else jnp.where(more, more_aux, aux)


def _cap(spec: FaultSpec, size: int) -> int:
    """How many hit positions a draw of `spec` lists."""
    return min(size, HIT_CAP if spec.count is None else spec.count)


def draw(key, spec: FaultSpec, rate, shape, width):
    """The random decisions of one corruption, which do not depend on the tensor's values:
    (hit, aux, positions, complete). `aux` as `_aux` draws it for every hit element (0
    elsewhere); `positions` (uint32, increasing, the size past the last) the flat positions of
    the first `_cap` hits, and every hit when `complete`."""
    size = math.prod(shape)
    if spec.count is not None:
        hit, aux, positions, complete = _counted_draws(key, spec, rate, size, width)
    else:
        hit, aux, positions, complete = _sparse_draws(key, spec, rate, size, width)
    return (*_shaped(spec, shape, hit, aux), positions, complete)


def _counted_draws(key, spec: FaultSpec, rate, size: int, width: int):
    """`draw`, flat, of a spec that hits exactly `count` distinct elements when on."""
    k_hit, k_aux = H.split(jax.random.key_data(key), 2)
    chosen = jax.random.choice(jax.random.wrap_key_data(k_hit), size, (_cap(spec, size),),
                               replace=False)
    hit = jnp.zeros(size, bool).at[chosen].set(rate > 0)
    positions = jnp.where(rate > 0, jnp.sort(chosen), size).astype(jnp.uint32)
    aux_keys = H.split(k_aux, AUX_KEYS)
    bit_keys = H.split(aux_keys[0], 2) if _draws_a_bit(spec, width) else None
    requests = _value_requests(spec, aux_keys, bit_keys, size)
    aux_bits = _value_bits(spec, H.hashes(requests) if requests else [], (size,))
    return hit, _aux(spec, aux_keys, aux_bits, width, (size,)), positions, jnp.bool_(True)


def _shaped(spec: FaultSpec, shape, hit, aux):
    """Flat (hit, aux) in the tensor's shape, hits outside the spec's lanes dropped."""
    hit, aux = hit.reshape(shape), None if aux is None else aux.reshape(shape)
    if spec.lanes is not None:
        lane = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
        hit &= jnp.isin(lane, jnp.asarray(spec.lanes))
    return hit, aux


def _varying(*values) -> frozenset:
    """The `shard_map` axes any of `values` varies over: both branches of a `lax.cond` must
    vary over the same axes."""
    return frozenset().union(*(varying_axes(v) for v in values))


def _no_draws(spec: FaultSpec, shape):
    """What `draw` gives when the rate is 0, without drawing: nothing is hit."""
    aux = {"bitflip": jnp.int32, "scale": jnp.float32, "additive": jnp.float32,
           "random": jnp.float32, "inf": jnp.float32}.get(spec.kind)
    size = math.prod(shape)
    return (jnp.zeros(shape, bool), None if aux is None else jnp.zeros(shape, aux),
            jnp.full(_cap(spec, size), size, jnp.uint32), jnp.bool_(True))
