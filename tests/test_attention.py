"""The fused and Pallas attention paths (`model.attention`, core/model.py) against the unfused
one, and which path a hook selects.

The fused path is `jax.nn.dot_product_attention` (cuDNN's kernel on a GPU, XLA's composition
here); it never materializes the scores or probabilities, so a hook that reads them, or the
context, must keep the einsum + softmax path. `auto`, the default, is unfused off a GPU: every
CPU run keeps the bits it had. What is compared here is the algorithm, so within a tolerance
derived from the arithmetic (see `error_bound`); which path runs is read from the traced step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.core import determinism
from sdcstudy.core import model as M
from sdcstudy.core import sites as S
from sdcstudy.core.config import ModelDims
from sdcstudy.core.errors import UserError

U32 = 2.0 ** -24  # unit roundoff of float32: scores, softmax and accumulation in both paths
UBF16 = 2.0 ** -8  # unit roundoff of bfloat16


def error_bound(q, k, v, dtype) -> float:
    """How far the two paths may differ on any element of the context.

    Both compute float32 scores, a float32 softmax and accumulate in float32; they differ in
    rounding only. The scale: the unfused path divides by sqrt(E), the fused one multiplies by
    a rounded 1/sqrt(E): each score's relative error is at most 2u, so an absolute 2u max|s|,
    and a softmax probability moves by at most p (|ds_i| + sum_j p_j |ds_j|) <= 4u max|s| p.
    The two sums over L keys (scores, context) may add in another order: (L + 2)u max|v| more.
    In bfloat16 the probabilities and the context are each rounded once to bfloat16 in both
    paths; where the float32 values differ by an ulp the roundings may go either way: at most
    one bfloat16 ulp of each probability (sum_j p_j = 1, so UBF16 max|v|) and of the output
    (UBF16 max|v|).
    """
    e, length = q.shape[-1], q.shape[1]
    q32, k32 = np.asarray(q, np.float32), np.asarray(k, np.float32)
    group = q.shape[2] // k.shape[2]
    k_rep = np.repeat(k32, group, axis=2)
    max_score = np.abs(np.einsum("bqhe,bshe->bhqs", q32, k_rep)).max() / np.sqrt(e)
    max_v = np.abs(np.asarray(v, np.float32)).max()
    bound = (4 * max_score + length + 2) * U32 * max_v
    if jnp.dtype(dtype) == jnp.bfloat16:
        bound += 2 * UBF16 * max_v
    return float(bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_equals_unfused_within_the_rounding_bound(dtype):
    """The fused path computes the same attention as the unfused one (grouped-query heads
    matched to the same kv head, causal mask, 1/sqrt(E) scale): every element within the
    bound above. Head dim 24 makes 1/sqrt(E) inexact, so the two roundings really differ in
    float32; a wrong grouping, mask or scale would miss by orders of magnitude."""
    b, length, h, kv, e = 2, 32, 4, 2, 24
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
               for shape in [(b, length, h, e), (b, length, kv, e), (b, length, kv, e)])

    @jax.jit
    def both(q, k, v):
        unfused = M._unfused_attention(q, k, v, S.identity_hook, 1)
        fused = M.fused_attention(q, k, v, M.XLA).reshape(unfused.shape)
        no_mask = jax.nn.dot_product_attention(q, k, v, implementation=M.XLA)
        return unfused, fused, no_mask.reshape(unfused.shape)

    unfused, fused, no_mask = (np.asarray(x, np.float32) for x in both(q, k, v))
    bound = error_bound(q, k, v, dtype)
    diff = np.abs(fused - unfused).max()
    assert diff <= bound, f"{dtype}: max |fused - unfused| {diff:.3g} over the bound {bound:.3g}"
    assert np.abs(no_mask - unfused).max() > bound  # a wrong mask misses it: the bound can fail


def flash_bound(q, k, v, dtype, block: int) -> float:
    """`error_bound` plus what the Pallas kernel's online softmax adds (`pallas_attention`).

    It scales scores by a rounded log2(e)/sqrt(E) and takes exp2: the same 2u relative error
    per score `error_bound` allows. Per block of `block` keys it rescales the running sum and
    output by exp2(m_old - m_new) (one rounding of the factor, one of each product) and
    divides once at the end: (2 n_blocks + 4) u max|v| more. In bfloat16 it rounds the
    unnormalized probabilities to bfloat16 before the product with v while its normalizer
    sums the float32 ones, so the weights may sum to 1 +- UBF16, on top of each weight's own
    rounding (UBF16): 2 UBF16 max|v| beyond `error_bound`'s."""
    blocks = -(-q.shape[1] // block)
    max_v = float(np.abs(np.asarray(v, np.float32)).max())
    bound = error_bound(q, k, v, dtype) + (2 * blocks + 4) * U32 * max_v
    if jnp.dtype(dtype) == jnp.bfloat16:
        bound += 2 * UBF16 * max_v
    return bound


def _qkv(dtype, b=2, length=32, h=4, kv=2, e=24):
    rng = np.random.default_rng(7)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                 for shape in [(b, length, h, e), (b, length, kv, e), (b, length, kv, e)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_equals_unfused_within_the_rounding_bound(dtype):
    """The Pallas path (its interpreter here, the kernels' own arithmetic) computes the
    unfused path's attention: grouped-query heads, causal mask and scale as there, every
    element within `flash_bound`; attention without the mask misses it (the test can fail).
    Length 32 is one forward block; 256 is two, so the online rescaling runs."""
    for length in (32, 256):
        q, k, v = _qkv(dtype, b=1, length=length)
        unfused = np.asarray(M._unfused_attention(q, k, v, S.identity_hook, 1), np.float32)
        pallas = np.asarray(M.pallas_attention(q, k, v).reshape(unfused.shape), np.float32)
        no_mask = np.asarray(jax.nn.dot_product_attention(q, k, v), np.float32)
        bound = flash_bound(q, k, v, dtype, block=128)
        diff = np.abs(pallas - unfused).max()
        assert diff <= bound, f"{dtype}, L={length}: |pallas - unfused| {diff:.3g} > {bound:.3g}"
        assert np.abs(no_mask.reshape(unfused.shape) - unfused).max() > bound


def test_pallas_gradients_equal_unfused_within_the_accumulation_term():
    """The Pallas backward kernel (dq, dk, dv) against autodiff of the unfused path, float32:
    each gradient within (L + 2) u of its largest element, the bound's accumulation-order term
    (its sums over L run in another order); the gradient of attention without the mask misses
    it."""
    q, k, v = _qkv("float32")
    do = jnp.asarray(np.random.default_rng(8).standard_normal((2, 32, 4 * 24), np.float32))
    length = q.shape[1]

    def grads(attend):
        return jax.vjp(attend, q, k, v)[1](do)

    unfused = grads(lambda q, k, v: M._unfused_attention(q, k, v, S.identity_hook, 1))
    pallas = grads(lambda q, k, v: M.pallas_attention(q, k, v).reshape(do.shape))
    no_mask = grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v).reshape(do.shape))
    for name, want, got, wrong in zip("qkv", unfused, pallas, no_mask):
        tolerance = (length + 2) * U32 * float(jnp.abs(want).max())
        diff = float(jnp.abs(got - want).max())
        assert diff <= tolerance, f"d{name}: {diff:.3g} > {tolerance:.3g}"
        assert float(jnp.abs(wrong - want).max()) > tolerance


