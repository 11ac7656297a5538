"""`sdcstudy reproduce`: the paper's per-layer tables as parsed, the scorecard's verdicts (each
band can fail), shards that partition the runs, a merge that equals the unsharded scorecard,
bad input in one sentence, and one node end to end."""

import dataclasses
import json
import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from report_runs import abft_rows, grid_rows, write_run

from sdcstudy import cli, runner
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.faults import published as PB
from sdcstudy.faults import published_layers as PL
from sdcstudy.report.runs import Run
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import claim_rows as CR
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import cli as RC
from sdcstudy.reproduce import figure10_paper as F10
from sdcstudy.reproduce import figures as FG
from sdcstudy.reproduce import findings as F
from sdcstudy.reproduce import mismatch_rows as M
from sdcstudy.reproduce import plan as P
from sdcstudy.reproduce import scorecard as S
from sdcstudy.reproduce import training_rows as TR

# --- Tables 6-9 as parsed, against Tables 1 and 2 ---------------------------------------------

LAYER_SOURCES = (("Table 6", "Table 8", ("fwd/attn", "fwd/ffn"), PL.FWD_NODES),
                 ("Table 7", "Table 9", ("bwd/attn", "bwd/ffn"), PL.BWD_NODES))


def test_layer_tables_have_sixteen_layers_and_their_columns():
    """Every table has a row per layer and site with one value per node of its columns; a
    lost row (the text extraction was said to have lost Table 6's layer 1) or a shifted
    column fails here."""
    for source, (table, nodes, _) in PL.LAYER_TABLES.items():
        assert sorted({layer for layer, _ in table}) == list(range(1, 17)), source
        assert all(len(values) == len(nodes) for values in table.values()), source
    assert PL.layer_values("Table 6", 1, "fwd/attn")[0] == 2.84e-5  # layer 1, node 1


def half_unit(value: float, digits: int = 3) -> float:
    """Half a unit in the last place of `value` printed with `digits` significant digits."""
    return 0.5 * 10 ** (math.floor(math.log10(abs(value))) - digits + 1) if value else 0.0


def test_layer_tables_agree_with_tables_1_2_but_where_the_module_says():
    """The mean over 16 layers of Tables 6-7 is Table 1's value and the maximum of Tables 8-9
    is Table 2's, to the rounding of the printed digits, except at exactly the places the
    module lists; a parsing error (a lost row, a shifted column) adds a place here."""
    found = {}
    for freq_source, severity_source, sites, nodes in LAYER_SOURCES:
        for node in nodes:
            for site in sites:
                at = PB.SITES.index(site)
                values = PL.layer_values(freq_source, node, site)
                mean, published = statistics.mean(values), PB.TABLE1_FREQUENCY[node][at]
                rounding = half_unit(published) + statistics.mean(map(half_unit, values))
                if abs(mean - published) > rounding * (1 + 1e-9):
                    found[(freq_source, node, site)] = (published, mean)
                top = max(PL.layer_values(severity_source, node, site))
                published = PB.TABLE2_MAX_SEVERITY[node][at]
                if abs(top - published) > half_unit(published) * (1 + 1e-9):
                    found[(severity_source, node, site)] = (published, top)
    assert found.keys() == PL.SELF_DISAGREEMENTS.keys()
    for key, (published, layers) in PL.SELF_DISAGREEMENTS.items():
        assert found[key] == (published, pytest.approx(layers)), key
    without_layer_1 = statistics.mean(PL.layer_values("Table 6", 1, "fwd/attn")[1:])
    assert abs(without_layer_1 / PB.TABLE1_FREQUENCY[1][0] - 1) > 0.04


def test_zero_frequency_layers_are_zero_severity_layers():
    """A layer without mismatches has no severity and the other way round (columns line up)."""
    for freq_source, severity_source, sites, nodes in LAYER_SOURCES:
        for node in nodes:
            for site in sites:
                freq = PL.layer_values(freq_source, node, site)
                severity = PL.layer_values(severity_source, node, site)
                assert [f == 0 for f in freq] == [s == 0 for s in severity], (node, site)


# --- verdicts on hand-made runs -----------------------------------------------------------------

ELEMENTS = 10**9


def lockstep_run(freq: dict, severity: dict, steps=10, layers=2, landed=1) -> Run:
    """A lock-step Run in memory: per site the given frequency and severity in every layer."""
    rows = grid_rows(steps, layers, 1, ELEMENTS, lambda step, micro, layer, site, rank: (
        round(freq.get(site, 0) * ELEMENTS), severity.get(site, 0.0) if freq.get(site) else 0.0))
    return Run(path=Path("n"), config={"experiment": {"mode": "lockstep"},
                                       "suspect": {"profile": "paper-node-1"}},
               summary={"faults/landed": landed}, metrics=pd.DataFrame({"step": [1]}),
               mismatch=pd.DataFrame(rows), faults=pd.DataFrame(), abft=pd.DataFrame())


def entry(node=1, mode="lockstep", expected=0.0, scale=1.0, steps=10, **extra) -> dict:
    """A planned run; `expected`: the mismatches (or faults) per site over the run, one number
    for every site or {site: number}."""
    per_site = expected if isinstance(expected, dict) else dict.fromkeys(PB.SITES, expected)
    return {"name": "n", "node": node, "mode": mode, "steps": steps, "layers": 2,
            "sites": {site: {"mismatches": per_site.get(site, 0.0), "scale": scale}
                      for site in PB.SITES},
            "active_steps": None, "onset_step": None, **extra}


def made(freq: dict, steps=10, layers=2) -> dict:
    """The mismatches per site `lockstep_run(freq)` holds: what its plan would expect from an
    engine that fires at the rates `freq`."""
    return {site: round(f * ELEMENTS) * steps * layers for site, f in freq.items()}


def verdicts(rows, source, quantity=None) -> list[str]:
    return [r.verdict for r in rows if r.source == source
            and (quantity is None or r.quantity == quantity)]


NODE1_FREQ = dict(zip(PB.SITES, PB.TABLE1_FREQUENCY[1]))
NODE1_SEVERITY = dict(zip(PB.SITES, PB.TABLE2_MAX_SEVERITY[1]))
NODE1_ENTRY = entry(expected=made(NODE1_FREQ))


def test_table1_frequency_band_passes_fails_and_too_rare():
    """Within 25% of Table 1 (times the time pattern) passes, 40% off fails, and a run that
    expects fewer than 100 mismatches, or 30 bursts, is not judged."""
    def rows(freq, **kw):
        run = lockstep_run({"bwd/attn": freq}, NODE1_SEVERITY)
        return M.site_rows(1, "n", run, entry(expected=made({"bwd/attn": freq}), **kw))

    assert verdicts(rows(1.6e-4), "Table 1", "bwd/attn") == ["pass"]
    (off,) = [r for r in rows(2.2e-4) if r.source == "Table 1" and r.quantity == "bwd/attn"]
    assert off.verdict == "fail" and not B.count_failed(off)  # the engine made what it should
    assert verdicts(rows(3.1e-4, scale=2.0), "Table 1", "bwd/attn") == ["pass"]
    rare = M.site_rows(1, "n", lockstep_run({"bwd/attn": 3e-9}, NODE1_SEVERITY),
                       entry(expected=50))
    (row,) = [r for r in rare if r.source == "Table 1" and r.quantity == "bwd/attn"]
    assert row.verdict == B.TOO_RARE and "60 mismatches over the run, as the 50 expected" \
        in row.reason
    assert verdicts(rows(1.6e-4, active_steps=5.0), "Table 1", "bwd/attn") == [B.TOO_RARE]


def test_table1_zero_sites_must_stay_zero():
    """Node 13 has no fwd/attn mismatch in Table 1: none passes, any fails."""
    quiet = M.site_rows(13, "n", lockstep_run({}, {}), entry(node=13))
    assert verdicts(quiet, "Table 1", "fwd/attn") == ["pass"]
    noisy = M.site_rows(13, "n", lockstep_run({"fwd/attn": 1e-3}, {"fwd/attn": 1.0}),
                        entry(node=13))
    assert verdicts(noisy, "Table 1", "fwd/attn") == ["fail"]
    assert verdicts(noisy, "Table 2", "fwd/attn") == ["fail"]


def test_table2_severity_band_and_no_events():
    """A factor 3 of Table 2 passes, a factor 4 fails, a site without mismatches has no
    events."""
    ok = M.site_rows(1, "n", lockstep_run(NODE1_FREQ, {"fwd/attn": 99 * 2.9}), NODE1_ENTRY)
    assert verdicts(ok, "Table 2", "fwd/attn") == ["pass"]
    off = M.site_rows(1, "n", lockstep_run(NODE1_FREQ, {"fwd/attn": 99 / 4}), NODE1_ENTRY)
    assert verdicts(off, "Table 2", "fwd/attn") == ["fail"]
    none = M.site_rows(1, "n", lockstep_run({}, {}), entry())
    assert verdicts(none, "Table 2", "fwd/attn") == ["no events"]


