"""Why a scorecard row fails, where a measurement says: the findings of docs/faults.md, section 5.

Some published numbers of Ma et al. cannot all hold at once under any error model we tried, and
some cannot hold on a model 10^5 times smaller than the paper's; docs/faults.md measures each
case. A failing row that one of those cases covers gets a `why`: the finding's section and one
sentence with this run's own numbers (the units a maximum spans, the corruptions a step, the
flagged steps that held a fault). A failing row no finding covers keeps an empty `why`, and the
scorecard counts it as unexplained. Imports no JAX.
"""

from __future__ import annotations

import math
from typing import Callable

import pandas as pd

from sdcstudy.report import tables as T
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce.bands import Row

# The paper's lock-step runs: 4500 steps x 16 microsteps of 16 layers at tp 8 (section 4),
# the (microstep, layer, rank) units a maximum severity of Tables 2, 8 and 9 is taken over.
PAPER_UNITS = 4500 * 16 * 16 * 8
FEW_FAULTS = 100.0  # corruptions a step below which a maximum over steps overshoots (5.1)
PAPER_TOKENS = 256 * 4096  # tokens of one optimizer step in sections 5-6 (appendix B)
SMOOTH_STEPS = 10  # the window of the loss means that set one batch's scatter aside (5.6)
SEVERITY_SOURCES = ("Table 2", "Table 8", "Table 9")
DOC = "docs/faults.md"


def _severity_units(row: Row, run) -> int:
    """The (step, microstep, layer, tp rank) units with a mismatch at the row's site (and
    layer) that its maximum severity is taken over."""
    units = run.mismatch_rollup.by_layer["units"]
    site, _, layer = row.quantity.partition(" layer ")
    units = units[units.index.get_level_values("site") == site]
    if layer:
        units = units[units.index.get_level_values("layer") == int(layer)]
    return int(units.sum())


def severity_tail(row: Row, entry: dict, run) -> str | None:
    """Tables 2, 8 and 9: a maximum of means with a 1/t tail grows with the units it spans."""
    if row.source not in SEVERITY_SOURCES:
        return None
    units = _severity_units(row, run)
    band = B.bounds(row.band)
    side = ("below: the maximum of a 1/t tail grows with the units it spans" if
            row.ours is not None and band is not None and row.ours < band[0] else
            "above: the paper's maxima need a tail 10^3 to 10^5 times lighter than an additive "
            "error on values with a density at zero, and then Figure 5's WCNTS would be as much "
            "lower")
    return (f"{DOC} 5.3, Table 2 is a statistic of the run's length: ours is the largest of "
            f"{units} (step, microstep, layer, rank) units with a mismatch, the paper's of up "
            f"to {PAPER_UNITS:.2g}; ours is {side}")


def wcnts_from_table1(row: Row, entry: dict, run) -> str | None:
    """Figure 5 above its band with no weight-gradient fault: Table 1's rates alone exceed it."""
    if row.source != "Figure 5" or not _above(row) or _weight_gradient_faults(run):
        return None
    return (f"{DOC} 5.1, Figure 5 against Table 1: the run made no weight-gradient fault, so "
            f"its WCNTS of {B.g(row.ours)} comes from the node's Table 1 rates alone; Table 1 "
            f"and Figure 5 disagree for this node")


def wcnts_few_faults(row: Row, entry: dict, run) -> str | None:
    """Figure 5 above its band with few corruptions a step: the maximum over steps of a sum of
    a few heavy-tailed errors overshoots its mean."""
    if row.source != "Figure 5" or not _above(row) or not _weight_gradient_faults(run):
        return None
    per_step = _landed_per_step(run)
    if per_step is None or per_step >= FEW_FAULTS:
        return None
    return (f"{DOC} 5.1, WCNTS in a small gradient: {B.g(per_step)} corruptions a step (the "
            f"paper's 8-billion-parameter gradients got thousands), and the worst of "
            f"{entry['steps']} steps of a sum of a few heavy-tailed errors overshoots its mean; "
            f"measured: the overshoot falls as the corruptions a step grow, across the nodes "
            f"and on the small model")


def last_bit(row: Row, entry: dict, run) -> str | None:
    """Node 3: flips of a gradient element's lowest mantissa bit."""
    if not _only_last_bit_flips(run):
        return None
    if row.source == "Figure 5" and _above(row):
        return (f"{DOC} 5.2, one last bit: a flip of the lowest mantissa bit of one float32 "
                f"gradient element is 2^-23 of that element, {B.g(row.ours)} of this model's "
                f"gradient; Figure 5's {B.g(row.published)} is below one such flip in a "
                f"typical element of an 8-billion-element gradient (about 1e-12)")
    if row.source == "Figure 6" and row.quantity == "param/diff_l2 grows":
        return (f"{DOC} 5.2, one last bit: under Adam a last-bit change of a gradient element "
                f"moves its update by a small fraction of half the parameter's rounding step, "
                f"so rounding absorbed every flip of the run and the parameters stayed bitwise "
                f"equal")
    return None


