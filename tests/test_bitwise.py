"""tests/bitwise.py's `bits`: what `==` on its result tells apart that `==` on values does not."""

import math

import pandas as pd

from bitwise import bits


def test_bits_tell_apart_what_values_do_not():
    assert 0.0 == -0.0 and bits(0.0) != bits(-0.0)
    assert 1 == 1.0 and bits({"step": 1}) != bits({"step": 1.0})
    assert math.nan != math.nan and bits([math.nan]) == bits([math.nan])
    assert bits({"loss": [0.5, 2.0]}) == bits({"loss": [0.5, 2.0]})
    frame = pd.DataFrame({"step": [1, 2], "value": [0.0, 1.5], "site": ["a", "b"]})
    signed = frame.assign(value=[-0.0, 1.5])
    pd.testing.assert_frame_equal(frame, signed, check_exact=True)  # equal by value
    assert bits(frame) != bits(signed) and bits(frame) == bits(frame.copy())
    assert bits(frame) != bits(frame.assign(site=["a", "c"]))