def test_layer_rows_judge_each_layer_against_the_papers_range():
    """Node 1 fwd/ffn: Table 8's layers span 18.4 to 312, widened by 3: 10 passes, 5 fails;
    Table 6's 2.86e-7 to 6.52e-7 widened by 25%: 4e-7 passes, 1e-6 fails."""
    assert PL.layer_range("Table 8", 1, "fwd/ffn") == (18.38, 312)
    assert PL.layer_range("Table 6", 1, "fwd/ffn") == (2.86e-7, 6.52e-7)
    run = lockstep_run({"fwd/ffn": 4e-7}, {"fwd/ffn": 10.0})
    rows = M.layer_rows(1, "n", run, entry(expected=made({"fwd/ffn": 4e-7})))
    assert verdicts(rows, "Table 8", "fwd/ffn layer 1") == ["pass"]
    assert verdicts(rows, "Table 6", "fwd/ffn layer 2") == ["pass"]
    low = M.layer_rows(1, "n", lockstep_run({"fwd/ffn": 1e-6}, {"fwd/ffn": 5.0}),
                       entry(expected=made({"fwd/ffn": 1e-6})))
    assert verdicts(low, "Table 8", "fwd/ffn layer 1") == ["fail"]
    assert verdicts(low, "Table 6", "fwd/ffn layer 1") == ["fail"]
    # Node 14 has no fwd/ffn mismatch in any layer of Table 6: ours must have none.
    assert verdicts(M.layer_rows(14, "n", run, entry(node=14)), "Table 6",
                    "fwd/ffn layer 1") == ["fail"]


def test_layer_rows_of_a_run_that_ends_before_the_faults_start():
    """A time pattern that starts after the run (node 13's onset at step 450 in a 200-step
    run) scales Table 1 by 0: the layer rows are judged, not divided by that 0 (the tiny
    scorecard's merge of 2026-11-29 stopped on it): a layer that expects no mismatch is too
    rare to judge, and one with a mismatch fails as an excess event."""
    rows = M.layer_rows(1, "n", lockstep_run({"fwd/ffn": 0.0}, {}), entry(scale=0.0))
    assert verdicts(rows, "Table 6", "fwd/ffn layer 1") == [B.TOO_RARE]
    rows = M.layer_rows(1, "n", lockstep_run({"fwd/ffn": 4e-7}, {"fwd/ffn": 10.0}),
                        entry(scale=0.0))
    assert verdicts(rows, "Table 6", "fwd/ffn layer 1") == ["fail"]


def _row(rows, source, quantity):
    (row,) = [r for r in rows if r.source == source and r.quantity == quantity]
    return row


def test_counts_inconsistent_with_the_expectation_fail_whatever_a_finding_says():
    """8 mismatches where the profile expects 7.8e-8 (a sampler that fires at a floor) fail
    as excess events, in Tables 1, 2, 6 and 8, and no finding explains them (the Table 2 row
    would otherwise get 5.3's why); 0 where 50 are expected fail as missing events. Before
    the count check the first were "too rare" and the second "no events"."""
    plan = [entry(steps=4, expected={"fwd/attn": 7.8e-8})]
    floor = lockstep_run({"fwd/attn": 1e-9}, {"fwd/attn": 99 * 4}, steps=4)
    rows = S.build(plan, {"n": floor})
    for source, quantity in (("Table 1", "fwd/attn"), ("Table 2", "fwd/attn"),
                             ("Table 6", "fwd/attn layer 1"), ("Table 8", "fwd/attn layer 2")):
        row = _row(rows, source, quantity)
        assert row.verdict == "fail" and row.reason.startswith(B.EXCESS), (source, row.reason)
        assert row.why == "" and B.count_failed(row)
    assert "8 mismatches where the profile expects 7.8e-08" in _row(rows, "Table 1",
                                                                     "fwd/attn").reason
    assert S.unexplained(rows) == S.engine_failures(rows) == 2 + 2 * 2  # sites, 2 layers
    silent = S.build([entry(expected={"fwd/attn": 50.0})], {"n": lockstep_run({}, {})})
    for source in ("Table 1", "Table 2"):
        assert _row(silent, source, "fwd/attn").reason.startswith(B.MISSING), source
    # A Poisson count of mean 50 is 0 with probability 2e-22; 35 or 70 are within reach of a
    # mean within 25% of 50 and stay too rare.
    assert B.count_check(0, 50.0, entry()).startswith(B.MISSING)
    assert B.count_check(35, 50.0, entry()) is None and B.count_check(70, 50.0, entry()) is None
    assert B.count_check(8, 7.8e-8, entry()).startswith(B.EXCESS)


def test_bursty_counts_are_judged_with_their_bursts():
    """In 10 steps with a burst expected in 0.5 of them (p = 0.05), no burst at all is likely
    (0.6), so 0 of 50 expected events is consistent; with a constant pattern it is not. A
    burst's worth of events (100) is consistent too, eight bursts' worth (800) is not."""
    bursty = entry(active_steps=0.5)
    assert B.count_check(0, 50.0, bursty) is None
    assert B.count_check(100, 50.0, bursty) is None
    assert B.count_check(0, 50.0, entry()).startswith(B.MISSING)
    assert B.count_check(800, 50.0, bursty).startswith(B.EXCESS)


def test_calibration_rows_are_tallied_apart():
    """Tables 1, 6 and 7 are calibration rows (the profiles' rates are set from Table 1), as is
    Figure 5 where the weight-gradient rate is set from the node's WCNTS; their passes and
    failures are counted apart from the held-out rows'."""
    run = lockstep_run({"bwd/attn": 2.2e-4}, NODE1_SEVERITY)
    rows = S.build([entry(expected=made({"bwd/attn": 2.2e-4}))], {"n": run})
    roles = {r.source: r.role for r in rows}
    assert roles == {"Table 1": B.CALIBRATION, "Table 2": B.HELD_OUT, "Table 6": B.CALIBRATION,
                     "Table 7": B.CALIBRATION, "Table 8": B.HELD_OUT, "Table 9": B.HELD_OUT,
                     "Appendix C.2": B.FIXED, "Tables 3/5": B.HELD_OUT,
                     "Figure 7": B.HELD_OUT, "Appendix D.4": B.HELD_OUT}
    tally = S.counts_by_role(rows)
    calibration = [r for r in rows if r.role == B.CALIBRATION]
    assert tally[B.CALIBRATION]["fail"] == sum(r.verdict == "fail" for r in calibration) > 0
    assert tally[B.HELD_OUT]["pass"] == sum(r.verdict == "pass" for r in rows
                                             if r.role == B.HELD_OUT) > 0
    assert {v: sum(tally[role][v] for role in S.ROLES) for v in B.VERDICTS} == S.counts(rows)
    text = S.markdown(rows, {"preset": "tiny", "steps": 10, "modes": list(P.MODES)})
    assert "| node | calibration pass | calibration fail | held-out pass | held-out fail |" in text
    assert text.index("## Node 1, calibration rows") < text.index("## Node 1, held-out rows")
    assert B.role(1, "Figure 5") == B.CALIBRATION and B.role(11, "Figure 5") == B.HELD_OUT


def test_figure5_calibration_follows_the_profiles():
    """Figure 5 is a calibration row exactly for the nodes whose weight-gradient rate the zoo
    sets from WCNTS (faults/profiles.py); if a profile changes, `bands.FIGURE5_NOT_FITTED`
    must follow it."""
    from sdcstudy.faults import profiles

    for node in P.NODES:
        grad = [s for s in profiles.paper_node(node).specs if s.site == "grad"]
        fitted = bool(grad) and grad[0].kind == "additive" and math.isclose(
            math.sqrt(grad[0].rate * profiles.MAGNITUDE_MEAN_SQUARE), PB.WCNTS[node],
            rel_tol=1e-6)
        assert (B.role(node, "Figure 5") == B.CALIBRATION) == fitted, node


def paired_run(mode, metrics: dict, landed=5, abft=None) -> Run:
    frame = pd.DataFrame({"step": np.arange(1, len(next(iter(metrics.values()))) + 1),
                          **metrics})
    return Run(path=Path("n"), config={"experiment": {"mode": mode},
                                       "suspect": {"profile": "paper-node-1"}},
               summary={"faults/landed": landed}, metrics=frame, mismatch=pd.DataFrame(),
               faults=pd.DataFrame(), abft=pd.DataFrame(abft or []))


def test_figure5_wcnts_within_a_factor_three():
    """Node 1's WCNTS is 0.037: 0.1 passes, 0.2 fails, a run without corruptions has none."""
    def row(nts, landed=5):
        run = paired_run("paramsync", {"grad/nts": [0.0, nts, nts / 2]}, landed)
        return TR.figure5_row(1, "n", run, entry(mode="paramsync", steps=3))

    assert row(0.1).verdict == "pass" and row(0.1).ratio == pytest.approx(0.1 / 0.037)
    assert row(0.2).verdict == "fail"
    assert row(0.1, landed=0).verdict == "no events"
    # A step gone NaN is left out of eq. (5)'s max; the run must not pass on the finite rest.
    gone = paired_run("paramsync", {"grad/nts": [0.0, 0.1, float("nan")]})
    e = entry(mode="paramsync", steps=3)
    for judged in (TR.figure5_row(1, "n", gone, e), TR.figure5_rms_row(1, "n", gone, e)):
        assert judged.verdict == "fail" and "not finite (the first, step 3)" in judged.reason


