"""Run-level metrics from run-folder tables, by docs/metrics.md's formulas (no JAX).

Ma et al., "Understanding Silent Data Corruption in LLM Training":
- frequency of a site at a microstep, eqs. (1)-(2): mismatches summed over tp ranks divided by
  elements summed over tp ranks, then averaged over layers; `freq[site]` is its mean over all
  microsteps of the run;
- severity of a site at a microstep, eqs. (3)-(4): the max over tp ranks and layers of the
  rows' severity; `max_severity[site]` is its max over microsteps;
- WCNTS, eq. (5): the max over steps of ||g' - g||_2 / ||g||_2.
Loss spikes are the study's, not the paper's (it gives no rule): `loss_spike_spans`.
"""

from __future__ import annotations

import math

import numpy as np

SITES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")


AGGREGATE_COLUMNS = ["step", "microstep", "layer", "site", "mismatches", "elements", "severity",
                     "nonfinite"]  # the mismatch-table columns `site_aggregates` reads


def site_aggregates(mismatch) -> dict:
    """{"freq": {site: f}, "max_severity": {site: s}, "mismatches": {site: n}, "nonfinite":
    {site: n}} from a mismatch.parquet DataFrame (sites without rows are left out)."""
    return site_aggregates_of_parts([mismatch] if mismatch is not None else [])


def whole_steps(parts):
    """DataFrames of a table in step order (`tablelog.table_frames`) again, each cut after
    its last whole step: the rows of a part's last step wait for the next part, where the step
    may go on, so each frame given holds every row of its steps."""
    import pandas as pd

    carry = None
    for part in parts:
        if carry is not None:
            part = pd.concat([carry, part], ignore_index=True)
        if not len(part):
            continue
        last = part["step"].max()
        yield part[part["step"] < last]
        carry = part[part["step"] == last]
    if carry is not None and len(carry):
        yield carry


def site_aggregates_of_parts(parts) -> dict:
    """`site_aggregates` of a table given as DataFrames in step order (its part files), one
    part at a time: memory holds one part and one step's rows, never the whole table, so a run
    of the paper's 36.9 million rows sums up in the memory of a flush. A step's rows may go on
    into the next part; they wait for it (`whole_steps`)."""
    totals = {"freq": {}, "micro": {}, "max_severity": {}, "mismatches": {}, "nonfinite": {}}
    for rows in whole_steps(parts):
        _accumulate(rows, totals)
    micro = totals.pop("micro")
    totals["freq"] = {site: total / micro[site] for site, total in totals["freq"].items()}
    return totals


def _accumulate(rows, totals: dict) -> None:
    """Adds whole steps' rows to the running sums of `site_aggregates_of_parts`."""
    for site, group in rows.groupby("site", sort=False):
        # eq. (1): per (microstep, layer), sum over tp ranks; eq. (2): mean over layers.
        per_layer = group.groupby(["step", "microstep", "layer"])[["mismatches", "elements"]].sum()
        freq_layer = per_layer["mismatches"] / per_layer["elements"]
        freq_micro = freq_layer.groupby(level=["step", "microstep"]).mean()
        for key, value in (("freq", float(freq_micro.sum())), ("micro", len(freq_micro)),
                           ("mismatches", int(group["mismatches"].sum())),
                           ("nonfinite", int(group["nonfinite"].sum()))):
            totals[key][site] = totals[key].get(site, 0) + value
        # eqs. (3)-(4): max over tp ranks, layers and microsteps (NaN only where all are).
        severity, known = float(group["severity"].max()), totals["max_severity"].get(site)
        if known is None or math.isnan(known) or severity > known:
            totals["max_severity"][site] = severity


def wcnts(metric_rows: list[dict]) -> float | None:
    """Eq. (5): the worst per-step noise-to-signal ratio of the weight gradients."""
    values = [r["grad/nts"] for r in metric_rows if isinstance(r.get("grad/nts"), (int, float))]
    values = [v for v in values if math.isfinite(v)]
    return max(values) if values else None


# The loss-spike criterion (docs/metrics.md, "Loss spikes"), stated once: every report, row and
# study that judges a loss spike reads these.
SPIKE_NATS = 0.5  # a suspect loss this far above the healthy one at the same step is flagged
SPIKE_MIN_STEPS = 2  # consecutive flagged steps: the model carries the rise, not one reading


def loss_spikes(metric_rows: list[dict], threshold: float = SPIKE_NATS) -> list[int]:
    """The steps the loss-spike criterion flags (`loss_spike_spans` says when they make a
    spike): those whose suspect loss is not finite or exceeds the healthy node's loss at the
    same step by more than `threshold` nats. Rows without both losses are skipped; a
    non-finite healthy loss flags nothing. summary.json's `loss_spikes`."""
    spikes = []
    for r in metric_rows:
        s, h = r.get("loss/suspect"), r.get("loss/healthy")
        if s is None or h is None:
            continue
        s = float(s) if not isinstance(s, str) else float("nan")
        if not math.isfinite(s) or s - float(h) > threshold:
            spikes.append(int(r["step"]))
    return spikes


def loss_spike_spans(flagged_steps, min_steps: int = SPIKE_MIN_STEPS) -> list[tuple[int, int]]:
    """The loss spikes, as (first, last) step: each run of at least `min_steps` consecutive
    steps that `loss_spikes` flags.

    The criterion of the study: the pair gives what the paper's single node lacked, a reference
    at the same step, so the suspect is judged against the healthy loss (a spike both nodes
    make, from the data, is none), and a rise counts only when the model carries it into the
    next step: one corrupted forward pass raises the loss read at its own step only, while a
    corrupted model stays up (Ma et al., Figure 7: until "training is again stabilized").
    `flagged_steps` may be summary.json's `loss_spikes` as written."""
    spans: list[list[int]] = []
    for step in sorted(set(int(s) for s in flagged_steps)):
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return [(first, last) for first, last in spans if last - first + 1 >= min_steps]


def merge_histograms(total: dict, new: dict) -> dict:
    """Add per-site bit histograms ({site: counts}) into `total`."""
    for site, counts in new.items():
        counts = np.asarray(counts, np.int64)
        total[site] = total.get(site, np.zeros_like(counts)) + counts
    return total
