"""The statistics vector of one lock-step comparison: how a suspect tensor differs from the
healthy one, computed on device bit for bit and decoded on the host.

Ma et al., "Understanding Silent Data Corruption in LLM Training", section 4 and appendix C.1:
`compare` counts the elements whose bits differ, their relative errors (eq. (3)), the
mismatches that are Inf or NaN and the differing bits per bit position, in one float32 vector
of `STATS_LEN` entries that can leave a jitted step with no host sync; `decode` turns one
such vector into python numbers, as `core/stats.py`'s reference computes them, and `merge`
combines decoded vectors (dp workers). Vectors must not be summed: the counts would add up,
but each vector's relative errors are scaled by its own exponent (REL_EXP). The taps that call
`compare` at the four sites are in `paired/lockstep.py`.

Every count is an exact integer held as a (hi, lo) pair, n = hi * 2**12 + lo: float32 holds
integers exactly only below 2**24, and one llama3-8b tensor per rank has more elements than
that. With 12 low bits, sums of up to 4096 encoded counts still decode exactly. Relative
errors are held as a sum and a max scaled by 2**-REL_EXP, with the per-tap integer exponent
REL_EXP: flipping the top exponent bit of a value below 1 gives a relative
error above 2**128, beyond float32's range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdcstudy.core import mesh as M

# --- statistics layout ------------------------------------------------------------------------
COUNT_BITS = 12  # a count n is stored as (n >> 12, n & 4095), both exact in float32
# Offsets of the (hi, lo) pairs.
MISMATCHES = 0  # elements whose bits differ
ELEMENTS = 2  # elements compared (this device's tensor)
FINITE_MISMATCHES = 4  # mismatches with both values finite: those in the severity mean
NONFINITE = 6  # mismatches whose suspect value is Inf or NaN
REL_SUM = 8  # sum of relative errors of the finite mismatches, times 2**-REL_EXP
REL_MAX = 9  # their max, times 2**-REL_EXP
REL_EXP = 10  # an integer exponent shared by REL_SUM and REL_MAX
BIT_HIST = 16  # 32 (hi, lo) pairs: elements differing in bit b at BIT_HIST + 2b (bit 0 = lsb)
HIST_BITS = 32  # bfloat16 uses the low 16
STATS_LEN = BIT_HIST + 2 * HIST_BITS

# float32 and bfloat16 share the exponent field (8 bits, bias 127); they differ in mantissa bits.
_MANTISSA = {jnp.dtype(jnp.float32): 23, jnp.dtype(jnp.bfloat16): 7}
_UINT = {jnp.dtype(jnp.float32): jnp.uint32, jnp.dtype(jnp.bfloat16): jnp.uint16}
_NO_EXPONENT = -(2 ** 20)
CHUNK = 8192  # elements per chunk of the mismatch statistics


# --- exact counts -----------------------------------------------------------------------------


def encode_count(n) -> jax.Array:
    """float32 (hi, lo) pair that holds the non-negative integer count `n` (< 2**32) exactly."""
    n = jnp.asarray(np.uint32(n) if isinstance(n, int) else n).astype(jnp.uint32)
    return jnp.stack([(n >> COUNT_BITS).astype(jnp.float32),
                      (n & ((1 << COUNT_BITS) - 1)).astype(jnp.float32)])


def decode_count(hi, lo) -> int:
    """Host side: the integer a (hi, lo) pair holds (also after summing pairs)."""
    hi, lo = float(hi), float(lo)
    if not (hi.is_integer() and lo.is_integer()):
        raise ValueError(f"({hi}, {lo}) is not an encoded count.")
    return (int(hi) << COUNT_BITS) + int(lo)


# --- the comparison, on device ----------------------------------------------------------------


def _decompose(bits, mantissa: int):
    """Exact (significand, exponent, negative, nonfinite) with value = ±sig * 2**exp.

    Read from the bits rather than with float arithmetic: XLA on CPU flushes subnormals to zero.
    """
    bits = bits.astype(jnp.uint32)
    field = (bits >> mantissa) & 0xFF
    fraction = bits & ((1 << mantissa) - 1)
    normal = field > 0
    sig = jnp.where(normal, fraction | (1 << mantissa), fraction)
    exp = jnp.where(normal, field, 1).astype(jnp.int32) - (127 + mantissa)
    return sig, exp, (bits >> (mantissa + 8)) & 1 == 1, field == 0xFF


def compare(healthy, suspect) -> jax.Array:
    """The `STATS_LEN` statistics vector of a suspect tensor against the healthy one."""
    dtype = jnp.dtype(healthy.dtype)
    if dtype not in _MANTISSA or suspect.dtype != dtype or suspect.shape != healthy.shape:
        raise TypeError(f"lock-step taps compare two float32 or bfloat16 tensors of one shape, "
                        f"got {healthy.dtype}{healthy.shape} and {suspect.dtype}{suspect.shape}.")
    bits_h = lax.bitcast_convert_type(healthy, _UINT[dtype]).reshape(-1)
    bits_s = lax.bitcast_convert_type(suspect, _UINT[dtype]).reshape(-1)
    # Mismatches are rare: the statistics are computed only when there is one (a device-side
    # branch, no host sync); a clean comparison costs one pass and a reduction.
    clean = jnp.concatenate([jnp.zeros(ELEMENTS, jnp.float32), encode_count(healthy.size),
                             jnp.zeros(STATS_LEN - ELEMENTS - 2, jnp.float32)])
    return lax.cond(jnp.any(bits_h != bits_s),
                    lambda: _mismatch_stats(bits_h, bits_s, _MANTISSA[dtype]),
                    lambda: M.vary(clean, tuple(M.varying_axes(bits_h))))


def _chunk_size(n: int) -> int:
    """The largest divisor of n up to CHUNK (n itself when no divisor is at least CHUNK / 64)."""
    for size in range(min(n, CHUNK), CHUNK // 64 - 1, -1):
        if n % size == 0:
            return size
    return n


def _mismatch_stats(bits_h, bits_s, mantissa: int) -> jax.Array:
    """Statistics of a tensor pair with at least one mismatch, `CHUNK` elements at a time.

    Chunks keep the branch's temporaries small: XLA plans memory for an untaken branch too, and
    a whole-tensor pass would need several tensor-sized buffers at every tap. Each chunk holds
    its relative errors scaled by its own exponent; the chunks are rescaled to the largest.
    Per chunk, the bit histogram's (chunk, 32) intermediate stays small and compiles fast.
    """
    size = _chunk_size(bits_h.size)
    per_chunk = lax.map(lambda hs: _chunk_stats(hs[0], hs[1], mantissa),
                        (bits_h.reshape(-1, size), bits_s.reshape(-1, size)))
    counts, rel_sum, rel_max, exponent = per_chunk
    counted = exponent != _NO_EXPONENT
    shared = jnp.max(exponent, initial=_NO_EXPONENT)
    shared = jnp.where(shared == _NO_EXPONENT, 0, shared)
    rescale = lambda x: jnp.where(counted, jnp.ldexp(x, exponent - shared), 0.0)  # noqa: E731
    totals = jnp.sum(counts, axis=0, dtype=jnp.uint32)
    return jnp.concatenate([
        encode_count(totals[0]), encode_count(bits_h.size), encode_count(totals[1]),
        encode_count(totals[2]),
        jnp.stack([jnp.sum(rescale(rel_sum)), jnp.max(rescale(rel_max), initial=0.0),
                   shared.astype(jnp.float32)]),
        jnp.zeros(BIT_HIST - REL_EXP - 1, jnp.float32),
        encode_count(totals[3:]).T.reshape(-1),
    ])


def _chunk_stats(bits_h, bits_s, mantissa: int):
    """(counts: mismatches, finite mismatches, nonfinite, 32 per-bit; sum and max of the relative
    errors times 2**-exponent; exponent, or _NO_EXPONENT when no finite value differs)."""
    differ = bits_h != bits_s
    sig_h, exp_h, neg_h, nonfinite_h = _decompose(bits_h, mantissa)
    sig_s, exp_s, neg_s, nonfinite_s = _decompose(bits_s, mantissa)
    finite = differ & ~nonfinite_h & ~nonfinite_s

    # |f' - f| / |f| = ratio * 2**(top - exp_q), with |f| = sig_q * 2**exp_q (the smallest
    # normal when f is zero) and both values scaled by 2**-top before they are subtracted.
    top = jnp.maximum(exp_h, exp_s)
    value_h = jnp.ldexp(jnp.where(neg_h, -1.0, 1.0) * sig_h.astype(jnp.float32), exp_h - top)
    value_s = jnp.ldexp(jnp.where(neg_s, -1.0, 1.0) * sig_s.astype(jnp.float32), exp_s - top)
    zero_h = sig_h == 0
    sig_q = jnp.where(zero_h, 1 << mantissa, sig_h).astype(jnp.float32)
    exp_q = jnp.where(zero_h, 1 - 127 - mantissa, exp_h)
    ratio = jnp.abs(value_s - value_h) / sig_q
    fraction, exp_r = jnp.frexp(ratio)
    counted = finite & (ratio > 0)
    exponent = jnp.where(counted, exp_r + top - exp_q, _NO_EXPONENT)
    shared = jnp.max(exponent, initial=_NO_EXPONENT)
    # eq. (3), Ma et al.: relative differences of the mismatching elements, scaled by 2**-shared.
    scaled = jnp.where(counted, jnp.ldexp(fraction, exponent - shared), 0.0)

    xor = (bits_h ^ bits_s).astype(jnp.uint32)
    count = lambda mask: jnp.sum(mask, dtype=jnp.uint32)  # noqa: E731
    per_bit = jnp.sum((xor[:, None] >> jnp.arange(HIST_BITS, dtype=jnp.uint32)) & 1, axis=0,
                      dtype=jnp.uint32)
    counts = jnp.concatenate([jnp.stack([count(differ), count(finite), count(differ & nonfinite_s)]),
                              per_bit])
    return counts, jnp.sum(scaled), jnp.max(scaled, initial=0.0), shared


# --- host-side decoding -----------------------------------------------------------------------
ROW_STATS = ("mismatches", "elements", "severity", "max_rel_err", "nonfinite")


def decode(vector) -> dict:
    """Host side: one statistics vector as python numbers, as `stats.mismatch_stats` gives them,
    plus `finite` (mismatches in the severity mean), `rel_sum` and `bits` (per-bit counts)."""
    v = np.asarray(vector, np.float64)
    count = lambda at: decode_count(v[at], v[at + 1])  # noqa: E731
    scale = 2.0 ** int(v[REL_EXP])
    finite = count(FINITE_MISMATCHES)
    rel_sum = float(v[REL_SUM]) * scale
    return {"mismatches": count(MISMATCHES), "elements": count(ELEMENTS),
            "severity": rel_sum / finite if finite else 0.0,
            "max_rel_err": float(v[REL_MAX]) * scale, "nonfinite": count(NONFINITE),
            "finite": finite, "rel_sum": rel_sum,
            "bits": np.array([count(BIT_HIST + 2 * b) for b in range(HIST_BITS)], np.int64)}


def merge(parts: list[dict]) -> dict:
    """Decoded stats of several tensors (e.g. dp workers) as if they were one."""
    if len(parts) == 1:
        return parts[0]
    finite = sum(p["finite"] for p in parts)
    rel_sum = sum(p["rel_sum"] for p in parts)
    return {"mismatches": sum(p["mismatches"] for p in parts),
            "elements": sum(p["elements"] for p in parts),
            "severity": rel_sum / finite if finite else 0.0,
            "max_rel_err": max(p["max_rel_err"] for p in parts),
            "nonfinite": sum(p["nonfinite"] for p in parts),
            "finite": finite, "rel_sum": rel_sum, "bits": sum(p["bits"] for p in parts)}