def loss_gap_of_one_batch(row: Row, entry: dict, run) -> str | None:
    """Figure 6's loss gap where the losses' means over a few steps stay within the band: the
    gap is the scatter of two drifted models' losses on one small batch."""
    if row.source != "Figure 6" or row.quantity != "loss gap":
        return None
    healthy, suspect = _losses(run)
    h, s = healthy.rolling(SMOOTH_STEPS).mean(), suspect.rolling(SMOOTH_STEPS).mean()
    smooth = ((s - h).abs() / h.abs()).dropna()
    if not len(smooth) or smooth.max() > B.LOSS_GAP:
        return None
    tokens = _tokens_per_step(run)
    over = f"{tokens:,} tokens" if tokens else "one batch"
    return (f"{DOC} 5.6, one batch's loss: a step's loss is the mean over {over}, the "
            f"paper's over {PAPER_TOKENS:,} (sections 5-6), and two drifted models' losses on "
            f"so few tokens scatter; their means over {SMOOTH_STEPS} steps stay within "
            f"{smooth.max():.1%} of each other ({_suspect_above(healthy, suspect)})")


def loss_gap_from_table1(row: Row, entry: dict, run) -> str | None:
    """Figure 6's loss gap on a node whose Table 1 rates give its WCNTS on their own."""
    if row.source != "Figure 6" or row.quantity != "loss gap" or _weight_gradient_faults(run):
        return None
    return (f"{DOC} 5.5, Figure 6 against Table 1: the run made no weight-gradient fault; "
            f"the node's Table 1 rates alone, with the error size that gives Figure 5's WCNTS, "
            f"move the loss by up to {B.g(row.ours)} ({_suspect_above(*_losses(run))})")


def abft_checks_our_faults(row: Row, entry: dict, run) -> str | None:
    """Figure 10: ABFT sees the faults of the products it checks, at Table 1's rates."""
    if row.source != "Figure 10":
        return None
    flagged, faulty = _flagged_steps(run), _attention_fault_steps(run)
    caught, stray = len(flagged & faulty), len(flagged - faulty)
    if not faulty:
        expected = entry["sites"].get("fwd/attn", B.NO_SITE)["mismatches"]
        return (f"{DOC} 5.4, Figure 10 against Table 1: the run held no attention-output "
                f"fault, as Table 1's rate for this node expects ({B.g(expected)} over the "
                f"run), and ABFT flagged {_steps(stray)}; a profile cannot follow Table 1 and "
                f"Figure 10 at once, and ours follow Table 1")
    return (f"{DOC} 5.4, Figure 10 against Table 1: ABFT flagged {caught} of the {len(faulty)} "
            f"steps with an attention-output fault (Table 1's rate) and {_steps(stray)} "
            f"without one; a profile cannot follow Table 1 and Figure 10 at once, and ours follow "
            f"Table 1")


FINDINGS: tuple[Callable[[Row, dict, object], str | None], ...] = (
    severity_tail, last_bit, wcnts_from_table1, wcnts_few_faults, loss_gap_of_one_batch,
    loss_gap_from_table1,
    abft_checks_our_faults)


def explain(rows: list[Row], entry: dict, run) -> list[Row]:
    """`rows` with the first finding that covers each failing row in its `why`."""
    for row in rows:
        if row.verdict != "fail":
            continue
        for finding in FINDINGS:
            if why := finding(row, entry, run):
                row.why = why
                break
    return rows


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _above(row: Row) -> bool:
    return row.ratio is not None and row.ratio > 1


def _fault_counts(run, site=None, kind=None, last_bit=None) -> pd.Series:
    """Faults the run's faults.parquet holds, per (step, site, kind, last_bit), of the given
    site, kind and last_bit (None: any)."""
    counts = run.fault_counts["faults"]
    for level, value in (("site", site), ("kind", kind), ("last_bit", last_bit)):
        if value is not None:
            counts = counts[counts.index.get_level_values(level) == value]
    return counts


def _weight_gradient_faults(run) -> int:
    counts = run.fault_counts["faults"]
    sites = counts.index.get_level_values("site").astype(str)
    return int(counts[sites.str.startswith("grad/")].sum())


def _only_last_bit_flips(run) -> bool:
    total = int(run.fault_counts["faults"].sum())
    return total > 0 and int(_fault_counts(run, kind="bitflip", last_bit=True).sum()) == total


def _losses(run) -> tuple[pd.Series, pd.Series]:
    """(loss/healthy, loss/suspect) per step of a paired run."""
    return tuple(pd.to_numeric(run.metrics[key], errors="coerce")
                 for key in ("loss/healthy", "loss/suspect"))


def _suspect_above(healthy: pd.Series, suspect: pd.Series) -> str:
    """How often and by how much the suspect's loss is above the healthy one's."""
    gap = (suspect - healthy) / healthy
    return (f"the suspect's loss is above the healthy one's at {(gap > 0).mean():.0%} of the "
            f"steps, and their relative difference is {gap.mean():+.2%} on average")


def _tokens_per_step(run) -> int | None:
    """Tokens of one optimizer step of the run's config (`config.tokens_per_step`), or None
    where it does not say."""
    experiment, data = run.config.get("experiment", {}), run.config.get("data", {})
    size = experiment.get("microsteps", 1), experiment.get("batch_size"), data.get("seq_len")
    return math.prod(size) if all(isinstance(v, int) for v in size) else None


def _landed_per_step(run) -> float | None:
    landed, steps = B.faults_landed(run), len(run.metrics)
    return landed / steps if steps else None


def _flagged_steps(run) -> set[int]:
    per_step = T.abft_frequency_by_step(run, "o", "fwd")
    return set(per_step.index[per_step > 0].astype(int))


def _attention_fault_steps(run) -> set[int]:
    counts = _fault_counts(run, site="fwd/attn")
    return set(counts.index.get_level_values("step").astype(int))
