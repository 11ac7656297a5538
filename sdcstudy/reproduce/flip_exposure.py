"""Tables 2, 8 and 9 at the paper's exposure under the flip model: the law of the maximum its
hits give over the paper's units, from the bit law and what a lock-step run recorded
(docs/reproduction.md, "Table 2 at the paper's exposure"; docs/faults.md 6.3).

The additive rows (`exposure_rows.rows`) fit a tail to the run's own units, which needs units
above 0.5; the flip model's are bit flips of at most 0.5 averaged with hundreds of others, so
a tiny run has none ("too rare"). But the flip model's law of one unit is known:
- a unit with one hit (lambda e^-lambda of a layer's microstep-rank slots, lambda its hits a
  slot at the layer's Table 6 or 7 frequency) is that hit: with probability 1 - p_tail a flip
  of mantissa bit j, uniform on 0-6 (the engine's bit law), relative error 2^(j-7) / s for the
  value's significand s; with probability p_tail an accumulator error (`kind: additive`),
  which exceeds t with probability A / t;
- a unit of k >= 2 hits is the mean of its flips, about E[B] = E[2^(j-7)] E[1 / s] (0.102),
  moved past t > E[B] by an accumulator error above k (t - E[B]): with probability p_tail A /
  (t - E[B]) whatever k (docs/faults.md 6.3; the mean of k - 1 flips is taken as E[B], which
  errs high for small k). Means of two or more flips alone are left out: they reach the
  largest single flips with a far smaller probability.
Over the paper's U units of a site (as many as its frequencies measured: Table 2 has at least
one) P(max <= t) = (1 - n(t) / U)^U, n(t) the expected units above t (`MaximumLaw`), exact in the
bulk: over the 7 bits and over the significands of the run's recorded flips (faults.parquet's
`original`; spread evenly over octaves where it recorded none). No sampling: a Monte Carlo of
the engine's draws would estimate the same sums, and not at the 1e-7 probabilities a maximum
over 10^7 units reads. The one number a run must measure is A, the accumulator errors' tail on
its values: fitted to the recorded relative errors of the site's additive hits, or of the four
sites' together where the site has fewer than `MIN_TAIL_HITS` above the floor `HIT_FLOOR`
(where the 1/t law is within some 10% of the additive kind's exact tail), by the maximum
likelihood of a tail P(r > t) = A / t above the floor: A = the floor x the share of hits above
it; our error in it is the Poisson 90% range of the count above (`count_spread`).
Table 2's row passes when Table 2 lies within the central `SCATTER_LEVEL` of this law, the law
taken at the low end of A's range for the lower quantile and at its high end for the upper
one, and states the probability that a correct model passes (`pass_probability`, at least
`SCATTER_LEVEL` up to the discreteness of the recorded significands). Tables 8-9 have one row
a site, each of the paper's layer maxima against its own layer's law (`layer_rows`). Imports
no JAX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from sdcstudy.faults import flip_model as FM
from sdcstudy.faults import published as PB
from sdcstudy.faults import published_layers as PL
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce.bands import Row

BULK_KIND, TAIL_KIND = "bitflip", "additive"  # faults.parquet's kinds of the two specs
# The floor of the accumulator errors' tail fit: P(m / |u| > t) = E[erf(m / (t sqrt 2))] is
# within 10% of its 1/t asymptote for t >= 1 (m <= 1; 5% from erf, about as much from the
# curvature of the values' density at zero).
HIT_FLOOR = 1.0
MIN_TAIL_HITS = 5
SCATTER_LEVEL = 0.90
FLIP_REASON = "flip model over the paper's"  # how a row of this law's reason starts
COUNT_LEVEL = 0.90  # the Poisson range of the fitted tail's hits above the floor


@dataclass(frozen=True)
class MaximumLaw:
    """P(max <= t) over a site's paper units (module docstring): `single` units with one hit,
    `multi` with more, a share `p_tail` of the hits accumulator errors with the tail
    constant `tail` (A), `significands` those of the values the bulk flips (sorted; empty:
    spread evenly over octaves)."""

    single: float
    multi: float
    p_tail: float
    tail: float
    significands: np.ndarray

    def _places(self) -> np.ndarray:
        return 2.0 ** (np.arange(FM.BULK_BITS) - FM.BULK_BITS)

    def bulk_exceedance(self, t: float) -> float:
        """P(B > t) of one bulk flip: over the 7 bits j equally likely, 2^(j-7) / s > t."""
        if t <= 0:
            return 1.0
        places = self._places()
        if len(self.significands) == 0:  # log2 s uniform on [0, 1)
            return float(np.mean(np.clip(np.log2(places / t), 0.0, 1.0)))
        below = np.searchsorted(self.significands, places / t, side="left")
        return float(np.mean(below) / len(self.significands))

    @cached_property
    def _bulk_mean(self) -> float:
        inverse = (np.mean(1 / self.significands) if len(self.significands) else
                   1 / (2 * math.log(2)))
        return float(np.mean(self._places()) * inverse)

    def bulk_mean(self) -> float:
        """E[B] = E[2^(j-7)] E[1 / s]: the severity of a unit of many bulk flips."""
        return self._bulk_mean

    def unit_exceedances(self, t: float, scale: float = 1.0) -> tuple[float, float]:
        """(P(S > t) of a one-hit unit, of a unit of several hits), the tail's A times
        `scale`: by its flip or accumulator error, and (the mean of its flips about E[B]) by an
        accumulator error above k (t - E[B]), all of them below E[B]. The same for every
        count of units: laws that differ only in `single` and `multi` share them."""
        tail = scale * self.p_tail * self.tail
        one = (1 - self.p_tail) * self.bulk_exceedance(t) + min(self.p_tail, tail / t)
        floor = self.bulk_mean()
        several = min(1.0, tail / (t - floor)) if t > floor else 1.0
        return min(1.0, one), several

    def exceedances(self, t: float, scale: float = 1.0, parts=None) -> float:
        """The expected units above t, the tail's A times `scale` (`unit_exceedances`, or
        `parts` where given)."""
        one, several = parts or self.unit_exceedances(t, scale)
        return self.single * one + self.multi * several

    def cdf(self, t: float, scale: float = 1.0, parts=None) -> float:
        """P(max <= t), the tail's A times `scale`: each of the paper's units (as many as its
        frequencies measured, not a Poisson count: Table 2 has at least one) at or below t;
        `parts`, where given, the `unit_exceedances` at t of a law sharing this one's."""
        units = self.single + self.multi
        if t <= 0 or units <= 0:
            return 0.0
        share = self.exceedances(t, scale, parts) / units
        return 0.0 if share >= 1 else math.exp(units * math.log1p(-share))

    def quantile(self, q: float, scale: float = 1.0) -> float:
        """The least t with P(max <= t) >= q (bisection on log t)."""
        lo, hi = 1e-12, 1e18
        if self.cdf(hi, scale) < q:
            return math.inf
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if self.cdf(mid, scale) < q else (lo, mid)
            if hi / lo < 1 + 1e-12:
                break
        return hi


