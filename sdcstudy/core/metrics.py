"""Run-level metrics from run-folder tables, by docs/metrics.md's formulas (no JAX).

Ma et al., "Understanding Silent Data Corruption in LLM Training":
- frequency of a site at a microstep, eqs. (1)-(2): mismatches summed over tp ranks divided by
  elements summed over tp ranks, then averaged over layers; `freq[site]` is its mean over all
  microsteps of the run;
- severity of a site at a microstep, eqs. (3)-(4): the max over tp ranks and layers of the
  rows' severity; `max_severity[site]` is its max over microsteps;
- WCNTS, eq. (5): the max over steps of ||g' - g||_2 / ||g||_2.
"""

from __future__ import annotations

import math

import numpy as np

SITES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")


def site_aggregates(mismatch) -> dict:
    """{"freq": {site: f}, "max_severity": {site: s}, "mismatches": {site: n}} from a
    mismatch.parquet DataFrame (sites without rows are left out)."""
    out = {"freq": {}, "max_severity": {}, "mismatches": {}, "nonfinite": {}}
    if mismatch is None or len(mismatch) == 0:
        return out
    for site, rows in mismatch.groupby("site", sort=False):
        # eq. (1): per (microstep, layer), sum over tp ranks; eq. (2): mean over layers.
        per_layer = rows.groupby(["step", "microstep", "layer"])[["mismatches", "elements"]].sum()
        freq_layer = per_layer["mismatches"] / per_layer["elements"]
        freq_micro = freq_layer.groupby(level=["step", "microstep"]).mean()
        # eqs. (3)-(4): max over tp ranks and layers per microstep, then max over microsteps.
        sev_micro = rows.groupby(["step", "microstep"])["severity"].max()
        out["freq"][site] = float(freq_micro.mean())
        out["max_severity"][site] = float(sev_micro.max())
        out["mismatches"][site] = int(rows["mismatches"].sum())
        out["nonfinite"][site] = int(rows["nonfinite"].sum())
    return out


def wcnts(metric_rows: list[dict]) -> float | None:
    """Eq. (5): the worst per-step noise-to-signal ratio of the weight gradients."""
    values = [r["grad/nts"] for r in metric_rows if isinstance(r.get("grad/nts"), (int, float))]
    values = [v for v in values if math.isfinite(v)]
    return max(values) if values else None


def loss_spikes(metric_rows: list[dict], threshold: float) -> list[int]:
    """Steps where the suspect's loss exceeds the healthy one's by more than `threshold` nats
    (or is not finite): the paired form of a loss-spike detector."""
    spikes = []
    for r in metric_rows:
        s, h = r.get("loss/suspect"), r.get("loss/healthy")
        if s is None or h is None:
            continue
        s = float(s) if not isinstance(s, str) else float("nan")
        if not math.isfinite(s) or s - float(h) > threshold:
            spikes.append(int(r["step"]))
    return spikes


def merge_histograms(total: dict, new: dict) -> dict:
    """Add per-site bit histograms ({site: counts}) into `total`."""
    for site, counts in new.items():
        counts = np.asarray(counts, np.int64)
        total[site] = total.get(site, np.zeros_like(counts)) + counts
    return total