@pytest.mark.parametrize("length", [8, 48, 96, 200])
def test_pallas_refuses_lengths_its_tiles_cannot_cover(length):
    q, k, v = _qkv("float32", b=1, length=length, e=16)
    with pytest.raises(UserError, match=f"model.attention=pallas needs a sequence length "
                                        f"that is a power of two .* not {length};"):
        M.pallas_attention(q, k, v)


def test_pallas_refuses_a_step_inside_shard_map():
    """The paired modes' step runs inside shard_map, whose outputs must say how they vary over
    the manual axes; the Pallas kernels' do not, so the model refuses in one sentence (exit 2)
    instead of failing deep in JAX."""
    from jax.sharding import PartitionSpec as P

    q, k, v = _qkv("float32", b=1, length=16, e=16)
    mesh = jax.make_mesh((1,), ("node",))
    inside = jax.shard_map(lambda q, k, v: M.pallas_attention(q, k, v), mesh=mesh,
                           in_specs=P(), out_specs=P())
    with pytest.raises(UserError, match="model.attention=pallas runs only in steps outside "
                                        "shard_map"):
        inside(q, k, v)


def _declared(*sites):
    return S.only(sites, lambda site, x, layer: x)


def _undeclared(site, x, layer):
    return x


@pytest.mark.parametrize("hook, expected", [
    (S.identity_hook, M.CUDNN),
    (_declared(S.ATTN_OUT, S.FFN_OUT), M.CUDNN),
    (_declared(S.ATTN_SCORES), M.UNFUSED),
    (_declared(S.ATTN_PROBS), M.UNFUSED),
    (_declared(S.ATTN_CONTEXT), M.UNFUSED),
    (_undeclared, M.UNFUSED),  # a hook that does not say which sites it reads may read any
    (S.compose(_declared(S.ATTN_IN), _declared(S.FFN_IN)), M.CUDNN),
    (S.compose(_declared(S.ATTN_OUT), _undeclared), M.UNFUSED),
    (S.compose(_declared(S.ATTN_OUT), _declared(S.ATTN_PROBS)), M.UNFUSED),
])
def test_hooks_on_scores_probabilities_or_context_keep_the_unfused_path(hook, expected):
    """On a GPU in bfloat16 `auto` and `fused` run cuDNN's kernel unless an active hook may
    read scores, probabilities or the context: a fault at `attn_probs` or a tap at
    `attn_scores` on the fused path would see a tensor that does not exist."""
    for mode in (M.AUTO, M.FUSED):
        assert M.attention_path(mode, hook, jnp.bfloat16, 64, platform="gpu",
                                cudnn_fails=False) == expected


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_pallas_runs_wherever_no_hook_reads_the_internals(platform):
    """`pallas` runs its kernels on any platform, in any dtype, whether or not cuDNN can launch
    under the flags; a hook that may read scores, probabilities or the context keeps the
    unfused path there too."""
    for dtype in (jnp.float32, jnp.bfloat16):
        for fails in (False, True):
            where = dict(platform=platform, cudnn_fails=fails)
            assert M.attention_path(M.PALLAS, S.identity_hook, dtype, 64, **where) == M.PALLAS
            assert M.attention_path(M.PALLAS, _declared(S.ATTN_OUT), dtype, 64,
                                    **where) == M.PALLAS
            for hook in (_declared(S.ATTN_PROBS), _declared(S.ATTN_CONTEXT), _undeclared):
                assert M.attention_path(M.PALLAS, hook, dtype, 64, **where) == M.UNFUSED