def no_units_here(quantity: str) -> str:
    """Why a Table 2 or Tables 8-9 row (`quantity`: a site, or a site and layer) states no
    chance at the run's exposure when the run holds no units there."""
    return f"this run holds no units at {quantity}, so its maximum has no law"


def no_paper_units(node: int, site: str) -> str:
    """Why such a row states none when the paper's maximum has no units: `site`'s frequency
    table (6 or 7) has no row for `node`, or gives 0 (as rounded there) in every layer."""
    table = PL.tables_for(site)[0]
    if PL.layer_values(table, node, site) is None:
        return f"{table} has no row for node {node}, so the paper's units are unknown"
    return f"{table} gives {site} a frequency of 0 in every layer, so the paper's units are 0"


def exposure(freqs, tp: int = FM.PAPER_TP) -> tuple[float, float]:
    """(U, N1): the paper's units with a mismatch, and with exactly one, summed over layers of
    Table 6 or 7 frequencies `freqs` (`flip_model.paper_units`)."""
    per_unit = 1 / (FM.ONE_EVENT * FM.PAPER_MICROSTEPS * tp)  # elements a unit, over ONE_EVENT
    units = FM.PAPER_MICROSTEPS * tp
    return (sum(FM.paper_units(f, tp) for f in freqs),
            sum(units * f * per_unit * math.exp(-f * per_unit) for f in freqs))


def count_spread(count: int, level: float = COUNT_LEVEL) -> float:
    """The factor, either way, of the central `level` Poisson range of a mean given `count`
    events: max(count / lo, hi / count)."""
    if count <= 0:
        return math.inf
    side = (1 - level) / 2
    hi = _solve(lambda m: B.poisson_below(count, m) - side, count, 50.0 * count + 50)
    lo = _solve(lambda m: side - B.poisson_above(count, m), 1e-9, count)
    return max(count / lo, hi / count)