def test_figure5_rms_of_grad_nts_is_judged_beside_its_maximum():
    """The second Figure 5 row is the root mean square of grad/nts over the steps, in the same
    band: a maximum of 0.15 fails while the rms passes; the role is Figure 5's."""
    run = paired_run("paramsync", {"grad/nts": [0.0, 0.15, 0.05]})
    e = entry(mode="paramsync", steps=3)
    wcnts, rms = TR.figure5_row(1, "n", run, e), TR.figure5_rms_row(1, "n", run, e)
    assert (wcnts.verdict, rms.verdict) == ("fail", "pass")
    assert rms.quantity == TR.RMS_NTS and rms.ours == pytest.approx((0.025 / 3) ** 0.5)
    assert "1 of them without noise" in rms.reason
    rows = [r for r in S.build([e], {"n": run}) if r.source == "Figure 5"]
    assert [r.quantity for r in rows] == ["WCNTS", TR.RMS_NTS]
    assert {r.role for r in rows} == {B.role(1, "Figure 5")}
    big = paired_run("paramsync", {"grad/nts": [0.5, 0.5, 0.5]})
    assert TR.figure5_rms_row(1, "n", big, e).verdict == "fail"
    # the WCNTS figure draws one pair of bars a node, the WCNTS row's, not the rms beside it
    assert FG.wcnts_rows(rows) == rows[:1]


def free_rows(healthy, suspect, diff, node=1, landed=5, onset=None):
    run = paired_run("free", {"loss/healthy": healthy, "loss/suspect": suspect,
                              "param/diff_l2": diff}, landed)
    return TR.figure6_rows(node, "n", run, entry(node=node, mode="free", steps=len(diff),
                                                 onset_step=onset))


def test_figure6_loss_gap_and_parameter_drift():
    """Losses within 2% and a growing parameter difference pass; a 3% gap at one step fails,
    a difference that falls back fails, a run without corruptions has no events."""
    steps = 20
    healthy = [3.0] * steps
    growing = [0.0] + [0.01 * s for s in range(1, steps)]
    good = free_rows(healthy, [3.05] * steps, growing)
    assert verdicts(good, "Figure 6") == ["pass", "pass"]
    spike = [3.05] * steps
    spike[7] = 3.1
    assert verdicts(free_rows(healthy, spike, growing), "Figure 6", "loss gap") == ["fail"]
    shrinking = [0.0, 0.5, 0.6] + [0.1] * (steps - 3)
    assert verdicts(free_rows(healthy, healthy, shrinking), "Figure 6",
                    "param/diff_l2 grows") == ["fail"]
    assert verdicts(free_rows(healthy, healthy, growing, landed=0), "Figure 6") == \
        ["no events", "no events"]


def drifting_run(exponent: float, steps=100, begins=1) -> Run:
    """A free run whose parameter difference is 1e-3 t^exponent from step `begins` on."""
    t = np.arange(1, steps + 1) - begins + 1
    diff = np.where(t > 0, 1e-3 * np.clip(t, 1, None).astype(float) ** exponent, 0.0)
    return paired_run("free", {"param/diff_l2": list(diff), "loss/healthy": [3.0] * steps,
                               "loss/suspect": [3.0] * steps})


def test_figure6_drift_rates_similar_on_most_nodes_is_one_row_for_all():
    """Each free run's growth exponent is the slope of ln diff against ln(steps since the drift
    began); the one row passes when more than half of the nodes lie within 2x of the median,
    and is not applicable with fewer than three drifting nodes."""
    from sdcstudy.reproduce import drift_rows as D

    assert D.growth_exponent(drifting_run(0.5, begins=40)) == pytest.approx(0.5)
    assert D.growth_exponent(drifting_run(0.5, begins=100)) is None  # one step of drift

    def row(exponents):
        plan = [entry(node=n, mode="free", steps=100) | {"name": f"f{n}"}
                for n in range(1, len(exponents) + 1)]
        runs = {f"f{n}": drifting_run(a) for n, a in enumerate(exponents, 1)}
        (only,) = D.rows(plan + [entry(node=1, mode="lockstep")], runs)
        assert (only.node, only.source, only.role) == (B.ACROSS_NODES, "Figure 6", B.HELD_OUT)
        return only

    similar = row([0.5, 0.6, 0.4, 2.0])
    assert similar.verdict == "pass" and similar.ours == 0.75
    assert "3 of 4 drifting nodes within 2x of the median exponent 0.55" in similar.reason
    assert similar.reason.endswith("outside: 4")
    assert row([0.1, 0.5, 2.0, 3.0]).verdict == "fail"  # median 1.25: only 2.0 within 2x
    assert row([0.5, 0.5]).verdict == "not applicable"
    assert D.rows([entry(mode="lockstep")], {}) == []
    text = S.markdown(S.build([entry(node=n, mode="free", steps=100) | {"name": f"f{n}"}
                               for n in (1, 2, 3)],
                              {f"f{n}": drifting_run(0.5) for n in (1, 2, 3)}),
                      {"preset": "tiny", "steps": 100, "modes": ["free"]})
    assert "| across nodes |" in text and "## Across nodes, held-out rows" in text


def test_figure6_node13_is_zero_before_its_onset():
    """Node 13: exactly zero before the onset passes, a tiny drift before it fails; with the
    onset after the run the growth is not applicable."""
    steps = 20
    healthy = [3.0] * steps
    after = [0.0] * 10 + [1e-3 * s for s in range(1, 11)]
    rows = free_rows(healthy, healthy, after, node=13, onset=11)
    assert verdicts(rows, "Figure 6", "param/diff_l2 before step 11") == ["pass"]
    assert verdicts(rows, "Figure 6", "param/diff_l2 grows") == ["pass"]
    early = list(after)
    early[3] = 1e-9
    assert verdicts(free_rows(healthy, healthy, early, node=13, onset=11), "Figure 6",
                    "param/diff_l2 before step 11") == ["fail"]
    late = free_rows(healthy, healthy, [0.0] * steps, node=13, landed=0, onset=450)
    assert verdicts(late, "Figure 6", "param/diff_l2 grows") == ["not applicable"]


def test_figure10_frequently_on_node_14_little_elsewhere():
    """ABFT flagging the forward `o` product in half the steps is "frequently": it passes on
    node 14 and fails elsewhere; flags in no step fail node 14 and pass the others."""
    steps = 10

    def row(node, flag_steps):
        checks = abft_rows(steps, 2, 1, lambda step, micro, layer, matmul, direction, rank:
                           matmul == "o" and direction == "fwd" and step in flag_steps)
        run = paired_run("abft", {"loss": [3.0] * steps}, abft=checks)
        return TR.figure10_row(node, "n", run, entry(node=node, mode="abft", steps=steps))

    half = range(1, 6)
    assert row(14, half).verdict == "pass" and row(14, half).ours == 0.5
    assert row(1, half).verdict == "fail"
    assert row(14, ()).verdict == "fail"
    assert row(1, ()).verdict == "pass"


# --- findings: why a failing row fails ----------------------------------------------------------


def test_figures_5_and_6_fail_on_site_fault_counts_the_profile_cannot_give():
    """The parameter-synchronized and free runs count their faults at Table 1's sites against
    the plan: 40 at fwd/ffn where 2 are expected fails every row as excess events, none where
    50 are expected as missing events; with corruptions unlogged only an excess is judged; the
    weight-gradient faults are not counted."""
    steps, expected = 3, {"fwd/attn": 3.0, "fwd/ffn": 2.0}
    metrics = {"grad/nts": [0.0, 0.05, 0.02], "loss/healthy": [3.0, 2.9, 2.8],
               "loss/suspect": [3.0, 2.9, 2.8], "param/diff_l2": [0.0, 1e-3, 2e-3]}

    def rows(faults, expected=expected, unlogged=0):
        out = []
        for mode, make in (("paramsync", lambda r, e: [TR.figure5_row(1, "n", r, e),
                                                       TR.figure5_rms_row(1, "n", r, e)]),
                           ("free", lambda r, e: TR.figure6_rows(1, "n", r, e))):
            run = with_faults(paired_run(mode, metrics), faults)
            run.summary["faults/unlogged"] = unlogged
            out += make(run, entry(mode=mode, steps=steps, expected=expected))
        return out

    consistent = pd.concat([fault_rows([1, 2, 3], site="fwd/attn"),
                            fault_rows([1, 3], site="fwd/ffn"), fault_rows(range(500))])
    assert [r.verdict for r in rows(consistent)] == ["pass"] * 4
    excess = pd.concat([consistent, fault_rows([2] * 38, site="fwd/ffn")])
    assert {r.reason.split(":")[0] for r in rows(excess)} == {B.EXCESS}
    assert all(B.count_failed(r) and "40 fwd/ffn faults" in r.reason for r in rows(excess))
    assert all(r.reason.startswith(B.MISSING) and "0 bwd/attn faults" in r.reason
               for r in rows(consistent, {**expected, "bwd/attn": 50.0}))
    assert [r.verdict for r in rows(consistent, {**expected, "bwd/attn": 50.0},
                                    unlogged=10)] == ["pass"] * 4


