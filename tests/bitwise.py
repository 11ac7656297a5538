"""`bits(value)`: a run's metrics, summary, table or arrays as something whose `==` compares every
bit; `state_bits(run_dir)`: a run's whole final training state, the same way.

Metrics and summaries are JSON numbers, and `==` on floats takes -0.0 for 0.0 and 1 for 1.0 (a
change in the bits a run computes could turn one into the other unseen); pandas'
`assert_frame_equal(check_exact=True)` does the same. The tests whose claim is "bitwise
identical" compare `bits(a) == bits(b)`: each float becomes its IEEE-754 bytes, each DataFrame
its columns' dtypes and raw bytes, each numpy array its dtype, shape and raw bytes.

Metrics, summaries (their `param_digest`) and tables say nothing of the optimizer state: a
resume that restored one of Adam's moments wrong by one bit would pass on them, and only show
steps later. `state_bits` reads every array of the run's last checkpoint (parameters, optimizer
state, step counter) with the project's own reader, `checkpoint.final_state`, which `sdcstudy
doctor` compares by as well.
"""

import hashlib
import struct

import numpy as np
import pandas as pd


class ArrayBits:
    """A numpy array's dtype, shape and raw bytes: equal only if every bit is. Shown by its
    dtype, shape and a digest of its bytes, so that a failed comparison names the array
    without printing it."""

    def __init__(self, array: np.ndarray):
        array = np.ascontiguousarray(array)
        self.key = (array.dtype.str, array.shape, array.tobytes())

    def __eq__(self, other):
        return isinstance(other, ArrayBits) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        dtype, shape, raw = self.key
        return f"{np.dtype(dtype)}{list(shape)} sha256 {hashlib.sha256(raw).hexdigest()[:16]}"


def bits(value):
    if isinstance(value, np.ndarray):
        return ArrayBits(value)
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


def state_bits(run_dir) -> dict:
    """Every array of the run's last checkpoint (parameters, optimizer state, step counter), by
    its path, as `ArrayBits`: the whole training state the run ended with, where the run saved
    at its last step (every run does: `runner`'s save at the step it ends on)."""
    from sdcstudy.core.checkpoint import final_state  # imports orbax: only where it is used

    return bits(final_state(run_dir))
