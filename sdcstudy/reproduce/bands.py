"""The bands the reproduction scorecard judges by, its row, and the verdicts. Imports no JAX.

Ma et al., "Understanding Silent Data Corruption in LLM Training". A published number passes
when ours lies in its band:
- Table 1 (mismatch frequency per site, eqs. 1-2): within `FREQ_TOLERANCE` (25%) of the
  published value times the node's time pattern over this run (`plan.expectations`: a run of
  200 steps holds more of nodes 10-11's initial spike than the paper's 4500). Judged only where
  the run expects at least `MIN_EXPECTED` mismatches, and a bursty profile `MIN_ACTIVE_STEPS`
  bursts; else "too rare for this run", with the expected count;
- Table 2 (maximum severity per site, eqs. 3-4): within a factor `SEVERITY_FACTOR` (3), wherever
  the site had a mismatch;
- Tables 6-9 (per decoder layer; the paper has 16, our models fewer): each of our layers within
  the paper's [min, max] over its 16 layers, widened by the same 25% (frequency, times the time
  pattern; judged where the layer expects `MIN_EXPECTED` mismatches) or factor 3 (severity);
- Figure 5 (WCNTS, eq. 5, the parameter-synchronized run): within a factor `WCNTS_FACTOR` (3),
  and so the root mean square of `grad/nts` over the run's steps, whose maximum WCNTS is;
- Figure 6 (the free run): `loss/suspect` within `LOSS_GAP` (2%) of `loss/healthy` at every
  step ("the loss curves on all unhealthy nodes are plotted but identical to that on the
  healthy node"), and `param/diff_l2` grows ("model weights on unhealthy nodes incrementally
  drift away"): above 0 and above its value at `GROWTH_FROM` (10%) of the run. Node 13 "shows
  no parameter difference before step 450": `param/diff_l2` is exactly 0 before the onset
  step of its profile. Across the free runs, "the rates at which the parameter differences
  increase are similar on most unhealthy nodes": more than half of the drifting nodes' growth
  exponents within a factor `DRIFT_SIMILAR` (2, our reading of "similar") of their median, one
  row for all nodes (`drift_rows`), judged where at least `MIN_DRIFT_NODES` (3) drift;
- Figure 10 (ABFT in float32, the forward product of the attention output projection `o`):
  appendix D.2, "ABFT only frequently flags SDCs on Node 14 while flagging little to no errors
  on other unhealthy nodes". We count the share of optimizer steps in which at least one
  forward `o` check flagged (over layers and microsteps): "frequently" is at least
  `ABFT_FREQUENT` (10%) of the steps, "little or nothing" at most `ABFT_LITTLE` (1%).
Where a band needs events and the run's injector made no corruption at all, the verdict is
"no events": passing would prove nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from sdcstudy.report import tables as T

FREQ_TOLERANCE = 0.25
SEVERITY_FACTOR = 3.0
WCNTS_FACTOR = 3.0
LOSS_GAP = 0.02
GROWTH_FROM = 0.10
MIN_EXPECTED = 100.0
MIN_ACTIVE_STEPS = 30.0  # the count of bursts is binomial: 30 put one deviation near 18%
ABFT_FREQUENT = 0.10
ABFT_LITTLE = 0.01
PAPER_ONSET = 450  # section 6.2
DRIFT_SIMILAR = 2.0
MIN_DRIFT_NODES = 3
ACROSS_NODES = 0  # the node of a row about all the scorecard's nodes
COUNT_LEVEL = 1e-3  # two-sided level of the event-count check
EXCESS, MISSING = "excess events", "missing events"
TOO_RARE = "too rare for this run"
CALIBRATION, HELD_OUT = "calibration", "held-out"
# A held-out row whose verdict the profile fixes by construction: a zero the paper published at
# a site or layer where Table 1's rate is 0, so the profile fires nothing there (`as_zero`), or
# the parameters' difference before an onset profile's onset, before which it fires nothing.
# Its pass tests the engine, not the model, so the scorecard counts it apart (`fixed`).
FIXED = "fixed by construction"
ZERO_BAND, ONSET_BAND = "0", "exactly 0"
# The sources the profiles' rates are set from (faults/profiles.py): Table 1 per site, and so
# Tables 6-7, its per-layer split (uniform over layers); Figures 3-4, the time patterns (bursts,
# initial spikes) measured back (`claim_rows.burst_row`). Figure 5 too, for every node whose
# weight-gradient rate is set from its WCNTS: not node 3 (a last-bit flip at a chosen rate) nor
# nodes 10 and 11 (no weight-gradient faults: WEIGHT_GRAD_SHARE 0).
CALIBRATION_SOURCES = ("Table 1", "Table 6", "Table 7", "Figure 3", "Figure 4")
FIGURE5_NOT_FITTED = (3, 10, 11)
# The flip model's tail fraction is fitted to Tables 8-9's per-layer maxima, which set Table
# 2's maximum too (faults/flip_model.py, docs/faults.md 6.3).
FLIP_CALIBRATION_SOURCES = ("Table 2", "Table 8", "Table 9")
# A published result the scorecard's runs do not make (`claim_rows.UNSCORED`), with why.
NOT_HERE = "not reproducible here"
VERDICTS = ("pass", "fail", "no events", TOO_RARE, "not applicable", "not run", NOT_HERE)
NO_SITE = {"mismatches": 0.0, "scale": 1.0}  # a site the profile does not corrupt


@dataclass
class Row:
    """One published number: ours beside it, the band and the verdict with its reason."""

    node: int
    source: str  # "Table 1", ..., "Figure 10"
    quantity: str  # the site, site and layer, or what the figure shows
    published: float | str | None  # a number, or the paper's words or range
    ours: float | None
    ratio: float | None  # ours / published, where the paper gives one number
    band: str
    verdict: str
    reason: str = ""
    expected: float | None = None  # what the band centres on: the published number, times the
    # time pattern over this run for a frequency (`plan.expectations`)
    why: str = ""  # for a failing row, the measured finding that explains it (`findings`)
    role: str = HELD_OUT  # CALIBRATION: a quantity the profile was fitted to (`role`)
    pass_probability: float | None = None  # the probability that a correct model passes
    # this row's band (`count_pass_probability`, `exposure_rows.pass_probability`,
    # `pass_chance`), exact or a lower bound; None where the row states none
    pass_probability_max: float | None = None  # an upper bound of that chance where
    # `pass_probability` is a lower bound (`seed_scatter`, Figure 10's run rows); else None


def role(node: int, source: str, fault_model: str = "additive") -> str:
    """Whether a row of `source` for `node` is a calibration row or a held-out one, under the
    profiles' `fault_model` (reproduce.plan.FAULT_MODELS)."""
    fitted = source in CALIBRATION_SOURCES or (source == "Figure 5"
                                                and node not in FIGURE5_NOT_FITTED)
    fitted |= fault_model == "flip" and source in FLIP_CALIBRATION_SOURCES
    return CALIBRATION if fitted else HELD_OUT


