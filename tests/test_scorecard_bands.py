"""The scorecard's bands state the probability that a correct model passes them, and the bands of
Tables 2/8/9 at the paper's exposure hold the scatter of the paper's own single maximum; Figure
10's rows at the paper's sizes tell sampling noise apart. Pure Python and numpy: no JAX."""

import math

import numpy as np
import pytest

from sdcstudy.faults import flip_model as FM
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import figure10_paper as F10


def _maxima_over_units(c: float, units: int, draws: int, seed: int = 0) -> np.ndarray:
    """Maxima over `units` unit severities S with P(S > t) = c / t (S = c / uniform): the tail
    both fault models give a unit's severity (docs/faults.md 6.3), drawn unit by unit."""
    rng = np.random.default_rng(seed)
    return (c / rng.uniform(size=(draws, units))).max(axis=1)


def test_the_scatter_of_one_maximum_is_the_tails_own():
    """Table 2 is one draw of a maximum over many units of a 1/t tail: its central 90% lies
    within 0.23x to 13.5x of its median (docs/faults.md 6.3 quotes these), and maxima drawn
    unit by unit show it. If this failed, the band would widen by a scatter the fault model
    does not give."""
    lo, hi = X.maximum_scatter()
    assert (round(lo, 2), round(hi, 1)) == (0.23, 13.5)
    maxima = _maxima_over_units(c=0.01, units=2000, draws=4000)
    ratio = maxima / np.median(maxima)
    assert np.quantile(ratio, [0.05, 0.95]) == pytest.approx([lo, hi], rel=0.15)
    assert np.mean(ratio <= 2.0) == pytest.approx(X.maximum_cdf(2.0), abs=0.02)


def test_a_correct_model_passes_the_exposure_band_nine_times_in_ten():
    """The band [Table 2 lo, Table 2 hi] of `band_factors`: a model whose median is right
    (within our estimate's measured spread either way) passes with the stated probability,
    at least 90%, checked by drawing the paper's maximum; the old band (the spread alone)
    passed it 36% of the time. If this failed, a row's P(pass) would not be what its band
    gives."""
    lo, hi = X.band_factors()
    stated = X.pass_probability(lo, hi)
    assert stated >= X.SCATTER_LEVEL
    maxima = _maxima_over_units(c=0.01, units=2000, draws=4000, seed=1)
    median = 0.01 * 2000 / math.log(2)  # the law's median, which a correct model predicts
    passed = [np.mean((e * median >= lo * maxima) & (e * median <= hi * maxima))
              for e in (1 / X.EXPOSURE_SPREAD, 1.0, X.EXPOSURE_SPREAD)]
    assert min(passed) == pytest.approx(stated, abs=0.02)
    old = 1 / X.EXPOSURE_SPREAD, X.EXPOSURE_SPREAD
    assert X.pass_probability(*old, spread=1.0) == pytest.approx(0.357, abs=0.001)


def _row(monkeypatch, times_table2: float):
    """Node 1's bwd/attn row at the paper's exposure when our fitted tail predicts
    `times_table2` times Table 2."""
    units = FM.layer_fit(1, "bwd/attn")["units"]
    c = times_table2 * 7392 * math.log(2) / units
    monkeypatch.setattr(X, "tail_fit", lambda run, site: (c, 100, 1000))
    (row,) = [r for r in X.rows(1, run=None) if r.quantity.startswith("bwd/attn")]
    return row


@pytest.mark.parametrize("times, verdict", [(5.0, "pass"), (0.06, "pass"), (10.0, "fail"),
                                            (0.03, "fail")])
def test_exposure_rows_widen_by_the_papers_scatter_and_state_their_chance(monkeypatch, times,
                                                                           verdict):
    """5x or 1/17 of Table 2 is inside the paper's own scatter (with our spread): pass;
    10x or 1/33 is outside: fail. Every such row states its pass probability. If this failed,
    the row would judge one draw of the paper's maximum as if it were its median."""
    row = _row(monkeypatch, times)
    assert row.verdict == verdict and row.ratio == pytest.approx(times)
    assert row.pass_probability == pytest.approx(X.pass_probability(*X.band_factors()))
    assert "13.5x of its median" in row.reason


def test_tables_8_9_rows_state_how_rarely_a_correct_model_fails_them():
    """A layer's median against [min / 1.4, max x 1.4] of 16 draws of it fails a correct model
    almost never: the row says so (the probability is the law's). If this failed, the stated
    probability would not follow from 16 draws."""
    p = X.layer_pass_probability()
    assert 0.9999 < p < 1
    rng = np.random.default_rng(2)
    draws = 1 / -np.log(rng.uniform(size=(200_000, 16))) * math.log(2)  # max / median
    s = X.LAYER_EXPOSURE_SPREAD
    fails = np.mean((draws.min(axis=1) / s > s) | (draws.max(axis=1) * s < s))
    assert fails == pytest.approx(1 - X.layer_pass_probability(spread=s), abs=3e-5)


@pytest.mark.parametrize("expected, entry", [(100.0, {}), (40.0, {}),
                                             (400.0, {"active_steps": 40, "steps": 200})])
def test_frequency_rows_state_the_chance_their_count_falls_in_the_band(expected, entry):
    """Table 1's +-25% band passes a correct model with the probability its count lands there:
    Poisson, or Poisson given binomial bursts, checked by drawing counts. If this failed, a
    frequency row's P(pass) would be wrong (a bursty profile's far lower than a Poisson one's)."""
    rng = np.random.default_rng(3)
    if entry:
        bursts = rng.binomial(entry["steps"], entry["active_steps"] / entry["steps"], 200_000)
        counts = rng.poisson(bursts * expected / entry["active_steps"])
    else:
        counts = rng.poisson(expected, 200_000)
    inside = np.mean((counts >= 0.75 * expected) & (counts <= 1.25 * expected))
    assert B.count_pass_probability(expected, entry) == pytest.approx(inside, abs=0.005)


