"""A Llama-style decoder in Flax NNX, with named sites and optional tensor parallelism.

Shapes: B batch, L sequence, D model, H query heads, K kv heads, G = H/K heads per kv head,
E head dim, F ffn, V vocab. Under tensor parallelism (inside `shard_map`, `tp_axis` set) the
input is sequence-sharded and the weights hold this rank's heads and FFN columns; head
counts are read from the weights' shapes, so the same code runs sharded and unsharded.

The model knows nothing about faults or comparisons: it calls `hook(site, x, layer)` at the
named sites of `core/sites.py` (identity by default), and `sites.linear(hook, site, x, w, layer)`
for the projections whose outputs are sites (a hook may own those products: ABFT's does).
Layers count from 1; layer 0 is outside the blocks.

Outside this module parameters are plain nested dicts (`init` and `apply`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from sdcstudy.core import determinism
from sdcstudy.core import embedding as E
from sdcstudy.core import sites as S
from sdcstudy.core.mesh import inside_shard_map
from sdcstudy.core.config import ModelDims
from sdcstudy.core.errors import UserError
from sdcstudy.core.sites import Hook, identity_hook

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Ma et al., appendix B.2: "Kaiming and Xavier uniform initialization". Projections use
# Xavier (Glorot) uniform; the embedding uses Kaiming (He) uniform over the model dimension.
_linear_init = nnx.initializers.xavier_uniform()
_embed_init = nnx.initializers.he_uniform(in_axis=-1, out_axis=-2)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def rope_frequencies(dims: ModelDims):
    """Inverse frequencies of the rotary embedding, with Llama 3 scaling when configured."""
    e = dims.head_dim
    inv_freq = 1.0 / (dims.rope_theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
    if dims.rope_scaling is None:
        return inv_freq
    s = dict(dims.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(medium, blended, scaled)


def rotary(dims: ModelDims, length: int):
    """cos and sin tables of shape (L, E) in the half-rotation layout of HF Llama."""
    angles_LE2 = jnp.arange(length, dtype=jnp.float32)[:, None] * rope_frequencies(dims)[None]
    angles_LE = jnp.concatenate([angles_LE2, angles_LE2], axis=-1)
    return jnp.cos(angles_LE), jnp.sin(angles_LE)


def apply_rotary(x_BLHE, cos_LE, sin_LE):
    half = x_BLHE.shape[-1] // 2
    rotated = jnp.concatenate([-x_BLHE[..., half:], x_BLHE[..., :half]], axis=-1)
    x32 = x_BLHE.astype(jnp.float32)
    out = x32 * cos_LE[:, None] + rotated.astype(jnp.float32) * sin_LE[:, None]
    return out.astype(x_BLHE.dtype)


class Attention(nnx.Module):
    def __init__(self, dims: ModelDims, *, rngs: nnx.Rngs):
        d, e, pdt = dims.d_model, dims.head_dim, DTYPES[dims.param_dtype]
        self.head_dim = e
        self.attention = getattr(dims, "attention", AUTO)
        self.wq = nnx.Param(_linear_init(rngs.params(), (d, dims.n_heads * e), pdt))
        self.wk = nnx.Param(_linear_init(rngs.params(), (d, dims.n_kv_heads * e), pdt))
        self.wv = nnx.Param(_linear_init(rngs.params(), (d, dims.n_kv_heads * e), pdt))
        self.wo = nnx.Param(_linear_init(rngs.params(), (dims.n_heads * e, d), pdt))

    def __call__(self, x_BLD, cos_LE, sin_LE, hook: Hook, layer: int):
        dtype, e = x_BLD.dtype, self.head_dim
        b, l, _ = x_BLD.shape
        q = S.linear(hook, S.ATTN_Q, x_BLD, self.wq[...].astype(dtype), layer)
        k = S.linear(hook, S.ATTN_K, x_BLD, self.wk[...].astype(dtype), layer)
        v = S.linear(hook, S.ATTN_V, x_BLD, self.wv[...].astype(dtype), layer)
        h, kv = q.shape[-1] // e, k.shape[-1] // e  # local head counts under tp
        q_BLHE = apply_rotary(q.reshape(b, l, h, e), cos_LE, sin_LE)
        k_BLKE = apply_rotary(k.reshape(b, l, kv, e), cos_LE, sin_LE)
        v_BLKE = v.reshape(b, l, kv, e)
        path = attention_path(self.attention, hook, dtype, e, length=l)
        if path == UNFUSED:
            context_BLHE = _unfused_attention(q_BLHE, k_BLKE, v_BLKE, hook, layer)
        elif path == PALLAS:
            context_BLHE = pallas_attention(q_BLHE, k_BLKE, v_BLKE).reshape(b, l, h * e)
        else:
            context_BLHE = fused_attention(q_BLHE, k_BLKE, v_BLKE, path).reshape(b, l, h * e)
        context_BLHE = hook(S.ATTN_CONTEXT, context_BLHE, layer)
        return S.linear(hook, S.ATTN_OUT, context_BLHE, self.wo[...].astype(dtype), layer)


def _unfused_attention(q_BLHE, k_BLKE, v_BLKE, hook: Hook, layer: int):
    """einsum + softmax with float32 scores, every intermediate a site: the path whose bits
    every run before `model.attention` has."""
    b, l, h, e = q_BLHE.shape
    kv, dtype = k_BLKE.shape[2], q_BLHE.dtype
    q_BLKGE = q_BLHE.reshape(b, l, kv, h // kv, e)
    scores_BKGLL = jnp.einsum("bqkge,bske->bkgqs", q_BLKGE, k_BLKE,
                              preferred_element_type=jnp.float32) / math.sqrt(e)
    causal_LL = jnp.tril(jnp.ones((l, l), dtype=bool))
    scores_BKGLL = jnp.where(causal_LL, scores_BKGLL, jnp.finfo(jnp.float32).min)
    scores_BKGLL = hook(S.ATTN_SCORES, scores_BKGLL, layer)
    probs_BKGLL = hook(S.ATTN_PROBS, jax.nn.softmax(scores_BKGLL, axis=-1).astype(dtype), layer)
    context_BLKGE = jnp.einsum("bkgqs,bske->bqkge", probs_BKGLL, v_BLKE)
    return context_BLKGE.reshape(b, l, h * e)


# `model.attention`: which attention computation the model runs (docs/config.md).
AUTO, FUSED, UNFUSED, PALLAS = "auto", "fused", "unfused", "pallas"
ATTENTION_MODES = (AUTO, FUSED, UNFUSED, PALLAS)
# The fused path's implementations, as `jax.nn.dot_product_attention` names them.
CUDNN, XLA = "cudnn", "xla"


def attention_path(mode: str, hook: Hook, dtype, head_dim: int,
                   platform: str | None = None, cudnn_fails: bool | None = None,
                   length: int | None = None) -> str:
    """UNFUSED, CUDNN, XLA or PALLAS: the attention a layer of sequence `length` runs under
    `model.attention` = `mode`.

    Unfused wherever a hook may read scores, probabilities or the context (a hook that does
    not declare its sites may read any), and for `auto` off a GPU, so that CPU runs keep
    every bit they had. Otherwise `jax.nn.dot_product_attention`: cuDNN's fused kernel on a
    GPU where cuDNN takes the shape (bfloat16, head dim a multiple of 8 up to 128), XLA's
    composition elsewhere (in jax 0.10 `implementation=None` means XLA's, even on a GPU).
    Where cuDNN's kernel cannot launch under the determinism flags (`cudnn_fails`, by default
    `determinism.cudnn_attention_fails()`), `fused` is refused and `auto` runs the Pallas
    kernels where they take the step (`pallas_takes`; on an H200 they ran medium's bfloat16
    step 1.95x as fast as the unfused one under the flags and repeated its bits in two
    processes), else unfused. `pallas` runs `pallas_attention` on any platform where no hook
    reads the internals.
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_MODES)}, "
                         f"not {mode!r}.")
    platform = platform or jax.default_backend()
    if mode == UNFUSED or (mode == AUTO and platform != "gpu"):
        return UNFUSED
    if S.reads_attention_internals(hook):
        return UNFUSED
    if mode == PALLAS:
        return PALLAS
    cudnn_takes = jnp.dtype(dtype) == jnp.bfloat16 and head_dim % 8 == 0 and head_dim <= 128
    if platform != "gpu" or not cudnn_takes:
        return XLA
    if not (determinism.cudnn_attention_fails() if cudnn_fails is None else cudnn_fails):
        return CUDNN
    if mode == AUTO:
        return PALLAS if length is not None and pallas_takes(length) else UNFUSED
    last = ".".join(map(str, determinism.CUDNN_ATTENTION_FAILS_THROUGH))
    raise UserError(f"model.attention=fused would run cuDNN's fused attention, which XLA in "
                    f"jaxlib {last} and earlier cannot launch under the determinism flags "
                    f"(the step fails at its first launch); use model.attention=auto or "
                    f"unfused.")


