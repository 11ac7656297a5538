"""Scorecard rows of the runs that train on: Figure 5 (RQ2, parameter sync), Figure 6 (RQ3,
free running) and Figure 10 (appendix D, ABFT). Bands in `bands`; imports no JAX. Each row
fails first on an event count inconsistent with the profile (`site_fault_count`).
"""

from __future__ import annotations

import math

import pandas as pd

from sdcstudy.faults import published as PB
from sdcstudy.report import tables as T
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce.bands import Row

ABFT_NODE = 14  # appendix D.2: the one node on which ABFT flags frequently
# Figure 5's second row: the root mean square of grad/nts over the steps, where WCNTS is its
# maximum. The weight-gradient rates set E[nts^2] (faults.profiles: r E[m^2] = WCNTS^2); a
# mean would fall below it wherever most steps have no fault (node 15: 161 of 200 on tiny).
RMS_NTS = "rms grad/nts"


def series(run, key: str) -> pd.Series:
    """Metric `key` per optimizer step (index: step), NaN where a step has none."""
    if key not in run.metrics or not len(run.metrics):
        return pd.Series(dtype=float)
    return pd.Series(pd.to_numeric(run.metrics[key], errors="coerce").to_numpy(float),
                     index=run.metrics["step"].astype(int).to_numpy())


def not_finite(run) -> str | None:
    """Why a run's WCNTS cannot pass: steps whose `grad/nts` is NaN or infinite, which eq. (5)'s
    max leaves out (a suspect gradient gone NaN would pass on its finite steps); else None."""
    nts = series(run, "grad/nts")
    bad = nts[~nts.map(math.isfinite)]
    return (f"{len(bad)} step(s) have a grad/nts that is not finite (the first, step "
            f"{int(bad.index.min())}), left out of the max") if len(bad) else None


def figure5_row(node: int, name: str, run, entry: dict) -> Row:
    """The WCNTS table of Figure 5, eq. (5), from the parameter-synchronized run."""
    published = PB.WCNTS[node]
    table = T.wcnts_table({name: run})
    ours = B.num(table.at[name, "wcnts"]) if name in table.index else None
    lo, hi = published / B.WCNTS_FACTOR, published * B.WCNTS_FACTOR
    band = B.interval(lo, hi)
    if ours is None:
        return Row(node, "Figure 5", "WCNTS", published, None, None, band, "fail",
                   "the run has no grad/nts")
    if wrong := site_fault_count(run, entry) or not_finite(run):
        return Row(node, "Figure 5", "WCNTS", published, ours, B.ratio(ours, published), band,
                   "fail", wrong, published)
    if B.faults_landed(run) == 0:
        return Row(node, "Figure 5", "WCNTS", published, ours, B.ratio(ours, published), band,
                   "no events", "no corruption landed in the run", published)
    step = table.at[name, "step"]
    return Row(node, "Figure 5", "WCNTS", published, ours, B.ratio(ours, published), band,
               "pass" if B.within(ours, lo, hi) else "fail",
               f"the worst step is {B.g(step)} of {entry['steps']}", published)


def figure5_rms_row(node: int, name: str, run, entry: dict) -> Row:
    """Figure 5 by the root mean square of `grad/nts` over the steps (`RMS_NTS`): the
    statistic the weight-gradient rates are set from, where WCNTS, eq. (5), is its maximum."""
    published = PB.WCNTS[node]
    nts = series(run, "grad/nts").dropna()
    lo, hi = published / B.WCNTS_FACTOR, published * B.WCNTS_FACTOR
    band, quantity = B.interval(lo, hi), RMS_NTS
    if not len(nts):
        return Row(node, "Figure 5", quantity, published, None, None, band, "fail",
                   "the run has no grad/nts")
    ours = float((nts ** 2).mean() ** 0.5)
    if wrong := site_fault_count(run, entry) or not_finite(run):
        return Row(node, "Figure 5", quantity, published, ours, B.ratio(ours, published), band,
                   "fail", wrong, published)
    if B.faults_landed(run) == 0:
        return Row(node, "Figure 5", quantity, published, ours, B.ratio(ours, published), band,
                   "no events", "no corruption landed in the run", published)
    return Row(node, "Figure 5", quantity, published, ours, B.ratio(ours, published), band,
               "pass" if B.within(ours, lo, hi) else "fail",
               f"over {len(nts)} steps, {int((nts == 0).sum())} of them without noise",
               published)


