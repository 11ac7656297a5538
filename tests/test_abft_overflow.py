"""ABFT's rounding rule on products whose checksums overflow (abft/checksum.py, `_ratio`).

A corruption that leaves a product element near float32's largest value makes its row's and
column's sums, and with them the rounding bound, infinite: residual / bound is then inf / inf,
NaN, which compares false with 1. One such element is still caught through the column (or
row) it alone fills; a 2 x 2 block of them overflows both, and was missed by `rounding` while
`paper` flagged it.
"""

import jax
import jax.numpy as jnp
import pandas as pd

from sdcstudy.abft import checker as A
from sdcstudy.abft import checksum as CS

NEAR_MAX = 3e38  # float32's largest finite value is about 3.4e38


def _product():
    a = jax.random.normal(jax.random.key(0), (8, 16))
    b = jax.random.normal(jax.random.key(1), (16, 4))
    return a, b, jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)


def _row(record) -> dict:
    return A.Checker.rows({"abft|o|1": record}, {}, step=1, microstep=0)[0]


def test_a_block_of_near_max_elements_is_flagged_under_both_rules():
    a, b, c = _product()
    bad = c.at[2:4, 0:2].set(NEAR_MAX)  # rows 2-3 and columns 0-1 sum past float32's range
    for rule in CS.THRESHOLDS:
        record = CS.check(a, b, bad, rule)
        assert record[CS.FLAGGED] == 1, rule
        assert (int(record[CS.ROW]), int(record[CS.COL])) == (2, 0), rule
    record = CS.check(a, b, bad, "rounding")
    assert record[CS.ROW_RATIO] == jnp.inf and record[CS.COL_RATIO] == jnp.inf
    frame = pd.DataFrame([_row(record)])
    assert A.host_flags(frame, "rounding").tolist() == [True]  # the host reads the same flag


def test_the_healthy_product_and_a_non_finite_operand_stay_unflagged():
    # No flag where the operands themselves are non-finite: the product is consistent with
    # what it was given (the corruption happened before this matmul).
    a, b, c = _product()
    assert CS.check(a, b, c, "rounding")[CS.FLAGGED] == 0
    a_inf = a.at[0, 0].set(jnp.inf)
    c_inf = jnp.dot(a_inf, b, precision=jax.lax.Precision.HIGHEST)
    for rule in CS.THRESHOLDS:
        assert CS.check(a_inf, b, c_inf, rule)[CS.FLAGGED] == 0, rule
