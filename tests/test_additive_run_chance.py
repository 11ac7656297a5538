"""The chance that a correct additive model passes Table 2 and Tables 8-9 at the run's exposure
(`reproduce.additive_run_chance`): its bounds against simulated maxima of the law they stand
for, under bulks at both extremes; the closed form of two Frechet laws where no maximum can
lie in the bulk; and the rows of a hand-made run. Imports no JAX."""

import numpy as np
import pandas as pd
import pytest
from types import SimpleNamespace

from sdcstudy.reproduce import additive_run_chance as A
from sdcstudy.reproduce import flip_exposure as FX
from sdcstudy.reproduce import pass_chance as PC
from sdcstudy.reproduce.bands import Row

SIMULATED = 200_000
TOLERANCE = 0.005  # five standard errors of a share over SIMULATED draws, at most
# (1 - c / t)^U, the exact law of a maximum over U units, against exp(-c U / t), the Frechet
# law the closed form takes: O(c / (t U)) apart where the maximum lies, under 1% from 50 units
FRECHET = 0.01
BULKS = ("the law's own", "all at 0", "all at the floor")


def _maxima(rng, c: float, units: int, draws: int, bulk: str) -> np.ndarray:
    """Maxima over `units` units of the tail P(S > t) = c / t (S = c / V, V uniform: c over
    the least of `units` uniforms, a Beta(1, units) draw); those below the floor moved to one
    end of the bulk, or left as the law has them."""
    m = c / rng.beta(1.0, units, size=draws)
    if bulk == "all at 0":
        return np.where(m < A.FLOOR, 0.0, m)
    if bulk == "all at the floor":
        return np.where(m < A.FLOOR, A.FLOOR * (1 - 1e-9), m)
    return m


def _frechet(paper_over_ours: float, factor: float = 3.0) -> float:
    """P(1 / factor <= M_ours / M_paper <= factor) of two Frechet maxima c U / E: E_paper / E_ours
    has P(<= r) = r / (1 + r)."""
    r = paper_over_ours
    return factor * r / (1 + factor * r) - r / (factor + r)


@pytest.mark.parametrize("c, ours, paper", [(0.3, 2, 3), (0.45, 1, 20), (0.2, 5, 5)])
@pytest.mark.parametrize("bulk", BULKS)
def test_table2_bounds_hold_simulated_maxima_whatever_the_bulk(c, ours, paper, bulk):
    rng = np.random.default_rng(11)
    mine, theirs = (_maxima(rng, c, u, SIMULATED, bulk) for u in (ours, paper))
    share = float(np.mean((mine >= theirs / 3) & (mine <= theirs * 3)))
    low, high = A.chance_bounds(A.TailMaximum(c, ours), [A.TailMaximum(c, paper)])
    assert low - TOLERANCE <= share <= high + TOLERANCE, (low, share, high)


def test_the_bulk_widens_the_bounds_and_moves_the_share_between_them():
    """Few units put maxima in the bulk: the two extreme bulks give shares that differ by more
    than the tolerance, so bounds narrower than their spread would fail the test above."""
    rng = np.random.default_rng(12)
    shares = []
    for bulk in BULKS[1:]:
        mine, theirs = (_maxima(rng, 0.3, u, SIMULATED, bulk) for u in (2, 3))
        shares.append(float(np.mean((mine >= theirs / 3) & (mine <= theirs * 3))))
    assert abs(shares[0] - shares[1]) > 10 * TOLERANCE
    low, high = A.chance_bounds(A.TailMaximum(0.3, 2), [A.TailMaximum(0.3, 3)])
    assert high - low > abs(shares[0] - shares[1]) - 2 * TOLERANCE


@pytest.mark.parametrize("bulk", BULKS)
def test_layer_bounds_hold_simulated_layer_ranges(bulk):
    """16 paper layers, one without mismatches (a maximum of 0), ours over a few units."""
    rng = np.random.default_rng(13)
    draws = SIMULATED // 4
    units = [3] * 7 + [8] * 8
    layers = np.column_stack([_maxima(rng, 0.3, u, draws, bulk) for u in units]
                             + [np.zeros(draws)])
    mine = _maxima(rng, 0.3, 2, draws, bulk)
    inside = (mine >= layers.min(axis=1) / 3) & (mine <= layers.max(axis=1) * 3)
    low, high = A.chance_bounds(A.TailMaximum(0.3, 2),
                                [A.TailMaximum(0.3, u) for u in units] + [None])
    assert low - 2 * TOLERANCE <= float(inside.mean()) <= high + 2 * TOLERANCE