def fault_rows(steps, site="grad/layers/0/attn/wq", kind="additive", bit=-1) -> pd.DataFrame:
    return pd.DataFrame({"step": list(steps), "site": site, "kind": kind, "bit": bit})


def with_faults(run: Run, faults: pd.DataFrame) -> Run:
    run.faults = faults
    return run


def test_findings_explain_severity_rows_by_the_units_their_maximum_spans():
    """A failing Table 2 row names the units its maximum spans and on which side of the band it
    lies; a passing row gets no why."""
    run = lockstep_run(NODE1_FREQ, {"fwd/attn": 99 / 4, "bwd/attn": 7392 * 2.5})
    rows = F.explain(M.site_rows(1, "n", run, NODE1_ENTRY), NODE1_ENTRY, run)
    (low,) = [r for r in rows if r.source == "Table 2" and r.quantity == "fwd/attn"]
    assert low.verdict == "fail" and "5.3" in low.why and "below" in low.why
    assert "largest of 20 (step, microstep, layer, rank) units" in low.why  # 10 steps x 2 layers
    (ok,) = [r for r in rows if r.source == "Table 2" and r.quantity == "bwd/attn"]
    assert ok.verdict == "pass" and ok.why == ""
    high = lockstep_run(NODE1_FREQ, {"fwd/attn": 99 * 4})
    (row,) = [r for r in F.explain(M.site_rows(1, "n", high, NODE1_ENTRY), NODE1_ENTRY,
                                   high)
              if r.source == "Table 2" and r.quantity == "fwd/attn"]
    assert "5.3" in row.why and "above" in row.why and "modelling choice" in row.why
    assert "flip model" in row.why and "Figure 5's WCNTS" not in row.why
    node10 = F.severity_tail(dataclasses.replace(row, node=10), NODE1_ENTRY, high)
    assert "lower Figure 5's WCNTS" in node10  # only where Table 1's faults set the WCNTS


def test_findings_tell_the_wcnts_overshoots_apart_and_leave_others_unexplained():
    """Figure 5 above its band: from Table 1's faults alone (no weight-gradient fault), from a
    few corruptions a step, from last-bit flips; with many corruptions a step no finding
    covers it, and the scorecard counts it as unexplained."""
    def row(faults, landed):
        run = with_faults(paired_run("paramsync", {"grad/nts": [0.5, 0.5]}, landed), faults)
        e = entry(mode="paramsync", steps=2)
        return F.explain([TR.figure5_row(1, "n", run, e)], e, run)[0]

    table1 = row(fault_rows([1, 2], site="fwd/attn"), landed=10)
    assert table1.verdict == "fail" and "5.1" in table1.why and "Table 1" in table1.why
    assert "modelling choices" in table1.why and "flip model" in table1.why
    assert "disagree" not in table1.why  # measured under one model: no contradiction claimed
    few = row(fault_rows([1, 2]), landed=10)
    assert "small gradient" in few.why and "5 corruptions a step" in few.why
    flips = row(fault_rows([1], kind="bitflip", bit=0), landed=1)
    assert "5.2" in flips.why
    many = row(fault_rows([1, 2]), landed=2 * int(F.FEW_FAULTS))
    assert many.verdict == "fail" and many.why == ""
    assert S.unexplained([table1, few, flips, many]) == 1


def test_findings_tell_one_batchs_scatter_from_a_lasting_loss_gap():
    """Figure 6: a gap of 3% that alternates in sign (10-step means equal) is one batch's
    scatter; a lasting 3% gap with only Table 1 faults is 5.5's; with weight-gradient faults
    no finding covers it."""
    steps = 40
    healthy = [1.0] * steps
    scatter = [1.0 + 0.03 * (-1) ** s for s in range(steps)]
    lasting = [1.03] * steps
    diff = [0.01 * s for s in range(steps)]

    def row(suspect, faults, microsteps=1, **extra):
        run = with_faults(paired_run("free", {"loss/healthy": healthy, "loss/suspect": suspect,
                                              "param/diff_l2": diff}), faults)
        run.config["experiment"] = {"mode": "free", "batch_size": 8, "microsteps": microsteps}
        run.config["data"] = {"seq_len": 128}
        e = entry(mode="free", steps=steps, **extra,
                  expected={"fwd/attn": float((faults["site"] == "fwd/attn").sum())})
        (gap,) = [r for r in F.explain(TR.figure6_rows(1, "n", run, e), e, run)
                  if r.quantity == "loss gap"]
        assert gap.verdict == "fail" and not B.count_failed(gap)
        return gap.why

    grad, table1 = fault_rows(range(1, steps)), fault_rows(range(1, steps), site="fwd/attn")
    assert "5.6" in row(scatter, grad) and "1,024 tokens" in row(scatter, grad)
    assert "4,096 tokens" in row(scatter, grad, microsteps=4)  # a step's tokens, every microstep
    assert "within 0.0% of each other" in row(scatter, grad)
    assert "5.5" in row(lasting, table1) and "at 100% of the steps" in row(lasting, table1)
    assert "a modelling choice and a regime" in row(lasting, table1)
    assert "one-component additive error" in row(lasting, table1)
    assert "the flip model's bit-place errors" in row(lasting, table1, fault_model="flip")
    assert row(lasting, grad) == ""


def test_findings_tell_one_batchs_gradient_norm_scatter_from_a_lasting_gap():
    """Figure 6's gradient norms: a gap of +5% and -3% by turns (10-step means 1% apart at
    the median step) is one batch's scatter, 5.8's; a lasting 5% gap, or +5% and 0 by turns
    (means 2.5% apart, beyond the 2% band), no finding covers."""
    steps = 40
    healthy = [2.0] * steps

    def why(suspect):
        run = paired_run("free", {"grad/norm": healthy, "grad/norm_suspect": suspect})
        (row,) = F.explain([CR.figure6_grad_norm_row(1, run)], entry(mode="free", steps=steps),
                           run)
        assert row.verdict == "fail" and row.ours > CR.GRAD_NORM_GAP
        return row.why

    scatter = [2.0 * (1.01 + 0.04 * (-1) ** s) for s in range(steps)]
    assert "5.8, one batch's gradient norm" in why(scatter)
    assert "1.0% apart at the median step" in why(scatter)
    assert "at 50% of the steps, by +1.00% on average" in why(scatter)
    assert why([2.1] * steps) == ""  # lasting: every 10-step mean 5% apart
    drifting = [2.0 * (1.025 + 0.025 * (-1) ** s) for s in range(steps)]
    assert why(drifting) == ""  # means 2.5% apart at the median step: beyond the band


def test_findings_count_the_abft_flags_that_held_an_attention_fault():
    """Figure 10: the why counts the flagged steps with an attention-output fault and those
    without one."""
    steps = 10
    checks = abft_rows(steps, 1, 1, lambda step, micro, layer, matmul, direction, rank:
                       matmul == "o" and direction == "fwd" and step in (2, 3, 9))
    run = with_faults(paired_run("abft", {"loss": [3.0] * steps}, abft=checks),
                      fault_rows([2, 3, 5], site="fwd/attn"))
    run.config.update(model={"preset": "tiny"}, data={"seq_len": 64},
                      experiment={"mode": "abft", "batch_size": 16})
    e = entry(mode="abft", steps=steps, expected=3.0)
    (row,) = F.explain([TR.figure10_row(1, "n", run, e)], e, run)
    assert row.verdict == "fail"
    assert "flagged 2 of the 3 steps with an attention-output fault" in row.why
    assert "and 1 step without one" in row.why
    # tiny's o check (k = n = 64, 1,024 tokens) as docs/faults.md 5.4 measures it
    assert "247 times eq. 6's threshold in this run's o check (k = 64, n = 64)" in row.why
    assert "tests the check's size, not Table 1 against Figure 10" in row.why
    assert "9.4e-05" not in row.why
    quiet = with_faults(paired_run("abft", {"loss": [3.0] * steps},
                                   abft=abft_rows(steps, 1, 1, lambda *key: False)),
                        fault_rows([2], site="fwd/attn"))
    quiet.config["model"] = {"preset": "no-such-preset"}
    e14 = entry(node=14, mode="abft", steps=steps, expected=1.0)
    (row14,) = F.explain([TR.figure10_row(14, "n", quiet, e14)], e14, quiet)
    assert row14.verdict == "fail" and "needs a rate of its own under ABFT" in row14.why
    assert "this run's o check is smaller than the paper's" in row14.why  # no such model


