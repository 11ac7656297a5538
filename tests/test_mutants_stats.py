"""Statistics and bounds against independent numpy computations, on hand-made inputs chosen
where a plausible slip gives a different answer (each slip below once left the suite green).

- The lock-step comparison's relative errors are held per chunk of `CHUNK` elements, each
  scaled by its own exponent, and rescaled to the largest exponent when the chunks are
  combined (`paired/mismatch.py`). Rescaling to the smallest (min for max) overflows the
  chunk whose errors are 2^150 larger: severity and max_rel_err become inf.
- ABFT's rounding bound (`abft/bound.py`): the operand-rounding term is
  rho_X |Y| w + (|X| + rho_X) rho_Y w; with |X| for |X| + rho_X it is short by rho_X rho_Y w.
  A GEMM that stores s partial sums in the output dtype adds (2s - 2) u_out per unit of
  |X| |Y| w; s - 1 would be short by (s - 1) u_out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcstudy.abft import bound as B
from sdcstudy.core import stats
from sdcstudy.paired import mismatch as MS

# The device computes relative errors in float32, numpy in float64 (as in test_lockstep.py).
REL_TOL = 1e-6


def _flip(values, index, bit):
    bits = np.array(values, np.float32).view(np.uint32)
    bits[index] ^= np.uint32(1) << np.uint32(bit)
    return bits.view(np.float32)


def test_chunks_with_far_apart_relative_errors_combine_at_the_largest_exponent():
    """Two chunks: the first holds only a last-mantissa-bit flip (relative error 2^-23), the
    second one more and a flip of the top exponent bit of 0.5 (2^127: relative error about
    2^128, past float32's range), so that the exponents differ across chunks and within one.
    Severity and max_rel_err must be numpy's, finite, on the huge error."""
    n = 2 * MS.CHUNK
    assert MS._chunk_size(n) == MS.CHUNK  # two chunks, or the test tests nothing
    healthy = np.full(n, 0.5, np.float32)
    suspect = _flip(_flip(_flip(healthy, 5, 0), MS.CHUNK + 7, 30), MS.CHUNK + 9, 0)
    assert suspect[MS.CHUNK + 7] == 2.0 ** 127
    want = stats.mismatch_stats(healthy, suspect)
    got = MS.decode(jax.jit(MS.compare)(jnp.asarray(healthy), jnp.asarray(suspect)))
    assert got["mismatches"] == want["mismatches"] == 3
    assert want["max_rel_err"] > 2.0 ** 127 and np.isfinite(got["max_rel_err"])
    for key in ("severity", "max_rel_err"):
        np.testing.assert_allclose(got[key], want[key], rtol=REL_TOL, err_msg=key)


def _numpy_bound(abs_c_sum, abs_x, abs_y_sum, rho_x, rho_y_sum, *, k, other, out_bits,
                 partials, acc_unit):
    """The module docstring's bound for row i, in float64, term by term."""
    u, u_out = 2.0 ** -24, {32: 0.0, 16: 2.0 ** -8}[out_bits]
    abs_x, abs_y_sum, abs_c_sum = (np.asarray(a, np.float64) for a in (abs_x, abs_y_sum,
                                                                      abs_c_sum))
    spread = abs_x @ abs_y_sum
    total = ((u_out + other * u) * abs_c_sum
             + (k * acc_unit + (k + other) * u + (2 * partials - 2) * u_out) * spread)
    if rho_x is not None:
        rho_x, rho_y_sum = np.asarray(rho_x, np.float64), np.asarray(rho_y_sum, np.float64)
        total = total + rho_x @ abs_y_sum + (abs_x + rho_x) @ rho_y_sum
    return 1.01 * total


@pytest.mark.parametrize("partials, out_bits, with_rho", [
    (1, 32, True),  # the rho term dominates: |X| + rho_X, not |X|
    (3, 16, False),  # s = 3 bfloat16 partials: (2s - 2) u_out, not (s - 1) u_out
    (4, 16, True),
])
def test_the_rounding_bound_is_its_formula(partials, out_bits, with_rho):
    """`bound` for 2 rows of a product with k = 3, n = 2, against the formula in numpy. rho_X
    as large as |X| where it matters, so that leaving it out of |X| + rho_X halves a term."""
    abs_x = np.array([[1.0, 2.0, 0.5], [0.25, 4.0, 1.0]], np.float32)
    abs_y_sum = np.array([3.0, 1.0, 2.0], np.float32)
    abs_c_sum = np.array([8.0, 6.0], np.float32)
    rho_x = np.array([[1.0, 2.0, 0.5], [0.0, 4.0, 0.0]], np.float32) if with_rho else None
    rho_y_sum = np.array([1.0, 0.5, 2.0], np.float32) if with_rho else None
    arithmetic = B.Arithmetic("tf32", 2 * B.U32, partials)
    got = B.bound(*(None if a is None else jnp.asarray(a)
                    for a in (abs_c_sum, abs_x, abs_y_sum, rho_x, rho_y_sum)),
                  k=3, other=2, out_bits=out_bits, arithmetic=arithmetic)
    want = _numpy_bound(abs_c_sum, abs_x, abs_y_sum, rho_x, rho_y_sum, k=3, other=2,
                        out_bits=out_bits, partials=partials, acc_unit=2 * B.U32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=REL_TOL)
