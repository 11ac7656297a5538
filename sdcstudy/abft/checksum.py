"""ABFT's checksummed product: one matrix multiplication checked by its row and column
checksums, forward and backward.

Ma et al., "Understanding Silent Data Corruption in LLM Training", appendix D, after Smith and
van de Geijn (2015) and Wu et al.: for C = A B (A: m x k, B: k x n) and w a vector of ones,
an SDC is flagged when

    ||C w - A (B w)||_inf > tau ||A||_inf ||B||_inf,   tau = k u                  (eq. 6)

with u the unit roundoff. We add the column checksums w^T C - (w^T A) B against
tau ||A||_1 ||B||_1: the rows and columns of the largest residuals locate a corrupted element.

Thresholds (`abft.threshold`):
- `paper`: tau = k * 2**-23, one threshold per check: float32's machine epsilon (the paper's
  u, `torch.finfo(float32).eps` in its float32 experiment; twice float32's unit roundoff). The
  paper takes u of the matmul's dtype: with bfloat16's that is `paper-dtype` below. With
  float32's u on bfloat16 matmuls (bfloat16 inputs, float32 accumulation) it raises false
  alarms: rounding C to bfloat16 moves a row sum by up to 2**-8 (|C| w)_i, which can be as
  large as 2**-8 ||A|| ||B||, so the bound is only safe for k >= 2**15.
- `rounding` (ours): a bound, row by row and column by column, on everything the product's
  arithmetic can do to the residual (`abft/bound.py` derives it and states what it assumes:
  operand rounding, float32 accumulation, output rounding, split-K, underflow). On the CPU it
  is 1.01 [(u_out + n u) (|C| w)_i + (2k + n) u (|A| (|B| w))_i] plus about 3e-33 for
  underflow (rows of about 1e-37, the last position's key and value cotangents late in
  training, flagged healthy bfloat16 runs without it), so a healthy run never flags; being
  per row rather than through the norms it is about sqrt(k) tighter than the norm form, so it
  still catches corruptions larger than the bfloat16 rounding of their own row.
- `paper-dtype` (host side only, for the evaluation): tau = k times the input dtype's epsilon
  (2**-7 for bfloat16), the paper's formula read with the bfloat16 epsilon.
Every rule's residuals come from the operands as the GEMM multiplies them (`bound.py`).

Each product is checked in its three matmuls: `fwd` (C = A B), `bwd_input` (dA = dC B^T) and
`bwd_weight` (dB = A^T dC). A forward fault (`checked_matmul`'s `fault`) is applied between the
product and its check, so it counts as a fault inside the matmul. With `recompute` a flagged
product is recomputed (`lax.cond`, on the device) and training continues on the correct value.
The forward record comes back beside the product; the backward records become the cotangent of
a zero sink, so no result needs a host sync. `abft/checker.py` puts this product on every
linear layer.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core import mesh as M
from sdcstudy.abft import bound as B
from sdcstudy.abft.tables import tau

THRESHOLDS = ("paper", "rounding")

# One check's record, float32 (integers below 2**24 exact): largest residuals and norm products
# (the paper's rules), largest residual-to-bound ratios (ours), the device rule's residual,
# threshold and flag, the located row and column, and the arithmetic the bound assumed.
(ROW_MAX, COL_MAX, NORM_INF, NORM_ONE, ROW_RATIO, COL_RATIO, ROW_RESIDUAL, ROW_THRESHOLD,
 COL_RESIDUAL, COL_THRESHOLD, FLAGGED, ROW, COL, RECOMPUTED, K, M_ROWS, N_COLS, OUT_BITS,
 IN_BITS, OPERAND_ROUNDING, ACC_BITS, OUTPUT_PARTIALS) = range(22)
RECORD_LEN = 22


def _bits(dtype) -> int:
    return jnp.dtype(dtype).itemsize * 8


def _ratio(residual, bound, operands_fit):
    """residual / bound: 0 where the residual is 0, inf where both are infinite but the
    operands' part of the bound is finite (`operands_fit`: |C| w overflowed, which no rounding
    can do); NaN, from non-finite operands, is no flag."""
    ratio = jnp.where(residual == 0, 0.0, residual / bound)
    return jnp.where(jnp.isnan(ratio) & operands_fit, jnp.inf, ratio)


def check(a_MK, b_KN, c_MN, rule: str, arithmetic: B.Arithmetic = B.CPU):
    """The record of one checksummed product: row and column residuals, the paper's norms,
    the configured rule's flag, and the located row and column. Under `rounding` the record
    also holds our bound's ratios (so both rules can be read from one run); under `paper` they
    are left out (NaN), which keeps the check cheaper."""
    return check_values(*(x.astype(jnp.float32) for x in (a_MK, b_KN, c_MN)),
                        (a_MK.dtype, b_KN.dtype, c_MN.dtype), rule, arithmetic)


def check_values(a32, b32, c32, dtypes, rule: str, arithmetic: B.Arithmetic):
    """`check` of float32 copies of the operands and product, whose dtypes in the GEMM were
    `dtypes` (A's, B's, C's): each copy is re-rounded to its dtype (`bound.as_stored`)."""
    hi = lax.Precision.HIGHEST  # the checksums themselves in full float32 on every backend
    a_dtype, b_dtype, c_dtype = dtypes
    compute = jnp.promote_types(a_dtype, b_dtype)
    a, rho_a = B.checksum_operand(a32, a_dtype, compute, arithmetic)
    b, rho_b = B.checksum_operand(b32, b_dtype, compute, arithmetic)
    c = B.as_stored(c32, c_dtype)
    (m, k), n = a.shape, b.shape[1]
    out_bits, in_bits = _bits(c_dtype), _bits(a_dtype)
    row_M = jnp.abs(jnp.sum(c, axis=1) - jnp.dot(a, jnp.sum(b, axis=1), precision=hi))
    col_N = jnp.abs(jnp.sum(c, axis=0) - jnp.dot(jnp.sum(a, axis=0), b, precision=hi))
    # A NaN residual compares false with every threshold: count it as infinitely large.
    row_M = jnp.where(jnp.isnan(row_M), jnp.inf, row_M)
    col_N = jnp.where(jnp.isnan(col_N), jnp.inf, col_N)
    abs_a, abs_b = jnp.abs(a), jnp.abs(b)
    norm_inf = jnp.max(jnp.sum(abs_a, axis=1)) * jnp.max(jnp.sum(abs_b, axis=1))
    norm_one = jnp.max(jnp.sum(abs_a, axis=0)) * jnp.max(jnp.sum(abs_b, axis=0))
    f = jnp.float32
    if rule == "rounding":
        # A non-finite product element has no rounding to allow for: left out of the bound,
        # it makes its residual (and the flag) infinite. Non-finite inputs make the bound so.
        abs_c = jnp.where(jnp.isfinite(c), jnp.abs(c), 0.0)
        same = dict(out_bits=out_bits, arithmetic=arithmetic)
        rows = None if rho_a is None else (rho_a, jnp.sum(rho_b, axis=1))
        cols = None if rho_a is None else (rho_b.T, jnp.sum(rho_a, axis=0))
        row_bound_M = B.bound(jnp.sum(abs_c, axis=1), abs_a, jnp.sum(abs_b, axis=1),
                              *(rows or (None, None)), k=k, other=n, **same)
        col_bound_N = B.bound(jnp.sum(abs_c, axis=0), abs_b.T, jnp.sum(abs_a, axis=0),
                              *(cols or (None, None)), k=k, other=m, **same)
        row_fit_M = jnp.isfinite(jnp.dot(abs_a, jnp.sum(abs_b, axis=1), precision=hi))
        col_fit_N = jnp.isfinite(jnp.dot(jnp.sum(abs_a, axis=0), abs_b, precision=hi))
        row_ratio_M = _ratio(row_M, row_bound_M, row_fit_M)
        col_ratio_N = _ratio(col_N, col_bound_N, col_fit_N)
        row, col = jnp.argmax(row_ratio_M), jnp.argmax(col_ratio_N)
        row_thr, col_thr = row_bound_M[row], col_bound_N[col]
        row_ratio, col_ratio = row_ratio_M[row], col_ratio_N[col]
        flagged = (row_ratio > 1) | (col_ratio > 1)
    else:
        row, col = jnp.argmax(row_M), jnp.argmax(col_N)
        factor = f(tau(rule, k, in_bits))
        row_thr, col_thr = factor * norm_inf, factor * norm_one
        row_ratio = col_ratio = f(jnp.nan)
        flagged = (row_M[row] > row_thr) | (col_N[col] > col_thr)
    return jnp.stack([jnp.max(row_M), jnp.max(col_N), norm_inf, norm_one, row_ratio, col_ratio,
                      row_M[row], row_thr, col_N[col], col_thr, flagged.astype(f),
                      row.astype(f), col.astype(f), f(0), f(k), f(m), f(n), f(out_bits),
                      f(in_bits), f(B.ROUNDINGS.index(arithmetic.operand_rounding)),
                      f(arithmetic.acc_bits), f(arithmetic.output_partials)])


def _flagged(record):
    return record[FLAGGED] > 0


def _product(a, b, out_dtype):
    """a @ b with a float32 result rounded once to `out_dtype` (float32 split-K partials)."""
    return jnp.einsum("...k,kn->...n", a, b, preferred_element_type=jnp.float32
                      ).astype(out_dtype)


def _mark_recomputed(record, recompute: bool):
    return record.at[RECOMPUTED].set(_flagged(record).astype(jnp.float32)) if recompute else record


# --- the forward check: product in, checked (and maybe recomputed) product out ----------------


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _verify(a, b, c, rule, arithmetic, recompute):
    record = check(a.reshape(-1, a.shape[-1]), b, c.reshape(-1, c.shape[-1]), rule, arithmetic)
    if recompute:
        c = lax.cond(_flagged(record), lambda: _product(a, b, c.dtype), lambda: c)
    return c, _mark_recomputed(record, recompute)


def _verify_fwd(a, b, c, rule, arithmetic, recompute):
    return _verify(a, b, c, rule, arithmetic, recompute), None


def _verify_bwd(rule, arithmetic, recompute, residuals, cts):
    del rule, arithmetic, recompute, residuals
    ct_c, _ = cts  # the gradient flows through the product's own (checked) backward
    return None, None, ct_c


_verify.defvjp(_verify_fwd, _verify_bwd)


# --- the product, whose backward checks both of its matmuls ------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _checked_product(a, b, sink, out_dtype, rule, arithmetic, recompute, corrupt_backward):
    del sink, rule, arithmetic, recompute, corrupt_backward
    return _product(a, b, out_dtype)


def _checked_product_fwd(a, b, sink, out_dtype, rule, arithmetic, recompute, corrupt_backward):
    del sink
    return _product(a, b, out_dtype), (a, b)


def _checked_product_bwd(out_dtype, rule, arithmetic, recompute, corrupt_backward, residuals,
                         ct_c):
    del out_dtype
    a, b = residuals
    ct_MN = ct_c.reshape(-1, ct_c.shape[-1])
    a_MK = a.reshape(-1, a.shape[-1])

    def input_grad():
        return jnp.einsum("mn,kn->mk", ct_MN, b, preferred_element_type=jnp.float32
                          ).astype(a.dtype)

    def weight_grad():
        return jnp.einsum("mk,mn->kn", a_MK, ct_MN, preferred_element_type=jnp.float32
                          ).astype(b.dtype)

    records = []
    grads = []
    for direction, compute, lhs, rhs in (("bwd_input", input_grad, ct_MN, b.T),
                                         ("bwd_weight", weight_grad, a_MK.T, ct_MN)):
        grad = compute()
        if corrupt_backward is not None:  # a test's stand-in for a fault inside the matmul
            grad = corrupt_backward(direction, grad)
        record = check(lhs, rhs, grad, rule, arithmetic)
        if recompute:
            grad = lax.cond(_flagged(record), compute, lambda g=grad: g)
        records.append(_mark_recomputed(record, recompute))
        grads.append(grad)
    sink_ct = M.vary(jnp.stack(records), M.varying_axes(ct_c))
    return grads[0].reshape(a.shape), grads[1], sink_ct


_checked_product.defvjp(_checked_product_fwd, _checked_product_bwd)


def checked_matmul(a, b, sink, *, out_dtype=None, rule: str = "paper",
                   arithmetic: B.Arithmetic = B.CPU, recompute: bool = False, fault=None,
                   corrupt_backward=None):
    """(a @ b, forward record); the backward records of dA and dB become `sink`'s cotangent.

    `fault(c) -> c` corrupts the product before its check (a fault inside the matmul).
    `arithmetic`: what the products do, as the rounding bound assumes (`bound.resolve`).
    """
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    # Inside shard_map, a weight replicated over some axes enters a product that varies over
    # them: mark it varying here, so that its gradient (which varies) is summed by the
    # transpose of this mark, as autodiff does for an ordinary product.
    axes = M.varying_axes(a) | M.varying_axes(b) | M.varying_axes(sink)
    a, b, sink = (M.vary(x, axes) for x in (a, b, sink))
    with jax.named_scope("abft"):
        c = _checked_product(a, b, sink, out_dtype, rule, arithmetic, recompute,
                             corrupt_backward)
        if fault is not None:
            c = fault(c)
        return _verify(a, b, c, rule, arithmetic, recompute)