@pytest.mark.parametrize("ours, paper", [(50, 500), (400, 9e6), (100, 100)])
def test_without_a_bulk_the_bounds_meet_the_frechet_closed_form(ours, paper):
    """c U far above the floor on both sides: the bounds part by the sum's steps alone and hold
    3r / (1 + 3r) - r / (3 + r), whatever c, within `FRECHET`; a paper over 10^4 times our
    units almost never lets ours pass."""
    for c in (0.15, 0.4):
        low, high = A.chance_bounds(A.TailMaximum(c, ours), [A.TailMaximum(c, paper)])
        exact = _frechet(paper / ours)
        assert low <= exact * (1 + FRECHET) and high >= exact * (1 - FRECHET)
        assert high - low < 0.005 * exact
    assert A.chance_bounds(A.TailMaximum(0.3, 400), [A.TailMaximum(0.3, 9e6)])[1] < 2e-4


def _run(units: int = 40, severity: float = 5.0, above: int = 8, site: str = "fwd/attn"):
    """A lock-step run's rollup at `site`: `units` units over 20 (step, microstep) groups,
    `above` of whose maxima are `severity` (the rest 0.1), in two layers."""
    groups = 20
    index = pd.MultiIndex.from_tuples([(site, s, 0) for s in range(groups)],
                                      names=["site", "step", "microstep"])
    micro = pd.DataFrame({"units": [units // groups] * groups,
                          "severity": [severity] * above + [0.1] * (groups - above)},
                         index=index)
    layer_index = pd.MultiIndex.from_tuples([(1, site), (2, site)],
                                            names=["layer", "site"])
    by_layer = pd.DataFrame({"units": [units // 2] * 2}, index=layer_index)
    return SimpleNamespace(config={"suspect": {"profile": "paper-node-1"}},
                           mismatch_rollup=SimpleNamespace(by_microstep=micro, by_layer=by_layer))


def test_a_runs_rows_state_the_chance_of_its_fit_and_none_where_c_is_unmeasured():
    site = Row(1, "Table 2", "fwd/attn", 99.0, 5.0, 0.05, "[33, 297]", "fail", "")
    layer = Row(1, "Table 8", "fwd/attn layer 2", "[1.04, 99] over 16 layers", 5.0, None,
                "[0.347, 297]", "pass", "")
    for row in (site, layer):
        chance = PC.raw_maximum_chance(row, _run())
        assert chance is not None and 0.0 < chance[0] < 0.05
    # our maxima over ten times the units: the paper's outnumber ours less, the chance is larger
    assert PC.raw_maximum_chance(layer, _run(units=400))[0] > PC.raw_maximum_chance(
        layer, _run())[0]
    # no (step, microstep) maximum above the floor: c is not measured, no chance is stated,
    # and the row is told why
    assert PC.raw_maximum_chance(site, _run(severity=0.3)) == A.C_UNMEASURED
    # a site, or a layer, without units in the run: that is the why, not c
    assert PC.raw_maximum_chance(Row(1, "Table 2", "bwd/ffn", 3.88, None, None, "-", "fail",
                                     ""), _run()) == FX.no_units_here("bwd/ffn")
    empty_layer = Row(1, "Table 8", "fwd/attn layer 5", "-", 0.0, None, "-", "fail", "")
    assert PC.raw_maximum_chance(empty_layer, _run()) == FX.no_units_here("fwd/attn layer 5")
    # the paper's side without units: node 14's Table 6 gives fwd/ffn 0 in every layer, node
    # 3 has no row there
    for node, words in ((14, "Table 6 gives fwd/ffn a frequency of 0 in every layer"),
                        (3, "Table 6 has no row for node 3")):
        why = PC.raw_maximum_chance(Row(node, "Table 2", "fwd/ffn", 1.0, 5.0, None, "-",
                                        "fail", ""), _run(site="fwd/ffn"))
        assert why.startswith(words)


def test_a_row_without_a_chance_says_the_runs_own_why_once():
    """`pass_chance.annotate` writes the why read from the run into the row's reason, and
    `say_why_none` does not add a second."""
    row = Row(1, "Table 2", "bwd/ffn", 3.88, None, None, "[1.29, 11.6]", "fail", "measured")
    PC.annotate([row], {}, _run())
    PC.say_why_none([row])
    assert row.pass_probability is None
    assert row.reason == f"measured{PC.NO_CHANCE}{FX.no_units_here('bwd/ffn')}"
