"""The chance that a correct additive model passes Table 2 and Tables 8-9 at the run's own
exposure (`Row.pass_probability` and its upper bound `pass_probability_max`; docs/reproduction.md,
"The chance a correct model passes").

Such a row compares the largest severity over the run's units of a site (or of one layer)
with the paper's, within `bands.SEVERITY_FACTOR` either way (Tables 8-9: within the factor of
the paper's range over its 16 layers). Under the additive model a unit's severity has the tail
P(S > t) = c / t above the bulk (docs/faults.md 5.3; `flip_model.BULK_MAX`, 0.5, the floor its
fit `flip_model.tail_constant` takes), so the largest over U units has P(max <= t) =
(1 - c / t)^U there (`TailMaximum`); below the floor lies the bulk, whose law the model does
not state. Both maxima are the model's: ours over the run's units (Table 2: the site's; a
layer row: the layer's), the paper's over its own (`flip_model.paper_units` at each layer's
Table 6 or 7 frequency), with the run's c (the same c a unit as the exposure rows carry to
the paper's units). The published maximum does not enter: it is the paper's draw of the
same law, which the row holds ours against. The chance is

    E_ours[1 - prod_l (1 - F_l(f M)) - prod_l F_l(M / f)]

over our maximum M and the paper's layers l (Table 2: one law, F(f M) - F(M / f); a paper
layer without mismatches a maximum of 0), f the factor. Where a maximum may lie in the bulk the
sum is bounded, not exact: the lower bound counts every outcome with a maximum in the bulk as
a failure, except those the law above the floor already decides, the upper bound as a pass
wherever one can be (`chance_bounds`); where no maximum can fall in the bulk the two agree and
reduce to the closed form of two Frechet laws, 3r / (1 + 3r) - r / (3 + r), r the paper's
units over ours (checked in tests/test_additive_run_chance.py). c is the run's fit at the
site, taken at the fit and at either end of its Poisson range of units above the floor
(`flip_exposure.count_spread`): the least lower bound and the greatest upper bound, the upper
one stated where it exceeds the lower by more than `RANGE_SHOWN`; none where no unit of the
site exceeds the floor (c unmeasured), which the row's reason then says. Imports no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sdcstudy.faults import flip_model as FM
from sdcstudy.faults import published_layers as PL
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import flip_exposure as FX
from sdcstudy.reproduce.bands import Row

FLOOR = FM.BULK_MAX  # the unit severity's tail is c / t above it
# Our maximum's values the expectation sums over: from the floor to where (1 - c / t)^U leaves
# less than 1e-12 for the c U of any run (c U < 1e3).
GRID = np.geomspace(FLOOR, 1e16, 20000)
# The upper bound is stated where it exceeds the lower by more than this share of it: the sum's
# own steps (0.2% apart) part the two by about as much where no maximum can lie in the bulk.
RANGE_SHOWN = 0.05


@dataclass(frozen=True)
class TailMaximum:
    """The largest severity over `units` units, each above the floor with P(S > t) = c / t."""

    c: float
    units: float

    def cdf(self, t) -> np.ndarray:
        """P(max <= t) for t at or above the floor (0 where c / t >= 1: every unit above)."""
        share = np.clip(1 - self.c / np.asarray(t, float), 0.0, 1.0)
        return share ** self.units


def _pass(high: list[np.ndarray], low: list[np.ndarray]) -> np.ndarray:
    """1 - prod_l (1 - P(X_l <= f M)) - prod_l P(X_l <= M / f), per M."""
    return 1 - np.prod([1 - h for h in high], axis=0) - np.prod(low, axis=0)


def chance_bounds(ours: TailMaximum, layers: list[TailMaximum | None],
                  factor: float = B.SEVERITY_FACTOR) -> tuple[float, float]:
    """(low, high): the chance that our maximum lies within `factor` of the paper's layer
    maxima's range (module docstring; None: a layer without mismatches, a maximum of 0).
    For M at or above the floor P(X_l <= f M) is known; P(X_l <= M / f) is known where M / f is
    at or above the floor, else between 0 and P(X_l <= floor). M in the bulk passes at most
    where some X_l <= f floor."""
    def law(x: np.ndarray, layer: TailMaximum | None) -> np.ndarray:
        return np.ones_like(x) if layer is None else layer.cdf(np.maximum(x, FLOOR))

    cdf = ours.cdf(GRID)
    mass = np.diff(cdf)
    # Each step's mass is evaluated at both its ends, GRID[:-1] and GRID[1:]: the laws are
    # elementwise, so they are computed once on GRID and sliced.
    high_grid = [law(factor * GRID, layer) for layer in layers]
    at_most_grid = [law(GRID / factor, layer) for layer in layers]
    known_grid = GRID / factor >= FLOOR
    lows, highs = [], []
    for end in (slice(None, -1), slice(1, None)):
        high = [h[end] for h in high_grid]
        at_most = [a[end] for a in at_most_grid]
        at_least = [np.where(known_grid[end], a, 0.0) if layer is not None else a
                    for a, layer in zip(at_most, layers)]
        lows.append(_pass(high, at_most))
        highs.append(_pass(high, at_least))
    low = float(np.sum(mass * np.minimum(*lows)))
    high = float(np.sum(mass * np.maximum(*highs)))
    bulk_passes = 1 - np.prod([1 - law(np.array([factor * FLOOR]), layer)[0]
                               for layer in layers])
    high += float(cdf[0]) * float(bulk_passes) + float(1 - cdf[-1])
    return max(0.0, low), min(1.0, high)


def paper_units(node: int, site: str, layer: bool) -> list[float]:
    """The paper's units each maximum a row holds ours against spans: every layer's (a layer
    row; 0 for a layer without mismatches), or the site's over all its layers (Table 2)."""
    freqs = PL.layer_values(PL.tables_for(site)[0], node, site) or ()
    units = [FM.paper_units(f) for f in freqs]
    return units if layer else [sum(units)]


C_UNMEASURED = ("the additive tail's constant c is measured from the site's units above 0.5, "
                "and this run has none")


def raw_chance(row: Row, run) -> tuple[float, float | None] | str:
    """(low, high) of an additive run's Table 2 or Tables 8-9 row at the run's exposure
    (module docstring), high None where it is within `RANGE_SHOWN` of low; where it states
    none, why: c unmeasured, or no units on either side."""
    site, _, layer = row.quantity.partition(" layer ")
    by_layer = run.mismatch_rollup.by_layer
    if site not in by_layer.index.get_level_values("site"):
        return FX.no_units_here(row.quantity)
    at = by_layer.xs(site, level="site")
    if layer:
        at = at.loc[[int(layer)]] if int(layer) in at.index else at.iloc[:0]
    units, paper = float(at["units"].sum()), paper_units(row.node, site, bool(layer))
    if units <= 0:
        return FX.no_units_here(row.quantity)
    c, above, _ = X.tail_fit(run, site)
    if above == 0:
        return C_UNMEASURED
    if max(paper, default=0.0) <= 0:
        return FX.no_paper_units(row.node, site)
    spread = FX.count_spread(above)
    bounds = [chance_bounds(TailMaximum(c * e, units),
                            [TailMaximum(c * e, u) if u > 0 else None for u in paper])
              for e in (1 / spread, 1.0, spread)]
    low, high = min(b[0] for b in bounds), max(b[1] for b in bounds)
    return low, (high if high > low * (1 + RANGE_SHOWN) else None)
