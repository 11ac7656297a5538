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
{1 / spread, 1, spread}. Where the run recorded too few accumulator errors above the floor
to measure A (`flip_exposure.MIN_TAIL_HITS`), A is the floor x their share at the four sites
over its Poisson range (0 to the range's upper end where none lies above the floor; 0 to the
floor where the run recorded no accumulator error), and the row states the least and the
greatest chance over it (`tail_range`). Imports no JAX.
"""

from __future__ import annotations

import math
from dataclasses import replace

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
    return min(table2_chances(ours, paper, _scales(spread), factor))


def table2_chances(ours: FX.MaximumLaw, paper: FX.MaximumLaw, scales,
                   factor: float = B.SEVERITY_FACTOR) -> list[float]:
    """`table2_chance` at each of the tail's A times `scales`."""
    return [expected_pass(ours, lambda m: paper.cdf(factor * m, e) - paper.cdf(m / factor, e),
                          e) for e in scales]


def layers_chance(ours: FX.MaximumLaw, layers: list[FX.MaximumLaw | None], spread: float,
                  factor: float = B.SEVERITY_FACTOR) -> float:
    """P(min_l X_l / factor <= M_ours <= max_l X_l x factor) over the paper's layer maxima
    X_l (None: a layer without mismatches, X_l = 0), the least over A's range."""
    return min(layers_chances(ours, layers, _scales(spread), factor))


def layers_chances(ours: FX.MaximumLaw, layers: list[FX.MaximumLaw | None], scales,
                   factor: float = B.SEVERITY_FACTOR) -> list[float]:
    """`layers_chance` at each of the tail's A times `scales` (laws that differ only in their
    units, as a site's layers do, take each M's unit exceedances once)."""
    def at(scale: float) -> float:
        def passes(m: float) -> float:
            parts: dict = {}  # layers of one bit law and A share their unit exceedances at t

            def cdf(law: FX.MaximumLaw | None, t: float) -> float:
                if law is None:
                    return 1.0
                key = (law.p_tail, law.tail, id(law.significands), t)
                if key not in parts:
                    parts[key] = law.unit_exceedances(t, scale)
                return law.cdf(t, scale, parts[key])
            # P(X_l <= f M) and P(X_l <= M / f) of each paper layer
            high = [cdf(law, factor * m) for law in layers]
            low = [cdf(law, m / factor) for law in layers]
            return 1.0 - math.prod(1 - c for c in high) - math.prod(low)
        return expected_pass(ours, passes, scale)
    return [at(e) for e in scales]


def _scales(spread: float) -> tuple[float, ...]:
    return (1 / spread, 1.0, spread)


def tail_range(tail: FX.SiteTail, records) -> tuple[FX.SiteTail, tuple[float, ...], bool]:
    """(tail, A's scales, whether A was too rare to measure): A's Poisson range where the run
    measured it; where it recorded too few accumulator errors above the floor
    (`SiteTail.too_rare`), A = the floor x their share at the four sites, over its Poisson
    range (from 0 to the range's upper end where none lies above the floor); from 0 to the
    floor (every hit above it) where the run recorded no accumulator error."""
    if not tail.too_rare():
        return tail, _scales(tail.spread), False
    recorded = len(FX.relative_errors(records, FX.TAIL_KIND)[1])
    if recorded == 0:  # their share above the floor is anything from 0 to 1
        return replace(tail, tail=FX.HIT_FLOOR), (0.0, 0.5, 1.0), True
    if tail.above > 0:
        spread = FX.count_spread(tail.above)
        measured = replace(tail, tail=FX.HIT_FLOOR * tail.above / recorded, spread=spread)
        return measured, _scales(spread), True
    upper = -math.log((1 - FX.COUNT_LEVEL) / 2)  # the mean whose P(no event) is the range's side
    return replace(tail, tail=FX.HIT_FLOOR * upper / recorded), (0.0, 0.5, 1.0), True


def raw_chance(row: Row, run) -> tuple[float, float | None] | str:
    """(chance, None) of a flip run's Table 2 or Tables 8-9 row at the run's exposure (module
    docstring), the least over A's range; (least, greatest) where A was too rare to measure
    (`tail_range`); where it states none, why: no units, or no paper exposure or severity."""
    site, _, layer = row.quantity.partition(" layer ")
    records, values = FX.run_records(run)
    tail, scales, rare = tail_range(FX.site_tail(row.node, site, records, values), records)
    by_layer = run.mismatch_rollup.by_layer
    at = by_layer.xs(site, level="site") if site in by_layer.index.get_level_values(
        "site") else by_layer.iloc[:0]
    if layer:
        at = at.loc[[int(layer)]] if int(layer) in at.index else at.iloc[:0]
    units, hits = float(at["units"].sum()), float(at["mismatches"].sum())
    if units <= 0:
        return FX.no_units_here(row.quantity)
    ours = run_law(tail, units, hits)
    freqs = PL.layer_values(PL.tables_for(site)[0], row.node, site) or ()
    if not layer:
        if float(PB.published(f"{PB.PAPER_PREFIX}{row.node}")["max_severity"][site]) == 0:
            return f"Table 2 gives {site} a largest severity of 0: the paper's maximum has no law"
        if FX.exposure(freqs)[0] == 0:
            return FX.no_paper_units(row.node, site)
        chances = table2_chances(ours, tail.law(freqs), scales)
    elif not freqs or max(freqs) == 0:
        return FX.no_paper_units(row.node, site)
    else:
        chances = layers_chances(ours, [tail.law((f,)) if f > 0 else None for f in freqs],
                                 scales)
    return min(chances), (max(chances) if rare else None)
