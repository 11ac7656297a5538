"""Named sites of the model and the hook through which the outside world sees them.

The model calls `hook(site, x, layer)` at every named point of its computation and uses what
the hook returns. The default hook is the identity, which costs nothing after tracing.
Lock-step taps, fault injection and ABFT are hooks composed from outside; the model knows
nothing about them.

A forward site (`attn_out`) sees the tensor itself. A site on a submodule's input (`attn_in`)
is where a hook with a custom VJP sees the input gradient in the backward pass: the paper's
`bwd/attn` and `bwd/ffn` sites are the cotangents at `attn_in` and `ffn_in`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from sdcstudy.core import mesh as M

# Submodule boundaries (Ma et al., section 4: the four sites of Tables 1-2).
ATTN_IN, ATTN_OUT = "attn_in", "attn_out"
FFN_IN, FFN_OUT = "ffn_in", "ffn_out"

# Inside the attention submodule.
ATTN_NORM, ATTN_Q, ATTN_K, ATTN_V = "attn_norm", "attn_q", "attn_k", "attn_v"
ATTN_SCORES, ATTN_PROBS, ATTN_CONTEXT = "attn_scores", "attn_probs", "attn_context"
# Inside the FFN submodule.
FFN_NORM, FFN_GATE, FFN_UP, FFN_ACT = "ffn_norm", "ffn_gate", "ffn_up", "ffn_act"
# Outside the blocks (layer 0).
EMBED, FINAL_NORM, LOGITS = "embed", "final_norm", "logits"

# Around the tensor-parallel collectives of a block (Megatron sequence parallelism, called only
# under `tp_axis`): the input and output, on each tp rank, of the all-gather before each
# submodule and of the reduce-scatter after it. Not in BLOCK_SITES: a hook that enumerates the
# block's sites (golden digests, fault specs by name) does not see them.
ATTN_GATHER_IN, ATTN_GATHER_OUT = "attn_gather_in", "attn_gather_out"
ATTN_SCATTER_IN, ATTN_SCATTER_OUT = "attn_scatter_in", "attn_scatter_out"
FFN_GATHER_IN, FFN_GATHER_OUT = "ffn_gather_in", "ffn_gather_out"
FFN_SCATTER_IN, FFN_SCATTER_OUT = "ffn_scatter_in", "ffn_scatter_out"
ALL_GATHER, REDUCE_SCATTER = "all_gather", "reduce_scatter"
# (submodule, collective) -> (input site, output site), in the order a block runs them.
COLLECTIVES = {
    ("attn", ALL_GATHER): (ATTN_GATHER_IN, ATTN_GATHER_OUT),
    ("attn", REDUCE_SCATTER): (ATTN_SCATTER_IN, ATTN_SCATTER_OUT),
    ("ffn", ALL_GATHER): (FFN_GATHER_IN, FFN_GATHER_OUT),
    ("ffn", REDUCE_SCATTER): (FFN_SCATTER_IN, FFN_SCATTER_OUT),
}
COLLECTIVE_SITES = tuple(site for pair in COLLECTIVES.values() for site in pair)

BLOCK_SITES = (ATTN_NORM, ATTN_IN, ATTN_Q, ATTN_K, ATTN_V, ATTN_SCORES, ATTN_PROBS,
               ATTN_CONTEXT, ATTN_OUT, FFN_NORM, FFN_IN, FFN_GATE, FFN_UP, FFN_ACT, FFN_OUT)
MODEL_SITES = (EMBED, FINAL_NORM, LOGITS)
ALL_SITES = BLOCK_SITES + MODEL_SITES

# The paper's four comparison sites, as (run-folder name, model site, direction).
# Sites that exist only inside the unfused attention (scores, probabilities) or whose hook
# the fused kernel's caller would have to honour on its own (the context): a hook that reads
# any of them keeps the einsum + softmax path (`core/model.py`, `model.attention`).
ATTENTION_INTERNALS = frozenset((ATTN_SCORES, ATTN_PROBS, ATTN_CONTEXT))

PAPER_SITES = {
    "fwd/attn": (ATTN_OUT, "fwd"),
    "fwd/ffn": (FFN_OUT, "fwd"),
    "bwd/attn": (ATTN_IN, "bwd"),
    "bwd/ffn": (FFN_IN, "bwd"),
}


class Hook(Protocol):
    def __call__(self, site: str, x: jax.Array, layer: int) -> jax.Array: ...


def identity_hook(site: str, x: jax.Array, layer: int) -> jax.Array:
    del site, layer
    return x


identity_hook.sites = frozenset()


def reads(hook: Hook) -> frozenset[str] | None:
    """The sites `hook` may read or change, from its `sites` attribute (set by `only`,
    `compose` and `declare`); None when it does not say, which means any site."""
    sites = getattr(hook, "sites", None)
    return None if sites is None else frozenset(sites)


def declare(sites, hook: Hook) -> Hook:
    """`hook`, saying it reads or changes only `sites` (the identity elsewhere): the model
    may then compute the other sites however it likes (fused attention)."""
    hook.sites = frozenset(sites)
    return hook


def reads_attention_internals(hook: Hook) -> bool:
    """Whether `hook` may read scores, probabilities or the context (or does not say)."""
    sites = reads(hook)
    return sites is None or bool(sites & ATTENTION_INTERNALS)


def compose(*hooks: Hook | None) -> Hook:
    """Apply hooks left to right: `compose(inject, tap)` corrupts first, then compares."""
    active = [h for h in hooks if h is not None and h is not identity_hook]
    if not active:
        return identity_hook
    if len(active) == 1:
        return active[0]

    def composed(site: str, x: jax.Array, layer: int) -> jax.Array:
        for h in active:
            x = h(site, x, layer)
        return x

    each = [reads(h) for h in active]
    if all(sites is not None for sites in each):
        composed.sites = frozenset().union(*each)
    return composed


def linear(hook: Hook, site: str, x: jax.Array, w: jax.Array, layer: int,
           out_dtype=None) -> jax.Array:
    """`hook(site, x @ w, layer)`: a matmul whose output is the named site.

    A hook with a `linear` method (ABFT's) computes the product itself; any other hook sees
    exactly the product the model would compute without it. `out_dtype` asks for a wider
    result (the float32 logits of a bfloat16 model).
    """
    own = getattr(hook, "linear", None)
    if own is not None:
        return own(site, x, w, layer, out_dtype)
    if out_dtype is None:
        # Inside `shard_map` (operands that vary over manual mesh axes) the weight gradient
        # takes `matmul`'s form; under `jax.jit` autodiff's own, whose bits earlier runs have.
        inside = M.varying_axes(x) | M.varying_axes(w)
        return hook(site, matmul(x, w) if inside else x @ w, layer)
    return hook(site, jnp.einsum("bld,dv->blv", x, w, preferred_element_type=out_dtype), layer)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` for x (..., d) and a weight w (d, v), with the weight's gradient computed as
    (dy^T x)^T rather than x^T dy.

    The products and their count are autodiff's; the weight gradient's summation order may
    differ from autodiff's, so a step built on it is bit-reproducible but not bit-equal to one
    built on `x @ w`. The form matters to XLA's CPU backend: for autodiff's x^T dy inside
    `shard_map` it emits a plain dot over a transposed operand plus a copy, and the tiny
    model's forward and backward pass takes about 15% longer than with the library matmul it
    picks for dy^T x. `linear` uses this form inside `shard_map` only: under `jax.jit` the
    plain step keeps autodiff's form and the bits of every run, golden record and figure made
    with it, though this one would take 0.84-0.85x its time there too (RESULTS.md,
    `experiments/compiler_options.py --matmul-form`).
    """
    return x @ w


def _matmul_fwd(x, w):
    return x @ w, (x, w)


def _reduce_to(cotangent, primal):
    """The cotangent summed over the mesh axes it varies over and its primal does not: the
    transposes that `check_vma` inserts for a broadcast operand (the data-parallel gradient
    all-reduce of a replicated weight, the tensor-parallel one of a replicated input)."""
    extra = tuple(sorted(M.varying_axes(cotangent) - M.varying_axes(primal)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent


def _matmul_bwd(residuals, dy):
    x, w = residuals
    dx = jnp.einsum("...n,kn->...k", dy, w)
    dw = jnp.einsum("mn,mk->nk", dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])).T
    return _reduce_to(dx, x), _reduce_to(dw, w)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def only(sites: tuple[str, ...], fn: Callable[[str, jax.Array, int], jax.Array]) -> Hook:
    """A hook that applies `fn` at the named sites and is the identity elsewhere."""
    wanted = frozenset(sites)

    def hook(site: str, x: jax.Array, layer: int) -> jax.Array:
        return fn(site, x, layer) if site in wanted else x

    return declare(wanted, hook)