def pallas_takes(length: int) -> bool:
    """Whether `pallas_attention` runs here: a length its tiles cover, outside `shard_map`."""
    return _tiled_length(length) and not inside_shard_map()


def _tiled_length(length: int) -> bool:
    """The Pallas kernels' tiles (128 keys forward, 32 backward) cover a power of two from 16
    to 128 or a multiple of 128."""
    return length % 128 == 0 or (16 <= length <= 128 and length & (length - 1) == 0)


@functools.partial(jax.jit, static_argnames=("implementation",))
def fused_attention(q_BLHE, k_BLKE, v_BLKE, implementation: str):
    """Causal attention in one call, (B, L, H, E) out; grouped-query by kv head as the
    unfused path groups it (query head n reads kv head n // (H/K)). A function of its own
    (`jit` inlines it) so that a traced step names it: `fused_attention` in the jaxpr."""
    return jax.nn.dot_product_attention(q_BLHE, k_BLKE, v_BLKE, is_causal=True,
                                        implementation=implementation)


def pallas_attention(q_BLHE, k_BLKE, v_BLKE):
    """Causal attention by JAX's Pallas flash-attention kernels, (B, L, H, E) out: Triton
    kernels on a GPU (the backward writes each block of dq, dk and dv from one program, no
    atomics, so its bits do not depend on scheduling), Pallas's interpreter elsewhere (slow:
    for checking). Grouped-query heads read their kv head as the unfused path groups them.
    The kernels' tiles (128 keys forward, 32 backward) need a power-of-two length from 16 to
    128 or a multiple of 128, and they run outside `shard_map` only."""
    from jax.experimental.pallas.ops.gpu import attention as flash

    b, length, h, e = q_BLHE.shape
    if inside_shard_map():
        raise UserError("model.attention=pallas runs only in steps outside shard_map (mode "
                        "train's; the paired modes' step is inside one): JAX's Pallas kernels "
                        "do not say how their output varies over a mesh's manual axes; use "
                        "model.attention=auto there.")
    if not _tiled_length(length):
        raise UserError(f"model.attention=pallas needs a sequence length that is a power of "
                        f"two from 16 to 128 or a multiple of 128, not {length}; use "
                        f"model.attention=auto or change data.seq_len.")
    group = h // k_BLKE.shape[2]
    k_BLHE, v_BLHE = (jnp.repeat(x, group, axis=2) for x in (k_BLKE, v_BLKE))
    return flash.mha(q_BLHE, k_BLHE, v_BLHE, None, sm_scale=1 / math.sqrt(e), causal=True,
                     interpret=jax.default_backend() != "gpu")


