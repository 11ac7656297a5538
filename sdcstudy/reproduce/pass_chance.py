"""The probability that a correct model passes a judged row (`Row.pass_probability`), for the
rows whose band is a test or a rule rather than a count band (`bands.count_pass_probability`)
or an exposure band (`exposure_rows`, `flip_exposure`). "A correct model" is the node's profile
taken as the truth: the chance is that of its own runs passing. Each value is exact or a lower
bound (docs/reproduction.md, "The chance a correct model passes"). Imports no JAX.

- A band fixed by construction (`bands.ZERO_BAND`, `bands.ONSET_BAND`): 1, the profile fires
  nothing there;
- appendix C.2, one rate over the layers: 1 - `claim_rows.TREND_LEVEL`, the test's level
  (the profiles' rate is the same in every layer);
- Figures 3 and 4, the over-dispersion and initial-spike tests: the share of `DRAWS` runs of
  the profile's per-step counts at the site (its time pattern, `faults.time_patterns`, with
  the run's expected mismatches) that the test passes, as its one-sided `CONFIDENCE` lower
  bound (Clopper-Pearson);
- Figure 10's run rows of the "little or nothing" nodes: at least the probability that at most
  `bands.ABFT_LITTLE` of the steps hold an attention-output fault (every step with one taken
  as flagged; a healthy float32 check flags nothing, docs/results/abft.md), over the steps'
  own fault probabilities (Poisson-binomial); at most the same with each step's probability
  times q, the one-sided `CONFIDENCE` lower bound of the share of the run's steps holding
  such a fault that ABFT flagged (`Row.pass_probability_max`; false alarms left out, which
  could only lower the chance);
- Figure 10's run row of the "frequently" node (14): between 0 and at most the probability that
  at least `bands.ABFT_FREQUENT` of the steps hold an attention-output fault (a step without
  one flags nothing), an upper bound (`Row.pass_probability_max`);
- appendix D.3, frequency x severity in the product of their bands: at least the chance both
  rows pass, P(A) + P(B) - 1, whatever their dependence;
- Table 2 and Tables 8-9 at the run's exposure (our maximum within 3x of the paper's, or of its
  layers' range): both maxima the model's law, ours over the run's units and the paper's over
  its own, by `additive_run_chance` (the unit severity's tail c / t above the bulk; a range
  where a maximum may lie in the bulk, whose law the model does not state) and
  `flip_run_chance` (the flip model's law of a maximum); these rows' chance is small wherever
  the paper's units outnumber ours.
Rows without one (Figures 5-6) are left None here: no law of a correct model's value in the
run is at hand; `seed_scatter` measures theirs from runs with other fault seeds.
"""

from __future__ import annotations

import math

import numpy as np

from sdcstudy.faults.time_patterns import node_pattern
from sdcstudy.report import tables as T
from sdcstudy.reproduce import additive_run_chance as ARC
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import claim_rows as CR
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import flip_exposure as FX
from sdcstudy.reproduce import flip_run_chance as FRC
from sdcstudy.reproduce.bands import Row
from sdcstudy.reproduce.plan import PAPER_STEPS

DRAWS = 400  # simulated runs a test's chance is measured on
CONFIDENCE = 0.95  # of the lower bound a simulated share states
SEED = 0


def lower_bound(passed: int, draws: int, confidence: float = CONFIDENCE) -> float:
    """The one-sided Clopper-Pearson lower bound of a share `passed` / `draws`: the p at which
    P(X >= passed) = 1 - confidence for X ~ Binomial(draws, p) (bisection)."""
    if passed <= 0:
        return 0.0
    lo, hi = 0.0, passed / draws
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1 - B.binomial_below(passed - 1, draws, mid) < 1 - confidence:
            lo = mid
        else:
            hi = mid
    return lo


def upper_bound(passed: int, draws: int, confidence: float = CONFIDENCE) -> float:
    """The one-sided Clopper-Pearson upper bound of a share `passed` / `draws`: the p at which
    P(X <= passed) = 1 - confidence (`lower_bound` of the failures, from the other side)."""
    return 1.0 - lower_bound(draws - passed, draws, confidence)


def step_means(node: int, entry: dict, site: str = CR.FIGURE_SITE) -> np.ndarray | None:
    """The profile's expected events at `site` at each step of the run (a bursty step's mean
    given it fires is this over `p_active`), from the entry's expected total and the node's time
    pattern; None where the entry's time-pattern scale is not that pattern's (another
    profile)."""
    expected = entry["sites"].get(site)
    steps = int(entry.get("steps") or 0)
    if expected is None or steps <= 0:
        return None
    pattern = node_pattern(node)
    weights = pattern.expected_multipliers(steps)
    paper = pattern.mean_multiplier(PAPER_STEPS)
    scale = float(weights.mean()) / paper if paper > 0 else 1.0
    if not math.isclose(scale, expected.get("scale", 1.0), rel_tol=1e-6) or weights.sum() <= 0:
        return None
    return expected["mismatches"] * weights / weights.sum()