def figure6_rows(node: int, name: str, run, entry: dict) -> list[Row]:
    """Figure 6: the losses stay together, the parameters drift apart (node 13: only after
    its onset)."""
    healthy, suspect = series(run, "loss/healthy"), series(run, "loss/suspect")
    diff = series(run, "param/diff_l2")
    events, wrong = B.faults_landed(run), site_fault_count(run, entry)
    rows = []
    gap = ((suspect - healthy).abs() / healthy.abs()) if len(healthy) else pd.Series(dtype=float)
    worst = B.num(gap.max()) if len(gap) else None
    loss_band = f"<= {B.LOSS_GAP:.0%} at every step"
    if worst is None or gap.isna().any() or not all(map(math.isfinite, gap)):
        rows.append(Row(node, "Figure 6", "loss gap", 0.0, worst, None, loss_band, "fail",
                        "a loss is missing or not finite"))
    elif wrong:
        rows.append(Row(node, "Figure 6", "loss gap", 0.0, worst, None, loss_band, "fail", wrong))
    elif events == 0:
        rows.append(Row(node, "Figure 6", "loss gap", 0.0, worst, None, loss_band, "no events",
                        "no corruption landed in the run"))
    else:
        at = int(gap.idxmax())
        rows.append(Row(node, "Figure 6", "loss gap", 0.0, worst, None, loss_band,
                        "pass" if worst <= B.LOSS_GAP else "fail",
                        f"largest relative gap at step {at}"))
    onset = entry.get("onset_step")
    last_step = int(diff.index.max()) if len(diff) else 0
    start = max(1, math.ceil(B.GROWTH_FROM * entry["steps"]), onset or 0)
    growth_band = f"last > 0 and > its value at step {start}"
    if onset is not None:
        before = diff[diff.index < onset]
        rows.append(Row(node, "Figure 6", f"param/diff_l2 before step {onset}",
                        f"0 before step {B.PAPER_ONSET}", B.num(before.abs().max())
                        if len(before) else None, None, B.ONSET_BAND,
                        "pass" if len(before) and (before == 0).all() else "fail",
                        f"{len(before)} steps before the profile's onset at step {onset}"))
    if not len(diff):
        rows.append(Row(node, "Figure 6", "param/diff_l2 grows", "grows", None, None,
                        growth_band, "fail", "the run has no param/diff_l2"))
    elif onset is not None and start >= last_step:
        rows.append(Row(node, "Figure 6", "param/diff_l2 grows", "grows", B.num(diff.iloc[-1]),
                        None, growth_band, "not applicable",
                        f"the onset (step {onset}) is not before the run's last step "
                        f"({last_step})"))
    elif wrong:
        rows.append(Row(node, "Figure 6", "param/diff_l2 grows", "grows", B.num(diff.iloc[-1]),
                        None, growth_band, "fail", wrong))
    elif events == 0:
        rows.append(Row(node, "Figure 6", "param/diff_l2 grows", "grows", B.num(diff.iloc[-1]),
                        None, growth_band, "no events", "no corruption landed in the run"))
    else:
        first, last = B.num(diff.get(start)), B.num(diff.iloc[-1])
        ok = last is not None and last > 0 and (first is None or last > first)
        rows.append(Row(node, "Figure 6", "param/diff_l2 grows", "grows", last,
                        B.ratio(last, first), growth_band, "pass" if ok else "fail",
                        f"{B.g(first)} at step {start}, {B.g(last)} at step {last_step}"))
    return rows


def figure10_row(node: int, name: str, run, entry: dict) -> Row:
    """Figure 10: how often ABFT flags the forward attention output projection."""
    frequent = node == ABFT_NODE
    published = "frequently" if frequent else "little or nothing"
    band = (f">= {B.ABFT_FREQUENT:.0%} of steps flagged" if frequent
            else f"<= {B.ABFT_LITTLE:.0%} of steps flagged")
    if not len(run.abft_by_step):
        return Row(node, "Figure 10", "fwd o flagged steps", published, None, None, band,
                   "fail", "the run has no ABFT checks")
    per_step = T.abft_frequency_by_step(run, "o", "fwd")
    steps = max(len(run.metrics), len(per_step), 1)
    ours = float((per_step > 0).sum()) / steps
    if wrong := _attention_fault_count(run, entry):
        return Row(node, "Figure 10", "fwd o flagged steps", published, ours, None, band,
                   "fail", wrong)
    if B.faults_landed(run) == 0:
        return Row(node, "Figure 10", "fwd o flagged steps", published, ours, None, band,
                   "no events", "no corruption landed in the run")
    ok = ours >= B.ABFT_FREQUENT if frequent else ours <= B.ABFT_LITTLE
    seen = (f"{int((per_step > 0).sum())} of {steps} steps; on average "
            f"{B.g(per_step.mean())} of the checks flagged")
    if ok and not frequent and not _attention_faults_landed(run):
        seen = (f"{B.TRIVIAL} no attention-output fault landed in the run, so only a false "
                f"alarm could fail it; {seen}")
    return Row(node, "Figure 10", "fwd o flagged steps", published, ours, None, band,
               "pass" if ok else "fail", seen)


def _attention_faults_landed(run) -> int:
    """Faults the run's faults.parquet holds at fwd/attn, the products ABFT checks."""
    counts = run.fault_counts["faults"]
    if not len(counts):
        return 0
    return int(counts[counts.index.get_level_values("site") == "fwd/attn"].sum())


def site_fault_count(run, entry: dict, sites=PB.SITES, what: str | None = None) -> str | None:
    """`bands.count_check` of the run's faults at each of Table 1's `sites` against the
    profile's expectation (the lock-step run's mismatches: one per landed corruption); the
    first inconsistent one, or None. The weight-gradient faults are not counted: a landed one
    is not a drawn one (an additive error on a zero row of the embedding's gradient changes
    nothing), and a leaf replicated over tp records its faults once per rank."""
    counts = run.fault_counts["faults"]
    by_site = counts.groupby(level="site").sum() if len(counts) else pd.Series(dtype=float)
    at_least = B.run_total(run, "faults/unlogged") > 0  # faults.parquet holds a lower bound
    for site in sites:
        observed = int(by_site.get(site, 0))
        expected = entry["sites"].get(site, B.NO_SITE)["mismatches"]
        if wrong := B.count_check(observed, expected, entry, what or f"{site} faults",
                                  at_least):
            return wrong
    return None


def _attention_fault_count(run, entry: dict) -> str | None:
    """The count check of the run's attention-output faults, the ones whose products ABFT
    checks."""
    return site_fault_count(run, entry, ("fwd/attn",), "attention-output faults")
