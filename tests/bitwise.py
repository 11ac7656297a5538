"""`bits(value)`: a run's metrics, summary or table as something whose `==` compares every bit.

Metrics and summaries are JSON numbers, and `==` on floats takes -0.0 for 0.0 and 1 for 1.0 (a
change in the bits a run computes could turn one into the other unseen); pandas'
`assert_frame_equal(check_exact=True)` does the same. The tests whose claim is "bitwise
identical" compare `bits(a) == bits(b)`: each float becomes its IEEE-754 bytes, each DataFrame
its columns' dtypes and raw bytes.
"""

import struct

import numpy as np
import pandas as pd


def bits(value):
    if isinstance(value, float):
        return ("float", struct.pack(">d", value))
    if isinstance(value, dict):
        return {key: bits(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [bits(v) for v in value]
    if isinstance(value, pd.DataFrame):
        return {"columns": list(value.columns), "index": bits(value.index.tolist()),
                **{name: _column_bits(value[name]) for name in value.columns}}
    return value


def _column_bits(column: pd.Series):
    array = column.to_numpy()
    if array.dtype.kind in "fiub":
        return (str(array.dtype), np.ascontiguousarray(array).tobytes())
    return (str(array.dtype), bits(array.tolist()))
