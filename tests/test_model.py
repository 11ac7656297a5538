"""The Llama model: named sites, hooks, dtypes, and tensor parallelism in shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sdcstudy.core import config as C
from sdcstudy.core import mesh as M
from sdcstudy.core import model
from sdcstudy.core import sites as S

DIMS = C.model_dims(C.ModelConfig(preset="tiny"))
# Sharded and unsharded float32 programs sum in different orders: relative differences of
# about 1e-6 are expected (float32 addition is not associative); 1e-5 leaves room and catches a
# wrong head or column layout, which gives O(1) differences.
TP_RTOL = 1e-5


@pytest.fixture(scope="module")
def setup():
    graphdef, params = model.init(DIMS, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, DIMS.vocab_size)
    return graphdef, params, tokens


def test_identity_hook_is_free_and_sees_every_site(setup):
    graphdef, params, tokens = setup
    seen = []

    def spy(site, x, layer):
        seen.append((site, layer, x.shape))
        return x

    plain = model.apply(graphdef, params, tokens)
    spied = model.apply(graphdef, params, tokens, hook=spy)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(spied))
    names = {(s, l) for s, l, _ in seen}
    for layer in range(1, DIMS.n_layers + 1):
        assert {(s, layer) for s in S.BLOCK_SITES} <= names
    assert {(s, 0) for s in S.MODEL_SITES} <= names
    shapes = {(s, l): shape for s, l, shape in seen}
    assert shapes[(S.ATTN_OUT, 1)] == (2, 16, DIMS.d_model)
    assert shapes[(S.FFN_ACT, 2)] == (2, 16, DIMS.ffn_dim)


def test_a_hook_changes_only_what_follows_its_site(setup):
    graphdef, params, tokens = setup

    def poke(site, x, layer):
        return x.at[0, 5].add(1.0) if (site, layer) == (S.FFN_OUT, 2) else x

    plain = np.asarray(model.apply(graphdef, params, tokens))
    poked = np.asarray(model.apply(graphdef, params, tokens, hook=poke))
    changed = np.any(plain != poked, axis=-1)
    # Only batch 0, position 5 changes: the last block's FFN output feeds no attention.
    assert changed[0, 5] and changed.sum() == 1


def test_init_is_deterministic_and_seeded():
    a = model.init(DIMS, jax.random.key(3))[1]
    b = model.init(DIMS, jax.random.key(3))[1]
    c = model.init(DIMS, jax.random.key(4))[1]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a["embed"]), np.asarray(c["embed"]))


def test_bfloat16_compute_tracks_float32(setup):
    graphdef, params, tokens = setup
    dims16 = C.model_dims(C.ModelConfig(preset="tiny", dtype="bfloat16"))
    graphdef16, _ = model.abstract_init(dims16)
    hook_dtypes = set()

    def spy(site, x, layer):
        if site == S.ATTN_OUT:
            hook_dtypes.add(x.dtype)
        return x

    f32 = np.asarray(model.apply(graphdef, params, tokens))
    b16 = np.asarray(model.apply(graphdef16, params, tokens, hook=spy))
    assert hook_dtypes == {jnp.dtype(jnp.bfloat16)}
    assert b16.dtype == np.float32
    # bfloat16 keeps 8 mantissa bits (relative step 2^-8 = 0.4%); through 2 layers the logits
    # stay within a few percent of their spread.
    assert np.max(np.abs(b16 - f32)) < 0.05 * np.ptp(f32)


def _tp_specs(params):
    """Megatron layout: Q, K, V, gate, up split by columns; O and down by rows."""
    def spec(path, _):
        name = path[-1].key
        if name in ("wq", "wk", "wv", "w_gate", "w_up"):
            return P(None, M.TP)
        if name in ("wo", "w_down"):
            return P(M.TP, None)
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


@pytest.mark.parametrize("tp", [2])
def test_tensor_parallel_matches_unsharded(setup, tp):
    graphdef, params, tokens = setup
    mesh = M.make_mesh(1, 1, tp)

    def local(params, tokens_BL):
        return model.apply(graphdef, params, tokens_BL, tp_axis=M.TP)

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(_tp_specs(params), P(None, M.TP)),
                                    out_specs=P(None, M.TP), check_vma=True))
    expected = np.asarray(model.apply(graphdef, params, tokens))
    got = np.asarray(sharded(params, tokens))
    np.testing.assert_allclose(got, expected, rtol=TP_RTOL, atol=TP_RTOL * np.abs(expected).max())


def test_shard_map_matmul_gradients_match_autodiff():
    """`sites.linear` inside `shard_map` uses `sites.matmul`, whose VJP must sum each cotangent
    over the mesh axes its operand is replicated on, as autodiff's transposes do: the weight
    gradient over `dp` (the batch is split there) and, for a weight split by columns over `tp`,
    the input gradient over `tp`. If this fails, data- or tensor-parallel gradients are
    per-device partial sums; replicas would still agree with each other bit for bit."""
    mesh = M.make_mesh(dp=2, tp=2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(4, 3, 6)), jnp.float32)

    def loss(x, w):  # the batch over dp, the weight's columns over tp
        y = S.linear(S.identity_hook, S.ATTN_Q, x, w, 0)
        return jax.lax.psum(jnp.sum(y * ct_local(y)), (M.DATA, M.TP))

    def ct_local(y):
        i, j = jax.lax.axis_index(M.DATA), jax.lax.axis_index(M.TP)
        return jax.lax.dynamic_slice(ct, (i * y.shape[0], 0, j * y.shape[2]), y.shape)

    grad = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                                 in_specs=(P(M.DATA), P(None, M.TP)),
                                 out_specs=(P(M.DATA), P(None, M.TP)), check_vma=True))
    got_x, got_w = grad(x, w)
    want_x, want_w = jax.grad(lambda x, w: jnp.sum((x @ w) * ct), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_initial_parameters_are_inits_bit_for_bit(dtype):
    # Every trainer starts from `init_params` (one compiled program per model shape) where it
    # once ran `init` eagerly or inside its own sharded initializer; the parameters must be
    # the same bits, or every recorded run would start elsewhere.
    dims = C.model_dims(C.from_dict({"model": {"n_layers": 1, "dtype": dtype}}).model)
    key = jax.random.fold_in(jax.random.key(3), 0)
    eager = jax.tree.leaves(model.init(dims, key)[1])
    shared = jax.tree.leaves(model.init_params(dims, key))
    assert len(eager) == len(shared) > 0
    for a, b in zip(eager, shared):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