# Sources whose every row is fixed by construction: appendix C.2's "no per-layer trends",
# where the profiles' rates are the same in every layer.
FIXED_SOURCES = ("Appendix C.2",)
# The reason of a pass that the run's faults could not have failed: a Figure 10 run row of a
# "little or nothing" node where no attention-output fault landed (only a false alarm fails it).
TRIVIAL = "passes trivially:"


def fixed(row: Row) -> bool:
    """Whether a row's verdict is fixed by construction (`FIXED`): judged by `as_zero`'s band
    or the onset's, of a `FIXED_SOURCES` source, or a `TRIVIAL` pass."""
    return (row.band in (ZERO_BAND, ONSET_BAND) or row.source in FIXED_SOURCES
            or row.reason.startswith(TRIVIAL))


def count_failed(row: Row) -> bool:
    """A row failed by its event count: the engine's doing, which no finding explains."""
    return row.verdict == "fail" and row.reason.startswith((EXCESS, MISSING))


def num(value) -> float | None:
    """A float, or None for a missing value or NaN."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def ratio(ours, published) -> float | None:
    return ours / published if ours is not None and published else None


def g(value) -> str:
    """Three significant digits, as the report prints numbers."""
    return T.fmt(value)


def within(value: float | None, lo: float, hi: float) -> bool:
    return value is not None and lo <= value <= hi


def interval(lo: float, hi: float) -> str:
    return f"[{g(lo)}, {g(hi)}]"


def bounds(band: str) -> tuple[float, float] | None:
    """(lo, hi) of a band that starts with an `interval`, else None."""
    if not band.startswith("["):
        return None
    lo, _, rest = band[1:].partition(", ")
    return num(lo), num(rest.partition("]")[0])


def _poisson_terms(k: int, mean: float, step: int) -> float:
    """The sum of Poisson(mean) probabilities from k onward in direction `step` (-1 or +1), on
    the side of the mode where they fall off."""
    log_mean, total, j = math.log(mean), 0.0, k
    while j >= 0:
        term = math.exp(j * log_mean - mean - math.lgamma(j + 1))
        total += term
        if term <= total * 1e-17:
            break
        j += step
    return total


def poisson_below(k: int, mean: float) -> float:
    """P(X <= k) for X ~ Poisson(mean), exact to float64's precision."""
    if k < 0:
        return 0.0
    if mean <= 0:
        return 1.0
    return _poisson_terms(k, mean, -1) if k <= mean else 1 - poisson_above(k + 1, mean)


def poisson_above(k: int, mean: float) -> float:
    """P(X >= k) for X ~ Poisson(mean)."""
    if k <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    return _poisson_terms(k, mean, +1) if k > mean else 1 - poisson_below(k - 1, mean)


