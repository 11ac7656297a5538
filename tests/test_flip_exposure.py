"""Table 2 and Tables 8-9 at the paper's exposure under the flip model
(`reproduce.flip_exposure`): the law of the maximum against closed forms, the tail constant
fitted to recorded hits, the verdicts and their pass probabilities. Pure numpy: no JAX."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import flip_exposure as FX
from sdcstudy.reproduce.bands import Row

EVEN = np.array([])  # significands spread evenly over octaves


def test_one_flip_on_significand_one_has_the_bit_places_as_its_quantiles():
    """One unit, one flip of a value of significand 1: the relative error is 2^(j-7) with j
    uniform on 0-6, so P(max <= 2^(j-7)) = (j + 1) / 7 and the median is 2^-4 (4 / 7 >= 1 / 2,
    3 / 7 below). A wrong bit law or place moves it."""
    law = FX.MaximumLaw(single=1.0, multi=0.0, p_tail=0.0, tail=0.0,
                        significands=np.array([1.0]))
    assert law.quantile(0.5) == pytest.approx(2.0 ** -4, rel=1e-9)
    assert law.cdf(2.0 ** -5) == pytest.approx(3 / 7, rel=1e-12)
    assert law.cdf(0.5) == pytest.approx(1.0, rel=1e-12)


def test_maximum_of_many_flips_on_even_octaves_matches_its_closed_form():
    """U one-hit units, significands spread evenly over octaves: bit 6's error is log-uniform
    on [1/4, 1/2], so P(max <= t) = (1 - log2(0.5 / t) / 7)^U there and the median is
    0.5 x 2^(-7 (1 - 2^(-1/U)))."""
    units = 1000
    law = FX.MaximumLaw(single=units, multi=0.0, p_tail=0.0, tail=0.0, significands=EVEN)
    expected = 0.5 * 2.0 ** (-7 * (1 - 0.5 ** (1 / units)))
    assert law.quantile(0.5) == pytest.approx(expected, rel=1e-9)


def test_tail_of_many_hit_units_is_frechet_above_the_bulk_mean():
    """Units of many hits: the mean of their flips is E[B] = E[2^(j-7)] E[1/s] (1 / (2 ln 2)
    for even octaves) and an accumulator error moves it past t with probability
    p A / (t - E[B]): the median maximum over U units is E[B] + p A U / ln 2."""
    units, p_tail, tail = 9.2e6, 3e-4, 0.15
    law = FX.MaximumLaw(single=0.0, multi=units, p_tail=p_tail, tail=tail, significands=EVEN)
    bulk_mean = (1 - 2.0 ** -7) / 7 / (2 * math.log(2))
    assert law.bulk_mean() == pytest.approx(bulk_mean, rel=1e-12)
    assert law.quantile(0.5) == pytest.approx(bulk_mean + p_tail * tail * units / math.log(2),
                                              rel=1e-6)
    assert law.cdf(bulk_mean * 0.99) == 0.0  # every unit's mean is about E[B]


def _records(site_errors: dict, kind: str = FX.TAIL_KIND) -> pd.DataFrame:
    rows = [{"site": site, "kind": kind, "original": 1.0, "corrupted": 1.0 + e}
            for site, errors in site_errors.items() for e in errors]
    return pd.DataFrame(rows, columns=["site", "kind", "original", "corrupted"])


def test_tail_constant_is_fitted_to_the_sites_recorded_accumulator_errors():
    """Relative errors with P(r > t) = A / t (r = A / u, u uniform) give back A; a site with
    fewer than MIN_TAIL_HITS above the floor takes the four sites' hits, never a
    weight-gradient site's."""
    rng = np.random.default_rng(0)
    errors = 0.2 / rng.uniform(size=20_000)
    tail, above, where = FX.hit_tail(_records({"fwd/attn": errors}), "fwd/attn")
    assert tail == pytest.approx(0.2, rel=0.05) and where == "at the site"
    assert above == int(np.sum(errors > FX.HIT_FLOOR))
    pooled = _records({"fwd/attn": errors, "bwd/ffn": [2.0, 3.0], "grad/embed": [1e9] * 9})
    tail, above, where = FX.hit_tail(pooled, "bwd/ffn")
    assert where == "at the four sites" and above == int(np.sum(errors > 1)) + 2
    few = _records({"bwd/ffn": [2.0, 3.0], "grad/embed": [1e9] * 9})
    assert FX.hit_tail(few, "bwd/ffn")[1] == 2


def test_count_spread_is_the_poisson_ninety_percent_range():
    """The factor either way of the central 90% Poisson range of a mean given n events: the
    wider end at exactly 5%, the other inside."""
    for count in (1, 5, 40):
        spread = FX.count_spread(count)
        hi, lo = count * spread, count / spread
        assert (B.poisson_below(count, hi) == pytest.approx(0.05, abs=1e-6)
                or B.poisson_above(count, lo) == pytest.approx(0.05, abs=1e-6))
        assert B.poisson_below(count, hi) <= 0.05 + 1e-6  # both ends within the factor
        assert B.poisson_above(count, lo) <= 0.05 + 1e-6
    assert FX.count_spread(40) < FX.count_spread(5) < FX.count_spread(1)


