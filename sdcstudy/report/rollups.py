"""Run tables summed up part by part: what the report reads instead of the rows.

A lock-step run at the paper's scale writes 36.9 million mismatch.parquet rows (4,500 steps
of 8,192), and a long run of a busy profile millions of faults.parquet rows; held as one
DataFrame they take gigabytes. Every table and figure of the report needs far less, so
`report/runs.load_run` reads each table one part file at a time (`tablelog.table_frames`)
into these rollups, in the memory of one part:

- `MismatchRollup`, by docs/metrics.md's formulas: eq. (1) per (site, step, microstep,
  layer) summed over tp ranks, then two tables of it.
  `by_microstep`, one row per (site, step, microstep): `freq` (eq. 2, the mean over
  layers), `severity` (eqs. 3-4, the max over tp ranks and layers), `mismatches`, and
  `units` (the (layer, tp rank) rows with a mismatch).
  `by_layer`, one row per (layer, site): `freq` (eq. 1's mean over all microsteps of the
  run), `severity` (the max over tp ranks and microsteps), `mismatches`, `units`, and what a
  fit of the severity tail over its (step, microstep) groups needs (`flip_model.
  tail_constant`, floor `TAIL_FLOOR`): `tail_n` (groups whose maximum is above the floor),
  `tail_inv` (their units over their maximum, summed) and `tail_below` (the units of the
  other groups with a mismatch).
- `abft_rollup`: one row per (step, matmul, direction): `checks` and `flagged`.
- `fault_rollup`: one row per (step, site, kind, last_bit): `faults` (last_bit: a flip of
  bit 0).

Eq. (1) needs all tp ranks of a (step, microstep, layer) together: a step that goes on into
the next part waits for it (`metrics.whole_steps`). The rollups equal the same
groupings of the whole table (tests/test_report.py checks it). Imports no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import pandas as pd

from sdcstudy.core import metrics as MX

# The columns each rollup reads of its table.
MISMATCH_READ = ["step", "microstep", "layer", "site", "mismatches", "elements", "severity"]
ABFT_READ = ["step", "matmul", "direction", "flagged"]
FAULT_READ = ["step", "site", "kind", "bit"]
LAYER_KEYS = ["site", "step", "microstep", "layer"]
MICRO_KEYS = ["site", "step", "microstep"]
ABFT_KEYS = ["step", "matmul", "direction"]
TAIL_FLOOR = 0.5  # flip_model.BULK_MAX: the largest relative error of one bulk flip
TAIL_COLUMNS = ["tail_n", "tail_inv", "tail_below"]
FAULT_KEYS = ["step", "site", "kind", "last_bit"]


@dataclass(frozen=True)
class MismatchRollup:
    """A mismatch table summed up (module docstring): `by_microstep` indexed by (site, step,
    microstep), `by_layer` by (layer, site)."""

    by_microstep: pd.DataFrame
    by_layer: pd.DataFrame

    def __len__(self) -> int:
        return len(self.by_microstep)


def _empty(keys: list[str], columns: list[str]) -> pd.DataFrame:
    index = pd.MultiIndex.from_arrays([[]] * len(keys), names=keys)
    return pd.DataFrame({c: pd.Series(dtype=float) for c in columns}, index=index)


EMPTY_MISMATCH = MismatchRollup(
    _empty(MICRO_KEYS, ["freq", "severity", "mismatches", "units"]),
    _empty(["layer", "site"], ["freq", "severity", "mismatches", "units", *TAIL_COLUMNS]))


def mismatch_rollup(parts: Iterable[pd.DataFrame]) -> MismatchRollup:
    """The `MismatchRollup` of a mismatch table given as DataFrames in step order."""
    micro, layer = [], []
    for rows in MX.whole_steps(parts):
        if not len(rows):
            continue
        rows = rows.assign(units=(rows["mismatches"] > 0).astype("int64"))
        per_layer = rows.groupby(LAYER_KEYS).agg(
            mismatches=("mismatches", "sum"), elements=("elements", "sum"),
            severity=("severity", "max"), units=("units", "sum"))
        per_layer["freq"] = per_layer["mismatches"] / per_layer["elements"]
        micro.append(per_layer.groupby(level=MICRO_KEYS).agg(
            freq=("freq", "mean"), severity=("severity", "max"),
            mismatches=("mismatches", "sum"), units=("units", "sum")))
        layer.append(_tail_sums(per_layer).groupby(level=["layer", "site"]).agg(
            freq_sum=("freq", "sum"), microsteps=("freq", "count"),
            severity=("severity", "max"), mismatches=("mismatches", "sum"),
            units=("units", "sum"), tail_n=("tail_n", "sum"), tail_inv=("tail_inv", "sum"),
            tail_below=("tail_below", "sum")))
    if not micro:
        return EMPTY_MISMATCH
    by_layer = pd.concat(layer).groupby(level=["layer", "site"]).agg(
        {"freq_sum": "sum", "microsteps": "sum", "severity": "max", "mismatches": "sum",
         "units": "sum", **dict.fromkeys(TAIL_COLUMNS, "sum")})
    by_layer.insert(0, "freq", by_layer.pop("freq_sum") / by_layer.pop("microsteps"))
    return MismatchRollup(pd.concat(micro).sort_index(), by_layer.sort_index())


def _tail_sums(per_layer: pd.DataFrame) -> pd.DataFrame:
    """`per_layer` with each group's share of `TAIL_COLUMNS` (module docstring)."""
    hit = per_layer["units"] > 0
    above = hit & (per_layer["severity"] > TAIL_FLOOR)
    return per_layer.assign(
        tail_n=above.astype("int64"),
        tail_inv=(per_layer["units"] / per_layer["severity"]).where(above, 0.0),
        tail_below=per_layer["units"].where(hit & ~above, 0))


def abft_rollup(parts: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """(step, matmul, direction) -> `checks`, `flagged` of an abft table given as parts."""
    sums = [part.groupby(ABFT_KEYS)["flagged"].agg(checks="size", flagged="sum")
            for part in parts if len(part)]
    if not sums:
        return _empty(ABFT_KEYS, ["checks", "flagged"])
    return pd.concat(sums).groupby(level=ABFT_KEYS).sum().astype("int64")


def fault_rollup(parts: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """(step, site, kind, last_bit) -> `faults` of a faults table given as parts."""
    sums = [part.assign(last_bit=part["bit"] == 0).groupby(FAULT_KEYS).size().rename("faults")
            for part in parts if len(part)]
    if not sums:
        return _empty(FAULT_KEYS, ["faults"])
    return pd.concat(sums).groupby(level=FAULT_KEYS).sum().to_frame()