def paper_entry(node, tp, flagged, faults=1.0, shape=None, placement="o_proj") -> dict:
    """One entry of `abft_paper_scale.measure` at the paper's k = 4096 / tp."""
    return {"shape": shape or f"paper tp {tp}", "m": 4096, "k": 4096 // tp, "n": 4096,
            "node": node, "placement": placement, "checks": 16, "active": 1.0,
            "fault_share": 1.0, "o_faults": faults, "context_faults": 0.0,
            "single_fault_ratio": 0.5, "flagged_active_paper": flagged,
            "flagged_paper": flagged}


def test_figure10_at_the_papers_sizes_scores_the_abft_nodes_as_held_out(tmp_path):
    """The measurement's entries are Figure 10 rows of the planned ABFT runs' nodes only (o_proj
    at the paper's shapes), judged by their share of checks flagged (node 14 at least 10%, the
    others at most 1%), held-out; a failing row names section 5.4's finding. If this failed,
    the scorecard would judge Figure 10 on entries or nodes it does not hold, or claim a
    contradiction its measurement did not make."""
    entries = [paper_entry(1, 1, 0.0), paper_entry(1, 32, 0.5),
               paper_entry(1, 32, 0.0, placement="inside"), paper_entry(1, 1, 1.0, shape="tiny"),
               paper_entry(14, 8, 0.2), paper_entry(14, 32, 1e-4), paper_entry(4, 32, 0.5),
               paper_entry(2, 1, 0.0, faults=0.0)]
    path = tmp_path / "abft_paper_scale.json"
    path.write_text(json.dumps(entries))
    plan = [entry(node=n, mode="abft") for n in (1, 2, 14)] + [entry(node=4)]
    rows = S.paper_scale_rows(plan, path)
    got = {(r.node, r.quantity.partition(" (")[0]): r.verdict for r in rows}
    assert got == {(1, "fwd o flagged checks, paper tp 1"): "pass",
                   (1, "fwd o flagged checks, paper tp 32"): "fail",
                   (2, "fwd o flagged checks, paper tp 1"): "no events",
                   (14, "fwd o flagged checks, paper tp 8"): "pass",
                   (14, "fwd o flagged checks, paper tp 32"): "fail"}
    assert {r.role for r in rows} == {B.HELD_OUT}
    whys = {(r.node, r.verdict): r.why for r in rows}
    assert "5.4, where the faults arise" in whys[1, "fail"] and "modelling choice" in whys[
        1, "fail"]
    assert "needs a rate of its own under ABFT" in whys[14, "fail"]
    assert "flags 0.0001 of the checks at paper tp 32" in whys[14, "fail"]  # its own numbers
    assert whys[1, "pass"] == whys[14, "pass"] == ""
    assert S.paper_scale_rows([entry(node=1)], path) == []  # no ABFT run planned
    tally = S.counts_by_role(S.build(plan[:1], {}, paper_scale=path))
    assert tally[B.HELD_OUT]["pass"] == tally[B.HELD_OUT]["fail"] == 1


def test_figure10_at_the_papers_sizes_without_its_measurement_is_not_run(tmp_path):
    """Without the measurement's file the scorecard still scores, with one "not run" row per
    ABFT node that says which command makes the file; if this failed, a missing file would
    stop the scorecard or drop the rows without a word."""
    rows = S.paper_scale_rows([entry(node=n, mode="abft") for n in (1, 14)],
                              tmp_path / "missing.json")
    assert [(r.node, r.verdict) for r in rows] == [(1, "not run"), (14, "not run")]
    assert all("missing.json is missing" in r.reason and S.PAPER_SCALE_COMMAND in r.reason
               for r in rows)


def test_the_committed_figure10_measurement_is_the_one_docs_describe():
    """docs/scorecards/abft_paper_scale.json holds docs/faults.md 5.4's table: no node flags at
    tp 1, node 14 flags at most 9.4e-5 of the checks (fails at every tp), nodes 10 and 11 flag
    every check at tp 8, node 4 at tp 32 passes on 20 of 226 draws, and every judged row is
    decided by its draws. If this failed, the committed file and the docs' table disagree."""
    plan = [entry(node=n, mode="abft") for n in range(1, 16)]
    rows = S.paper_scale_rows(plan)
    tp = {(r.node, r.quantity.partition(" (")[0].rsplit(" ", 1)[1]): r for r in rows}
    assert len(rows) == 45
    assert all(tp[n, "1"].verdict in ("pass", "no events") for n in range(1, 16) if n != 14)
    assert [tp[14, t].verdict for t in ("1", "8", "32")] == ["fail"] * 3
    assert max(tp[14, t].ours for t in ("1", "8", "32")) == pytest.approx(F.NODE14_MOST_FLAGGED,
                                                                         rel=0.01)
    assert tp[10, "8"].ours == tp[11, "8"].ours == 1.0
    # every judged row decided by its draws (re-measured where 16 could not), none by the
    # analytic estimate: each states the draws' chance
    judged = [r for r in rows if r.verdict in ("pass", "fail")]
    assert judged and all(r.pass_probability == F10.DECIDED_CHANCE for r in judged)
    assert tp[4, "32"].verdict == "pass" and "20 of 226 fault draws flagged" in tp[4, "32"].reason


# --- plan and shards ------------------------------------------------------------------------------


def test_shards_partition_the_runs():
    """Every planned run is in exactly one shard of I/N, for several N; the order is node by
    node in MODES order."""
    req = P.request("tiny", 5, [1, 11, 14], None, [])
    plan, configs = P.build(req)
    names = [e["name"] for e in plan]
    assert names[:4] == [f"paper-node-1-{mode}" for mode in P.MODES]
    assert len(names) == 12 == len(set(names)) == len(configs)
    for count in (1, 2, 5, 12, 13):
        shards = [[n for i, n in enumerate(names) if P.in_shard(i, (k, count))]
                  for k in range(count)]
        assert sorted(sum(shards, [])) == sorted(names)
    assert configs["paper-node-1-abft"].mesh.tp == 1
    assert configs["paper-node-1-abft"].model.dtype == "float32"
    assert configs["paper-node-11-free"].experiment.steps == 5


# --- the command, with a fake runner ----------------------------------------------------------------


class FakeRunner:
    """Stands in for `runner.run`: a small run folder of the mode and profile it is given."""

    def __init__(self, interrupt_at=None):
        self.calls, self.interrupt_at = [], interrupt_at

    def __call__(self, cfg, out_dir, *, resume=False, progress=True, echo=print, **_):
        mode, profile, steps = cfg.experiment.mode, cfg.suspect.profile, cfg.experiment.steps
        self.calls.append((out_dir.name, resume))
        if out_dir.name == self.interrupt_at:
            self.interrupt_at = None
            Path(out_dir).mkdir(parents=True)
            (Path(out_dir) / RF.CONFIG).write_text("experiment: {mode: free}\n")
            raise KeyboardInterrupt("interrupted")
        if resume:  # the fake starts the unfinished run over
            shutil.rmtree(out_dir)
        node = PB.paper_node_number(profile)
        freq = dict(zip(PB.SITES, PB.TABLE1_FREQUENCY.get(node, (0,) * 4)))
        severity = dict(zip(PB.SITES, PB.TABLE2_MAX_SEVERITY.get(node, (0,) * 4)))
        metrics = [{"step": s, "loss/healthy": 3.0, "loss/suspect": 3.0 + 0.001 * node,
                    "param/diff_l2": 0.01 * s * node, "grad/nts": 0.01 * node,
                    "faults/landed": 1} for s in range(1, steps + 1)]
        kwargs = {}
        if mode == "lockstep":
            kwargs["mismatch"] = grid_rows(steps, 2, 2, 10**6, lambda st, mi, layer, site, r: (
                round(freq[site] * 10**6), severity[site] if freq[site] else 0.0))
        if mode == "abft":
            kwargs["abft"] = abft_rows(steps, 2, 1, lambda st, *key: node == 14 and st % 2)
        write_run(Path(out_dir), mode=mode, profile=profile, metrics=metrics,
                  summary={"faults/landed": steps}, config=C.to_dict(cfg), **kwargs)
        (Path(out_dir) / RF.CHECKPOINTS / str(steps)).mkdir(parents=True, exist_ok=True)  # as runs do
        return {"run_dir": str(out_dir)}


@pytest.fixture
def fake(monkeypatch):
    runs = FakeRunner()
    monkeypatch.setattr(runner, "run", runs)
    return runs


def reproduce(out, *extra):
    return cli.main(["reproduce", "--nodes", "1,14", "--steps", "6", "--out", str(out),
                     "--no-progress", *extra])


def scorecard(root) -> list[dict]:
    return json.loads((Path(root) / S.JSON).read_text())["rows"]