def _solve(f, lo: float, hi: float) -> float:
    """The root of a monotone `f` that changes sign on [lo, hi] (bisection)."""
    sign = f(lo) > 0
    for _ in range(200):
        mid = (lo + hi) / 2
        if (f(mid) > 0) == sign:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def relative_errors(records, kind: str, site: str | None = None):
    """(originals, relative errors) of the finite, non-zero recorded hits of `kind`, at `site`
    or at any of the four Table 1 sites."""
    at = records[records["kind"] == kind]
    at = at[at["site"] == site] if site else at[at["site"].isin(PB.SITES)]
    original = at["original"].to_numpy(float)
    corrupted = at["corrupted"].to_numpy(float)
    keep = np.isfinite(original) & np.isfinite(corrupted) & (original != 0)
    original, corrupted = original[keep], corrupted[keep]
    return original, np.abs(corrupted - original) / np.abs(original)


def significands(originals) -> np.ndarray:
    """s in [1, 2) of each value, sorted."""
    mantissa, _ = np.frexp(np.abs(np.asarray(originals, float)))
    return np.sort(2 * mantissa)


def hit_tail(records, site: str) -> tuple[float, int, str]:
    """(A, hits above `HIT_FLOOR`, where): the accumulator errors' tail constant of the run,
    from the site's recorded additive hits, else from the four sites' together."""
    for where, at in (("at the site", site), ("at the four sites", None)):
        _, errors = relative_errors(records, TAIL_KIND, at)
        above = int(np.sum(errors > HIT_FLOOR))
        if above >= MIN_TAIL_HITS:
            return HIT_FLOOR * above / len(errors), above, where
    return 0.0, above, where


def pass_probability(law: MaximumLaw, lo: float, hi: float, spread: float) -> float:
    """The least, over the true A at our A times {1 / spread, 1, spread}, of P(Table 2 in
    [lo, hi]) under the law."""
    return min(law.cdf(hi, e) - law.cdf(lo, e) for e in (1 / spread, 1.0, spread))


def is_flip_run(run) -> bool:
    """Whether a run's profile is a paper node's under the flip model."""
    profile = str(((getattr(run, "config", None) or {}).get("suspect") or {}).get("profile", ""))
    return PB.paper_node_number(profile) is not None and profile.endswith(PB.FLIP_SUFFIX)


@dataclass(frozen=True)
class SiteTail:
    """What a run gives a site's law: p_tail, A (0 where p_tail is 0), the recorded hits above
    `HIT_FLOOR` it was fitted to and where, our A's error either way, the bulk's significands."""

    p_tail: float
    tail: float
    above: int
    where: str
    spread: float
    significands: np.ndarray

    def law(self, freqs) -> MaximumLaw:
        units, single = exposure(freqs)
        return MaximumLaw(single, units - single, self.p_tail, self.tail, self.significands)

    def too_rare(self) -> str | None:
        if self.p_tail == 0 or self.above >= MIN_TAIL_HITS:
            return None
        return (f"{self.above} recorded accumulator errors above {HIT_FLOOR:g} {self.where}: "
                f"too few to measure their tail (at least {MIN_TAIL_HITS}; p_tail "
                f"{B.g(self.p_tail)})")

    def words(self) -> str:
        bulk = (f"{len(self.significands)} recorded flips' significands" if
                len(self.significands) else
                "significands spread evenly over octaves (no flip recorded)")
        tail = (f"p_tail {B.g(self.p_tail)} of the hits accumulator errors, A = "
                f"{B.g(self.tail)} from the {self.above} recorded above {HIT_FLOOR:g} "
                f"{self.where} (within {self.spread:.2g}x)" if self.p_tail > 0 else
                "no accumulator errors (p_tail 0)")
        return f"bulk over the 7 mantissa bits on {bulk}, {tail}"


def site_tail(node: int, site: str, records, values: np.ndarray) -> SiteTail:
    p_tail = FM.tail_fraction(node, site)
    if p_tail == 0:
        return SiteTail(0.0, 0.0, 0, "", 1.0, values)
    tail, above, where = hit_tail(records, site)
    return SiteTail(p_tail, tail, above, where, count_spread(above), values)


def central(law: MaximumLaw, spread: float) -> tuple[float, float]:
    """The central `SCATTER_LEVEL` of the law's maximum, its lower end at A / spread and its
    upper one at A x spread."""
    side = (1 - SCATTER_LEVEL) / 2
    return law.quantile(side, 1 / spread), law.quantile(1 - side, spread)


def run_records(run):
    records = run.faults
    return records, significands(relative_errors(records, BULK_KIND)[0])