class FeedForward(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dims: ModelDims, *, rngs: nnx.Rngs):
        d, f, pdt = dims.d_model, dims.ffn_dim, DTYPES[dims.param_dtype]
        self.w_gate = nnx.Param(_linear_init(rngs.params(), (d, f), pdt))
        self.w_up = nnx.Param(_linear_init(rngs.params(), (d, f), pdt))
        self.w_down = nnx.Param(_linear_init(rngs.params(), (f, d), pdt))

    def __call__(self, x_BLD, hook: Hook, layer: int):
        dtype = x_BLD.dtype
        gate_BLF = S.linear(hook, S.FFN_GATE, x_BLD, self.w_gate[...].astype(dtype), layer)
        up_BLF = S.linear(hook, S.FFN_UP, x_BLD, self.w_up[...].astype(dtype), layer)
        act_BLF = hook(S.FFN_ACT, jax.nn.silu(gate_BLF) * up_BLF, layer)
        return S.linear(hook, S.FFN_OUT, act_BLF, self.w_down[...].astype(dtype), layer)


class Block(nnx.Module):
    def __init__(self, dims: ModelDims, *, rngs: nnx.Rngs):
        pdt = DTYPES[dims.param_dtype]
        self.attn_norm = RMSNorm(dims.d_model, dims.norm_eps, pdt)
        self.attn = Attention(dims, rngs=rngs)
        self.ffn_norm = RMSNorm(dims.d_model, dims.norm_eps, pdt)
        self.ffn = FeedForward(dims, rngs=rngs)

    def __call__(self, x_BLD, cos_LE, sin_LE, hook: Hook, layer: int, tp_axis: str | None):
        # Megatron sequence parallelism: gather the sequence-sharded input before each
        # submodule, reduce-scatter its partial output after. Sites sit inside, per rank; each
        # collective's input and output are sites too (`sites.COLLECTIVES`).
        h = hook(S.ATTN_NORM, self.attn_norm(x_BLD), layer)
        if tp_axis is not None:
            h = all_gather(hook, S.COLLECTIVES["attn", S.ALL_GATHER], h, layer, tp_axis)
        h = hook(S.ATTN_IN, h, layer)
        a = self.attn(h, cos_LE, sin_LE, hook, layer)  # its output projection is `attn_out`
        if tp_axis is not None:
            a = reduce_scatter(hook, S.COLLECTIVES["attn", S.REDUCE_SCATTER], a, layer, tp_axis)
        x_BLD = x_BLD + a

        h = hook(S.FFN_NORM, self.ffn_norm(x_BLD), layer)
        if tp_axis is not None:
            h = all_gather(hook, S.COLLECTIVES["ffn", S.ALL_GATHER], h, layer, tp_axis)
        h = hook(S.FFN_IN, h, layer)
        f = self.ffn(h, hook, layer)  # its down projection is `ffn_out`
        if tp_axis is not None:
            f = reduce_scatter(hook, S.COLLECTIVES["ffn", S.REDUCE_SCATTER], f, layer, tp_axis)
        return x_BLD + f


