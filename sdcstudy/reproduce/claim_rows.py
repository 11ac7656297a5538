"""Scorecard rows for the published results beyond the bands of Tables 1, 2, 6-9 and Figures 5,
6 and 10 (issue 55): Figures 3-4 measured back, Figure 5's shape, Figure 6's gradient norms,
appendix C.2's "no per-layer trends", D.3's worst-case estimate, Figure 7's loss spike and
Tables 3/5's fine-tuning outcome, and rows (`bands.NOT_HERE`) that say why a result is not
reproduced here.
Each takes what a run leaves (its metrics, mismatch rollup, summary) or rows already scored.
Imports no JAX.

Ma et al., "Understanding Silent Data Corruption in LLM Training":
- Figure 3 (nodes 7, 14): "spikes of mismatch frequency sometimes occur": the per-step count of
  fwd/attn mismatches is over-dispersed against a uniform rate (`dispersion_p_value`);
- Figure 4 (nodes 10, 11): "large initial spikes in smoothed mismatch frequency": the first
  `INITIAL_SHARE` of the steps holds more fwd/attn mismatches a step than the rest, beyond
  Poisson noise. Both are inputs of the profiles' time patterns: calibration rows;
- Figure 5's shape: "the L2 norm of the gradient difference is large before the 100-th step
  ... and continues to decrease as the norm of the ground-truth gradients decreases": its mean
  before `EARLY_STEP` (half the run where shorter) above its mean after; not applicable where
  neither the healthy gradient norm nor the corruptions a step fall (docs/faults.md 5.7);
- Figure 6's gradient norms, plotted and given no number: the suspect's `grad/norm_suspect`
  within `GRAD_NORM_GAP` of the healthy `grad/norm` at the median step (our reading, as the
  loss curves are "identical");
- C.2: "we generally do not observe any per decoder layer trends": per site, the layers' counts
  are consistent with one rate (a chi-square test at `TREND_LEVEL`). The profiles' rates are
  uniform over layers, so the row is fixed by construction;
- D.3: node 10's worst case, Table 1's fwd/attn frequency x Table 2's severity, 4.78e-3 x 1120
  = 5.35: ours from the node's two rows at the paper's exposure (the frequency taken back to
  the paper's time pattern), in the product of their bands;
- Figure 7: a loss spike by the study's one criterion (`core.metrics.loss_spike_spans`; the
  steps it flags are the runs' summary.json `loss_spikes`): the suspect's loss not finite or
  more than `SPIKE_NATS` above the healthy one's at the same step, at `SPIKE_MIN_STEPS`
  consecutive steps;
- Tables 3/5: the fine-tuned suspect's test accuracy above the model's before fine-tuning and
  its disagreement with the healthy node at most `DP_FACTOR` times the other seed's.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sdcstudy.core import metrics as MX
from sdcstudy.faults import published as PB
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import flip_exposure as FX
from sdcstudy.reproduce.bands import Row
from sdcstudy.reproduce.training_rows import series

BURST_NODES, INITIAL_SPIKE_NODES = (7, 14), (10, 11)  # Figures 3 and 4
FIGURE_SITE = "fwd/attn"  # the site Figures 3 and 4 plot
BURST_LEVEL = 1e-3  # one-sided level of the over-dispersion and initial-spike tests
INITIAL_SHARE = 0.10  # the steps of an "initial spike": the first tenth of the run
EARLY_STEP = 100  # Figure 5: "large before the 100-th step"
SHAPE_SOURCE = "Figure 5, shape"  # held-out: the rates are set from WCNTS, not from the curve
FLAT = 1.1  # a series "does not fall" where its early mean is at most 1.1x its late one
GRAD_NORM_GAP = 0.02  # the loss's 2% (bands.LOSS_GAP), read for the gradient norms
TREND_LEVEL = 1e-3  # C.2: the chi-square test's level
D3_NODE, D3_PUBLISHED = 10, 5.35  # appendix D.3: 4.78e-3 x 1120
SPIKE_NATS, SPIKE_MIN_STEPS = MX.SPIKE_NATS, MX.SPIKE_MIN_STEPS  # Figure 7: the one criterion
FIGURE7_NODES = (4, 6, 7)  # "On Node 4, Node 6 and Node 7, the loss spikes occur"
DP_FACTOR = 2.0  # Tables 3/5: "comparable to finetuning under a different shuffling seed"


def chi2_survival(statistic: float, dof: int) -> float:
    """P(chi2(dof) >= statistic), by the Wilson-Hilferty normal approximation (within about
    1e-3 of the exact tail for dof >= 1 at the levels used here)."""
    if dof <= 0:
        return 1.0
    if statistic <= 0:
        return 1.0
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def step_counts(run, site: str = FIGURE_SITE) -> pd.Series:
    """Mismatches at `site` per step (summed over microsteps), every step of the run present."""
    micro = run.mismatch_rollup.by_microstep
    steps = (pd.Index(run.metrics["step"].astype(int)) if "step" in run.metrics
             else pd.Index([], dtype=int))
    if not len(micro) or site not in micro.index.get_level_values("site"):
        return pd.Series(0, index=steps, dtype=float)
    counts = micro.xs(site, level="site")["mismatches"].groupby(level="step").sum()
    return counts.reindex(steps.union(counts.index), fill_value=0).astype(float)


def dispersion_p_value(counts) -> float:
    """One-sided p-value of the counts' index of dispersion against one Poisson rate: (n - 1)
    var / mean is chi2(n - 1) under it."""
    counts = np.asarray(counts, float)
    mean = counts.mean() if len(counts) else 0.0
    if len(counts) < 2 or mean == 0:
        return 1.0
    return chi2_survival(float(((counts - mean) ** 2).sum() / mean), len(counts) - 1)


def burst_row(node: int, run) -> Row | None:
    """Figure 3 or 4 measured back from a lock-step run (module docstring); None for a node the
    figures do not plot."""
    counts = step_counts(run)
    if node in BURST_NODES:
        quantity, band = (f"{FIGURE_SITE} mismatches a step: spikes (over-dispersion)",
                          f"p < {BURST_LEVEL:g} against one rate")
        if counts.sum() == 0:
            return Row(node, "Figure 3", quantity, "spikes", None, None, band, "no events",
                       "no fwd/attn mismatch in the run")
        p = dispersion_p_value(counts)
        dispersion = float(counts.var(ddof=1) / counts.mean())
        return Row(node, "Figure 3", quantity, "spikes", dispersion, None, band,
                   "pass" if p < BURST_LEVEL else "fail",
                   f"variance / mean {B.g(dispersion)} over {len(counts)} steps, p = {p:.2g}")
    if node not in INITIAL_SPIKE_NODES:
        return None
    first = max(1, round(INITIAL_SHARE * len(counts)))
    early, late = counts.iloc[:first], counts.iloc[first:]
    quantity = (f"{FIGURE_SITE} mismatches a step, first {first} steps over the rest: an "
                f"initial spike")
    band = f"> 1, p < {BURST_LEVEL:g}"
    if not len(late) or counts.sum() == 0:
        return Row(node, "Figure 4", quantity, "initial spike", None, None, band, "no events",
                   "no fwd/attn mismatch in the run" if len(late) else "a run of one step")
    ratio, p = initial_spike(counts)
    return Row(node, "Figure 4", quantity, "initial spike", ratio, None, band,
               "pass" if spiked(ratio, p) else "fail",
               f"{int(early.sum())} mismatches in the first {first} steps against "
               f"{B.g(late.mean() * first)} at the later rate, p = {p:.2g}")


def initial_spike(counts) -> tuple[float, float]:
    """(the first `INITIAL_SHARE` of the steps' mean count over the rest's, the one-sided
    Poisson p-value of the early sum at the later rate) of per-step counts, at least two steps
    long."""
    counts = np.asarray(counts, float)
    first = max(1, round(INITIAL_SHARE * len(counts)))
    early, late_rate = counts[:first], counts[first:].mean()
    if not late_rate:
        return math.inf, 0.0
    return (float(early.mean() / late_rate),
            B.poisson_above(int(early.sum()), late_rate * first))


def spiked(ratio: float, p: float) -> bool:
    """Figure 4's verdict on `initial_spike`'s numbers."""
    return ratio > 1 and p < BURST_LEVEL


def shape_split(steps: pd.Index) -> int:
    """The step that splits Figure 5's curve: `EARLY_STEP`, or half a shorter run."""
    return min(EARLY_STEP, int(steps.max()) // 2) if len(steps) else EARLY_STEP


def early_over_late(values: pd.Series, split: int) -> float | None:
    """The mean of `values` (indexed by step) before `split` over its mean from it on; None
    where either side is empty or the later mean is 0."""
    early, late = values[values.index < split], values[values.index >= split]
    if not len(early) or not len(late) or not late.mean():
        return None
    return float(early.mean() / late.mean())


def figure5_shape_row(node: int, run) -> Row:
    """Figure 5's curve: `grad/diff_l2` larger before `EARLY_STEP` than after (module
    docstring), from the parameter-synchronized run; not applicable where neither the healthy
    gradient norm nor the corruptions a step fall after the split (by more than `FLAT`): the
    paper's difference falls as its gradient norm does, and such a run has nothing to fall."""
    diff = series(run, "grad/diff_l2").dropna()
    split = shape_split(diff.index)
    quantity = f"grad/diff_l2, mean before step {split} over after"
    early, late = diff[diff.index < split], diff[diff.index >= split]
    if not len(early) or not len(late) or diff.max() == 0:
        return Row(node, SHAPE_SOURCE, quantity, "large, then falling", None, None, "> 1",
                   "no events", "no gradient difference in the run" if diff.max() == 0 else
                   f"a run of {len(diff)} steps, too short to split at step {split}")
    ratio = early.mean() / late.mean() if late.mean() else math.inf
    norm = series(run, "grad/norm").reindex(diff.index)
    measured = (f"{B.g(early.mean())} before, {B.g(late.mean())} after; its rank correlation "
                f"with the healthy gradient norm {B.g(_rank_correlation(diff, norm))}")
    falls = early_over_late(norm.dropna(), split), early_over_late(faults_a_step(run), split)
    if falls[0] is not None and max(f or 0.0 for f in falls) <= FLAT:
        faults = "no corruption" if falls[1] is None else f"{B.g(falls[1])}x its corruptions"
        return Row(node, SHAPE_SOURCE, quantity, "large, then falling", ratio, None, "> 1",
                   "not applicable",
                   f"{measured}; nothing falls for it to follow: the healthy gradient norm "
                   f"before step {split} is {B.g(falls[0])}x its norm after, with {faults} a "
                   f"step (docs/faults.md 5.7)")
    return Row(node, SHAPE_SOURCE, quantity, "large, then falling", ratio, None, "> 1",
               "pass" if ratio > 1 else "fail", measured)


def faults_a_step(run) -> pd.Series:
    """Corruptions per step at every site, the weight gradients' included: `faults/landed`
    (logged or not; once per device that holds each, docs/metrics.md). faults.parquet's
    `grad/` rows are among them, not beside them."""
    return series(run, "faults/landed").fillna(0.0)


def _rank_correlation(a: pd.Series, b: pd.Series) -> float | None:
    """Spearman's rank correlation of two series on one index; None where either is constant
    or missing."""
    both = pd.DataFrame({"a": a, "b": b}).dropna().rank()
    if len(both) < 2 or both["a"].std() == 0 or both["b"].std() == 0:
        return None
    return float(np.corrcoef(both["a"], both["b"])[0, 1])


def figure6_grad_norm_row(node: int, run) -> Row:
    """Figure 6's gradient norms: the median over steps of |suspect - healthy| / healthy."""
    healthy = series(run, "grad/norm")
    suspect = series(run, "grad/norm_suspect").reindex(healthy.index)
    gap = ((suspect - healthy).abs() / healthy).dropna()
    quantity, band = "gradient norm, median relative gap", f"<= {GRAD_NORM_GAP:.0%}"
    if not len(gap):
        return Row(node, "Figure 6", quantity, "plotted", None, None, band, "fail",
                   "the run has no grad/norm_suspect")
    median = float(gap.median())
    return Row(node, "Figure 6", quantity, "plotted", median, None, band,
               "pass" if median <= GRAD_NORM_GAP else "fail",
               f"largest {B.g(float(gap.max()))} at step {int(gap.idxmax())}; the paper gives "
               f"no number: {GRAD_NORM_GAP:.0%} is the loss's band, our reading")


def layer_trend_rows(node: int, run) -> list[Row]:
    """C.2: per site with at least `bands.MIN_EXPECTED` mismatches, the layers' counts against
    one rate (chi-square, equal elements a layer)."""
    by_layer = run.mismatch_rollup.by_layer
    rows = []
    if not len(by_layer):
        return rows
    for site in PB.SITES:
        at = by_layer[by_layer.index.get_level_values("site") == site]["mismatches"]
        counts = at.to_numpy(float)
        if len(counts) < 2 or counts.sum() < B.MIN_EXPECTED:
            continue
        mean = counts.mean()
        statistic = float(((counts - mean) ** 2).sum() / mean)
        p = chi2_survival(statistic, len(counts) - 1)
        rows.append(Row(node, "Appendix C.2", f"{site}: mismatches over {len(counts)} layers",
                        "no per-layer trend", float(counts.max() / counts.min())
                        if counts.min() else None, None, f"one rate, p >= {TREND_LEVEL:g}",
                        "pass" if p >= TREND_LEVEL else "fail",
                        f"chi-square {B.g(statistic)} on {len(counts) - 1} degrees of "
                        f"freedom, p = {p:.2g}; the profile's rate is the same in every layer"))
    return rows


def _severity_factors(severity: Row) -> tuple[float, float]:
    """(lo, hi) of a Table 2 row at the paper's exposure as factors of the published value:
    the additive model's `exposure_rows.band_factors`, or the flip model's own band
    (`flip_exposure`: the band on ours that holds the published value in the law's central
    range, read back from the row at its three significant digits)."""
    bounds = B.bounds(severity.band)
    if severity.reason.startswith(FX.FLIP_REASON) and bounds is not None:
        return bounds[0] / severity.published, bounds[1] / severity.published
    return X.band_factors()


def d3_row(rows: list[Row]) -> Row | None:
    """D.3 from node 10's scored rows: Table 1's fwd/attn frequency, taken back to the paper's
    4500 steps (this run's over its time pattern's scale, `plan.expectations`), x Table 2's
    fwd/attn severity at the paper's exposure, against 5.35 in the product of the two bands.
    Where it fails on the side its severity row fails, with the frequency in its band, it
    carries that row's finding."""
    mine = [r for r in rows if r.node == D3_NODE]
    freq = next((r for r in mine if r.source == "Table 1" and r.quantity == "fwd/attn"), None)
    severity = next((r for r in mine if r.source == "Table 2"
                     and r.quantity == "fwd/attn" + X.SUFFIX), None)
    if freq is None or severity is None:
        return None
    lo_s, hi_s = _severity_factors(severity)
    lo = D3_PUBLISHED * (1 - B.FREQ_TOLERANCE) * lo_s
    hi = D3_PUBLISHED * (1 + B.FREQ_TOLERANCE) * hi_s
    quantity = "node 10's worst-case row-sum factor, frequency x severity (fwd/attn)"
    if freq.ours is None or severity.ours is None:
        return Row(D3_NODE, "Appendix D.3", quantity, D3_PUBLISHED, None, None,
                   B.interval(lo, hi), B.TOO_RARE,
                   "Table 1's or Table 2's fwd/attn row has no number")
    scale = freq.expected / freq.published if freq.expected and freq.published else 1.0
    frequency = freq.ours / scale
    ours = frequency * severity.ours
    row = Row(D3_NODE, "Appendix D.3", quantity, D3_PUBLISHED, ours,
              B.ratio(ours, D3_PUBLISHED), B.interval(lo, hi),
              "pass" if B.within(ours, lo, hi) else "fail",
              f"{B.g(frequency)} (this run's {B.g(freq.ours)} over its time pattern's "
              f"{B.g(scale)}x) x {B.g(severity.ours)} (Table 2 at the paper's exposure); the "
              f"band is the two rows' bands multiplied")
    if row.verdict == "fail" and freq.verdict == "pass" and severity.why \
            and (ours > hi) == (severity.ratio is not None and severity.ratio > 1):
        row.why = f"its severity factor is Table 2 at the paper's exposure: {severity.why}"
    return row


def loss_spike(healthy: pd.Series, suspect: pd.Series) -> tuple[list, int | None, float]:
    """The loss spikes of `suspect` against `healthy` (per step) by the study's criterion
    (`core.metrics.loss_spike_spans`), as (first, last) steps; the step of the largest excess of
    the suspect's loss over the healthy one's and that excess in nats (a non-finite suspect
    loss is an infinite excess; None, 0.0 without a step to compare)."""
    healthy = healthy.reindex(suspect.index)
    rows = [{"step": step, "loss/healthy": h, "loss/suspect": s}
            for step, h, s in zip(suspect.index, healthy, suspect)]
    spans = MX.loss_spike_spans(MX.loss_spikes(rows))
    excess = suspect - healthy
    excess[~np.isfinite(suspect.to_numpy(float))] = math.inf
    excess = excess.dropna()
    if not len(excess):
        return spans, None, 0.0
    return spans, int(excess.idxmax()), float(excess.max())


def figure7_row(node: int, run, what: str) -> Row:
    """Figure 7: the loss spike of `node` (4, 6, 7) in a fine-tuning run's loss series, or none
    (the paper shows none for the other nodes), by `loss_spike`; `what` names the run's task
    and size. `ours` is the largest excess, the reason names the spikes' steps."""
    healthy, suspect = series(run, "loss/healthy"), series(run, "loss/suspect")
    spans, step, excess = loss_spike(healthy, suspect)
    published = "a loss spike" if node in FIGURE7_NODES else "no loss spike"
    rule = (f"suspect loss > healthy + {SPIKE_NATS:g} nats (or not finite) at "
            f"{SPIKE_MIN_STEPS} consecutive steps")
    band = rule if node in FIGURE7_NODES else f"never {rule}"
    quantity = f"suspect loss over healthy, largest excess ({what})"
    if step is None:
        return Row(node, "Figure 7", quantity, published, None, None, band, "fail",
                   "the run has no losses")
    found = (f"a spike at steps {', '.join(f'{a}-{b}' for a, b in spans)}" if spans
             else "no spike")
    return Row(node, "Figure 7", quantity, published, excess, None, band,
               "pass" if bool(spans) == (node in FIGURE7_NODES) else "fail",
               f"{found}; largest excess at step {step} of {int(suspect.index.max())}")


def finetune_row(node: int, task: str, ta: float, dp: float, initial_ta: float,
                 seed_dp: float) -> Row:
    """Tables 3/5 for one node and task: the suspect's test accuracy above the model's before
    fine-tuning, and its disagreement at most `DP_FACTOR` x the other shuffle seed's."""
    ok = ta > initial_ta and dp <= DP_FACTOR * seed_dp
    return Row(node, "Tables 3/5", f"TA (DP), {task}",
               "TA above the unfine-tuned model's; DP comparable to another seed's", ta, None,
               f"TA > {B.g(initial_ta)}, DP <= {DP_FACTOR:g} x {B.g(seed_dp)}",
               "pass" if ok else "fail",
               f"TA {B.g(ta)} (before fine-tuning {B.g(initial_ta)}), DP {B.g(dp)} (another "
               f"seed {B.g(seed_dp)})")


# Published results the scorecard's runs do not make, and why (docs/reproduction.md).
UNSCORED = (
    ("Tables 3/5", "test accuracy and disagreement after fine-tuning on six QA tasks",
     "the paper fine-tunes Mistral-7B-v0.3 on CosmosQA, MathQA, ScienceQA, OpenbookQA, BoolQ "
     "and RACE, which this offline machine has neither the weights nor the data for; the "
     "scorecard plans no fine-tuning run. `python experiments/finetune_qa.py --out DIR` "
     "fine-tunes the tiny model on the synthetic multiple-choice task, which `finetune_row` "
     "scores"),
    ("Figure 7", "loss spikes while fine-tuning (nodes 4, 6, 7; node 6 to 0% accuracy)",
     "the scorecard plans no fine-tuning run; `figure7_row` scores any run's loss series. "
     "Node 6 as published makes no spike here (its faults land in the weight gradient, which "
     "clipping and Adam absorb); the zoo regime `paper-node-6-loss-spike` (node 6 plus rare "
     "errors in the parameter update) does: `python experiments/loss_spike.py --out DIR`, "
     "docs/faults.md section 7"),
    ("Appendix D.4", "bfloat16 ABFT false alarms on healthy nodes, none at float32",
     "the scorecard's ABFT runs check in float32, as appendix D.1 ran it; measured apart by "
     "`python experiments/abft_eval.py --out DIR` (docs/results/abft.md: the paper's threshold "
     "flags every healthy bfloat16 trial of the tiny model and no float32 one)"),
)


def unscored_rows() -> list[Row]:
    """One `bands.NOT_HERE` row, across nodes, for each result of `UNSCORED`."""
    return [Row(B.ACROSS_NODES, source, quantity, "see the paper", None, None, "-", B.NOT_HERE,
                why) for source, quantity, why in UNSCORED]
