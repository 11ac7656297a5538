"""The fused attention path (`model.attention`, core/model.py) against the unfused one, and which
path a hook selects.

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


def test_where_cudnn_cannot_launch_auto_runs_unfused_and_fused_is_refused():
    """Under the determinism flags jaxlib 0.11.2's XLA fails to launch cuDNN's fused attention
    (an H200, 2026-11-30): there `auto` runs the unfused path, and `fused` is refused in one
    sentence (a UserError: exit 2) instead of failing at the first step."""
    hook = S.identity_hook
    assert M.attention_path(M.AUTO, hook, jnp.bfloat16, 64, platform="gpu",
                            cudnn_fails=True) == M.UNFUSED
    assert M.attention_path(M.AUTO, hook, jnp.bfloat16, 64, platform="gpu",
                            cudnn_fails=False) == M.CUDNN
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
    program `unfused` does, so no CPU run changes a bit."""
    assert _jaxpr(M.FUSED).count("name=fused_attention") == DIMS.n_layers
    assert "fused_attention" not in _jaxpr(M.FUSED, _declared(S.ATTN_PROBS))
    assert "fused_attention" in _jaxpr(M.FUSED, _declared(S.ATTN_OUT))
    assert _jaxpr(M.AUTO) == _jaxpr(M.UNFUSED)
    assert "fused_attention" not in _jaxpr(M.UNFUSED)


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