def poisson_p_value(observed: int, mean: float) -> float:
    """The two-sided p-value of an observed count against a Poisson mean: twice the smaller
    tail, at most 1."""
    return min(1.0, 2 * min(poisson_below(observed, mean), poisson_above(observed, mean)))


def binomial_below(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0:
        return 1.0
    if p >= 1:
        return 0.0
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1)
                                 + j * math.log(p) + (n - j) * math.log1p(-p))
                        for j in range(k + 1)))


def _count_tail(k: int, mean: float, entry: dict, below: bool) -> float:
    """P(X <= k) (`below`) or P(X >= k) of the run's event count X of the given mean: Poisson,
    or for a bursty profile Poisson given its bursts, which are binomial over the steps."""
    tail = poisson_below if below else poisson_above
    active, steps = entry.get("active_steps"), entry.get("steps") or 0
    if active is None or not 0 < active < steps:
        return tail(k, mean)
    p, per_burst = active / steps, mean / active
    total = 0.0
    for bursts in range(steps + 1):
        log_pmf = (math.lgamma(steps + 1) - math.lgamma(bursts + 1)
                   - math.lgamma(steps - bursts + 1) + bursts * math.log(p)
                   + (steps - bursts) * math.log1p(-p))
        if log_pmf > -50:
            total += math.exp(log_pmf) * tail(k, bursts * per_burst)
    return total


def count_check(observed: int, expected: float, entry: dict, what: str = "mismatches",
                at_least: bool = False) -> str | None:
    """"excess events: ..." or "missing events: ..." when `observed` events are inconsistent
    with every mean within FREQ_TOLERANCE of `expected` at COUNT_LEVEL; else None.
    `at_least`: `observed` is a lower bound (some events went unlogged), so only an excess
    is judged."""
    lo, hi = expected * (1 - FREQ_TOLERANCE), expected * (1 + FREQ_TOLERANCE)
    side = COUNT_LEVEL / 2
    if _count_tail(observed, hi, entry, below=False) < side:
        word = EXCESS
    elif not at_least and _count_tail(observed, lo, entry, below=True) < side:
        word = MISSING
    else:
        return None
    return (f"{word}: {observed} {what} where the profile expects {g(expected)} (no mean "
            f"within {FREQ_TOLERANCE:.0%} of it gives this count at a two-sided level of "
            f"{COUNT_LEVEL:g})")


def count_pass_probability(expected: float, entry: dict) -> float:
    """The probability that a correct model passes a frequency band of +-FREQ_TOLERANCE
    around `expected` events: its count X (Poisson, or Poisson given binomial bursts, as
    `count_check` reads it) within [(1 - FREQ_TOLERANCE) expected, (1 + FREQ_TOLERANCE)
    expected]."""
    return count_between(expected * (1 - FREQ_TOLERANCE), expected * (1 + FREQ_TOLERANCE),
                         expected, entry)


def count_between(lo: float, hi: float, expected: float, entry: dict) -> float:
    """P(lo <= X <= hi) for the run's count X of mean `expected` (as `count_check` reads it)."""
    if expected <= 0:
        return 1.0 if lo <= 0 <= hi else 0.0
    lo, hi = math.ceil(lo), math.floor(hi)
    if hi < lo:
        return 0.0
    outside = (_count_tail(lo - 1, expected, entry, below=True)
               + _count_tail(hi + 1, expected, entry, below=False))
    return max(0.0, 1.0 - outside)


def run_total(run, key: str) -> int:
    """A count over the run: summary.json's `key`, else the sum of the metric."""
    total = run.summary.get(key)
    if total is None and key in run.metrics:
        total = pd.to_numeric(run.metrics[key], errors="coerce").sum()
    return int(total or 0)


def faults_landed(run) -> int:
    """Corruptions the injector made over the run."""
    return run_total(run, "faults/landed")


def too_rare(entry: dict, expected: float, observed: int,
             where: str = "over the run") -> str | None:
    """Why a frequency can not be measured in this run, or None when it can; asked only of a
    count that `count_check` found consistent with its expectation."""
    if expected < MIN_EXPECTED:
        return (f"{observed} mismatches {where}, as the {g(expected)} expected (fewer than "
                f"{MIN_EXPECTED:g}) allow")
    active = entry.get("active_steps")
    if active is not None and active < MIN_ACTIVE_STEPS:
        return (f"{observed} mismatches {where}, {g(expected)} expected, but in an expected "
                f"{g(active)} steps with bursts (fewer than {MIN_ACTIVE_STEPS:g})")
    return None


def as_zero(node: int, source: str, quantity: str, published, mismatches: int,
            ours: float | None, note: str = "") -> Row:
    """A number the paper gives as zero (no mismatch there): ours must have none either."""
    ok = mismatches == 0
    return Row(node, source, quantity, published, ours if ours is not None else 0.0, None,
               ZERO_BAND,
               "pass" if ok else "fail",
               (f"no mismatch, as published{note}" if ok else
                f"{mismatches} mismatches where the paper has none{note}"))
