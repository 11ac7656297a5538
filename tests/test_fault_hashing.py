"""The fault engine's batched hashes (`faults/hashing.py`) are `jax.random`'s draws bit for bit,
and a fault site makes few of them.

If the equality tests fail, JAX derives its threefry keys or bits another way than the one
hashing.py reproduces (`jax_threefry_partitionable`), and every fault draw has moved.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.faults import corrupt as FC
from sdcstudy.faults import hashing as H
from sdcstudy.faults import specs as FS

SEEDS = (0, 1, 2 ** 31 + 5)


def _u32(x):
    return np.asarray(x).view(np.uint32)


@pytest.mark.parametrize("seed", SEEDS)
def test_keys_and_bits_are_jax_randoms(seed):
    key = jax.random.key(seed)
    data = jax.random.key_data(key)
    assert np.array_equal(H.split(data, 5), jax.random.key_data(jax.random.split(key, 5)))
    matrix, vector = H.bits([(data, (3, 7)), (data, (11,))])  # two requests, one hash
    assert np.array_equal(matrix, jax.random.bits(key, (3, 7), jnp.uint32))
    assert np.array_equal(vector, jax.random.bits(key, (11,), jnp.uint32))
    words = [H.fold_in(data, [4, jnp.int32(9), jnp.uint32(2 ** 32 - 1)]),
             jax.jit(H.fold_in)(data, jnp.asarray([4, 9, 2 ** 32 - 1], jnp.uint32))]
    folded = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 4), 9),
                                2 ** 32 - 1)
    for w in words:
        assert np.array_equal(w, jax.random.key_data(folded))
    # vmapped over rows of data, as a stack of parameter leaves derives its keys
    rows = jnp.asarray([[1, 2], [3, 4]], jnp.uint32)
    stacked = jax.vmap(lambda d: H.fold_in(data, d))(rows)
    for row, got in zip(rows.tolist(), stacked):
        want = jax.random.fold_in(jax.random.fold_in(key, row[0]), row[1])
        assert np.array_equal(got, jax.random.key_data(want))


@pytest.mark.parametrize("seed", SEEDS)
def test_uniforms_and_bernoullis_are_jax_randoms(seed):
    # Compared inside jit, as the step computes them: outside, each operation rounds alone,
    # and the multiply-add of the scaling may be contracted inside a compiled program.
    key = jax.random.key(seed)
    shape = (4, 257)

    def ours(data):
        (bits,) = H.bits([(data, shape)])
        return H.uniform(bits), H.uniform(bits, -5.5, -0.25), H.bernoulli(bits, 0.5)

    def theirs(key):
        return (jax.random.uniform(key, shape), jax.random.uniform(key, shape, jnp.float32,
                                                                   -5.5, -0.25),
                jax.random.bernoulli(key, 0.5, shape))

    for a, b in zip(jax.jit(ours)(jax.random.key_data(key)), jax.jit(theirs)(key)):
        assert np.array_equal(_u32(a) if a.dtype != bool else a, _u32(b) if b.dtype != bool
                              else b)


@pytest.mark.parametrize("seed", SEEDS)
def test_randint_is_jax_randoms(seed):
    # A bit flip's bit among the allowed ones (mantissa bits: 23 of float32's; exponent: 8).
    key = jax.random.key(seed)
    higher_key, lower_key = H.split(jax.random.key_data(key), 2)
    higher, lower = H.bits([(higher_key, (6, 50)), (lower_key, (6, 50))])
    for n in (2, 7, 8, 23, 31):
        assert np.array_equal(H.randint(higher, lower, n),
                              jax.random.randint(key, (6, 50), 0, n)), n


def _threefry_hashes(jaxpr) -> int:
    """Threefry hashes in a jaxpr and every jaxpr inside it (conditionals, loops, calls)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "threefry2x32"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _threefry_hashes(inner)
    return count


def test_a_site_draws_in_four_hashes():
    # The three keys, their splits, every listed draw, and the dense rest: 4 hashes where the
    # same numbers drawn through jax.random take 12, each a loop XLA compiles on its own.
    spec = FS.FaultSpec("fwd/attn", "additive", rate=1e-4, scale=(2.0 ** -8, 1.0)).validate()
    x = jnp.ones((32, 64), jnp.float32)
    data = jax.random.key_data(jax.random.key(0))
    jaxpr = jax.make_jaxpr(lambda x, k: FC.corrupt_and_record(x, k, 1e-4, spec, 16,
                                                              skip_idle=True))(x, data)
    assert _threefry_hashes(jaxpr.jaxpr) == 4
