"""Fault rates are exact at any size: the elements the sampler hits against the count the rate
expects, for rates from 1 down to 1e-12 per element.

The test: over many independent draws the total number of hit elements is binomial, and for
these rates within the spread of a Poisson count of the same mean, so the two-sided Poisson
p-value of the observed total against rate x elements x draws (`bands.poisson_p_value`) must
exceed LEVEL. The keys are fixed, so a failure does not come and go: it means the sampler does
not fire at the spec's rate. A float32 Bernoulli (jax.random.bernoulli's default) fails this
same test below 2^-23: its uniform on a 2^-23 grid fires at about 1.19e-7 for every smaller
rate (test_a_float32_bernoulli_fails_the_same_test).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.faults import corrupt as FC
from sdcstudy.faults import draws as FD
from sdcstudy.faults import specs as FS
from sdcstudy.reproduce.bands import poisson_p_value

LEVEL = 1e-3
SHAPE = (256, 1024)
ELEMENTS = math.prod(SHAPE)
HUGE = 2 ** 30  # elements of a tensor seen only through its hit positions
WANTED = 30  # expected hits over all draws at least this


def _p_value(observed: int, rate: float, elements: int, draws: int) -> float:
    return poisson_p_value(observed, rate * elements * draws)


@functools.lru_cache(maxsize=None)
def _landed_count():
    """One jitted site (its rate an input, so one program for every rate): a bitflip always
    lands, so the landed elements are the hit ones."""
    x = jax.random.normal(jax.random.key(0), SHAPE, jnp.float32)
    spec = FS.FaultSpec("fwd/attn", "bitflip", rate=1.0)
    return jax.jit(lambda key, rate: FC.corrupt(x, key, spec, rate)[1].sum())


@pytest.mark.parametrize("rate", [1.0, 0.3, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6])
def test_corruptions_follow_the_rate(rate):
    """Through `corrupt`, as a site runs it. Rates above HIT_CAP / ELEMENTS (4e-3) pass the cap
    of hits drawn one by one and draw the rest of the tensor densely; a count that fails there
    means the two parts do not join into one Bernoulli process."""
    draws = max(2, math.ceil(WANTED / (rate * ELEMENTS)))
    count = _landed_count()
    keys = jax.random.split(jax.random.key(1), draws)
    observed = sum(int(count(key, jnp.float32(rate))) for key in keys)
    assert _p_value(observed, rate, ELEMENTS, draws) > LEVEL, (observed, rate * ELEMENTS * draws)


def _positions(rate: float, cap: int, draws: int, size: int = HUGE, seed: int = 2):
    """The hit positions of `draws` draws over a tensor of `size` elements, without the tensor."""
    keys = jax.random.split(jax.random.key(seed), draws)
    return np.asarray(jax.jit(jax.vmap(lambda k: FD.hit_positions(k, rate, size, cap)))(keys))


@pytest.mark.parametrize("rate, cap, draws", [(1e-7, 1024, 2), (1e-9, 16, 40),
                                              (1e-12, 4, 40_000)])
def test_hit_counts_follow_rates_far_below_float32s_grid(rate, cap, draws):
    """Rates below 2^-23 over 2^30 elements a draw, counted from the positions alone: every
    draw's hits must fit its cap (or the count is incomplete), and the total must match."""
    positions = _positions(rate, cap, draws)
    assert (positions[:, -1] == HUGE).all()
    observed = int((positions < HUGE).sum())
    assert _p_value(observed, rate, HUGE, draws) > LEVEL, (observed, rate * HUGE * draws)


def test_a_float32_bernoulli_fails_the_same_test():
    """What the test above guards against: at 1e-9 over 2^24 elements a draw a float32
    Bernoulli fires about 120 times too often. If this fails, the test has lost its power (or
    JAX's default Bernoulli changed)."""
    rate, size, draws = 1e-9, 2 ** 24, 4
    keys = jax.random.split(jax.random.key(3), draws)
    hits = jax.jit(jax.vmap(lambda k: jax.random.bernoulli(k, rate, (size,)).sum()))(keys)
    assert _p_value(int(hits.sum()), rate, size, draws) < LEVEL


def test_hit_positions_are_distinct_and_uniform_past_float32s_integers():
    """Positions increase strictly and spread evenly over 2^30 elements, down to their lowest
    bit: a gap computed in float32 alone would land only on even positions past 2^24."""
    positions = _positions(2e-7, 1024, 20)
    hit = positions < HUGE
    assert (np.diff(positions, axis=1)[hit[:, 1:]] > 0).all()
    found = positions[hit].astype(np.float64)
    n = found.size
    assert n > 1000
    for values, mean, var in ((found / HUGE, 0.5, 1 / 12), (found % 2, 0.5, 0.25),
                              (found % 256, 127.5, (256 ** 2 - 1) / 12)):
        assert abs(values.mean() - mean) < 5 * math.sqrt(var / n)


@pytest.mark.parametrize("size", [1, 7, 65_536, FD.MAX_ELEMENTS])
def test_positions_saturate_at_the_size_without_overflow(size):
    """The running sum of the gaps is min(cumsum, size), exactly, for gaps as large as
    `hit_positions` makes them (a block past the last element), where uint32 sums of two such
    gaps near 2^31 would wrap."""
    rng = np.random.default_rng(size)
    biggest = size + 2 * FD.BLOCK - 1
    for high in (2, 50, biggest + 1):
        steps = rng.integers(0, high, 1024).astype(np.uint32)
        steps[rng.integers(0, 1024, 8)] = biggest
        got = np.asarray(jax.jit(FD.saturating_cumsum, static_argnums=1)(steps, size))
        want = np.minimum(np.cumsum(steps.astype(np.uint64)), size).astype(np.uint32)
        np.testing.assert_array_equal(got, want)
