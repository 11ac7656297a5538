"""Why a scorecard row fails, where a measurement says: the findings of docs/faults.md, section 5.

A failing row that one of the measured cases of docs/faults.md covers gets a `why`: the
section and one sentence with this run's own numbers (the units a maximum spans, the
corruptions a step, the flagged steps that held a fault, the size of this run's ABFT check).
A finding says two published numbers contradict each other only where that was measured under
more than one fault model; otherwise it names the modelling choice the row rests on and the
alternative tried (section 6's flip model, section 5.4's placements and tp degrees). A failing
row no finding covers keeps an empty `why`, and the scorecard counts it as unexplained.
Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import numpy as np
import pandas as pd

from sdcstudy.core import presets as CP
from sdcstudy.core.errors import ConfigError
from sdcstudy.report import tables as T
from sdcstudy.reproduce import abft_paper_scale as A
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce.bands import Row
from sdcstudy.reproduce.claim_rows import GRAD_NORM_GAP
from sdcstudy.reproduce.training_rows import ABFT_NODE, series

# The flip model's relative L2 noise over the additive model's at the same rates (docs/faults.md
# 6.2: sqrt(0.0258 / 0.0902); tests/test_reproduce.py derives it from the two models). Written
# out: the profiles that hold the additive model's moment import JAX, which `sdcstudy report`
# must not.
FLIP_NOISE_RATIO = 0.535

# The paper's lock-step runs: 4500 steps x 16 microsteps of 16 layers (section 4) on PAPER_TP
# tensor-parallel ranks, the (microstep, layer, rank) units a maximum severity of Tables 2, 8
# and 9 is taken over. The paper does not state its tensor-parallel degree: 8, one rank per
# accelerator of an 8-accelerator node, is our modelling choice.
PAPER_TP = 8
PAPER_UNITS = 4500 * 16 * 16 * PAPER_TP
# docs/faults.md 5.4: one fault of its row's RMS over eq. 6's threshold at the paper's
# k = 4096 / tp, n = 4096 (tp 1 / 8 / 32), and the most of node 14's checks any tp and
# placement flagged.
PAPER_SCALE_RATIOS = "0.011 / 0.24 / 1.8"
NODE14_MOST_FLAGGED = 9.4e-5
NODES_WITHOUT_WEIGHT_FAULTS = (10, 11)  # bands.FIGURE5_NOT_FITTED's nodes with Table 1 faults
FEW_FAULTS = 100.0  # corruptions a step below which a maximum over steps overshoots (5.1)
PAPER_TOKENS = 256 * 4096  # tokens of one optimizer step in sections 5-6 (appendix B)
SMOOTH_STEPS = 10  # the window of the means that set one batch's scatter aside (5.6, 5.8)
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


def flip_law_at_exposure(row: Row, entry: dict, run) -> str | None:
    """Tables 2, 8 and 9 at the paper's exposure under the flip model (`flip_exposure`): a
    paper maximum below the law's range is the bulk's, which the bit law puts near 0.5 at any
    busy site; one above it needs more accumulator-error tail than the run's A."""
    if entry.get("fault_model", "additive") != "flip" or not X.is_exposure_row(row):
        return None
    where = f"{DOC} 6.3, \"At the paper's exposure\""
    if row.source == "Table 2" and row.ratio is not None and row.ratio < 1:
        return (f"{where}: the paper's maximum lies above the flip law's 90% range: it needs "
                f"more accumulator errors with the A / t tail than this run's records give A")
    return (f"{where}: the flip model's bit law (each of bits 0-6 of a mantissa equally likely, "
            f"read from single events) puts the maximum of a site or layer with more than a "
            f"few hundred one-hit units between 0.49 and 0.5 nine times in ten; the paper's "
            f"bulk-only maxima are lower: at the paper's exposure the bit law is too heavy")