def rows(node: int, run, quantity: str) -> list[Row]:
    """One row a site with a Table 2 value: the median of the law's maximum against it,
    `quantity` the site's row name with a {site} field (module docstring)."""
    paper = PB.published(f"{PB.PAPER_PREFIX}{node}")
    records, values = run_records(run)
    out = []
    for site in PB.SITES:
        published = float(paper["max_severity"][site])
        freqs = PL.layer_values(PL.tables_for(site)[0], node, site) or ()
        if published == 0 or exposure(freqs)[0] == 0:
            continue
        out.append(site_row(node, published, quantity.format(site=site), freqs,
                            site_tail(node, site, records, values)))
    return out


def site_row(node: int, published: float, quantity: str, freqs, given: SiteTail) -> Row:
    """The row of one site (`rows`)."""
    if given.too_rare():
        return Row(node, "Table 2", quantity, published, None, None, "-", B.TOO_RARE,
                   given.too_rare(), published)
    law = given.law(freqs)
    lo, hi = central(law, given.spread)
    ours = law.quantile(0.5)
    units, single = exposure(freqs)
    return Row(node, "Table 2", quantity, published, ours, B.ratio(ours, published),
               B.interval(published * ours / hi, published * ours / lo),
               "pass" if lo <= published <= hi else "fail",
               f"{FLIP_REASON} {_units(units)} units ({_units(single)} with one "
               f"hit): {given.words()}; Table 2 is one draw of the maximum, "
               f"{SCATTER_LEVEL:.0%} of them in [{B.g(lo)}, {B.g(hi)}]", published,
               pass_probability=pass_probability(law, lo, hi, given.spread))


def layer_rows(node: int, run, suffix: str) -> list[Row]:
    """Tables 8-9 at the paper's exposure, one row a site: each of the paper's layer maxima
    against its own layer's law (its Table 6 or 7 frequency), judged by how many of them lie
    outside their central `SCATTER_LEVEL`: at most the count that a correct model stays within
    with probability `SCATTER_LEVEL` (`allowed_misses`), the row's name the site and `suffix`."""
    records, values = run_records(run)
    out = []
    for site in PB.SITES:
        freq_table, source = PL.tables_for(site)
        maxima, freqs = PL.layer_values(source, node, site), PL.layer_values(freq_table, node, site)
        if not maxima or not freqs or max(maxima) == 0:
            continue
        given = site_tail(node, site, records, values)
        quantity = f"{site} per layer" + suffix
        published = f"{B.interval(min(maxima), max(maxima))} over {PL.PAPER_LAYERS} layers"
        if given.too_rare():
            out.append(Row(node, source, quantity, published, None, None, "-", B.TOO_RARE,
                           given.too_rare()))
            continue
        layers = [(m, given.law((f,))) for m, f in zip(maxima, freqs) if f > 0]
        ranges = [central(law, given.spread) for _, law in layers]
        outside = [i for i, ((m, _), (lo, hi)) in enumerate(zip(layers, ranges))
                   if not lo <= m <= hi]
        allowed, chance = allowed_misses(layers, ranges, given.spread)
        shown = "; ".join(f"{B.g(layers[i][0])} against [{B.g(ranges[i][0])}, "
                          f"{B.g(ranges[i][1])}]" for i in outside[:3])
        out.append(Row(node, source, quantity, published, float(len(outside)), None,
                       f"at most {allowed} of {len(layers)} layers outside", "pass" if
                       len(outside) <= allowed else "fail",
                       f"{len(outside)} of the paper's {len(layers)} layer maxima outside the "
                       f"central {SCATTER_LEVEL:.0%} of their layer's law{': ' if shown else ''}"
                       f"{shown}{' ...' if len(outside) > 3 else ''} (flip model, "
                       f"{given.words()})", pass_probability=chance))
    return out


def allowed_misses(layers, ranges, spread: float) -> tuple[int, float]:
    """(k, its chance): the least k such that a correct model has at most k layer maxima
    outside their ranges with probability `SCATTER_LEVEL` or more, the least over the true A
    at ours times {1 / spread, 1, spread}, and that probability."""
    def at_most(k: int) -> float:
        chances = []
        for e in (1 / spread, 1.0, spread):
            misses = np.zeros(len(layers) + 1)
            misses[0] = 1.0
            for (_, law), (lo, hi) in zip(layers, ranges):
                inside = law.cdf(hi, e) - law.cdf(lo, e)
                misses[1:] = misses[1:] * inside + misses[:-1] * (1 - inside)
                misses[0] *= inside
            chances.append(float(misses[:k + 1].sum()))
        return min(chances)
    k = 0
    while at_most(k) < SCATTER_LEVEL and k < len(layers):
        k += 1
    return k, at_most(k)


def _units(units: float) -> str:
    return f"{units:,.0f}" if units < 1e6 else f"{units:.3g}"