def _entry(node, flagged_draws, share, active=1.0, analytic=None, checks=16):
    """One `abft_paper_scale.measure` entry at tp 32 with `flagged_draws` of `checks` draws."""
    return {"shape": "paper tp 32", "m": 4096, "k": 128, "n": 4096, "node": node,
            "placement": "o_proj", "checks": checks, "active": active, "fault_share": share,
            "o_faults": share, "context_faults": 0.0, "single_fault_ratio": 1.76,
            "sparse_prediction": analytic,
            "flagged_active_paper": share * flagged_draws / checks,
            "flagged_paper": active * share * flagged_draws / checks}


def test_figure10_paper_rows_leave_sampling_noise_to_the_analytic_estimate():
    """Node 4 at tp 32 in the committed measurement: 3 of 16 draws flag, 0.0116 of the checks
    against a 1% band, a count the band's edge (0.162 a draw) reaches 49% of the time; the
    analytic 0.00644 judges it (pass) and the row says how many draws would decide. 16 of 16
    flags are decided by the draws (fail), and so is a count far below the edge. If this failed,
    a Figure 10 verdict at the paper's sizes would be sampling noise."""
    noisy = _entry(4, 3, 0.0616, analytic=0.00644)
    (row,) = F10.rows([noisy])
    assert not F10.decided(noisy) and row.verdict == "pass" and row.ours == 0.00644
    needed = F10.draws_to_decide(0.00644 / 0.0616, F10.edge_probability(noisy))
    assert "sampling noise" in row.reason and f"about {needed} draws" in row.reason
    assert 150 < needed < 220  # z^2 p (1 - p) / (edge - p)^2 with p 0.105, edge 0.162
    loud = _entry(4, 16, 0.0616, analytic=0.00644)
    (row,) = F10.rows([loud])
    assert F10.decided(loud) and row.verdict == "fail" and row.ours == pytest.approx(0.0616)
    quiet = _entry(4, 0, 1.0, analytic=0.5, checks=600)  # 0 of 600 at a 1% edge: decided
    assert F10.decided(quiet) and F10.rows([quiet])[0].verdict == "pass"


def test_draws_to_decide_never_asks_fewer_than_decide_a_count_of_none():
    """At a rate of 0 the normal approximation asks for 1 draw; a count of none decides only
    when (1 - edge)^n < DECIDE_LEVEL / 2. The draws asked for decide a zero count and one
    fewer do not (likewise every draw flagged above the edge). If this failed, a row would
    say that fewer draws than it already has would decide it."""
    edge = F10.edge_probability(_entry(4, 0, 0.0616))  # 0.162
    for p, flagged in ((0.0, lambda n: 0), (1.0, lambda n: n)):
        needed = F10.draws_to_decide(p, edge)
        assert needed > 1
        for n, decides in ((needed, True), (needed - 1, False)):
            assert F10.decided(_entry(4, flagged(n), 0.0616, checks=n)) == decides


def test_figure10_paper_rows_explain_each_failure_with_its_own_numbers():
    """A failing row's why names its node, shape and what the other placements measured there
    (node 1: none inside the attention); node 14's names the share its bursts leave on.
    If this failed, one sentence would stand for rows whose causes differ."""
    entries = [_entry(1, 16, 1.0), dict(_entry(1, 0, 1.0), placement="inside"),
               _entry(14, 6, 1.0, active=0.00025)]
    rows = F10.explain(F10.rows(entries), entries)
    whys = {r.node: r.why for r in rows}
    assert "of node 1" in whys[1] and "inside the attention (its context) this node flags 0 " \
        "of the checks at paper tp 32" in whys[1]
    assert "in bursts on 0.00025 of the run, flags 9.38e-05 of the checks at paper tp 32" in \
        whys[14]


def test_layer_frequency_rows_state_the_chance_of_a_layer_at_table_1s_rate():
    """Tables 6-7: a layer at Table 1's rate passes [min x 0.75, max x 1.25] of the paper's 16
    layers with its count's probability of landing there: node 1 bwd/attn (Table 7 spans
    1.4e-4 to 3.0e-4 around Table 1's 2.2e-4) at 1,000 expected mismatches a layer passes
    almost surely, at 10 less often (0.97). If this failed, a layer row's P(pass) would not be
    its count's."""
    from sdcstudy.reproduce import mismatch_rows as M

    paper = (1.0e-4, 3.0e-4)
    entry = {"active_steps": None, "steps": 200}
    site = {"mismatches": 2000.0, "scale": 1.0}
    row = M._layer_row(1, "Table 7", "bwd/attn", 1, "freq", paper, 1.6e-4, 1000, site, 2, entry)
    table1 = 1.56e-4  # Table 1, node 1, bwd/attn
    assert row.pass_probability == pytest.approx(B.count_between(
        1000 * 0.75e-4 / table1, 1000 * 3.75e-4 / table1, 1000, entry))
    assert row.pass_probability > 0.999
    few = M._layer_row(1, "Table 7", "bwd/attn", 1, "freq", paper, 1.6e-4, 10,
                       dict(site, mismatches=20.0), 2, entry)
    assert few.pass_probability < 0.99 < row.pass_probability
