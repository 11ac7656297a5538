"""Figure 6's claim across nodes (section 6.1 of the paper): "the rates at which the parameter
differences increase are similar on most unhealthy nodes, although the unhealthy nodes produce
SDCs with different degrees of frequency and severity". One scorecard row for all the free
runs, not a row per node: the claim is about most nodes, so no single node can fail it.

A run's drift rate is its growth exponent: the least-squares slope of ln `param/diff_l2`
against ln t, t the steps since the drift began (the first step with a difference), over the
last 90% of them (`bands.GROWTH_FROM`). A power law d ~ t^a is a straight line of slope a on
the paper's log-scaled plot against log t, whatever its level; the levels themselves differ by
orders of magnitude between nodes. The row passes when more than half of the drifting nodes lie
within `bands.DRIFT_SIMILAR` of their median exponent. Bands in `bands`; imports no JAX.
"""

from __future__ import annotations

import math

import numpy as np

from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import training_rows as TR
from sdcstudy.reproduce.bands import Row

QUANTITY = "drift growth exponent, similar on most nodes"
PUBLISHED = "similar on most nodes"
MIN_POINTS = 5  # differences in the fitted window, fewer: no exponent


def growth_exponent(run) -> float | None:
    """The slope of ln `param/diff_l2` against ln(steps since the drift began) over the last
    (1 - GROWTH_FROM) of those steps; None where the run drifts in fewer than MIN_POINTS."""
    diff = TR.series(run, "param/diff_l2")
    drifting = diff[diff > 0]
    if not len(drifting):
        return None
    since = diff.index.to_numpy() - drifting.index[0] + 1
    span = since.max()
    keep = (since >= max(1.0, B.GROWTH_FROM * span)) & (diff.to_numpy() > 0)
    if keep.sum() < MIN_POINTS:
        return None
    slope, _ = np.polyfit(np.log(since[keep]), np.log(diff.to_numpy()[keep]), 1)
    return float(slope)


def rows(plan: list[dict], runs: dict) -> list[Row]:
    """The one row of Figure 6's drift rates across the finished free runs (none where the
    plan has no free run)."""
    free = [e for e in plan if e["mode"] == "free"]
    if not free:
        return []
    band = f"more than half within {B.DRIFT_SIMILAR:g}x of the median"
    exponents = {e["node"]: growth_exponent(runs[e["name"]]) for e in free
                 if runs.get(e["name"]) is not None}
    exponents = {node: a for node, a in exponents.items() if a is not None and math.isfinite(a)}
    if len(exponents) < B.MIN_DRIFT_NODES:
        return [Row(B.ACROSS_NODES, "Figure 6", QUANTITY, PUBLISHED, None, None, band,
                    "not applicable", f"{len(exponents)} of the {len(free)} free runs drift "
                    f"(fewer than {B.MIN_DRIFT_NODES} to compare)", role=B.HELD_OUT)]
    median = float(np.median(list(exponents.values())))
    within = {node for node, a in exponents.items()
              if median > 0 and median / B.DRIFT_SIMILAR <= a <= median * B.DRIFT_SIMILAR}
    share = len(within) / len(exponents)
    listed = ", ".join(f"{node}: {B.g(a)}" for node, a in sorted(exponents.items()))
    outside = sorted(set(exponents) - within)
    return [Row(B.ACROSS_NODES, "Figure 6", QUANTITY, PUBLISHED, share, None, band,
                "pass" if share > 0.5 else "fail",
                f"{len(within)} of {len(exponents)} drifting nodes within "
                f"{B.DRIFT_SIMILAR:g}x of the median exponent {B.g(median)} (node: exponent "
                f"{listed}); outside: {', '.join(map(str, outside)) or 'none'}",
                role=B.HELD_OUT)]