def _tail(p_tail=3.27e-4, tail=0.18, above=30) -> FX.SiteTail:
    return FX.SiteTail(p_tail, tail, above, "at the site", FX.count_spread(above), EVEN)


FREQS = (0.0249,) * 16  # node 10's fwd/attn-like layer frequencies


def test_verdict_follows_table_2_across_the_laws_central_range():
    """Table 2 at the law's median passes, just outside its central 90% (A at either end of its
    range) fails; the band on ours says the same; a correct model passes with at least 90%."""
    given = _tail()
    law = given.law(FREQS)
    lo, hi = FX.central(law, given.spread)
    for published, verdict in ((law.quantile(0.5), "pass"), (hi * 1.01, "fail"),
                               (lo / 1.01, "fail"), (hi * 0.99, "pass")):
        row = FX.site_row(10, published, "fwd/attn, at the paper's exposure", FREQS, given)
        assert row.verdict == verdict, published
        band = B.bounds(row.band)
        assert B.within(row.ours, *band) == (verdict == "pass")
        assert 0.9 <= row.pass_probability < 1
        # the least over A's range, below the law's own mass at our A
        assert row.pass_probability < law.cdf(hi) - law.cdf(lo) - 0.01
    rare = FX.site_row(10, 1120.0, "q", FREQS, _tail(above=4))
    assert rare.verdict == B.TOO_RARE and rare.ours is None


def test_pass_probability_is_the_laws_mass_in_the_band():
    """With A known exactly (spread 1) the central 90% holds 90% of a continuous law."""
    law = FX.MaximumLaw(single=0.0, multi=1e6, p_tail=1e-4, tail=0.15, significands=EVEN)
    lo, hi = FX.central(law, 1.0)
    assert FX.pass_probability(law, lo, hi, 1.0) == pytest.approx(0.90, abs=1e-6)


def test_layer_rows_allow_the_misses_a_correct_model_makes_nine_times_in_ten():
    """16 alike continuous layer laws, A exact: misses are Binomial(16, 0.1), P(<= 2) = 0.789,
    P(<= 3) = 0.932, so 3 are allowed."""
    law = FX.MaximumLaw(single=0.0, multi=1e6, p_tail=1e-4, tail=0.15, significands=EVEN)
    layers = [(1.0, law)] * 16
    ranges = [FX.central(law, 1.0)] * 16
    allowed, chance = FX.allowed_misses(layers, ranges, 1.0)
    assert allowed == 3
    assert chance == pytest.approx(B.binomial_below(3, 16, 0.1), abs=1e-6)


def _run(node: int, records: pd.DataFrame, profile_suffix: str = "-flip"):
    return SimpleNamespace(config={"suspect": {"profile": f"paper-node-{node}{profile_suffix}"}},
                           faults=records)


def test_flip_runs_get_the_laws_rows_and_the_bulk_nodes_maxima_are_judged():
    """A flip-model run's exposure rows come from the law, also where the run recorded nothing
    (node 13's bulk-only bwd/ffn: 80,000 one-flip units put the maximum near 0.5, Table 2 says
    0.316: fail); an additive run is not a flip run."""
    empty = pd.DataFrame(columns=["site", "kind", "original", "corrupted"])
    (row,) = X.rows(13, _run(13, empty))
    assert row.reason.startswith("flip model") and row.verdict == "fail"
    assert row.ours == pytest.approx(0.5, rel=0.01)
    (layer,) = X.layer_rows(13, _run(13, empty))
    assert layer.source == "Table 9" and layer.verdict == "fail" and X.is_exposure_row(layer)
    assert not FX.is_flip_run(_run(13, empty, "")) and not FX.is_flip_run(None)


def test_failing_flip_rows_are_explained_by_the_flip_law_not_the_additive_tail():
    """A flip Table 2 row failing with the paper's maximum below the law (ours above it) is the
    bit law's heavy bulk; above the law, too little A / t tail; the same row of an additive run
    keeps the additive model's finding."""
    from sdcstudy.reproduce import findings as F

    def row(ours, published):
        return Row(5, "Table 2", "bwd/ffn" + X.SUFFIX, published, ours, ours / published,
                   B.interval(ours / 2, ours * 2), "fail", FX.FLIP_REASON + " 1e6 units")

    heavy, light = row(0.49, 0.0908), row(0.3, 40.0)
    F.explain([heavy, light], {"fault_model": "flip"}, None)
    assert "bit law is too heavy" in heavy.why and "6.3" in heavy.why
    assert "more accumulator errors" in light.why
    additive = row(0.49, 0.0908)
    F.explain([additive], {"fault_model": "additive"}, None)
    assert additive.why.startswith("docs/faults.md 5.3")
