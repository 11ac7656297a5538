"""summary.json fields of a paired run, from its metrics rows and mismatch table (no JAX):
WCNTS (eq. 5) and the steps it leaves out because their gradient difference is not finite,
the final parameter difference, the steps the loss-spike criterion flags
(`loss_spikes`, by `metrics.loss_spikes`; `metrics.loss_spike_spans` tells which of them make a
spike, at report time), the per-site frequency and severity aggregates (eqs. 1-4) and the
per-site histograms of mismatching bit positions.
"""

from __future__ import annotations

import math

import numpy as np

from sdcstudy.core import metrics as MX
from sdcstudy.core import runfolder as RF
from sdcstudy.core.stats import bit_width, class_counts


def paired_summary(rows: list[dict], tables: dict, histograms: dict, dtype: str) -> dict:
    nonfinite = nonfinite_nts_steps(rows)
    out = {"wcnts": MX.wcnts(rows),
           "grad/nonfinite_steps": len(nonfinite),
           "grad/first_nonfinite_step": nonfinite[0] if nonfinite else None,
           "param/diff_l2": rows[-1].get("param/diff_l2") if rows else None,
           "loss_spikes": MX.loss_spikes(rows)}
    if RF.MISMATCH in tables:
        out.update(MX.site_aggregates_of_parts(
            tables[RF.MISMATCH].frames(MX.AGGREGATE_COLUMNS)))
        out["bit_histogram"] = bit_histogram_summary(histograms, dtype)
    return out


def nonfinite_nts_steps(rows: list[dict]) -> list[int]:
    """The steps whose `grad/nts` is NaN or infinite (a suspect gradient holding a NaN or an
    Inf), which `metrics.wcnts` leaves out: without them a suspect whose gradient went NaN
    showed a WCNTS of 0.0."""
    steps = []
    for r in rows:
        nts = r.get("grad/nts")
        if nts is None:
            continue
        if isinstance(nts, str) or not math.isfinite(float(nts)):
            steps.append(int(r["step"]))
    return steps


def bit_histogram_summary(histograms: dict, dtype: str) -> dict:
    """Per site: mismatching elements per bit position (index 0 = the lowest mantissa bit) and
    per field, to tell single bit flips (one position) from arithmetic faults (many low bits)."""
    width = bit_width(dtype)
    out = {}
    for site in sorted(histograms, key=lambda s: MX.SITES.index(s) if s in MX.SITES else 99):
        counts = np.asarray(histograms[site], np.int64)[:width]
        out[site] = {"bits": counts.tolist(), **class_counts(counts, dtype)}
    return out