def simulated_counts(node: int, means: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One run's per-step counts: Poisson at `means`, a bursty node's steps firing with its
    `p_active` (then at means / p_active)."""
    pattern = node_pattern(node)
    if pattern.kind == "burst":
        fired = rng.random(len(means)) < pattern.p_active
        return np.where(fired, rng.poisson(means / pattern.p_active), 0)
    return rng.poisson(means)


def passes_test(node: int, counts: np.ndarray) -> bool:
    """Whether Figure 3's or 4's test (`claim_rows.burst_row`) passes these per-step counts."""
    if counts.sum() == 0:
        return False  # "no events"
    if node in CR.BURST_NODES:
        return CR.dispersion_p_value(counts) < CR.BURST_LEVEL
    return len(counts) > 1 and CR.spiked(*CR.initial_spike(counts))


def figure_test_chance(node: int, entry: dict) -> float | None:
    """Figures 3-4: the lower bound of the share of `DRAWS` simulated runs that pass."""
    means = step_means(node, entry)
    if means is None:
        return None
    rng = np.random.default_rng(SEED)
    passed = sum(passes_test(node, simulated_counts(node, means, rng)) for _ in range(DRAWS))
    return lower_bound(passed, DRAWS)


def at_most_steps(probabilities: np.ndarray, k: int) -> float:
    """P(at most k of independent steps occur), the steps occurring with `probabilities`
    (Poisson-binomial, by its distribution over counts 0..k)."""
    dist = np.zeros(k + 2)
    dist[0] = 1.0
    for p in probabilities:
        dist[1:] = dist[1:] * (1 - p) + dist[:-1] * p
        dist[0] *= 1 - p
    return float(min(1.0, dist[:k + 1].sum()))


def figure10_little_chance(node: int, entry: dict) -> float | None:
    """A "little or nothing" node's Figure 10 run row: at least the chance that at most
    `bands.ABFT_LITTLE` of the steps hold an attention-output fault."""
    means = step_means(node, entry, "fwd/attn")
    if means is None:
        return 1.0 if "fwd/attn" not in entry["sites"] else None
    return at_most_steps(_steps_with_fault(node, means), math.floor(B.ABFT_LITTLE * len(means)))


def flagged_share_low(run) -> float | None:
    """q: the one-sided `CONFIDENCE` lower bound (Clopper-Pearson) of the share of the run's
    steps holding an attention-output fault in which ABFT flagged the forward o product;
    None where no step holds one."""
    counts = run.fault_counts["faults"]
    at = counts[(counts.index.get_level_values("site") == "fwd/attn") & (counts > 0)]
    fault_steps = set(at.index.get_level_values("step"))
    if not fault_steps or not len(run.abft_by_step):
        return None
    per_step = T.abft_frequency_by_step(run, "o", "fwd")
    flagged = set(per_step[per_step > 0].index)
    return lower_bound(len(fault_steps & flagged), len(fault_steps))


def figure10_little_bound(node: int, entry: dict, run) -> float | None:
    """A "little or nothing" node's Figure 10 run row: at most the chance that at most
    `bands.ABFT_LITTLE` of the steps are flagged, each step flagged with its fault probability
    times `flagged_share_low`."""
    means, q = step_means(node, entry, "fwd/attn"), flagged_share_low(run)
    if means is None or q is None:
        return None
    return at_most_steps(q * _steps_with_fault(node, means),
                         math.floor(B.ABFT_LITTLE * len(means)))


def at_least_steps(probabilities: np.ndarray, k: int) -> float:
    """P(at least k of independent steps occur), the steps occurring with `probabilities`
    (Poisson-binomial over counts 0..k, the last absorbing: exact where it is tiny)."""
    if k <= 0:
        return 1.0
    dist = np.zeros(k + 1)
    dist[0] = 1.0
    for p in probabilities:
        top = dist[k] + dist[k - 1] * p
        dist[1:k] = dist[1:k] * (1 - p) + dist[:k - 1] * p
        dist[0] *= 1 - p
        dist[k] = top
    return float(min(1.0, dist[k]))


def figure10_frequent_bound(node: int, entry: dict) -> float | None:
    """The "frequently" node's Figure 10 run row: at most the chance that at least
    `bands.ABFT_FREQUENT` of the steps hold an attention-output fault."""
    means = step_means(node, entry, "fwd/attn")
    if means is None:
        return 0.0 if "fwd/attn" not in entry["sites"] else None
    return at_least_steps(_steps_with_fault(node, means),
                          math.ceil(B.ABFT_FREQUENT * len(means)))


def _steps_with_fault(node: int, means: np.ndarray) -> np.ndarray:
    """Each step's probability of an attention-output fault (a bursty step fires with
    `p_active`, then at means / p_active)."""
    pattern = node_pattern(node)
    p_fire = pattern.p_active if pattern.kind == "burst" else 1.0
    return p_fire * -np.expm1(-means / p_fire)


def raw_maximum_chance(row: Row, run) -> tuple[float, float | None] | str | None:
    """(chance, upper bound or None) of a Table 2 or Tables 8-9 row at the run's exposure:
    the flip model's by `flip_run_chance`, the additive one's by `additive_run_chance`; where
    it states none, why (read from the run); None for a row at the paper's exposure."""
    if row.quantity.endswith(X.SUFFIX):
        return None
    if FX.is_flip_run(run):
        return FRC.raw_chance(row, run)
    return ARC.raw_chance(row, run)