def all_gather(hook: Hook, sites: tuple[str, str], x_BLD, layer: int, tp_axis: str):
    """This rank's sequence shard gathered from every tp rank, its input and output sites."""
    site_in, site_out = sites
    x_BLD = hook(site_in, x_BLD, layer)
    return hook(site_out, lax.all_gather(x_BLD, tp_axis, axis=1, tiled=True), layer)


def reduce_scatter(hook: Hook, sites: tuple[str, str], x_BLD, layer: int, tp_axis: str):
    """This rank's partial sums, summed over tp ranks and scattered by sequence shard, its
    input and output sites."""
    site_in, site_out = sites
    x_BLD = hook(site_in, x_BLD, layer)
    return hook(site_out, lax.psum_scatter(x_BLD, tp_axis, scatter_dimension=1, tiled=True),
                layer)


class Llama(nnx.Module):
    def __init__(self, dims: ModelDims, *, rngs: nnx.Rngs):
        self.dims = dims
        pdt = DTYPES[dims.param_dtype]
        self.embed = nnx.Param(_embed_init(rngs.params(), (dims.vocab_size, dims.d_model), pdt))
        self.layers = nnx.List([Block(dims, rngs=rngs) for _ in range(dims.n_layers)])
        self.final_norm = RMSNorm(dims.d_model, dims.norm_eps, pdt)
        if not dims.tie_embeddings:
            self.head = nnx.Param(_linear_init(rngs.params(), (dims.d_model, dims.vocab_size), pdt))

    def __call__(self, tokens_BL, *, hook: Hook = identity_hook, tp_axis: str | None = None):
        """float32 logits (B, L, V). Under tp, tokens and logits are this rank's sequence shard."""
        dims = self.dims
        dtype = DTYPES[dims.dtype]
        length = tokens_BL.shape[1] * (1 if tp_axis is None else lax.axis_size(tp_axis))
        cos_LE, sin_LE = rotary(dims, length)
        embedded_BLD = E.lookup(self.embed[...], tokens_BL,
                                getattr(dims, "embedding_grad", E.SCATTER))
        x_BLD = hook(S.EMBED, embedded_BLD.astype(dtype), 0)
        for i, block in enumerate(self.layers):
            x_BLD = block(x_BLD, cos_LE, sin_LE, hook, i + 1, tp_axis)
        x_BLD = hook(S.FINAL_NORM, self.final_norm(x_BLD), 0)
        head_DV = self.embed[...].T if dims.tie_embeddings else self.head[...]
        return S.linear(hook, S.LOGITS, x_BLD, head_DV.astype(dtype), 0, out_dtype=jnp.float32)


