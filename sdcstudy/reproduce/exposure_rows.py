"""Table 2 at the paper's exposure: the severity tail a lock-step run measured, carried to as
many units as the paper's run had (docs/reproduction.md, "At the paper's exposure").

Table 2 is the largest severity over every unit of the paper's run with a mismatch, a unit
being one (microstep, layer, tp rank), eq. 3's mean relative error over its mismatching
elements. Our runs span a few hundred units a site, the paper's about 10^5 to 10^7, so a
maximum over ours says little about Table 2 unless it is carried over. Both fault models give
a unit severity a tail P(S > t) = c / t for t well above the bulk (docs/faults.md 6.3), whose
maximum over U units has the median c U / ln 2. So:
- c is fitted to this run's units by `flip_model.tail_constant` (maximum likelihood, each
  (step, microstep) group's maximum over its units, maxima at or below 0.5 read as "at most
  0.5");
- U is the paper's units of the site: per layer 72,000 microsteps x tp ranks, each hit with
  the probability Table 6 or 7's layer frequency gives (`flip_model.paper_units`: one
  mismatching element over the run is Table 7's 2.39e-14, tp = 8 assumed: the paper does not
  state it);
- the row passes when c U / ln 2 is within `EXPOSURE_SPREAD` of Table 2 either way: the
  seed-to-seed spread of this very statistic, measured (`EXPOSURE_SPREAD`'s comment).
Fewer than `MIN_TAIL_UNITS` units above 0.5 fit no tail: "too rare for this run". Imports no
JAX.
"""

from __future__ import annotations

import math
import statistics

from sdcstudy.faults import flip_model as FM
from sdcstudy.faults import published as PB
from sdcstudy.faults import published_layers as PL
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce.bands import Row

SUFFIX = ", at the paper's exposure"
QUANTITY = "{site}" + SUFFIX
MIN_TAIL_UNITS = 5
# The largest ratio, either way, between one fault seed's c U / ln 2 and the median over
# seeds: 1.68, over 14 sites of nodes 1, 7, 9, 10 and 11 and 4 fault seeds, tiny, 200 steps
# (python experiments/exposure_spread.py; docs/faults.md 5.3), rounded up.
EXPOSURE_SPREAD = 1.7
# The same for one layer's tail at the paper's median units a layer (`layer_rows`): 1.35
# over 27 layers and sites of the same runs, rounded up.
LAYER_EXPOSURE_SPREAD = 1.4


def tail_fit(run, site: str) -> tuple[float, int, int]:
    """(c, units above the floor, units) of `site` in a lock-step run's mismatch rollup."""
    micro = run.mismatch_rollup.by_microstep
    if not len(micro) or site not in micro.index.get_level_values("site"):
        return 0.0, 0, 0
    at = micro.xs(site, level="site")
    at = at[at["units"] > 0]
    maxima, units = list(at["severity"].astype(float)), list(at["units"].astype(float))
    above = sum(m > FM.BULK_MAX for m in maxima)
    return FM.tail_constant(maxima, units), above, int(sum(units))


def rows(node: int, run) -> list[Row]:
    """One row a site with a Table 2 value: c U / ln 2 against it (module docstring)."""
    paper = PB.published(f"{PB.PAPER_PREFIX}{node}")
    out = []
    for site in PB.SITES:
        published = float(paper["max_severity"][site])
        units = FM.layer_fit(node, site)["units"]
        if published == 0 or units == 0:
            continue
        c, above, ours_units = tail_fit(run, site)
        quantity = QUANTITY.format(site=site)
        lo, hi = published / EXPOSURE_SPREAD, published * EXPOSURE_SPREAD
        band = B.interval(lo, hi)
        if above < MIN_TAIL_UNITS:
            out.append(Row(node, "Table 2", quantity, published, None, None, band, B.TOO_RARE,
                           f"{above} of {ours_units} units above {FM.BULK_MAX:g}: too few to "
                           f"fit a tail (at least {MIN_TAIL_UNITS})", published))
            continue
        ours = FM.predicted_maximum(c, units)
        verdict = "pass" if B.within(ours, lo, hi) else "fail"
        out.append(Row(node, "Table 2", quantity, published, ours, B.ratio(ours, published),
                       band, verdict, f"c = {B.g(c)} from {above} of {ours_units} units above "
                       f"{FM.BULK_MAX:g}, over the paper's {_units(units)} units", published))
    return out


def layer_rows(node: int, run) -> list[Row]:
    """Tables 8-9 at the paper's exposure: each of our layers' tail, fitted to its (step,
    microstep) groups (the rollup's `tail_*` sums), carried to the median of the paper's
    per-layer units at the site, against the paper's range over its 16 layers widened by
    `LAYER_EXPOSURE_SPREAD` either way."""
    by_layer = run.mismatch_rollup.by_layer
    out = []
    for (layer, site), at in by_layer.iterrows():
        source = PL.tables_for(site)[1]
        maxima, freqs = PL.layer_values(source, node, site), PL.layer_values(
            PL.tables_for(site)[0], node, site)
        if not maxima or not freqs or max(maxima) == 0:
            continue
        units = statistics.median(FM.paper_units(f) for f in freqs)
        lo, hi = min(maxima) / LAYER_EXPOSURE_SPREAD, max(maxima) * LAYER_EXPOSURE_SPREAD
        quantity = f"{site} layer {layer}" + SUFFIX
        published = f"{B.interval(min(maxima), max(maxima))} over {PL.PAPER_LAYERS} layers"
        above = int(at["tail_n"])
        if above < MIN_TAIL_UNITS:
            out.append(Row(node, source, quantity, published, None, None, B.interval(lo, hi),
                           B.TOO_RARE, f"{above} groups above {FM.BULK_MAX:g}: too few to fit "
                           f"a tail (at least {MIN_TAIL_UNITS})"))
            continue
        c = FM.tail_constant_of_sums(above, at["tail_inv"], at["tail_below"])
        ours = FM.predicted_maximum(c, units)
        out.append(Row(node, source, quantity, published, ours, None, B.interval(lo, hi),
                       "pass" if B.within(ours, lo, hi) else "fail",
                       f"c = {B.g(c)} from {above} groups above {FM.BULK_MAX:g}, over the "
                       f"paper's median {_units(units)} units a layer"))
    return out


def _units(units: float) -> str:
    return f"{units:,.0f}" if units < 1e6 else f"{units:.3g}"


def is_exposure_row(row: Row) -> bool:
    return row.source in ("Table 2", "Table 8", "Table 9") and row.quantity.endswith(SUFFIX)


def spread(values: list[float]) -> float:
    """The largest ratio, either way, between one of `values` (> 0) and their median (for an
    even count, the geometric mean of the middle two)."""
    ordered = sorted(values)
    n = len(ordered)
    median = (ordered[n // 2] if n % 2 else math.sqrt(ordered[n // 2 - 1] * ordered[n // 2]))
    return max(max(v / median, median / v) for v in ordered)