def tail_at_exposure(row: Row, entry: dict, run) -> str | None:
    """Tables 2, 8 and 9 at the paper's exposure: out of reach of additive errors below the
    band; above it, under the additive model, every hit carries the 1/t tail."""
    if not X.is_exposure_row(row):
        return None
    band = B.bounds(row.band)
    if row.ours is not None and band is not None and row.ours < band[0]:
        published = row.published if isinstance(row.published, str) else B.g(row.published)
        return (f"{DOC} 5.3, below at the paper's exposure: {row.source}'s {published} is "
                f"out of reach of any additive error (its tail carried to the paper's units "
                f"gives {B.g(row.ours)}); it needs healthy values of exactly or nearly zero, "
                f"which neither fault model makes")
    if entry.get("fault_model", "additive") != "additive":
        return None
    fitted = row.reason.split(", over the paper's")[0]
    times = (f"{B.g(row.ratio)}x Table 2" if row.ratio is not None else
             f"{B.g(row.ours / band[1])}x the top of the band" if band else "above the band")
    return (f"{DOC} 5.3, the additive model's tail at the paper's exposure: the model gives "
            f"every hit a relative error with a 1/t tail (c = 0.14 a unit on values of normal "
            f"density at zero; this run's {fitted}), which the paper's units carry to "
            f"{times} (a modelling choice); the "
            f"alternative tried, section 6's flip model, gives that tail to a fraction of the "
            f"hits fitted to Tables 8-9 (calibration rows under it)")


def severity_tail(row: Row, entry: dict, run) -> str | None:
    """Tables 2, 8 and 9: a maximum of means with a 1/t tail grows with the units it spans."""
    if row.source not in SEVERITY_SOURCES or X.is_exposure_row(row):
        return None
    units = _severity_units(row, run)
    band = B.bounds(row.band)
    if row.ours is not None and band is not None and row.ours < band[0]:
        side = "below: the maximum of a 1/t tail grows with the units it spans"
        if entry.get("fault_model", "additive") == "flip":
            side += (" (under the flip model only its fitted fraction of accumulator errors "
                     "has that tail; its bulk of flips gives at most 0.5, section 6)")
    else:
        side = ("above: the one-component additive error (a modelling choice) has a 1/t tail "
                "10^3 to 10^5 times heavier than the paper's maxima need; section 6's flip "
                "model, bit flips with a fitted fraction of accumulator errors, is the "
                "alternative tried")
        if row.node in NODES_WITHOUT_WEIGHT_FAULTS:
            side += ("; for this node, whose WCNTS comes from its Table 1 faults, a lighter "
                     "tail of that one component would lower Figure 5's WCNTS with it")
    return (f"{DOC} 5.3, Table 2 is a statistic of the run's length: ours is the largest of "
            f"{units} (step, microstep, layer, rank) units with a mismatch, the paper's of up "
            f"to {PAPER_UNITS:.2g} (at tp {PAPER_TP}, our choice); ours is {side}")


def wcnts_from_table1(row: Row, entry: dict, run) -> str | None:
    """Figure 5 above its band with no weight-gradient fault: Table 1's rates alone exceed it."""
    if row.source != "Figure 5" or not _above(row) or _weight_gradient_faults(run):
        return None
    head = (f"{DOC} 5.1, Figure 5 from Table 1's rates: the run made no weight-gradient fault, "
            f"so its {row.quantity} of {B.g(row.ours)} comes from the node's Table 1 rates "
            f"alone, under three modelling choices: ")
    if entry.get("fault_model", "additive") == "flip":
        return head + (f"the flip model's bit-place noise ({B.g(FLIP_NOISE_RATIO)} times the "
                       "additive model's, section 6.2), Figure 4's initial spike at amplitude "
                       "10 (a guess: the paper gives none) and a maximum taken in this run's "
                       "late steps; the additive model, the alternative, gives about twice the "
                       "noise")
    return head + ("the one-component additive error's power, Figure 4's initial spike at "
                   "amplitude 10 (a guess: the paper gives none) and a maximum taken in this "
                   "run's late steps; the alternative tried, section 6's flip model, halves the "
                   "noise and passes node 10's rms of grad/nts (its maximum stays about 4x) and "
                   "node 11's maximum")


