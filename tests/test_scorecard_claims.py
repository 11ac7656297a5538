"""The scorecard's rows for the published results beyond the bands of Tables 1, 2, 6-9 and
Figures 5, 6 and 10 (`reproduce/claim_rows.py`), each scored on synthetic run data: Figures 3-4
measured back, Figure 5's shape, Figure 6's gradient norms, C.2, D.3, Figure 7's loss spike and
Tables 3/5; the results no run makes are "not run" rows that say why. Pure Python: no JAX."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from report_runs import grid_rows

from sdcstudy.core import metrics as MX
from sdcstudy.paired import summary as PS
from sdcstudy.report.runs import Run
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import claim_rows as CR
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import flip_exposure as FX
from sdcstudy.reproduce import scorecard as S
from sdcstudy.reproduce.bands import Row


def _lockstep(count, steps=200, layers=2) -> Run:
    """A lock-step Run whose fwd/attn mismatches at (step, layer) are `count(step, layer)`."""
    rows = grid_rows(steps, layers, 1, 10**9, lambda step, micro, layer, site, rank: (
        (count(step, layer), 0.01) if site == "fwd/attn" else (0, 0.0)))
    return Run(path=Path("n"), config={"experiment": {"mode": "lockstep"}},
               summary={"faults/landed": 1},
               metrics=pd.DataFrame({"step": np.arange(1, steps + 1)}),
               mismatch=pd.DataFrame(rows), faults=pd.DataFrame(), abft=pd.DataFrame())


def _paired(**metrics) -> Run:
    frame = pd.DataFrame({"step": np.arange(1, len(next(iter(metrics.values()))) + 1),
                          **{k.replace("__", "/"): v for k, v in metrics.items()}})
    return Run(path=Path("n"), config={"experiment": {"mode": "free"}},
               summary={"faults/landed": 5}, metrics=frame, mismatch=pd.DataFrame(),
               faults=pd.DataFrame(), abft=pd.DataFrame())


def test_figure3_bursts_are_measured_back_as_over_dispersion():
    """Node 7's bursts (10 steps of 200 holding every mismatch) are over-dispersed against one
    rate: pass; the same total spread evenly (Poisson) is not: fail. If this failed, the row
    would pass a uniform rate as Figure 3's spikes."""
    rng = np.random.default_rng(0)
    bursty = {step: int(rng.poisson(40)) if step % 20 == 0 else 0 for step in range(1, 201)}
    even = {step: int(rng.poisson(2)) for step in range(1, 201)}
    row = CR.burst_row(7, _lockstep(lambda step, layer: bursty[step] // 2))
    assert (row.source, row.verdict) == ("Figure 3", "pass") and row.ours > 10
    row = CR.burst_row(14, _lockstep(lambda step, layer: even[step] // 2 + (step % 2)))
    assert row.verdict == "fail"
    assert CR.burst_row(1, _lockstep(lambda step, layer: 1)) is None  # not plotted
    assert CR.burst_row(7, _lockstep(lambda step, layer: 0)).verdict == "no events"
    assert B.role(7, "Figure 3") == B.role(10, "Figure 4") == B.CALIBRATION


def test_figure4_initial_spike_is_more_mismatches_early_than_later():
    """Node 10: 10 a step in the first 20 steps and 2 after pass; 2 throughout fails."""
    spike = CR.burst_row(10, _lockstep(lambda step, layer: 5 if step <= 20 else 1))
    flat = CR.burst_row(11, _lockstep(lambda step, layer: 1))
    assert (spike.source, spike.verdict, spike.ours) == ("Figure 4", "pass", 5.0)
    assert flat.verdict == "fail" and flat.ours == 1.0


def test_chi2_survival_is_the_tail_of_chi_square():
    """The Wilson-Hilferty tail against known quantiles: chi2(1) at 6.635 is 0.01, chi2(199)
    at 248.3 is 0.01, chi2(10) at 29.59 is 0.001."""
    assert CR.chi2_survival(6.635, 1) == pytest.approx(0.01, rel=0.1)
    assert CR.chi2_survival(248.3, 199) == pytest.approx(0.01, rel=0.05)
    assert CR.chi2_survival(29.59, 10) == pytest.approx(0.001, rel=0.1)


def test_figure5_shape_is_larger_before_step_100_and_held_out():
    """A gradient difference that falls with the gradient norm passes; one that grows fails.
    The row is held-out (the rates are fitted to WCNTS, not to the curve)."""
    norm = np.linspace(2.0, 0.5, 200)
    falling = CR.figure5_shape_row(1, _paired(grad__diff_l2=0.04 * norm, grad__norm=norm))
    rising = CR.figure5_shape_row(1, _paired(grad__diff_l2=0.04 / norm, grad__norm=norm))
    assert falling.verdict == "pass" and falling.ours > 1 and "correlation" in falling.reason
    assert rising.verdict == "fail" and rising.ours < 1
    assert "before step 100" in falling.quantity
    assert B.role(1, falling.source) == B.HELD_OUT and B.role(1, "Figure 5") == B.CALIBRATION
    short = CR.figure5_shape_row(1, _paired(grad__diff_l2=[3.0, 2.0, 1.0, 1.0],
                                            grad__norm=[2.0, 2.0, 1.0, 1.0]))
    assert "before step 2" in short.quantity and short.verdict == "pass"
    # Three steps split at step 1 leave nothing before it: said so, not "no difference".
    shortest = CR.figure5_shape_row(1, _paired(grad__diff_l2=[3.0, 2.0, 1.0],
                                               grad__norm=[2.0, 2.0, 1.0]))
    assert (shortest.verdict, shortest.reason) == (
        "no events", "a run of 3 steps, too short to split at step 1")
    flat = CR.figure5_shape_row(1, _paired(grad__diff_l2=np.zeros(200), grad__norm=norm))
    assert (flat.verdict, flat.reason) == ("no events", "no gradient difference in the run")


def test_figure5_shape_needs_something_that_falls():
    """A healthy gradient norm 5% lower after step 100, and as many corruptions a step, give
    the difference nothing to follow: not applicable, whichever way it moves (tiny's 200
    steps); where the corruptions a step fall threefold (Figure 4's initial spike) a rising
    difference is judged, and fails."""
    norm = np.r_[np.full(99, 1.05), np.ones(101)]
    for diff in (0.04 * norm, 0.04 / norm):
        row = CR.figure5_shape_row(1, _paired(grad__diff_l2=diff, grad__norm=norm,
                                              faults__landed=np.full(200, 50.0)))
        assert row.verdict == "not applicable" and "1.05x its norm after" in row.reason
    spike = np.r_[np.full(99, 150.0), np.full(101, 50.0)]
    row = CR.figure5_shape_row(10, _paired(grad__diff_l2=0.04 / norm, grad__norm=norm,
                                           faults__landed=spike))
    assert row.verdict == "fail"


def test_figure5_shape_counts_each_weight_gradient_corruption_once():
    """`faults/landed` counts every corruption, the weight gradients' too (faults.parquet's
    `grad/` rows are among them): corruptions at the activations falling from 3 to 1 a step
    beside 10 a step in the weight gradients fall 13/11 = 1.18x, and the row is judged. Adding
    the `grad/` rows again (10 a step counted twice: 23/21 = 1.095x, under `FLAT`) read as
    nothing falling: not applicable."""
    from sdcstudy.core import tablelog as TL

    norm = np.r_[np.full(99, 1.05), np.ones(101)]
    landed = np.r_[np.full(99, 13.0), np.full(101, 11.0)]
    grad_rows = pd.DataFrame([{**dict.fromkeys(TL.FAULT_COLUMNS, 0), "step": step,
                               "site": "grad/head", "kind": "bitflip", "flat_index": i}
                              for step in range(1, 201) for i in range(10)],
                             columns=list(TL.FAULT_COLUMNS))
    run = _paired(grad__diff_l2=0.04 / norm, grad__norm=norm, faults__landed=landed)
    run = Run(path=run.path, config=run.config, summary=run.summary, metrics=run.metrics,
              mismatch=run.mismatch, faults=grad_rows, abft=run.abft)
    assert CR.faults_a_step(run).tolist() == landed.tolist()
    row = CR.figure5_shape_row(10, run)
    assert row.verdict == "fail", row.reason


def test_figure6_gradient_norms_follow_the_healthy_ones():
    """A 1% median gap passes, a 5% one fails; the reason says the paper gives no number."""
    healthy = np.linspace(2.0, 1.0, 50)
    near = CR.figure6_grad_norm_row(1, _paired(grad__norm=healthy,
                                               grad__norm_suspect=healthy * 1.01))
    far = CR.figure6_grad_norm_row(1, _paired(grad__norm=healthy,
                                              grad__norm_suspect=healthy * 1.05))
    assert (near.verdict, far.verdict) == ("pass", "fail")
    assert "the paper gives no number" in near.reason


def test_c2_no_per_layer_trend_is_one_rate_over_the_layers_and_fixed():
    """Counts of 100 a step in each of 4 layers: one rate, pass; 100, 200, 300, 400: a trend,
    fail. The row is fixed by construction (the profiles' rates are the same in each layer)."""
    (flat,) = CR.layer_trend_rows(1, _lockstep(lambda step, layer: 100, steps=5, layers=4))
    (trend,) = CR.layer_trend_rows(1, _lockstep(lambda step, layer: 100 * layer, steps=5,
                                               layers=4))
    assert (flat.verdict, trend.verdict) == ("pass", "fail")
    assert B.fixed(flat) and flat.source == "Appendix C.2"
    assert CR.layer_trend_rows(1, _lockstep(lambda step, layer: 1, steps=5)) == []  # too few


def _rows_of_node10(freq, severity):
    return [Row(10, "Table 1", "fwd/attn", 4.78e-3, freq, None, "", "pass"),
            Row(10, "Table 2", "fwd/attn" + X.SUFFIX, 1120.0, severity, None, "", "pass")]


def test_d3_is_node_10s_frequency_times_its_severity_at_the_papers_exposure():
    """4.78e-3 x 1120 = 5.35 passes; 100 times it fails; a missing number is too rare."""
    row = CR.d3_row(_rows_of_node10(4.78e-3, 1120.0))
    assert row.verdict == "pass" and row.ours == pytest.approx(5.35, rel=1e-3)
    assert CR.d3_row(_rows_of_node10(4.78e-3, 112000.0)).verdict == "fail"
    assert CR.d3_row(_rows_of_node10(4.78e-3, None)).verdict == B.TOO_RARE
    assert CR.d3_row(_rows_of_node10(4.78e-3, 1120.0)[:1]) is None


def test_d3_takes_the_frequency_back_to_the_papers_time_pattern():
    """A run whose time pattern doubles Table 1's rate (Figure 4's initial spike over a short
    run: the Table 1 row expects 2 x 4.78e-3) enters D.3 at 4.78e-3, and passes; failing above
    with its severity row failing above, it carries that row's finding."""
    freq, severity = _rows_of_node10(2 * 4.78e-3, 1120.0)
    freq.expected = 2 * 4.78e-3
    row = CR.d3_row([freq, severity])
    assert row.verdict == "pass" and row.ours == pytest.approx(5.35, rel=1e-3)
    severity.ours, severity.ratio = 112000.0, 100.0
    severity.verdict, severity.why = "fail", "docs/faults.md 5.3, the tail"
    row = CR.d3_row([freq, severity])
    assert row.verdict == "fail" and row.why.endswith("docs/faults.md 5.3, the tail")
    freq.verdict = "fail"
    assert CR.d3_row([freq, severity]).why == ""


def test_d3_under_the_flip_model_takes_the_severity_rows_own_band():
    """A flip-model Table 2 row carries its own band (flip_exposure); D.3 multiplies by it,
    not by the additive band factors: with a band of [0.5, 2] x 1120, 4.78e-3 x 3000 (2.7x
    the published product) fails, though it lies inside the additive factors' band."""
    def flip_rows(severity):
        freq, sev = _rows_of_node10(4.78e-3, severity)
        sev.band, sev.reason = B.interval(560.0, 2240.0), FX.FLIP_REASON + " 1e7 units"
        return [freq, sev]
    lo, hi = X.band_factors()
    assert lo < 3000 / 1120 < hi  # the additive band would pass it
    assert CR.d3_row(flip_rows(3000.0)).verdict == "fail"
    assert CR.d3_row(flip_rows(1500.0)).verdict == "pass"


def test_figure7_spike_is_the_one_criterion():
    """Node 6's spike (pass) is a suspect loss 0.6 nats over the healthy one at two consecutive
    steps, or a NaN from some step on; at one step only (a corrupted reading), 0.4 nats, or
    with the healthy loss up as much, there is none (fail). On node 1, where the paper shows
    none, the verdicts turn round. The steps it judges are the ones summary.json's
    `loss_spikes` flags, by the same functions."""
    assert (CR.SPIKE_NATS, CR.SPIKE_MIN_STEPS) == (MX.SPIKE_NATS, MX.SPIKE_MIN_STEPS) == (0.5, 2)
    base = np.linspace(3.0, 1.0, 40)

    def run(bump, steps=(30,), healthy_too=False):
        healthy, suspect = base.copy(), base.copy()
        suspect[list(steps)] += bump
        if healthy_too:
            healthy[list(steps)] += bump
        return _paired(loss__healthy=healthy, loss__suspect=suspect)

    def verdicts(case):
        return tuple(CR.figure7_row(node, case, "the synthetic multiple-choice task, "
                                    "tiny").verdict for node in (6, 1))
    assert verdicts(run(0.6, (30, 31))) == ("pass", "fail")
    assert verdicts(run(float("nan"), range(30, 40))) == ("pass", "fail")
    for no_spike in (run(0.6), run(0.4, (30, 31)), run(0.6, (30, 31), healthy_too=True)):
        assert verdicts(no_spike) == ("fail", "pass")
    spike = CR.figure7_row(6, run(0.6, (30, 31)), "tiny")
    assert "steps 31-32" in spike.reason and "step 31 of 40" in spike.reason
    assert "tiny" in spike.quantity and spike.ours == pytest.approx(0.6)
    assert "no spike" in CR.figure7_row(6, run(0.6), "tiny").reason
    # summary.json's field for the same losses flags the same steps
    rows = run(0.6, (30, 31)).metrics.to_dict("records")
    assert PS.paired_summary(rows, {}, {}, "float32")["loss_spikes"] == [31, 32]


def test_tables_3_5_pass_above_the_unfine_tuned_model_and_near_the_other_seed():
    """Tables 3/5's claim on one task: TA above the model before fine-tuning and DP at most
    twice the other seed's."""
    assert CR.finetune_row(1, "qa", 93.4, 1.2, 50.0, 3.4).verdict == "pass"
    assert CR.finetune_row(6, "qa", 42.6, 52.4, 50.0, 3.4).verdict == "fail"
    assert CR.finetune_row(6, "qa", 93.0, 52.4, 50.0, 3.4).verdict == "fail"


def test_results_no_run_makes_are_rows_with_their_reason():
    """Every scorecard lists Tables 3/5, Figure 7 and D.4 as "not reproducible here" with why,
    so its tally does not pass over them. If this failed, a scorecard would look complete
    without them."""
    rows = S.build([], {})
    assert {(r.source, r.verdict) for r in rows} == {
        ("Tables 3/5", B.NOT_HERE), ("Figure 7", B.NOT_HERE), ("Appendix D.4", B.NOT_HERE)}
    assert all("scorecard" in r.reason for r in rows)
    assert S.counts(rows)[B.NOT_HERE] == 3
    assert set(S.ORDER) >= {r.source for r in rows}


def test_figure10_run_passes_without_an_attention_fault_are_counted_apart():
    """A "little or nothing" node whose ABFT run landed no attention-output fault passes
    Figure 10 whatever its model: the row says it passes trivially and is tallied with the
    rows fixed by construction; with one fwd/attn fault landed the same pass is held-out.
    (Issue 55: all 7 Figure 10 run passes of tiny.md were such nodes.)"""
    from report_runs import abft_rows

    from sdcstudy.reproduce import training_rows as TR

    def run(faults):
        checks = abft_rows(4, 1, 1, lambda *cell: False)
        return Run(path=Path("n"), config={"experiment": {"mode": "abft"}},
                   summary={"faults/landed": 3}, metrics=pd.DataFrame({"step": [1, 2, 3, 4]}),
                   mismatch=pd.DataFrame(), faults=pd.DataFrame(faults),
                   abft=pd.DataFrame(checks))

    entry = {"node": 1, "mode": "abft", "steps": 4, "active_steps": None,
             "sites": {site: {"mismatches": 1.0 if site == "fwd/attn" else 0.0, "scale": 1.0}
                       for site in ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")}}
    quiet = TR.figure10_row(1, "n", run([{"step": 2, "site": "fwd/ffn", "kind": "additive",
                                          "bit": -1}]), dict(entry, sites={
                                              **entry["sites"], "fwd/attn": {"mismatches": 0.0,
                                                                             "scale": 1.0},
                                              "fwd/ffn": {"mismatches": 1.0, "scale": 1.0}}))
    assert quiet.verdict == "pass" and quiet.reason.startswith(B.TRIVIAL) and B.fixed(quiet)
    hit = TR.figure10_row(1, "n", run([{"step": 2, "site": "fwd/attn", "kind": "additive",
                                        "bit": -1}]), entry)
    assert hit.verdict == "pass" and not B.fixed(hit)
