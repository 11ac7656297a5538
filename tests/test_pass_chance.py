"""The chance that a correct model passes a scorecard row (`reproduce.pass_chance`): each closed
form against a simulation of the law it stands for, within a named tolerance, and each rule on
hand-made entries and rows. Imports no JAX."""

import math
import subprocess
import sys

import numpy as np
import pytest

from sdcstudy.faults.time_patterns import node_pattern
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import pass_chance as PC
from sdcstudy.reproduce import scorecard as S
from sdcstudy.reproduce.bands import Row
from sdcstudy.reproduce.plan import PAPER_STEPS


def test_lower_bound_is_clopper_pearsons():
    assert PC.lower_bound(400, 400) == pytest.approx(0.05 ** (1 / 400), rel=1e-9)
    assert PC.lower_bound(0, 400) == 0.0
    p = PC.lower_bound(30, 100)
    assert 1 - B.binomial_below(29, 100, p) == pytest.approx(0.05, rel=1e-6)


def test_at_most_steps_is_the_binomial_when_every_step_is_alike():
    for k in (0, 2, 5):
        assert PC.at_most_steps(np.full(200, 0.01), k) == pytest.approx(
            B.binomial_below(k, 200, 0.01), rel=1e-9)


def _entry(node: int, mismatches: float, steps: int = 200, site: str = "fwd/attn") -> dict:
    pattern = node_pattern(node)
    scale = pattern.mean_multiplier(steps) / pattern.mean_multiplier(PAPER_STEPS)
    return {"steps": steps, "sites": {site: {"mismatches": mismatches, "scale": scale}}}


def test_the_initial_spike_test_passes_a_spiking_profile_and_not_a_silent_one():
    assert PC.figure_test_chance(10, _entry(10, 1e5)) > 0.99
    assert PC.figure_test_chance(10, _entry(10, 0.0)) == 0.0


def test_the_over_dispersion_test_needs_bursts_that_fire():
    assert PC.figure_test_chance(7, _entry(7, 5e3)) > 0.99
    # node 14 fires in one step of 4000: in 200 steps it is mostly silent ("no events")
    assert PC.figure_test_chance(14, _entry(14, 5e3)) < 0.1


def test_a_profile_whose_time_pattern_is_not_the_nodes_states_no_chance():
    entry = _entry(10, 1e5)
    entry["sites"]["fwd/attn"]["scale"] = 1.0  # a constant pattern, not node 10's spike
    assert PC.figure_test_chance(10, entry) is None


def test_figure10_little_is_certain_without_attention_faults_and_hopeless_with_many():
    assert PC.figure10_little_chance(4, _entry(4, 1.0, site="fwd/ffn")) == 1.0
    assert PC.figure10_little_chance(1, _entry(1, 1e4)) < 1e-6
    rare = PC.figure10_little_chance(1, _entry(1, 0.5))
    assert rare == pytest.approx(B.binomial_below(2, 200, -math.expm1(-0.5 / 200)), rel=1e-9)


def test_at_least_steps_is_the_binomial_tail_even_where_it_is_tiny():
    """P(at least k of 200 alike steps) against 1 - P(at most k - 1), and far out in the tail
    (where that difference is 0 in floats) against the leading term C(200, k) p^k, within 1%.
    If this failed, node 14's Figure 10 bound would be lost to rounding."""
    for k in (0, 1, 5):
        assert PC.at_least_steps(np.full(200, 0.01), k) == pytest.approx(
            1 - B.binomial_below(k - 1, 200, 0.01) if k else 1.0, rel=1e-9)
    p = 1e-6
    assert PC.at_least_steps(np.full(200, p), 20) == pytest.approx(
        math.comb(200, 20) * p ** 20, rel=0.01)


def test_figure10_frequent_is_bounded_by_the_steps_that_hold_a_fault():
    """Node 14 ("frequently", at least 10% of steps flagged): at most the chance that 20 of 200
    steps hold an attention fault: none without attention faults, all but certain with many,
    all but impossible at its bursts (one step in 4,000 on). `annotate` states it as 0 to that."""
    assert PC.figure10_frequent_bound(14, _entry(14, 1.0, site="fwd/ffn")) == 0.0
    assert PC.figure10_frequent_bound(1, _entry(1, 1e4)) > 1 - 1e-9
    assert PC.figure10_frequent_bound(14, _entry(14, 5.0)) < 1e-30
    row = Row(14, "Figure 10", "fwd o flagged steps", "frequently", 0.0, None,
              ">= 10% of steps flagged", "fail")
    PC.annotate([row], _entry(14, 5.0), run=None)
    assert row.pass_probability == 0.0 and row.pass_probability_max < 1e-30
    assert S.chance_cell(row).startswith("0 to ")


def _row(source, quantity, verdict, chance=None, node=10, band="-"):
    return Row(node, source, quantity, 1.0, 1.0, 1.0, band, verdict, pass_probability=chance)


def test_d3_chance_is_at_least_both_rows_passing():
    rows = [_row("Table 1", "fwd/attn", "pass", 0.99),
            _row("Table 2", "fwd/attn" + X.SUFFIX, "fail", 0.93)]
    d3 = _row("Appendix D.3", "x", "fail")
    assert PC.d3_chance(d3, rows) == pytest.approx(0.92)
    assert PC.d3_chance(d3, rows[:1]) is None