def wcnts_few_faults(row: Row, entry: dict, run) -> str | None:
    """Figure 5 above its band with few corruptions a step: the maximum over steps of a sum of
    a few heavy-tailed errors overshoots its mean."""
    if row.source != "Figure 5" or row.quantity != "WCNTS" or not _above(row) \
            or not _weight_gradient_faults(run):
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
    smooth = _gap_of_means(healthy, suspect)
    if not len(smooth) or smooth.max() > B.LOSS_GAP:
        return None
    tokens = _tokens_per_step(run)
    over = f"{tokens:,} tokens" if tokens else "one batch"
    return (f"{DOC} 5.6, one batch's loss: a step's loss is the mean over {over}, the "
            f"paper's over {PAPER_TOKENS:,} (sections 5-6), and two drifted models' losses on "
            f"so few tokens scatter; their means over {SMOOTH_STEPS} steps stay within "
            f"{smooth.max():.1%} of each other ({_suspect_above(healthy, suspect)})")


def grad_norm_of_one_batch(row: Row, entry: dict, run) -> str | None:
    """Figure 6's gradient norms where their means over a few steps stay within the band at
    the median step: the per-step gap is the scatter of two drifted models' gradients on one
    small batch, which the drift-only controls of docs/faults.md 5.8 give with no fault."""
    if row.source != "Figure 6" or not row.quantity.startswith("gradient norm"):
        return None
    healthy, suspect = _grad_norms(run)
    smooth = _gap_of_means(healthy, suspect)
    if not len(smooth) or smooth.median() > GRAD_NORM_GAP:
        return None
    gap = (suspect - healthy) / healthy
    return (f"{DOC} 5.8, one batch's gradient norm: two drifted models' gradients on one "
            f"small batch scatter, as the drift-only controls' do with no fault landing; "
            f"their means over {SMOOTH_STEPS} steps are {smooth.median():.1%} apart at the "
            f"median step (the suspect's norm is above the healthy one's at "
            f"{(gap > 0).mean():.0%} of the steps, by {gap.mean():+.2%} on average)")


def loss_gap_from_table1(row: Row, entry: dict, run) -> str | None:
    """Figure 6's loss gap on a node whose Table 1 rates give its WCNTS on their own."""
    if row.source != "Figure 6" or row.quantity != "loss gap" or _weight_gradient_faults(run):
        return None
    error = (f"the flip model's bit-place errors ({B.g(FLIP_NOISE_RATIO)} times the additive "
             "model's noise)" if entry.get("fault_model", "additive") == "flip" else
             "the one-component additive error whose size gives Figure 5's WCNTS")
    return (f"{DOC} 5.5, Figure 6 from Table 1's rates: the run made no weight-gradient fault; "
            f"the node's Table 1 rates alone, under {error}, with Figure 4's initial spike at "
            f"amplitude 10 (a guess) on a model of this size, move the loss by up to "
            f"{B.g(row.ours)} ({_suspect_above(*_losses(run))}): a modelling choice and a "
            f"regime, not Table 1 against Figure 6")


def abft_checks_our_faults(row: Row, entry: dict, run) -> str | None:
    """Figure 10: ABFT sees the faults of the products it checks, at Table 1's rates, in a
    check far smaller, and so far more sensitive, than the paper's."""
    if row.source != "Figure 10":
        return None
    flagged, faulty = _flagged_steps(run), _attention_fault_steps(run)
    caught, stray = len(flagged & faulty), len(flagged - faulty)
    if not faulty:
        expected = entry["sites"].get("fwd/attn", B.NO_SITE)["mismatches"]
        seen = (f"the run held no attention-output fault, as Table 1's rate for this node "
                f"expects ({B.g(expected)} over the run), and ABFT flagged {_steps(stray)}")
    else:
        seen = (f"ABFT flagged {caught} of the {len(faulty)} steps with an attention-output "
                f"fault (Table 1's rate) and {_steps(stray)} without one")
    return f"{DOC} 5.4, Figure 10 at the paper's sizes: {seen}; {_check_size(run, row.node)}"


