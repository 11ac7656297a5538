"""The chance a correct flip model passes Table 2 and Tables 8-9 at the run's own exposure
(sdcstudy/reproduce/flip_run_chance.py): the sums against simulated maxima of the same laws,
the Poisson one-hit share, and the rows of a flip run that get a chance and those that do not.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from sdcstudy.faults import published_layers as PL
from sdcstudy.reproduce import flip_exposure as FX
from sdcstudy.reproduce import flip_run_chance as FRC
from sdcstudy.reproduce import pass_chance as PC
from sdcstudy.reproduce.bands import Row

DRAWS = 2000


def law(single: float, multi: float = 0.0, p_tail: float = 0.0, tail: float = 0.0):
    return FX.MaximumLaw(single, multi, p_tail, tail, np.array([]))


def draws(of: FX.MaximumLaw, rng, n: int = DRAWS, scale: float = 1.0) -> np.ndarray:
    """Maxima drawn from the law by inverting its distribution function."""
    return np.array([of.quantile(u, scale) for u in rng.uniform(1e-9, 1 - 1e-9, n)])


def within_sampling(chance: float, hits: int, n: int = DRAWS) -> bool:
    """The simulated share within 4 standard errors of the chance (a 1-in-15,000 miss)."""
    return abs(hits / n - chance) <= 4 * math.sqrt(chance * (1 - chance) / n) + 1 / n


@pytest.mark.parametrize("ours, paper", [
    (law(3), law(50)),  # the bulk alone: the largest flip of 3 units against 50's
    (law(2, 40, p_tail=0.02, tail=0.3), law(20, 400, p_tail=0.02, tail=0.3)),  # with a tail
])
def test_table2_chance_is_the_share_of_simulated_maxima_that_pass(ours, paper):
    rng = np.random.default_rng(1)
    mine, theirs = draws(ours, rng), draws(paper, rng)
    passed = int(np.sum((theirs / 3 <= mine) & (mine <= 3 * theirs)))
    chance = FRC.table2_chance(ours, paper, spread=1.0)
    assert 0.05 < chance < 0.98  # neither sure nor hopeless: the comparison can fail
    assert within_sampling(chance, passed), (chance, passed / DRAWS)


def test_layers_chance_is_the_share_of_simulated_layer_ranges_that_pass():
    """Four paper layers, one without mismatches (its maximum 0, the range's low end 0)."""
    rng = np.random.default_rng(2)
    ours = law(2, 30, p_tail=0.05, tail=0.2)
    layers = [law(5), law(40, 200, p_tail=0.05, tail=0.2), None, law(1)]
    mine = draws(ours, rng)
    theirs = np.stack([np.zeros(DRAWS) if lw is None else draws(lw, rng) for lw in layers])
    passed = int(np.sum((theirs.min(axis=0) / 3 <= mine) & (mine <= 3 * theirs.max(axis=0))))
    chance = FRC.layers_chance(ours, layers, spread=1.0)
    assert 0.05 < chance < 0.999
    assert within_sampling(chance, passed), (chance, passed / DRAWS)
    # without the empty layer, the low end is a real maximum: fewer pass
    assert FRC.layers_chance(ours, [layers[0], layers[1], layers[3]], 1.0) < chance


def test_the_chance_is_the_least_over_the_tails_range():
    ours, paper = law(2, 40, p_tail=0.02, tail=0.3), law(100, 5000, p_tail=0.02, tail=0.3)
    each = [FRC.table2_chance(FX.MaximumLaw(2, 40, 0.02, 0.3 * e, np.array([])),
                              FX.MaximumLaw(100, 5000, 0.02, 0.3 * e, np.array([])), 1.0)
            for e in (1 / 2, 1.0, 2)]
    assert FRC.table2_chance(ours, paper, spread=2.0) == pytest.approx(min(each), abs=1e-12)


@pytest.mark.parametrize("lam", [1e-3, 0.5, 2.0, 8.0])
def test_one_hit_units_inverts_the_zero_truncated_poisson_mean(lam):
    units = 1000.0
    hits = units * lam / -math.expm1(-lam)
    expected = units * lam * math.exp(-lam) / -math.expm1(-lam)
    assert FRC.one_hit_units(units, hits) == pytest.approx(expected, rel=1e-6)
    assert FRC.one_hit_units(units, units) == units and FRC.one_hit_units(0, 0) == 0


def _flip_run(additive_above: int, units: int = 40, hits: int = 400):
    """A lock-step run of node 1 under the flip model: `units` units with a mismatch at
    fwd/ffn (half in each of two layers), 200 recorded flips and 100 accumulator errors,
    `additive_above` of them above the tail fit's floor."""
    rng = np.random.default_rng(3)
    original = rng.uniform(0.5, 4.0, 300)
    relative = np.concatenate([rng.uniform(0.0, 0.4, 200),
                               np.full(additive_above, 5.0),
                               rng.uniform(0.0, 0.5, 100 - additive_above)])
    faults = pd.DataFrame({"site": "fwd/ffn", "kind": ["bitflip"] * 200 + ["additive"] * 100,
                           "original": original, "corrupted": original * (1 + relative)})
    index = pd.MultiIndex.from_tuples([(1, "fwd/ffn"), (2, "fwd/ffn")], names=["layer", "site"])
    by_layer = pd.DataFrame({"units": [units // 2] * 2, "mismatches": [hits // 2] * 2},
                            index=index)
    return SimpleNamespace(config={"suspect": {"profile": "paper-node-1-flip"}}, faults=faults,
                           mismatch_rollup=SimpleNamespace(by_layer=by_layer))


def test_a_flip_runs_raw_rows_get_a_chance_where_its_tail_is_measured():
    run = _flip_run(additive_above=8)
    site = Row(1, "Table 2", "fwd/ffn", 1.0, 1.0, 1.0, "[0.333, 3]", "pass", "")
    layer = Row(1, "Table 8", "fwd/ffn layer 2", "x", 1.0, None, "[0, 3]", "pass", "")
    for row in (site, layer):
        chance = PC.raw_maximum_chance(row, run)
        assert chance is not None and 0.0 <= chance[0] <= 1.0 and chance[1] is None
    assert FRC.raw_chance(layer, run) != FRC.raw_chance(
        Row(1, "Table 8", "fwd/ffn layer 2", "x", 1.0, None, "[0, 3]", "pass", ""),
        _flip_run(additive_above=8, units=400, hits=4000))  # ours over more units: another law
    # a site the run has no units at
    assert PC.raw_maximum_chance(Row(1, "Table 2", "bwd/ffn", 1.0, 1.0, 1.0, "-", "pass", ""),
                                 run) == FX.no_units_here("bwd/ffn")
    # the paper's side: node 14's Table 2 gives fwd/ffn no severity, its Table 6 no mismatches
    assert PC.raw_maximum_chance(Row(14, "Table 2", "fwd/ffn", 0.0, 1.0, None, "-", "fail", ""),
                                 run).startswith("Table 2 gives fwd/ffn a largest severity of 0:")
    assert PC.raw_maximum_chance(Row(14, "Table 8", "fwd/ffn layer 2", "x", 1.0, None, "-",
                                     "fail", ""), run) == FX.no_paper_units(14, "fwd/ffn")


@pytest.mark.parametrize("above", [2, 0])
def test_too_few_accumulator_errors_state_the_range_over_a_wide_tail(above):
    """Below `MIN_TAIL_HITS` above the floor, A is taken over its Poisson range (0 to its
    upper end where none lies above): the row states the least and the greatest chance, and
    the chance at an A inside the range lies between them."""
    run = _flip_run(additive_above=above)
    site = Row(1, "Table 2", "fwd/ffn", 1.0, 1.0, 1.0, "[0.333, 3]", "pass", "")
    low, high = FRC.raw_chance(site, run)
    assert 0.0 <= low < high <= 1.0
    records, values = FX.run_records(run)
    tail, scales, rare = FRC.tail_range(FX.site_tail(1, "fwd/ffn", records, values), records)
    spread = FX.count_spread(above) if above else None
    assert rare and scales == ((1 / spread, 1.0, spread) if above else (0.0, 0.5, 1.0))
    ours = FRC.run_law(tail, 40.0, 400.0)  # the run's units and hits at the site
    freqs = PL.layer_values(PL.tables_for("fwd/ffn")[0], 1, "fwd/ffn")
    middle = FRC.table2_chances(ours, tail.law(freqs), [(scales[0] + scales[1]) / 2])[0]
    assert low <= middle <= high


def test_a_run_without_accumulator_errors_takes_their_share_from_0_to_1():
    run = _flip_run(additive_above=0)
    records, values = FX.run_records(run.__class__(**{**vars(run), "faults": run.faults[
        run.faults["kind"] == "bitflip"]}))
    tail, scales, rare = FRC.tail_range(FX.site_tail(1, "fwd/ffn", records, values), records)
    assert rare and tail.tail == FX.HIT_FLOOR and scales == (0.0, 0.5, 1.0)
