"""Figure 10 at the paper's sizes, as scorecard rows: the share of fwd o checks flagged over the
paper's run, per node and tp, from `abft_paper_scale.measure`'s entries (docs/faults.md 5.4),
judged against appendix D.2 (node 14 "frequently", at least `bands.ABFT_FREQUENT` of the
checks; the others "little to no", at most `bands.ABFT_LITTLE`). Imports no JAX.

A measured share rests on a few fault draws a shape (16 in the committed measurement), each
given one fault at least where a check rarely holds one. Its verdict is sampling noise where
the draws' flag count is consistent with the band's edge: a binomial test of the count against
the per-draw flag probability that sits on the edge, at the two-sided level `DECIDE_LEVEL`.
There the row is judged by the analytic estimate of the same share
(`abft_paper_scale.sparse_prediction`, 1 - exp(-lambda q), which the measurement matches
where it decides, docs/faults.md 5.4) and says how many draws would decide it by measurement
(`draws_to_decide`).
"""

from __future__ import annotations

import math

from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce.bands import Row
from sdcstudy.reproduce.training_rows import ABFT_NODE

DECIDE_LEVEL = 0.01
# The chance a correct model passes a row the draws decide: its share is within the band, so the
# draws put it past the edge at most as often as at the edge, DECIDE_LEVEL / 2. A row the
# analytic estimate judges states none (that estimate's own error has no stated law).
DECIDED_CHANCE = 1 - DECIDE_LEVEL / 2
Z_DECIDE = 2.5758  # the normal quantile of 1 - DECIDE_LEVEL / 2


def edge_probability(entry: dict) -> float:
    """The per-draw flag probability at which the row's share of the run's checks sits on its
    band's edge: the edge over the share of the run the pattern is on and the share of checks
    that hold a fault."""
    edge = B.ABFT_FREQUENT if entry["node"] == ABFT_NODE else B.ABFT_LITTLE
    weight = entry.get("active", 1.0) * entry.get("fault_share", 1.0)
    return edge / weight if weight > 0 else math.inf


def flagged_draws(entry: dict, rule: str = "paper") -> int:
    """How many of the entry's draws flagged (a fault-bearing draw's flags; healthy checks of
    these shapes flag none)."""
    share = entry.get("fault_share", 1.0) or 1.0
    return max(0, min(entry["checks"], round(entry[f"flagged_active_{rule}"] / share *
                                             entry["checks"])))


def decided(entry: dict, rule: str = "paper") -> bool:
    """Whether the draws' flag count tells the share from the band's edge: the two-sided
    binomial p-value of the count at `edge_probability` is below `DECIDE_LEVEL` (an edge at
    or above 1 or at 0 is decided by any count)."""
    p, n, k = edge_probability(entry), entry["checks"], flagged_draws(entry, rule)
    if p >= 1 or p <= 0:
        return True
    if k > n * p:
        return 1 - B.binomial_below(k - 1, n, p) < DECIDE_LEVEL / 2
    if k < n * p:
        return B.binomial_below(k, n, p) < DECIDE_LEVEL / 2
    return False


def draws_to_decide(flag_probability: float, edge: float) -> int | None:
    """Draws whose flag share tells `flag_probability` from `edge` at `DECIDE_LEVEL` (normal
    approximation: Z^2 p (1 - p) / (edge - p)^2), and never fewer than the least that decide
    even the farthest count (none flagged below the edge, every draw above it: (1 - edge)^n or
    edge^n under DECIDE_LEVEL / 2), where the approximation fails; None where they are equal."""
    if flag_probability == edge:
        return None
    p = flag_probability
    normal = math.ceil(Z_DECIDE ** 2 * p * (1 - p) / (edge - p) ** 2)
    farthest = 1 - edge if p < edge else edge
    floor = (math.ceil(math.log(DECIDE_LEVEL / 2) / math.log(farthest))
             if 0 < farthest < 1 else 1)
    return max(1, normal, floor)