def _check_size(run, node: int) -> str:
    """How this run's o check compares with the paper's, and node 14's own case."""
    shape = _o_check(run)
    size = ("this run's o check is smaller than the paper's" if shape is None else
            f"one fault of its row's RMS is {B.g(_single_fault_ratio(shape))} times eq. 6's "
            f"threshold in this run's o check (k = {shape.k}, n = {shape.n})")
    text = (f"{size}, against {PAPER_SCALE_RATIOS} at the paper's k = 4096/tp, n = 4096 for tp "
            f"1 / 8 / 32 (the paper does not state its tp), so this row tests the check's size, "
            f"not Table 1 against Figure 10")
    return text + ("; " + _node14() if node == ABFT_NODE else "")


def _node14() -> str:
    return (f"node 14's Table 1 rate, in bursts, flags at most {NODE14_MOST_FLAGGED:.2g} of the "
            f"checks at every tp and placement tried at the paper's sizes: Figure 10's "
            f"\"frequently\" needs a rate of its own under ABFT, which the profile does not model")


def _o_check(run) -> A.Shape | None:
    """The shape of the run's forward o product on one tp rank: the tokens of a microstep,
    the rank's share of the attention width and the model width; None where the config does
    not resolve."""
    model = run.config.get("model", {})
    known = {f.name for f in dataclasses.fields(CP.ModelConfig)}
    try:
        dims = CP.model_dims(CP.ModelConfig(**{k: v for k, v in model.items() if k in known}))
    except (ConfigError, KeyError, TypeError):  # a model this version cannot resolve
        return None
    tp = run.config.get("mesh", {}).get("tp", 1) or 1
    tokens = (run.config.get("experiment", {}).get("batch_size") or 1) * (
        run.config.get("data", {}).get("seq_len") or 1)
    return A.Shape("run", min(tokens, A.PAPER_TOKENS), dims.n_heads * dims.head_dim // tp,
                   dims.d_model)


@functools.lru_cache(maxsize=8)
def _single_fault_ratio(shape: A.Shape) -> float:
    """`abft_paper_scale.single_fault_ratio` of `shape`, seeded as `measure` seeds its first
    shape (tiny's o check: 247, as docs/faults.md 5.4 tabulates)."""
    return A.single_fault_ratio(shape, np.random.default_rng([0, 0, 0, 1]))


FINDINGS: tuple[Callable[[Row, dict, object], str | None], ...] = (
    flip_law_at_exposure, tail_at_exposure, severity_tail, last_bit, wcnts_from_table1,
    wcnts_few_faults, loss_gap_of_one_batch, loss_gap_from_table1, grad_norm_of_one_batch,
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


def _gap_of_means(healthy: pd.Series, suspect: pd.Series) -> pd.Series:
    """|suspect - healthy| / |healthy| of their means over `SMOOTH_STEPS` steps, per step where
    a whole window exists."""
    h, s = healthy.rolling(SMOOTH_STEPS).mean(), suspect.rolling(SMOOTH_STEPS).mean()
    return ((s - h).abs() / h.abs()).dropna()


def _grad_norms(run) -> tuple[pd.Series, pd.Series]:
    """(grad/norm, grad/norm_suspect) per step of a paired run, empty where it has none."""
    healthy = series(run, "grad/norm")
    return healthy, series(run, "grad/norm_suspect").reindex(healthy.index)


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