def test_fixed_bands_and_c2_state_their_chance():
    entry = _entry(4, 1.0)
    assert PC.row_chance(_row("Table 1", "fwd/ffn", "pass", band=B.ZERO_BAND), entry,
                         None) == 1.0
    assert PC.row_chance(_row("Appendix C.2", "fwd/attn", "pass"), entry, None) == 0.999


def test_chance_words_count_the_rows_a_correct_model_rarely_passes():
    rows = [_row("Table 2", "a", "fail", 1e-4), _row("Table 2", "b", "pass", 1e-4),
            _row("Table 1", "c", "pass", 0.99), _row("Figure 5", "d", "fail"),
            _row("Table 1", "e", B.TOO_RARE, 0.5)]
    words = S.chance_words(rows)
    assert "Of the 4 judged rows, 3 state" in words
    assert "1 failing and 1 passing rows" in words


def test_the_scorer_imports_no_jax_with_the_time_patterns():
    code = ("import sys; import sdcstudy.reproduce.pass_chance, sdcstudy.reproduce.scorecard; "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def _abft_run(fault_steps, flagged_steps, steps: int = 200):
    """A run's rollups: one fwd/attn fault in each of `fault_steps`, one at fwd/ffn in step 1
    (not an attention-output fault), and ABFT's fwd o checks flagging in `flagged_steps`."""
    import pandas as pd
    from types import SimpleNamespace

    keys = [(s, "fwd/attn", "bitflip", False) for s in fault_steps] + [
        (1, "fwd/ffn", "bitflip", False)]
    faults = pd.DataFrame({"faults": [1] * len(keys)}, index=pd.MultiIndex.from_tuples(
        keys, names=["step", "site", "kind", "last_bit"]))
    checks = [(s, m, "fwd") for s in range(1, steps + 1) for m in ("o", "down")]
    abft = pd.DataFrame({"checks": 4, "flagged": [int(m == "o" and s in flagged_steps)
                                                 for s, m, _ in checks]},
                        index=pd.MultiIndex.from_tuples(checks,
                                                        names=["step", "matmul", "direction"]))
    return SimpleNamespace(fault_counts=faults, abft_by_step=abft)


def test_figure10_little_upper_bound_takes_the_flagged_share_of_fault_steps():
    """The share of fault steps flagged (4 of 4: q at least 0.05^(1/4) at 95%) scales each
    step's fault probability; every step alike, the bound is the binomial's. A flag outside a
    fault step (a false alarm) does not raise q; none flagged gives q = 0, a bound of 1; the
    lower bound stays below the upper, and `annotate` states both."""
    entry = _entry(1, 0.5)
    run = _abft_run([3, 10, 50, 90], {3, 10, 50, 90, 120})
    q = 0.05 ** (1 / 4)
    assert PC.flagged_share_low(run) == pytest.approx(q, rel=1e-9)
    p_step = -math.expm1(-0.5 / 200)
    upper = PC.figure10_little_bound(1, entry, run)
    assert upper == pytest.approx(B.binomial_below(2, 200, q * p_step), rel=1e-9)
    assert PC.figure10_little_chance(1, entry) < upper < 1
    assert PC.flagged_share_low(_abft_run([3, 10], {3})) == pytest.approx(
        PC.lower_bound(1, 2), rel=1e-12)
    assert PC.figure10_little_bound(1, entry, _abft_run([3, 10], set())) == 1.0
    assert PC.flagged_share_low(_abft_run([], {5})) is None
    row = Row(1, "Figure 10", "fwd o flagged steps", "little or nothing", 0.02, None,
              "<= 1% of steps flagged", "fail")
    PC.annotate([row], entry, run)
    assert row.pass_probability == PC.figure10_little_chance(1, entry)
    assert row.pass_probability_max == upper


def test_a_judged_row_with_no_chance_says_why_in_its_reason():
    """`say_why_none`: each judged row whose chance is None ends its reason with why; a row
    with a chance, and one not run, keep theirs."""
    def row(source, quantity, verdict="fail", chance=None):
        return Row(8, source, quantity, 1.0, 2.0, 2.0, "[1, 3]", verdict, "measured",
                   pass_probability=chance)

    rows = [row("Table 2", "bwd/attn"), row("Figure 6", "gradient norm, median relative gap"),
            row("Figure 10", "fwd o flagged checks, paper tp 8 (k 512, n 4096, m 4096)"),
            row("Appendix D.3", "node 10"), row("Figure 3", "bursts"),
            row("Table 2", "bwd/ffn", chance=0.4), row("Table 2", "fwd/attn", "not run")]
    PC.say_why_none(rows)
    said = [r.reason.partition("; no P(pass): ")[2] for r in rows]
    assert said[0].startswith("no law")  # a maximum's why comes from its run (`annotate`)
    assert "seed_scatter.json" in said[1] and "analytic estimate" in said[2]
    assert "Table 1 or Table 2" in said[3] and said[4].startswith("no law")
    assert [r.reason for r in rows[5:]] == ["measured", "measured"]