def rows(entries: list[dict], placement: str = "o_proj", rule: str = "paper") -> list[Row]:
    """One row an entry at the paper's shapes under `placement` (module docstring)."""
    out = []
    for e in entries:
        if e["node"] == 0 or e["placement"] != placement or not e["shape"].startswith("paper"):
            continue
        node, frequent = e["node"], e["node"] == ABFT_NODE
        published = "frequently" if frequent else "little or nothing"
        band = (f">= {B.ABFT_FREQUENT:.0%} of checks flagged" if frequent
                else f"<= {B.ABFT_LITTLE:.0%} of checks flagged")
        quantity = f"fwd o flagged checks, {e['shape']} (k {e['k']}, n {e['n']}, m {e['m']})"
        faults = e["o_faults"] + e["context_faults"]
        ours = e[f"flagged_{rule}"]
        if not faults:
            out.append(Row(node, "Figure 10", quantity, published, ours, None, band,
                           "no events", "the profile puts no fault in the attention"))
            continue
        how = _how_decided(e, rule)
        by_draws = decided(e, rule)
        if not by_draws and e.get("sparse_prediction") is not None:
            ours = e["sparse_prediction"]
        ok = ours >= B.ABFT_FREQUENT if frequent else ours <= B.ABFT_LITTLE
        out.append(Row(node, "Figure 10", quantity, published, ours, None, band,
                       "pass" if ok else "fail",
                       f"{B.g(faults)} faults per check ({placement}); {how}; one fault of its "
                       f"row's RMS is {B.g(e['single_fault_ratio'])} times eq. 6's threshold",
                       pass_probability=DECIDED_CHANCE if by_draws else None))
    return out


def _how_decided(e: dict, rule: str) -> str:
    n, k = e["checks"], flagged_draws(e, rule)
    measured = (f"{k} of {n} fault draws flagged: {B.g(e[f'flagged_{rule}'])} of the run's "
                f"checks ({B.g(e.get('active', 1.0))} of the run with the pattern on, "
                f"{B.g(e.get('fault_share', 1.0))} of its checks with a fault)")
    if decided(e, rule):
        return measured + f", which the draws decide (binomial, level {DECIDE_LEVEL:g})"
    analytic = e.get("sparse_prediction")
    if analytic is None:
        return measured + ", which sampling noise could put either side of the band's edge"
    weight = e.get("active", 1.0) * e.get("fault_share", 1.0)
    needed = draws_to_decide(analytic / weight if weight else 0.0, edge_probability(e))
    return (measured + f", which sampling noise could put either side of the band's edge; the "
            f"analytic estimate {B.g(analytic)} (1 - exp(-lambda q)) judges it"
            + (f"; at that estimate's rate about {needed:,} draws would decide it by measurement"
               if needed else ""))


def _entry_of(entries: list[dict], node: int, shape: str, placement: str) -> dict | None:
    return next((e for e in entries if e["node"] == node and e["shape"] == shape
                 and e["placement"] == placement), None)


def explain(rows_: list[Row], entries: list[dict], rule: str = "paper") -> list[Row]:
    """The why of each failing row, with its own numbers: node 14's rate, or for another node
    what its faults give at this shape under the other placements measured."""
    for row in rows_:
        if row.verdict != "fail":
            continue
        shape = row.quantity.split(", ")[1].partition(" (")[0]
        if row.node == ABFT_NODE:
            row.why = (f"docs/faults.md 5.4, Figure 10 at the paper's sizes: node 14's Table 1 "
                       f"rate, in bursts on {B.g(_active(entries, row.node, shape))} of the "
                       f"run, flags {B.g(row.ours)} of the checks at {shape}: \"frequently\" "
                       f"needs a rate of its own under ABFT, which the profile does not model; "
                       f"D.2 and D.3 say the float32 flags need not follow the bfloat16 "
                       f"mismatches and that ABFT's overhead changes the utilization the "
                       f"faults depend on")
            continue
        others = [(p, e[f"flagged_{rule}"]) for p in ("inside", "split")
                  if (e := _entry_of(entries, row.node, shape, p)) is not None]
        elsewhere = "; ".join(f"with them {_words(p)} this node flags {B.g(v)} of the checks"
                              for p, v in others)
        row.why = (f"docs/faults.md 5.4, where the faults arise: this row puts every attention "
                   f"fault of node {row.node} between o's product and its check, the placement "
                   f"that flags most"
                   + (f"; {elsewhere} at {shape}" if elsewhere else "")
                   + ". The paper states neither its tp nor where its faults arose: a "
                     "modelling choice, not Table 1 against Figure 10")
    return rows_


def _active(entries: list[dict], node: int, shape: str) -> float:
    entry = _entry_of(entries, node, shape, "o_proj")
    return entry.get("active", 1.0) if entry else 1.0


def _words(placement: str) -> str:
    return {"inside": "inside the attention (its context)",
            "split": "split between the context and o"}.get(placement, placement)