def test_merge_of_shards_equals_the_unsharded_scorecard(fake, tmp_path, capsys):
    """Two shards merged score exactly as one unsharded command; a --resume of a finished
    shard runs nothing again."""
    assert reproduce(tmp_path / "whole") == 0
    assert len(fake.calls) == 8
    assert reproduce(tmp_path / "s0", "--shard", "0/2") == 0
    assert reproduce(tmp_path / "s1", "--shard", "1/2") == 0
    assert len(fake.calls) == 16
    assert cli.main(["reproduce", "--merge", str(tmp_path / "s0"), str(tmp_path / "s1"),
                     "--out", str(tmp_path / "merged"), "--no-progress"]) == 0
    assert scorecard(tmp_path / "merged") == scorecard(tmp_path / "whole")
    paper = [r for r in scorecard(tmp_path / "merged") if "paper tp" in r["quantity"]]
    assert sorted({(r["node"], r["role"]) for r in paper}) == [(1, B.HELD_OUT), (14, B.HELD_OUT)]
    for name in ("scorecard.md", "scorecard.csv", "figures/wcnts.png", "figures/sites.png"):
        assert (tmp_path / "merged" / name).is_file(), name
    assert not list((tmp_path / "merged" / "runs").glob("*/checkpoints"))
    assert reproduce(tmp_path / "s0", "--shard", "0/2", "--resume") == 0
    assert len(fake.calls) == 16
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "merged"), "--out", str(tmp_path / "rep")]) == 0
    assert "# Reproduction scorecard" in capsys.readouterr().out


def test_a_partial_merge_marks_missing_runs_not_run(fake, tmp_path):
    """One shard alone: the other shard's runs are "not run", not failures, and --resume on
    the merged folder runs them."""
    assert reproduce(tmp_path / "s1", "--shard", "1/2") == 0
    assert cli.main(["reproduce", "--merge", str(tmp_path / "s1"), "--out",
                     str(tmp_path / "m"), "--no-progress"]) == 0
    rows = scorecard(tmp_path / "m")
    assert {r["verdict"] for r in rows if r["source"] == "Table 1"} == {"not run"}
    assert {r["verdict"] for r in rows if r["source"] == "Figure 5"} != {"not run"}
    calls = len(fake.calls)
    assert reproduce(tmp_path / "m", "--resume") == 0  # the merged folder, completed
    assert len(fake.calls) == calls + 4
    assert "not run" not in {r["verdict"] for r in scorecard(tmp_path / "m")}


