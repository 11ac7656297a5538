"""model.embedding_grad: the embedding lookup's gradient without a scatter (core/embedding.py).

`sorted` sums each vocabulary row's cotangents in an order the tokens fix (a stable sort, a
segmented scan, a gather) so that a GPU step without XLA's determinism flags has no atomic
scatter-add; `scatter`, the default, must keep the program every run had."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.core import config as C
from sdcstudy.core import embedding as E
from sdcstudy.core.errors import UserError


def _reference_row_sums(ids, rows, n_rows):
    out = np.zeros((n_rows, rows.shape[1]), rows.dtype)
    for i, row in zip(ids, rows):
        out[i] += row
    return out


def test_row_sums_are_each_rows_sum_exactly_on_whole_numbers():
    # Whole numbers below 2^24 add exactly in float32 in any order: the sums must equal the
    # reference's bit for bit, rows no id names must be zero, every id (first, last, repeated
    # many times, once) must be found.
    rng = np.random.default_rng(0)
    n_rows = 37
    ids = np.concatenate([rng.integers(3, 30, 500), [0, 36, 36, 5]]).astype(np.int32)
    rng.shuffle(ids)
    rows = rng.integers(-1000, 1000, (ids.size, 6)).astype(np.float32)
    got = np.asarray(jax.jit(E.row_sums, static_argnums=2)(ids, rows, n_rows))
    want = _reference_row_sums(ids, rows, n_rows)
    assert np.array_equal(got, want)
    assert not got[[1, 2, 30, 35]].any() and got[36].any() and got[0].any()


def test_the_sorted_gradient_is_autodiffs_within_the_summation_bound():
    # The same terms summed in another order: each element within n u sum|terms| of the
    # scatter-add's (n the row's count, u float32's unit roundoff: under the worst case of two
    # orders, 2 (n - 1) u sum|terms|, which rounding that does not conspire stays well inside),
    # and the forward the same.
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.normal(size=(50, 8)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 50, (4, 64)), jnp.int32)
    upstream = jnp.asarray(rng.normal(size=(4, 64, 8)), jnp.float32)

    def grads(mode):
        out, vjp = jax.vjp(lambda t: E.lookup(t, tokens, mode), table)
        return out, vjp(upstream)[0]

    (out_s, g_scatter), (out_o, g_sorted) = grads(E.SCATTER), grads(E.SORTED)
    assert np.array_equal(np.asarray(out_s), np.asarray(out_o))
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=50)[:, None]
    magnitude = _reference_row_sums(np.asarray(tokens).ravel(),
                                    np.abs(np.asarray(upstream)).reshape(-1, 8), 50)
    bound = counts * 2.0 ** -24 * magnitude
    assert np.all(np.abs(np.asarray(g_sorted) - np.asarray(g_scatter)) <= bound)
    assert not np.array_equal(np.asarray(g_sorted), np.zeros_like(g_sorted))


def test_scatter_keeps_the_lookup_program_and_sorted_has_no_scatter():
    # `scatter` must trace to exactly what `jnp.take` traced to (every run's bits kept);
    # `sorted`'s gradient has no scatter at all, so no atomic add on a GPU.
    table = jax.ShapeDtypeStruct((50, 8), jnp.float32)
    tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)

    def grad_jaxpr(lookup):
        return str(jax.make_jaxpr(jax.grad(lambda t, x: lookup(t, x).sum()))(table, tokens))

    assert grad_jaxpr(lambda t, x: E.lookup(t, x, E.SCATTER)) == grad_jaxpr(
        lambda t, x: jnp.take(t, x, axis=0))
    assert "scatter" in grad_jaxpr(lambda t, x: E.lookup(t, x, E.SCATTER))
    assert "scatter" not in grad_jaxpr(lambda t, x: E.lookup(t, x, E.SORTED))
    # nor a while loop, whose predicate a GPU reads on the host at every iteration
    lowered = jax.jit(jax.grad(lambda t, x: E.lookup(t, x, E.SORTED).sum())).lower(
        table, tokens).as_text()
    assert "stablehlo.while" not in lowered and "stablehlo.sort" in lowered


def test_sorted_is_refused_inside_shard_map_and_a_bad_value_in_the_config():
    from jax.sharding import PartitionSpec as P

    table, tokens = jnp.ones((8, 4)), jnp.zeros((2, 3), jnp.int32)
    inside = jax.shard_map(lambda t, x: E.lookup(t, x, E.SORTED),
                           mesh=jax.make_mesh((1,), ("node",)), in_specs=(P(), P()),
                           out_specs=P())
    with pytest.raises(UserError, match="model.embedding_grad=sorted runs only in steps "
                                        "outside shard_map"):
        inside(table, tokens)
    with pytest.raises(C.ConfigError, match="model.embedding_grad must be one of scatter, "
                                            "sorted, not 'atomic'"):
        C.model_dims(C.from_dict({}, ["model.embedding_grad=atomic"]).model)
    dims = C.model_dims(C.from_dict({}, ["model.embedding_grad=sorted"]).model)
    assert dims.embedding_grad == E.SORTED
