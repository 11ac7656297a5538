"""The embedding lookup, and a gradient for it that needs no scatter (`model.embedding_grad`).

Autodiff of `jnp.take` sums each vocabulary row's cotangents with a scatter-add. On a GPU
without XLA's determinism flags that scatter adds with atomics, in whatever order the threads
arrive: a step's bits can change from one run to the next (under the flags XLA sorts the
indices first, as here). `sorted` sums them in an order fixed by the tokens alone: the
positions sorted by token (a stable sort), each token's cotangents summed by a segmented scan
(a fixed tree of adds), and each vocabulary row read at its token's last position (a gather,
no scatter). The sums are the same terms in another order, so the bits differ from the
scatter's; `scatter`, the default, keeps every bit every run had. `sorted` is for a GPU step
run without the determinism flags (docs/gpu.md), and runs outside `shard_map` only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core.errors import UserError
from sdcstudy.core.mesh import inside_shard_map
from sdcstudy.core.presets import EMBEDDING_GRADS

SCATTER, SORTED = EMBEDDING_GRADS  # model.embedding_grad


def lookup(table_VD, tokens, embedding_grad: str = SCATTER):
    """`table_VD[tokens]`, its gradient by `embedding_grad` (module docstring)."""
    if embedding_grad == SCATTER:
        return jnp.take(table_VD, tokens, axis=0)
    if embedding_grad != SORTED:
        raise ValueError(f"model.embedding_grad must be one of {', '.join(EMBEDDING_GRADS)}, "
                         f"not {embedding_grad!r}.")
    if inside_shard_map():
        raise UserError("model.embedding_grad=sorted runs only in steps outside shard_map (mode "
                        "train's; the paired modes' step is inside one); use "
                        "model.embedding_grad=scatter there.")
    return _lookup_sorted(table_VD, tokens)


@jax.custom_vjp
def _lookup_sorted(table_VD, tokens):
    return jnp.take(table_VD, tokens, axis=0)


def _lookup_sorted_fwd(table_VD, tokens):
    return jnp.take(table_VD, tokens, axis=0), (table_VD, tokens)


def _lookup_sorted_bwd(residuals, cotangent):
    table_VD, tokens = residuals  # summed in float32 at least (bfloat16 tables too)
    rows_ND = cotangent.reshape(-1, table_VD.shape[1])
    rows_ND = rows_ND.astype(jnp.promote_types(rows_ND.dtype, jnp.float32))
    return row_sums(tokens.reshape(-1), rows_ND, table_VD.shape[0]).astype(table_VD.dtype), None


_lookup_sorted.defvjp(_lookup_sorted_fwd, _lookup_sorted_bwd)


def row_sums(ids_N, rows_ND, n_rows: int):
    """(n_rows, D): row v is the sum of the `rows_ND` whose id is v (zero where none is),
    summed in an order fixed by `ids_N`: a stable sort, a segmented scan, a gather."""
    order_N = jnp.argsort(ids_N, stable=True)
    sorted_ids_N, sorted_rows_ND = ids_N[order_N], rows_ND[order_N]
    starts_N = jnp.concatenate([jnp.ones(1, bool), sorted_ids_N[1:] != sorted_ids_N[:-1]])

    def add_within_segments(earlier, later):
        starts_e, sums_e = earlier
        starts_l, sums_l = later
        return starts_e | starts_l, jnp.where(starts_l[:, None], sums_l, sums_e + sums_l)

    _, sums_ND = lax.associative_scan(add_within_segments, (starts_N, sorted_rows_ND))
    vocabulary_V = jnp.arange(n_rows, dtype=sorted_ids_N.dtype)
    # unrolled: a `while` loop would read its predicate on the host at every step on a GPU
    last_V = jnp.maximum(jnp.searchsorted(sorted_ids_N, vocabulary_V, side="right",
                                          method="scan_unrolled") - 1, 0)
    present_V = sorted_ids_N[last_V] == vocabulary_V
    return jnp.where(present_V[:, None], sums_ND[last_V], jnp.zeros((), rows_ND.dtype))