def init(dims: ModelDims, key: jax.Array):
    """`(graphdef, params)`: a static description and a plain nested dict of arrays."""
    model = Llama(dims, rngs=nnx.Rngs(params=key))
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def init_params(dims: ModelDims, key: jax.Array) -> dict:
    """`init(dims, key)`'s parameters, bit for bit, from one compiled program per model shape:
    every trainer, mode and mesh starts from it (and XLA's persistent compilation cache shares
    it between processes), then places, stacks or shards what it gives in a small program of
    its own, where a sharded initializer of the whole state would be a program per mesh."""
    return _init_program(dims)(jax.random.key_data(key))


@functools.cache
def _init_program(dims: ModelDims):
    return jax.jit(lambda key_data: init(dims, jax.random.wrap_key_data(key_data))[1])


def abstract_init(dims: ModelDims):
    """Like `init`, with `jax.ShapeDtypeStruct` leaves and no computation."""
    model = nnx.eval_shape(lambda: Llama(dims, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def apply(graphdef, params, tokens_BL, *, hook: Hook = identity_hook, tp_axis: str | None = None):
    return nnx.merge(graphdef, params)(tokens_BL, hook=hook, tp_axis=tp_axis)


def token_losses(graphdef, params, tokens_BL1, mask_BL=None, *, hook: Hook = identity_hook,
                 tp_axis: str | None = None):
    """Sum of next-token negative log-likelihoods and the number of counted tokens."""
    return sequence_losses(graphdef, params, tokens_BL1[:, :-1], tokens_BL1[:, 1:], mask_BL,
                           hook=hook, tp_axis=tp_axis)


def sequence_losses(graphdef, params, inputs_BL, targets_BL, mask_BL=None, *,
                    hook: Hook = identity_hook, tp_axis: str | None = None):
    """Like `token_losses` with inputs and targets given apart, as sequence parallelism needs
    (each tp rank holds its own slice of both; the sums are then this rank's part)."""
    logits_BLV = apply(graphdef, params, inputs_BL, hook=hook, tp_axis=tp_axis)
    logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
    nll_BL = -jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
    weights_BL = jnp.ones_like(nll_BL) if mask_BL is None else mask_BL.astype(jnp.float32)
    return jnp.sum(nll_BL * weights_BL), jnp.sum(weights_BL)