def test_where_each_mode_runs_what():
    """`unfused` always; `auto` unfused off a GPU (CPU bits as before); float32 and head dims
    cuDNN does not take fall back to XLA's composition; a mode that is not one is refused."""
    hook = S.identity_hook
    for fails in (False, True):
        where = dict(platform="gpu", cudnn_fails=fails)
        assert M.attention_path(M.UNFUSED, hook, jnp.bfloat16, 64, **where) == M.UNFUSED
        assert M.attention_path(M.FUSED, hook, jnp.float32, 64, **where) == M.XLA
        assert M.attention_path(M.FUSED, hook, jnp.bfloat16, 12, **where) == M.XLA
        assert M.attention_path(M.AUTO, hook, jnp.bfloat16, 64, platform="cpu",
                                cudnn_fails=fails) == M.UNFUSED
        assert M.attention_path(M.FUSED, hook, jnp.bfloat16, 64, platform="cpu",
                                cudnn_fails=fails) == M.XLA
    with pytest.raises(ValueError, match="model.attention must be one of"):
        M.attention_path("flash", hook, jnp.float32, 64)


def test_where_cudnn_cannot_launch_auto_runs_pallas_where_it_takes_the_step_and_fused_is_refused():
    """Under the determinism flags jaxlib 0.11.2's XLA fails to launch cuDNN's fused attention
    (an H200, 2026-11-30): there `auto` runs the Pallas kernels (1.95x the unfused step on
    that H200, its bits repeated) at a length they tile and outside shard_map, the unfused
    path otherwise (and under a hook on the internals), and `fused` is refused in one sentence
    (a UserError: exit 2) instead of failing at the first step."""
    from jax.sharding import PartitionSpec as P

    hook, where = S.identity_hook, dict(platform="gpu", cudnn_fails=True)
    for length in (16, 128, 512, 4096):
        assert M.attention_path(M.AUTO, hook, jnp.bfloat16, 64, length=length,
                                **where) == M.PALLAS
    for length in (8, 200, None):
        assert M.attention_path(M.AUTO, hook, jnp.bfloat16, 64, length=length,
                                **where) == M.UNFUSED
    assert M.attention_path(M.AUTO, _declared(S.ATTN_PROBS), jnp.bfloat16, 64, length=512,
                            **where) == M.UNFUSED
    assert M.attention_path(M.AUTO, hook, jnp.float32, 64, length=512, **where) == M.XLA
    assert M.attention_path(M.AUTO, hook, jnp.bfloat16, 64, platform="gpu",
                            cudnn_fails=False, length=512) == M.CUDNN
    paths = []
    inside = jax.shard_map(lambda x: paths.append(M.attention_path(
        M.AUTO, hook, jnp.bfloat16, 64, length=512, **where)) or x,
        mesh=jax.make_mesh((1,), ("node",)), in_specs=P(), out_specs=P())
    inside(jnp.zeros(1))
    assert paths == [M.UNFUSED]
    with pytest.raises(UserError, match="model.attention=fused would run cuDNN's fused "
                                        "attention.*jaxlib 0.11.2 and earlier"):
        M.attention_path(M.FUSED, hook, jnp.bfloat16, 64, platform="gpu", cudnn_fails=True)