@pytest.mark.parametrize("argv,message", [
    (["--nodes", "1,16"], "'16'"),
    (["--nodes", "1,1"], "more than once"),
    (["--shard", "2/2"], "--shard '2/2' must be I/N"),
    (["--shard", "x"], "must be I/N"),
    (["--preset", "huge"], "--preset 'huge' is not one of"),
    (["--dtype", "float16"], "--dtype 'float16'"),
    (["--modes", "free,sync"], "--modes 'free,sync' names 'sync'"),
    (["--modes", "free,free"], "more than once"),
    (["--fault-model", "flips"], "--fault-model 'flips' is not one of additive, flip"),
])
def test_bad_input_is_one_sentence(fake, tmp_path, capsys, argv, message):
    assert cli.main(["reproduce", "--out", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0 and fake.calls == []
    assert not (tmp_path / "r").exists()


def test_bad_merges_are_one_sentence(fake, tmp_path, capsys):
    """Folders that are not reproduce folders, of other settings, overlapping, or --merge
    with run arguments: one sentence, exit 2, nothing written."""
    assert reproduce(tmp_path / "a") == 0
    assert cli.main(["reproduce", "--nodes", "1,14", "--steps", "7", "--out",
                     str(tmp_path / "b"), "--no-progress"]) == 0
    (tmp_path / "plain").mkdir()
    cases = [([tmp_path / "plain"], "is not a reproduce folder"),
             ([tmp_path / "a", tmp_path / "b"], "was run with other steps"),
             ([tmp_path / "a", tmp_path / "a"], "more than once")]
    assert reproduce(tmp_path / "c") == 0
    cases.append(([tmp_path / "a", tmp_path / "c"], "the shards overlap"))
    for dirs, message in cases:
        capsys.readouterr()
        assert cli.main(["reproduce", "--merge", *map(str, dirs), "--out",
                         str(tmp_path / "m")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and err.count("\n") == 0, err
        assert not (tmp_path / "m").exists()
    assert cli.main(["reproduce", "--merge", str(tmp_path / "a"), "--nodes", "1",
                     "--out", str(tmp_path / "m")]) == 2
    assert "--merge takes only --out" in capsys.readouterr().err


def test_an_interrupted_command_resumes_and_keeps_finished_runs(fake, tmp_path, capsys):
    """Ctrl-C in the third run names the folder to --resume; the resumed command keeps the
    two finished runs, continues the third and runs the rest."""
    fake.interrupt_at = "paper-node-1-free"
    assert reproduce(tmp_path / "r") == 130
    assert f"--resume --out {tmp_path / 'r'}" in capsys.readouterr().err
    assert reproduce(tmp_path / "r", "--resume") == 0
    assert fake.calls[3:5] == [("paper-node-1-free", True), ("paper-node-1-abft", False)]
    assert len(fake.calls) == 9


def test_modes_keep_some_of_each_nodes_runs(fake, tmp_path, capsys):
    """--modes plans and runs only those modes, in MODES order; the scorecard has their
    sources only and says which runs it holds."""
    assert reproduce(tmp_path / "r", "--modes", "free, paramsync") == 0
    assert [name for name, _ in fake.calls] == [f"paper-node-{n}-{m}" for n in (1, 14)
                                               for m in ("paramsync", "free")]
    assert {r["source"] for r in scorecard(tmp_path / "r") if r["verdict"] != B.NOT_HERE} == \
        {"Figure 5", "Figure 5, shape", "Figure 6"}
    assert "steps per run, the paramsync and free runs" in capsys.readouterr().out


def test_the_flip_model_runs_the_flip_profiles_and_calibrates_tables_2_8_9(fake, tmp_path,
                                                                           capsys):
    """--fault-model flip gives each node's suspect `paper-node-N-flip`; Tables 2, 8 and 9 are
    then calibration rows (its tail is fitted to them), Figure 10 at the paper's sizes is not
    run (measured for the additive model), and --resume or --merge with the additive command's
    folders refuses."""
    from sdcstudy.faults import profiles

    assert P.FAULT_MODELS == profiles.FAULT_MODELS
    profiles_run = []
    fake_call = FakeRunner.__call__

    def record(self, cfg, out_dir, **kwargs):
        profiles_run.append(cfg.suspect.profile)
        return fake_call(self, cfg, out_dir, **kwargs)

    FakeRunner.__call__ = record
    try:
        assert reproduce(tmp_path / "f", "--fault-model", "flip") == 0
    finally:
        FakeRunner.__call__ = fake_call
    assert set(profiles_run) == {"paper-node-1-flip", "paper-node-14-flip"}
    assert "the flip model (`paper-node-N-flip`)" in capsys.readouterr().out
    rows = scorecard(tmp_path / "f")
    roles = {(r["source"], r["role"]) for r in rows if r["source"].startswith("Table ")}
    assert roles == {(f"Table {t}", B.CALIBRATION) for t in (1, 2, 6, 7, 8, 9)}
    paper = [r for r in rows if "paper's sizes" in r["quantity"]]
    assert paper and {r["verdict"] for r in paper} == {"not run"}
    assert B.role(1, "Table 2") == B.HELD_OUT == B.role(1, "Table 9", "additive")
    assert reproduce(tmp_path / "a", "--shard", "0/2") == 0
    assert reproduce(tmp_path / "a", "--shard", "0/2", "--resume", "--fault-model", "flip") == 2
    assert "other fault_model" in capsys.readouterr().err
    assert cli.main(["reproduce", "--merge", str(tmp_path / "a"), str(tmp_path / "f"),
                     "--out", str(tmp_path / "m")]) == 2
    assert "other fault_model" in capsys.readouterr().err


def test_chosen_models_take_each_nodes_own_and_reuse_copies_the_same_runs(
        fake, tmp_path, capsys, monkeypatch):
    """--fault-model chosen runs each node's model (flip_model.MODEL_OF_NODE); --reuse of the
    additive and flip folders copies every run without running one, and the scorecard equals
    one run for real; a run of other settings, or made by other software, is run again."""
    from sdcstudy.faults import flip_model

    monkeypatch.setattr(flip_model, "MODEL_OF_NODE", {14: "flip"})
    monkeypatch.setattr(RC, "_environment", lambda: {"packages": {"jax": "1"}})
    env = json.dumps({"packages": {"jax": "1"}})
    assert reproduce(tmp_path / "a") == 0 and reproduce(tmp_path / "f", "--fault-model",
                                                        "flip") == 0
    for run in (tmp_path / "a" / "runs").iterdir():
        (run / RF.ENV).write_text(env)
    for run in (tmp_path / "f" / "runs").iterdir():
        (run / RF.ENV).write_text(env)
    ran = len(fake.calls)
    assert reproduce(tmp_path / "c", "--fault-model", "chosen", "--reuse", str(tmp_path / "a"),
                     str(tmp_path / "f")) == 0
    assert len(fake.calls) == ran and "reused" in capsys.readouterr().out
    assert reproduce(tmp_path / "real", "--fault-model", "chosen") == 0
    assert len(fake.calls) == ran + 8
    assert scorecard(tmp_path / "c") == scorecard(tmp_path / "real")
    plan = json.loads((tmp_path / "c" / "reproduce.json").read_text())["plan"]
    assert {e["node"]: e.get("fault_model") for e in plan} == {1: None, 14: "flip"}
    roles = {(r["node"], r["source"], r["role"]) for r in scorecard(tmp_path / "c")}
    assert (1, "Table 2", B.HELD_OUT) in roles and (14, "Table 2", B.CALIBRATION) in roles
    (tmp_path / "a" / "runs" / "paper-node-1-free" / RF.ENV).write_text(
        json.dumps({"packages": {"jax": "2"}}))
    assert reproduce(tmp_path / "d", "--fault-model", "chosen", "--steps", "7", "--reuse",
                     str(tmp_path / "a")) == 0
    assert len(fake.calls) == ran + 16  # other steps: nothing is the same run
    assert reproduce(tmp_path / "e", "--fault-model", "chosen", "--reuse",
                     str(tmp_path / "a")) == 0
    assert len(fake.calls) == ran + 16 + 5  # node 1's free (other jax) and node 14's runs
    for bad, message in (([str(tmp_path / "a"), str(tmp_path / "a")], "more than once"),
                         ([str(tmp_path / "g")], "the --out folder")):
        capsys.readouterr()
        assert reproduce(tmp_path / "g", "--reuse", *bad) == 2
        assert message in capsys.readouterr().err


def test_reuse_leaves_out_flags_that_only_say_how_long_to_wait(fake, tmp_path, monkeypatch):
    """A run made before the CLI set its rendezvous patience is the run this command would make:
    --reuse copies it. A flag that changes code generation makes it another run."""
    from sdcstudy.core import determinism

    flags = "--xla_force_host_platform_device_count=8"
    patience = f"{determinism.WAIT_XLA_FLAGS[1]}=600"
    monkeypatch.setattr(RC, "_environment", lambda: {"xla_flags": f"{patience} {flags}"})
    assert reproduce(tmp_path / "a") == 0
    every = len(fake.calls)
    fast_math = f"{flags} --xla_cpu_enable_fast_math=true"
    for n, (before, runs_again) in enumerate(((flags, 0), (fast_math, every))):
        for run in (tmp_path / "a" / "runs").iterdir():
            (run / RF.ENV).write_text(json.dumps({"xla_flags": before}))
        ran = len(fake.calls)
        assert reproduce(tmp_path / f"b{n}", "--reuse", str(tmp_path / "a")) == 0
        assert len(fake.calls) == ran + runs_again


def test_manifests_from_before_modes_and_models_ran_every_mode_additive(fake, tmp_path):
    """A reproduce.json without `modes` reads as every mode, so its folder resumes and merges
    with the shards of the same command."""
    assert reproduce(tmp_path / "r", "--shard", "0/2") == 0
    path = tmp_path / "r" / "reproduce.json"
    manifest = json.loads(path.read_text())
    del manifest["request"]["modes"], manifest["request"]["fault_model"]
    path.write_text(json.dumps(manifest))
    assert reproduce(tmp_path / "r", "--shard", "0/2", "--resume") == 0
    assert reproduce(tmp_path / "s1", "--shard", "1/2") == 0
    assert cli.main(["reproduce", "--merge", str(tmp_path / "r"), str(tmp_path / "s1"),
                     "--out", str(tmp_path / "m"), "--no-progress"]) == 0
    assert "not run" not in {r["verdict"] for r in scorecard(tmp_path / "m")}


def test_resume_refuses_other_settings(fake, tmp_path, capsys):
    assert reproduce(tmp_path / "r") == 0
    assert reproduce(tmp_path / "r", "--resume", "--dtype", "bfloat16") == 2
    assert "other dtype" in capsys.readouterr().err


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_reproduce_one_node_end_to_end(tmp_path, capsys):
    """Node 11's four runs for real, a few steps of a one-layer model: every scorecard file, a
    row per source, and the runs' own numbers in it."""
    out = tmp_path / "r"
    assert cli.main(["reproduce", "--nodes", "11", "--steps", "3", "--out", str(out),
                     "--set", "model.n_layers=1", "--no-progress"]) == 0
    assert "| 11 |" in capsys.readouterr().out
    for name in (S.MARKDOWN, S.CSV, S.JSON):
        assert (out / name).is_file()
    rows = scorecard(out)
    # every source but Figure 3 (nodes 7 and 14), C.2 (two layers at least) and D.3 (node 10)
    assert {r["source"] for r in rows} == set(S.ORDER) - {"Figure 3", "Appendix C.2",
                                                          "Appendix D.3"}
    assert not [r for r in rows if r["verdict"] == "not run"]
    summary = RF.json_load(out / "runs" / "paper-node-11-paramsync" / RF.SUMMARY)
    (wcnts,) = [r for r in rows if r["source"] == "Figure 5" and r["quantity"] == "WCNTS"]
    assert wcnts["ours"] == pytest.approx(summary["wcnts"]) and math.isfinite(wcnts["ours"])
    frame = pd.read_csv(out / S.CSV)
    assert list(frame.columns) == list(S.COLUMNS) and len(frame) == len(rows)


# --- which model each node keeps -----------------------------------------------------------


def test_each_node_keeps_the_model_that_passes_more_compared_rows():
    """Counted: the additive model's held-out sources, less Figure 10 at the paper's sizes; a
    tie keeps the additive model."""
    from sdcstudy.reproduce import model_choice as MC

    def rows(node, verdicts):
        return [{"node": node, "source": s, "quantity": q, "verdict": v}
                for s, q, v in verdicts]

    additive = rows(1, [("Table 2", "fwd/attn", "fail"), ("Figure 5", "WCNTS", "pass"),
                        ("Table 1", "fwd/attn", "pass"), ("Table 1", "fwd/ffn", "pass")]) + \
        rows(2, [("Figure 6", "loss gap", "pass"),
                 ("Figure 10", "fwd o flagged checks, paper tp 8 (k 512)", "pass")])
    flip = rows(1, [("Table 2", "fwd/attn", "pass"), ("Figure 5", "WCNTS", "pass"),
                    ("Table 1", "fwd/attn", "fail"), ("Table 1", "fwd/ffn", "fail")]) + \
        rows(2, [("Figure 6", "loss gap", "pass"),
                 ("Figure 10", "fwd o flagged checks, the paper's sizes", "not run")])
    choice = MC.choose({"additive": additive, "flip": flip})
    assert {n: c["model"] for n, c in choice.items()} == {1: "flip", 2: "additive"}
    assert choice[1]["additive"]["by_source"] == {"Table 2": "0/1", "Figure 5": "1/1"}
    assert choice[2]["flip"] == {"pass": 1, "fail": 0, "other": 0,
                                 "by_source": {"Figure 6": "1/1"}}
    assert MC.kept(choice) == {1: "flip"}
    assert "| 1 | 0/1 / 1/1 |" in MC.markdown(choice)


# --- Table 2 at the paper's exposure ---------------------------------------------------------


def _tail_run(c: float, steps=200, layers=2, seed=0) -> Run:
    """A lock-step Run whose bwd/attn unit severities follow P(S > t) = c / t (S = c / u)."""
    rng = np.random.default_rng(seed)
    draws = iter(c / rng.uniform(size=steps * layers))
    rows = grid_rows(steps, layers, 1, ELEMENTS, lambda step, micro, layer, site, rank: (
        (1, next(draws)) if site == "bwd/attn" else (0, 0.0)))
    return Run(path=Path("n"), config={"experiment": {"mode": "lockstep"},
                                       "suspect": {"profile": "paper-node-1"}},
               summary={"faults/landed": 1}, metrics=pd.DataFrame({"step": [1]}),
               mismatch=pd.DataFrame(rows), faults=pd.DataFrame(), abft=pd.DataFrame())


def test_table2_at_the_papers_exposure_carries_the_fitted_tail_to_its_units(monkeypatch):
    """c is recovered from 400 units (within 25%), carried to the paper's units of the site as
    c U / ln 2 and judged in the measured spread; too few units above 0.5 are too rare."""
    from sdcstudy.faults import flip_model as FM

    (row,) = [r for r in X.rows(1, _tail_run(0.2)) if "bwd/attn" in r.quantity]
    c, above, units = X.tail_fit(_tail_run(0.2), "bwd/attn")
    assert units == 400 and above > 100 and c == pytest.approx(0.2, rel=0.25)
    paper_units = FM.layer_fit(1, "bwd/attn")["units"]
    assert row.ours == pytest.approx(c * paper_units / math.log(2))
    assert row.verdict == "fail" and row.ratio > 100  # the additive model's case on tiny
    monkeypatch.setattr(X, "EXPOSURE_SPREAD", 2 * row.ratio)
    assert [r.verdict for r in X.rows(1, _tail_run(0.2)) if "bwd/attn" in r.quantity] == \
        ["pass"]
    (rare,) = [r for r in X.rows(1, _tail_run(1e-4)) if "bwd/attn" in r.quantity]
    assert rare.verdict == B.TOO_RARE and rare.ours is None
    assert X.spread([1.0, 2.0, 4.0]) == 2.0 and X.spread([1.0, 4.0]) == 2.0


def test_the_comparison_of_models_leaves_out_the_rows_the_flip_tail_is_fitted_to():
    """A flip-model pass at the paper's exposure (a calibration row under it) does not count
    for the flip model; the same quantity at the run's exposure does."""
    from sdcstudy.reproduce import model_choice as MC

    def rows(verdict_here, verdict_there):
        return [{"node": 1, "source": "Table 9", "quantity": "bwd/ffn layer 1",
                 "verdict": verdict_here},
                {"node": 1, "source": "Table 9", "quantity": "bwd/ffn layer 1" + X.SUFFIX,
                 "verdict": verdict_there}]
    assert MC.choose({"additive": rows("fail", "fail"),
                      "flip": rows("fail", "pass")})[1]["model"] == "additive"
    assert MC.choose({"additive": rows("fail", "fail"),
                      "flip": rows("pass", "fail")})[1]["model"] == "flip"


def test_the_kept_models_are_the_committed_comparisons():
    """flip_model.MODEL_OF_NODE is what the committed comparison of the two tiny scorecards
    keeps (docs/scorecards/fault_models.json, experiments/compare_fault_models.py), and that
    comparison follows from its own tallies by the rule."""
    from sdcstudy.faults import flip_model
    from sdcstudy.reproduce import model_choice as MC

    committed = json.loads((Path(S.PAPER_SCALE).parent / "fault_models.json").read_text())
    assert {int(k): v for k, v in committed["kept"].items()} == flip_model.MODEL_OF_NODE
    for node, c in committed["nodes"].items():
        flip_wins = c["flip"]["pass"] > c["additive"]["pass"]
        assert c["model"] == ("flip" if flip_wins else "additive"), node
    assert sorted(map(int, committed["nodes"])) == list(P.NODES)
    assert set(MC.MODELS) == set(P.FAULT_MODELS)


def test_tables_8_9_at_the_papers_exposure_fit_each_layers_tail():
    """Per layer, the rollup's tail sums give the tail constant `tail_constant` gives on that
    layer's (step, microstep) maxima, carried to the paper's median units a layer; the tail
    floor is the flip model's largest bulk error."""
    from sdcstudy.faults import flip_model as FM
    from sdcstudy.report import rollups as R

    assert R.TAIL_FLOOR == FM.BULK_MAX
    run = _tail_run(0.2)
    rows = {r.quantity: r for r in X.layer_rows(1, run)}
    frame = run.mismatch
    for layer in (1, 2):
        at = frame[(frame["site"] == "bwd/attn") & (frame["layer"] == layer)]
        c = FM.tail_constant(list(at["severity"]), [1.0] * len(at))
        units = sorted(FM.paper_units(f) for f in PL.layer_values("Table 7", 1, "bwd/attn"))
        median = (units[7] + units[8]) / 2
        row = rows[f"bwd/attn layer {layer}" + X.SUFFIX]
        assert row.source == "Table 9" and row.ours == pytest.approx(c * median / math.log(2))
        assert row.verdict == "fail" and X.is_exposure_row(row)
    assert {r.verdict for q, r in rows.items() if "bwd/attn" not in q} == {B.TOO_RARE}


def test_the_findings_flip_noise_ratio_is_the_two_models_own():
    """findings.FLIP_NOISE_RATIO, written out so that reports need no JAX, is sqrt(the flip
    model's noise per unit rate / the additive model's E[m^2]) to its three digits."""
    from sdcstudy.faults import flip_model as FM
    from sdcstudy.faults import profiles as FP

    assert F.FLIP_NOISE_RATIO == round(math.sqrt(FM.bulk_noise() / FP.MAGNITUDE_MEAN_SQUARE), 3)


def test_every_scorecard_names_what_it_was_measured_with(fake, tmp_path):
    """scorecard.md's header and scorecard.json's "provenance" name the sdcstudy commit (or
    package version), the sampler, the fault model per node, the preset, dtype, steps per
    mode and seeds; the sdcstudy version the runs' env.json recorded, and the machine they ran
    on, are named too."""
    from types import SimpleNamespace

    from sdcstudy.reproduce import provenance as PV

    assert cli.main(["reproduce", "--nodes", "1,14", "--steps", "6", "--out", str(tmp_path),
                     "--modes", "lockstep,free", "--fault-model", "chosen", "--set",
                     "experiment.seed=3", "--set", "suspect.fault_seed=5", "--no-progress"]) == 0
    facts = json.loads((tmp_path / S.JSON).read_text())["provenance"]
    assert facts["commit"] == PV.commit() and facts["version"] == PV.version()
    assert facts["commit"] or facts["version"]
    assert facts["sampler"] == PV.SAMPLER and facts["fault_model"] == "chosen"
    assert facts["node_models"] == {"additive": [14], "flip": [1]}
    assert facts["preset"] == "tiny" and facts["dtype"] == ["float32"]
    assert facts["steps"] == {"lockstep": [6], "free": [6]}
    assert (facts["seed"], facts["fault_seed"]) == (3, 5)
    header = (tmp_path / S.MARKDOWN).read_text().splitlines()[4]
    assert header == PV.line(facts)
    for words in (facts["commit"] or "commit unknown", "sampler exact", "fault model chosen "
                  "(additive: nodes 14; flip: nodes 1)", "preset tiny", "dtype float32",
                  "steps lockstep 6, free 6", "seed 3, fault seed 5"):
        assert words in header, words
    runs = {"a": SimpleNamespace(env={"packages": {"sdcstudy": "9.9", "jaxlib": "0.1"},
                                      "platform": "cpu", "cpu": {"model": "Xeon",
                                                                 "isa": ["avx2", "avx512f"]}}),
            "b": SimpleNamespace(env={}),
            "c": SimpleNamespace(env={"platform": "cpu", "cpu": {"model": "EPYC",
                                                                 "isa": ["avx2"]}}),
            "d": SimpleNamespace(env={"platform": "gpu", "device_kinds": {"NVIDIA H200": 1}})}
    facts = PV.collect({}, [], runs)
    assert facts["runs_version"] == ["9.9"]
    assert facts["runs_machine"] == ["CPU EPYC (no AVX-512)", "CPU Xeon (AVX-512), jaxlib 0.1",
                                     "NVIDIA H200"]
    assert ("runs recorded sdcstudy 9.9 on CPU EPYC (no AVX-512); CPU Xeon (AVX-512), "
            "jaxlib 0.1; NVIDIA H200;") in PV.line(facts)


def test_rows_fixed_by_construction_are_tallied_apart_from_held_out_ones():
    """A zero the paper published at a site whose Table 1 rate is 0 (node 13 has only bwd/ffn
    mismatches) and node 13's zero difference before its onset are "fixed by construction":
    counted in their own columns, not among the held-out rows that could have failed."""
    run = lockstep_run({"bwd/ffn": 2e-6}, {"bwd/ffn": 1.0})
    lock = S.build([entry(node=13, expected=made({"bwd/ffn": 2e-6}))], {"n": run})
    roles = {(r.source, r.quantity): r.role for r in lock}
    for site in ("fwd/attn", "fwd/ffn", "bwd/attn"):
        assert roles[("Table 2", site)] == B.FIXED, site
        assert roles[("Table 1", site)] == B.CALIBRATION, site
    assert roles[("Table 2", "bwd/ffn")] == B.HELD_OUT
    steps = 20
    after = [0.0] * 10 + [1e-3 * s for s in range(1, 11)]
    free = paired_run("free", {"loss/healthy": [3.0] * steps, "loss/suspect": [3.0] * steps,
                               "param/diff_l2": after}, 5)
    rows = lock + S.build([entry(node=13, mode="free", steps=steps, onset_step=11)],
                          {"n": free})
    roles = {(r.source, r.quantity): r.role for r in rows}
    assert roles[("Figure 6", "param/diff_l2 before step 11")] == B.FIXED
    assert roles[("Figure 6", "loss gap")] == B.HELD_OUT
    tally = S.counts_by_role(rows)
    fixed = [r for r in rows if r.role == B.FIXED]
    assert tally[B.FIXED]["pass"] == sum(r.verdict == "pass" for r in fixed) >= 4
    assert tally[B.HELD_OUT]["pass"] == sum(r.verdict == "pass" for r in rows
                                             if r.role == B.HELD_OUT)
    assert sum(tally[role][v] for role in S.ROLES for v in B.VERDICTS) == len(rows)
    text = S.markdown(rows, {"preset": "tiny", "steps": 10, "modes": list(P.MODES)})
    assert "| held-out fail | fixed by construction pass | fixed by construction fail |" in text
    assert "## Node 13, fixed by construction rows" in text
