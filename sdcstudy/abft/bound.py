"""ABFT's rounding bound (`abft.threshold: rounding`) and the arithmetic it assumes.

A checked product C = A B (A: m x k, B: k x n) comes from a GEMM that

(i) multiplies the operands A~, B~ it is given, or those values rounded by the platform:
    at XLA's DEFAULT (and HIGH) precision a GPU rounds float32 operands to TF32 (10 mantissa
    bits) on its tensor cores; bfloat16 operands are multiplied as they are;
(ii) forms the k products of each element exactly or rounded once, and sums them in float32
    with unit roundoff u_acc, in any order, in any number of partial sums held in float32
    (split-K);
(iii) stores the result in the output dtype: rounded once (unit u_out: 2^-8 for bfloat16, 0
    for float32), or, where a GEMM stores s partial sums in the output dtype and adds them
    there, s roundings of the partials and s - 1 of their running sums.

The checksums are float32 sums and dots at HIGHEST precision (unit u = 2^-24, round to
nearest) of operands A^, B^ that reproduce (i): every reduced-precision operand (and C) is
re-rounded to its own format with `reduce_precision`, exact on a value that really has that
format and a restoration of one that a compiler pass widened (XLA's excess-precision
simplification removes a float32 -> bfloat16 -> float32 round trip, which would hand the
checksum the unrounded float32 weight); float32 operands of a float32 product are rounded as
`operand_rounding` says. Elementwise |A~ - A^| <= rho_A and |B~ - B^| <= rho_B: rho is 0 where
A^ reproduces the GEMM's rounding exactly; under `tf32` (round to nearest, ties to even) it is
the distance to ties away from zero, which is not 0 only on ties.

To first order, with w a vector of ones and |.| elementwise,

    |C - A~ B~|       <= u_out |C| + (k u_acc + (2s - 2) u_out) |A~| |B~|        (ii), (iii)
    |A~ B~ - A^ B^|   <= rho_A |B^| + (|A^| + rho_A) rho_B                         (i)
    float32 checksums:   n u |C| w + (n + k) u |A^| |B^| w     (C w; B^ w, then A^ (B^ w))

so for row i

    |C w - A^ (B^ w)|_i <= 1.01 [(u_out + n u) (|C| w)_i
                                 + (k u_acc + (k + n) u + (2s - 2) u_out) (|A^| (|B^| w))_i
                                 + (rho_A (|B^| w))_i + ((|A^| + rho_A) (rho_B w))_i]

plus, for underflow, 1.01 eta [(2k + 2s + 1) n + 2k + 3 n (|A^| w)_i + 2 w^T |B^| w]
(eta = 2^-126, `ETA`; below), and for column j the same with m for n, A^ and B^ transposed.
The 1.01 covers the second-order terms (products of two unit roundoffs, and
|A~| <= |A^| + rho_A inside the accumulation term). With s = 1, rho = 0 and u_acc = u this is
the bound of the CPU, where float32 is IEEE arithmetic rounding to nearest: (2k + n) u.

u_acc is 2^-24 on the CPU and 2^-23 on every other platform: tensor cores may truncate
instead of rounding to nearest and skip normalization between partial sums, and products of
TF32 or bfloat16 operands are exact in float32, so k u_acc with u_acc = 2^-23 covers k - 1
truncated additions in any order, and float32 hardware that rounds to nearest as well.

The checked products compute their dots with a float32 result and cast it to the output
dtype (`checksum._product`), so a split-K GEMM keeps float32 partials and s = 1 holds; s > 1
(`abft.output_partials`) is for a compiler that stores partials in the output dtype anyway.

Underflow. The terms above are relative: they hold while every value stays normal. Where a
row of A or C is tiny (a cotangent of about 1e-37, as the last position's key and value in a
causal attention get late in training: a healthy bfloat16 run flagged such rows, 2026-11-30),
a product, a sum or the output may underflow, and a platform that flushes to zero (or treats a
subnormal input as zero) loses up to eta = 2^-126, float32's and bfloat16's smallest normal,
each time, whatever the values' size. Per element of C that is at most k products, k - 1 sums,
2s - 1 roundings of the output and its partials, and the operands' own subnormals flushed
(eta |B^| and eta |A^| summed); the checksums add n sums of C w, k products and k sums of
A^ (B^ w), and B^ w's own n sums, each times |A^|. Summed over the row: the eta term above,
about 3e-33 for k = 256 and n = 512 (more with large operands), far below any corruption the
check is for.

Not covered: accumulators narrower than float32 (FP8 paths), operand rounding other than
TF32 of float32 (a TPU's DEFAULT precision multiplies in bfloat16 passes), and a platform
that rounds float32 operands without saying so: `auto` knows the CPU and GPUs only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from sdcstudy.core.errors import ConfigError

U32 = 2.0 ** -24  # float32 unit roundoff, round to nearest
ETA = 2.0 ** -126  # the most one underflow can lose: float32's (and bfloat16's) smallest normal
MARGIN = 1.01  # second-order rounding terms (Golub and Van Loan, eq. 2.7.11)
UNIT_ROUNDOFF = {32: 0.0, 16: 2.0 ** -8}  # rounding of a float32 accumulator to the output
# What the GEMM does to float32 operands of a float32 product; the record's code is the index.
ROUNDINGS = ("none", "tf32", "tf32_truncate")
SETTINGS = ("auto", *ROUNDINGS)
TF32_EXPONENT, TF32_MANTISSA = 8, 10
_TF32_KEEP = 0xFFFFE000  # sign, exponent and the top 10 mantissa bits of a float32
_TF32_HALF = 0x1000  # half of TF32's last place, in float32 bits
# jax_default_matmul_precision values whose float32 dots a GPU runs on TF32 tensor cores, and
# those it runs in float32.
_TF32_PRECISIONS = (None, "default", "fastest", "bfloat16", "high", "tensorfloat32",
                    "TF32_TF32_F32")
_FLOAT32_PRECISIONS = ("highest", "float32", "F32_F32_F32")


@dataclass(frozen=True)
class Arithmetic:
    """What a checked GEMM does, as the bound assumes it (see the module docstring)."""

    operand_rounding: str = "none"  # float32 operands of a float32 product: none, tf32, ...
    acc_unit: float = U32  # u_acc, the float32 accumulation's unit roundoff
    output_partials: int = 1  # s, partial sums stored in the output dtype (1: rounded once)

    @property
    def acc_bits(self) -> int:
        """-log2(u_acc): 24 for round to nearest, 23 for truncation."""
        return round(-math.log2(self.acc_unit))


CPU = Arithmetic()  # IEEE float32 throughout: the bound of the CPU


_UNSET = object()


def resolve(setting: str = "auto", output_partials: int = 1, *, backend: str | None = None,
            precision=_UNSET) -> Arithmetic:
    """The arithmetic of the checked products on `backend` (the default one) at `precision`
    (jax_default_matmul_precision when unset), when the step is traced.

    `auto`: TF32 operands on a GPU when float32 dots run at DEFAULT or HIGH precision, none
    at HIGHEST and on the CPU. u_acc: 2^-24 on the CPU, 2^-23 elsewhere."""
    backend = backend or jax.default_backend()
    if precision is _UNSET:
        precision = jax.config.jax_default_matmul_precision
    if setting not in SETTINGS:
        raise ConfigError(f"abft.operand_rounding {setting!r} is not one of "
                          f"{', '.join(SETTINGS)}.")
    rounding = setting
    if setting == "auto":
        rounding = _auto_rounding(backend, precision)
    acc_unit = U32 if backend == "cpu" else 2 * U32
    return Arithmetic(rounding, acc_unit, output_partials)


def _auto_rounding(backend: str, precision) -> str:
    if backend == "cpu":
        return "none"
    if backend != "gpu":
        raise ConfigError(f"abft.operand_rounding=auto knows the cpu and gpu platforms, not "
                          f"{backend}; set abft.operand_rounding to one of "
                          f"{', '.join(ROUNDINGS)}.")
    if precision in _FLOAT32_PRECISIONS:
        return "none"
    if precision in _TF32_PRECISIONS:
        return "tf32"
    raise ConfigError(f"abft.operand_rounding=auto does not know what matmul precision "
                      f"{precision!r} does to float32 operands; set abft.operand_rounding to "
                      f"one of {', '.join(ROUNDINGS)}.")


def as_stored(x32, dtype):
    """A float32 copy of a `dtype` value re-rounded to `dtype`'s format: the identity on a
    true `dtype` value, and what the GEMM saw where a compiler pass widened the copy."""
    if jnp.dtype(dtype).itemsize >= 4:
        return x32
    info = jnp.finfo(dtype)
    return lax.reduce_precision(x32, info.nexp, info.nmant)


def _tf32_bits(x32, add: int):
    bits = lax.bitcast_convert_type(x32, jnp.uint32)
    return lax.bitcast_convert_type((bits + jnp.uint32(add)) & jnp.uint32(_TF32_KEEP),
                                    jnp.float32)


def tf32_nearest(x32):
    """float32 rounded to TF32, to nearest with ties to even."""
    return lax.reduce_precision(x32, TF32_EXPONENT, TF32_MANTISSA)


def tf32_nearest_away(x32):
    """float32 rounded to TF32, to nearest with ties away from zero."""
    return _tf32_bits(x32, _TF32_HALF)


def tf32_truncate(x32):
    """float32 rounded to TF32 toward zero (the low 13 mantissa bits dropped)."""
    return _tf32_bits(x32, 0)


def checksum_operand(x32, dtype, compute_dtype, arithmetic: Arithmetic):
    """(A^, rho_A): the operand as the checksum uses it, and the elementwise distance to any
    value the GEMM may have used instead (None where it is 0)."""
    x32 = as_stored(x32, dtype)
    if jnp.dtype(compute_dtype) != jnp.float32 or arithmetic.operand_rounding == "none":
        return x32, None
    if arithmetic.operand_rounding == "tf32_truncate":
        return tf32_truncate(x32), None
    nearest = tf32_nearest(x32)
    gap = jnp.abs(tf32_nearest_away(x32) - nearest)  # ties only
    return nearest, jnp.where(jnp.isnan(gap), 0.0, gap)


def bound(abs_c_sum, abs_x, abs_y_sum, rho_x, rho_y_sum, *, k: int, other: int,
          out_bits: int, arithmetic: Arithmetic):
    """The bound per row of X Y (columns: X = B^T, Y = A^T): see the module docstring.
    `abs_y_sum` = |Y| w, `rho_y_sum` = rho_Y w (None with `rho_x` when rho is 0)."""
    hi = lax.Precision.HIGHEST
    u_out = UNIT_ROUNDOFF[out_bits]
    spread = jnp.dot(abs_x, abs_y_sum, precision=hi)
    per_spread = (k * arithmetic.acc_unit + (k + other) * U32
                  + (2 * arithmetic.output_partials - 2) * u_out)
    total = (u_out + other * U32) * abs_c_sum + per_spread * spread
    if rho_x is not None:
        total = total + jnp.dot(rho_x, abs_y_sum, precision=hi) + jnp.dot(
            abs_x + rho_x, rho_y_sum, precision=hi)
    return MARGIN * (total + underflow(abs_x, abs_y_sum, k=k, other=other,
                                       output_partials=arithmetic.output_partials))


def underflow(abs_x, abs_y_sum, *, k: int, other: int, output_partials: int = 1):
    """What underflow may add to a row's residual (module docstring, "Underflow"): eta times
    the operations that may flush, and the operands' subnormals flushed."""
    per_row = (2 * k + 2 * output_partials + 1) * other + 2 * k
    return ETA * (per_row + 3 * other * jnp.sum(abs_x, axis=-1) + 2 * jnp.sum(abs_y_sum))