@pytest.mark.parametrize("flags, jaxlib, fails", [
    ("--xla_gpu_deterministic_ops=true --xla_gpu_exclude_nondeterministic_ops=true", "0.11.2",
     True),
    ("--xla_gpu_exclude_nondeterministic_ops=true", "0.10.2", True),  # either flag
    ("--xla_gpu_deterministic_ops=true", "0.11.2.dev20261101", True),
    ("--xla_gpu_deterministic_ops=true", "0.11.3", False),  # not measured: cuDNN is tried
    ("--xla_gpu_deterministic_ops=true", "0.12.0", False),
    ("--xla_gpu_deterministic_ops=false --xla_gpu_exclude_nondeterministic_ops=false",
     "0.11.2", False),  # the flags off: cuDNN launched (the acceptance's free step)
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", "0.11.2", False),
    ("", "0.11.2", False),
])
def test_cudnn_attention_fails_under_either_determinism_flag_through_jaxlib_0_11_2(
        flags, jaxlib, fails):
    assert determinism.cudnn_attention_fails(flags, jaxlib) is fails


DIMS = ModelDims(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                 head_dim=16, ffn_dim=128)


def _jaxpr(attention: str, hook=S.identity_hook) -> str:
    dims = dataclasses.replace(DIMS, attention=attention)
    graphdef, params = M.abstract_init(dims)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    return str(jax.make_jaxpr(lambda p, t: M.apply(graphdef, p, t, hook=hook))(params, tokens))


def test_the_traced_step_runs_the_selected_path():
    """Read from the traced model (no compile): `fused` with no hook calls `fused_attention`
    in every layer; a hook on `attn_probs` removes it; `auto` on this CPU traces exactly the
    program `unfused` does, so no CPU run changes a bit; `pallas` calls the Pallas kernels
    (with their own backward) in every layer, and not under a hook on `attn_scores`."""
    assert _jaxpr(M.FUSED).count("name=fused_attention") == DIMS.n_layers
    assert "fused_attention" not in _jaxpr(M.FUSED, _declared(S.ATTN_PROBS))
    assert "fused_attention" in _jaxpr(M.FUSED, _declared(S.ATTN_OUT))
    assert _jaxpr(M.AUTO) == _jaxpr(M.UNFUSED)
    assert "fused_attention" not in _jaxpr(M.UNFUSED)
    assert _jaxpr(M.PALLAS).count("bwd=_mha_backward") == DIMS.n_layers
    assert "mha_backward" not in _jaxpr(M.PALLAS, _declared(S.ATTN_SCORES))
    assert "mha_backward" not in _jaxpr(M.UNFUSED) + _jaxpr(M.FUSED)


def test_a_declared_hook_is_not_called_at_sites_the_fused_path_has_not():
    """A hook declaring `attn_out` sees `attn_out` (and the context, which both paths have)
    on the fused path, never scores or probabilities."""
    seen = set()

    def spy(site, x, layer):
        seen.add(site)
        return x

    _jaxpr(M.FUSED, S.declare({S.ATTN_OUT}, spy))
    assert S.ATTN_OUT in seen and S.ATTN_CONTEXT in seen
    assert not seen & {S.ATTN_SCORES, S.ATTN_PROBS}


@pytest.mark.slow
def test_a_pallas_training_repeats_its_bits_and_tracks_the_unfused_one(tmp_path):
    """Three steps of the tiny training under `model.attention=pallas`, twice: every metric and
    the whole final state (parameters, optimizer state, step) bit for bit the same; each step's
    loss and gradient norm within 1e-5
    (relative) of the unfused training's (float32; the attention's own differences are about
    1e-6 of its output)."""
    from sdcstudy import runner
    from sdcstudy.core import config as C
    from sdcstudy.core import runfolder as RF

    from bitwise import bits, state_bits

    def train(attention: str, name: str):
        cfg = C.from_dict({"experiment": {"steps": 3, "batch_size": 4},
                           "data": {"seq_len": 32}}, [f"model.attention={attention}"])
        runner.run(cfg, tmp_path / name, progress=False)
        rows = [{k: v for k, v in r.items() if not k.startswith("time/")}
                for r in RF.read_jsonl(tmp_path / name / RF.METRICS)]
        return rows, RF.json_load(tmp_path / name / RF.SUMMARY)["param_digest"]

    first, again, unfused = train("pallas", "a"), train("pallas", "b"), train("unfused", "u")
    assert bits(first) == bits(again)
    assert state_bits(tmp_path / "a") == state_bits(tmp_path / "b")
    assert first[1] != unfused[1]  # a different program: the comparison below is not trivial
    for ours, theirs in zip(first[0], unfused[0]):
        assert ours["loss/healthy"] == pytest.approx(theirs["loss/healthy"], rel=1e-5)
        assert ours["grad/norm"] == pytest.approx(theirs["grad/norm"], rel=1e-5)
