"""The chance that a correct flip model passes Table 2 and Tables 8-9 at the run's own exposure
(`Row.pass_probability`; docs/reproduction.md, "The chance a correct model passes").

Such a row compares the largest severity over the run's units of a site (or of one layer)
with the paper's, within `bands.SEVERITY_FACTOR` either way (Tables 8-9: within the factor of
the paper's range over its 16 layers). Under the flip model the largest severity over U units
has the law `flip_exposure.MaximumLaw` (its bit law, the run's recorded significands and
accumulator errors): the paper's maximum over the paper's units, ours over the run's. With
both drawn from that law, the chance that ours passes is
    E_ours[F_paper(f M) - F_paper(M / f)]           (Table 2, f the factor),
    E_ours[1 - prod_l (1 - F_l(f M)) - prod_l F_l(M / f)]   (Tables 8-9, l the paper's layers:
        every paper layer above f M, or every one below M / f, fails it),
a Stieltjes sum over `GRID` values of M on a log scale (steps of our law's distribution
function under 1e-12 left out). Our units and those with one hit are
the run's: units with a mismatch from the mismatch rollup, hits per unit Poisson with the
rollup's mean (as `flip_exposure.exposure` takes the paper's). The accumulator errors' tail A
is the run's (`flip_exposure.site_tail`), the chance the least over the true A at ours times
{1 / spread, 1, spread}; none where the run has too few accumulator errors to measure A.
Imports no JAX.
"""

from __future__ import annotations

import math

import numpy as np

from sdcstudy.faults import published as PB
from sdcstudy.faults import published_layers as PL
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import flip_exposure as FX
from sdcstudy.reproduce.bands import Row

GRID = np.geomspace(1e-6, 1e12, 1200)  # severities M the expectation sums over


def one_hit_units(units: float, hits: float) -> float:
    """Of `units` units with at least one hit and `hits` hits in all, the expected number with
    exactly one, hits per unit Poisson(lam) given at least one: mean lam / (1 - e^-lam)."""
    if units <= 0:
        return 0.0
    mean = hits / units
    if mean <= 1.0:
        return float(units)
    lo, hi = 1e-12, mean  # lam / (1 - e^-lam) rises from 1 at 0 to ~lam
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid / -math.expm1(-mid) < mean else (lo, mid)
    lam = (lo + hi) / 2
    return float(units * lam * math.exp(-lam) / -math.expm1(-lam))


def run_law(tail: FX.SiteTail, units: float, hits: float) -> FX.MaximumLaw:
    """The law of the run's maximum over its `units` units at a site (or layer)."""
    single = one_hit_units(units, hits)
    return FX.MaximumLaw(single, units - single, tail.p_tail, tail.tail, tail.significands)


def expected_pass(ours: FX.MaximumLaw, passes, scale: float) -> float:
    """E[passes(M)] over our maximum M (its law at the tail's A times `scale`)."""
    cdf = np.array([ours.cdf(t, scale) for t in GRID])
    mass = np.diff(np.concatenate([[0.0], cdf]))
    return float(sum(m * passes(t) for m, t in zip(mass, GRID) if m > 1e-12))


def table2_chance(ours: FX.MaximumLaw, paper: FX.MaximumLaw, spread: float,
                  factor: float = B.SEVERITY_FACTOR) -> float:
    """P(M_paper / factor <= M_ours <= M_paper x factor), the least over A's range."""
    def at(scale: float) -> float:
        return expected_pass(ours, lambda m: paper.cdf(factor * m, scale)
                             - paper.cdf(m / factor, scale), scale)
    return min(at(e) for e in (1 / spread, 1.0, spread))


def layers_chance(ours: FX.MaximumLaw, layers: list[FX.MaximumLaw | None], spread: float,
                  factor: float = B.SEVERITY_FACTOR) -> float:
    """P(min_l X_l / factor <= M_ours <= max_l X_l x factor) over the paper's layer maxima
    X_l (None: a layer without mismatches, X_l = 0), the least over A's range."""
    def at(scale: float) -> float:
        def passes(m: float) -> float:
            # P(X_l <= f M) and P(X_l <= M / f) of each paper layer
            high = [1.0 if law is None else law.cdf(factor * m, scale) for law in layers]
            low = [1.0 if law is None else law.cdf(m / factor, scale) for law in layers]
            return 1.0 - math.prod(1 - c for c in high) - math.prod(low)
        return expected_pass(ours, passes, scale)
    return min(at(e) for e in (1 / spread, 1.0, spread))


def raw_chance(row: Row, run) -> float | None:
    """The chance of a flip run's Table 2 or Tables 8-9 row at the run's exposure (module
    docstring), or None: no units, no paper exposure, or A not measurable."""
    site, _, layer = row.quantity.partition(" layer ")
    records, values = FX.run_records(run)
    tail = FX.site_tail(row.node, site, records, values)
    if tail.too_rare():
        return None
    by_layer = run.mismatch_rollup.by_layer
    at = by_layer.xs(site, level="site") if site in by_layer.index.get_level_values(
        "site") else by_layer.iloc[:0]
    if layer:
        at = at.loc[[int(layer)]] if int(layer) in at.index else at.iloc[:0]
    units, hits = float(at["units"].sum()), float(at["mismatches"].sum())
    if units <= 0:
        return None
    ours = run_law(tail, units, hits)
    freqs = PL.layer_values(PL.tables_for(site)[0], row.node, site) or ()
    if not layer:
        if float(PB.published(f"{PB.PAPER_PREFIX}{row.node}")["max_severity"][site]) == 0 \
                or FX.exposure(freqs)[0] == 0:
            return None
        return table2_chance(ours, tail.law(freqs), tail.spread)
    if not freqs or max(freqs) == 0:
        return None
    return layers_chance(ours, [tail.law((f,)) if f > 0 else None for f in freqs],
                         tail.spread)