def row_chance(row: Row, entry: dict, run) -> float | None:
    """The chance of one judged row of `run`, planned as `entry` (module docstring), or None."""
    if row.band in (B.ZERO_BAND, B.ONSET_BAND):
        return 1.0
    if row.source == "Appendix C.2":
        return 1 - CR.TREND_LEVEL
    if row.source in ("Figure 3", "Figure 4"):
        return figure_test_chance(row.node, entry)
    if row.source == "Figure 10" and row.published == "little or nothing":
        return figure10_little_chance(row.node, entry)
    return None


def annotate(rows: list[Row], entry: dict, run) -> None:
    """Fill in `pass_probability` on the run's judged rows that state none (`row_chance`; the
    raw maxima by `raw_maximum_chance`, with `pass_probability_max` where theirs is a range),
    the bounds of the "frequently" node's Figure 10 run row (0 to `figure10_frequent_bound`)
    and the upper bound of the "little or nothing" nodes' (`figure10_little_bound`)."""
    for row in rows:
        if row.pass_probability is not None or row.verdict not in ("pass", "fail"):
            continue
        if row.source == "Figure 10" and row.published == "frequently":
            most = figure10_frequent_bound(row.node, entry)
            if most is not None:
                row.pass_probability, row.pass_probability_max = 0.0, most
            continue
        if row.source in ("Table 2", "Table 8", "Table 9") and row.band not in (
                B.ZERO_BAND, B.ONSET_BAND):
            chance = raw_maximum_chance(row, run)
            if isinstance(chance, str):
                say_none(row, chance)
            elif chance is not None:
                row.pass_probability, row.pass_probability_max = chance
            continue
        row.pass_probability = row_chance(row, entry, run)
        if row.source == "Figure 10" and row.published == "little or nothing":
            row.pass_probability_max = figure10_little_bound(row.node, entry, run)


def d3_chance(d3: Row, rows: list[Row]) -> float | None:
    """D.3's chance: at least P(frequency row passes) + P(severity row passes) - 1."""
    parts = [next((r.pass_probability for r in rows if r.node == d3.node and r.source == src
                   and r.quantity == quantity), None)
             for src, quantity in (("Table 1", "fwd/attn"), ("Table 2", "fwd/attn" + X.SUFFIX))]
    if any(p is None for p in parts):
        return None
    return max(0.0, sum(parts) - 1.0)


def why_none(row: Row) -> str:
    """Why a judged row states no chance, in the words its reason ends with (a Table 2 or
    Tables 8-9 row at the run's exposure has its why from the run, `annotate`)."""
    if row.source in ("Figure 5", "Figure 6", CR.SHAPE_SOURCE):
        return ("no seed-to-seed scatter of this command's runs (docs/scorecards/"
                "seed_scatter.json)")
    if row.source == "Appendix D.3":
        return "its Table 1 or Table 2 row states none"
    if row.source == "Figure 10" and "paper tp" in row.quantity:
        return "the analytic estimate judges it, the draws being too few to decide"
    return "no law of a correct model's value is known for it here"


NO_CHANCE = "; no P(pass): "  # what comes before a judged row's why it states no chance


def say_none(row: Row, why: str) -> None:
    """End `row`'s reason with why it states no chance."""
    row.reason = f"{row.reason}{NO_CHANCE}{why}"


def say_why_none(rows: list[Row]) -> None:
    """End the reason of each judged row that states no chance, and does not say why yet,
    with `why_none`."""
    for row in rows:
        if (row.verdict in ("pass", "fail") and row.pass_probability is None
                and NO_CHANCE not in row.reason):
            say_none(row, why_none(row))
