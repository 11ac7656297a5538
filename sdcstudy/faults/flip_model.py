"""The flip model of the paper nodes: flips of the stored bfloat16 result's bits, with a tail
of accumulator errors (`paper_node(node, fault_model="flip")`, docs/faults.md section 6).

Ma et al. ("Understanding Silent Data Corruption in LLM Training") computed in bfloat16, and
the per-layer maxima of their Tables 8-9 for the nodes with few events are the sizes of single
mantissa-bit flips (node 15: 0.0053, 0.0082, 0.0176; node 5: 0.0048; node 13: 0.036-0.32).
A hit of the model's bulk flips one of the 7 mantissa bits of the bfloat16 result, each
equally likely (`BULK_BIT_CLASS`): bit j gives a relative error 2^(j-7) / s in
[2^(j-8), 2^(j-7)], s in [1, 2) the value's significand, whatever the value's size. A fraction
`p_tail` of the hits are instead the accumulator errors of the default model (`kind:
additive`, error m x the row's RMS), whose relative error has the 1/t tail that Table 2's large
maxima need; `tail_fraction` fits it per node and site to the per-layer maxima of Tables 8-9.
"""

from __future__ import annotations

import math
from functools import lru_cache

from sdcstudy.faults import published_layers as PL

BULK_BIT_CLASS = "bf16-mantissa"  # bits 16-22 of a float32 value, bits 0-6 of a bfloat16
BULK_BITS = 7
# E[4^(j-7)] over the 7 mantissa bits, equally likely: the mean square of the flipped place.
PLACE_MEAN_SQUARE = (1 - 4.0 ** -BULK_BITS) / (3 * BULK_BITS)
BULK_MAX = 0.5  # the largest relative error one bulk flip gives (bit 6 at significand 1)
# The relative error of an additive hit with m log-uniform on [2^-8, 1], on a value whose size
# over its row's RMS has the normal density at zero, phi(0): P(|err / f| > t) -> ADDITIVE_TAIL
# / t for t >> 1, ADDITIVE_TAIL = 2 phi(0) E[m] (docs/faults.md, section 2).
ADDITIVE_MEAN = (1 - 2.0 ** -8) / (8 * math.log(2))
ADDITIVE_TAIL = math.sqrt(2 / math.pi) * ADDITIVE_MEAN

# The paper's exposure (section 4 and appendix B): 4500 steps of 16 micro-batches of 1, and one
# mismatching element in one layer over the run is a frequency of ONE_EVENT (Table 7, node 5,
# layer 3; Table 1's 1.49e-15 is it over 16 layers). The tensor-parallel degree is not stated:
# PAPER_TP = 8 is assumed, and a fitted tail fraction scales as 1 / tp.
PAPER_MICROSTEPS = 4500 * 16
# The model each node keeps (`sdcstudy reproduce --fault-model chosen`): the one whose
# held-out rows pass more often on the tiny scorecards, docs/faults.md 6.5; the others keep
# the additive one.
MODEL_OF_NODE = {1: "flip", 8: "flip", 10: "flip"}
ONE_EVENT = 2.39e-14
PAPER_TP = 8


def gaussian_octave_moment(power: int, terms: range = range(-80, 12)) -> float:
    """E[4^e |f|^power] for a standard normal f = s 2^e (s in [1, 2)): the sum over octaves e
    of 4^e E[|f|^power; 2^e <= |f| < 2^(e+1)], power 0 or -2."""
    def partial(x: float) -> float:  # E[|f|^power; |f| < x]
        if power == 0:
            return math.erf(x / math.sqrt(2))
        return -math.sqrt(2 / math.pi) * math.exp(-x * x / 2) / x - math.erf(x / math.sqrt(2))
    total = 0.0
    for e in terms:
        lo, hi = 2.0 ** e, 2.0 ** (e + 1)
        total += 4.0 ** e * (partial(hi) - partial(lo))
    return total


def bulk_noise(kappa: float | None = None) -> float:
    """||f' - f||^2 / ||f||^2 per unit rate of the bulk: E[4^(j-7)] x kappa, kappa =
    E[4^e] / E[f^2] (the significand's -2nd moment weighted by f^2): 0.543 for normal values
    (the default), 3 / (8 ln 2) x ln 2 / 1.5 = 0.462 for values spread evenly over octaves."""
    return PLACE_MEAN_SQUARE * (gaussian_octave_moment(0) if kappa is None else kappa)


def bulk_mean_square() -> float:
    """E[r^2] of one bulk hit on a normal value, r = |f' - f| / |f|: E[4^(j-7)] E[s^-2]."""
    return PLACE_MEAN_SQUARE * gaussian_octave_moment(-2)


def paper_units(freq: float, tp: int = PAPER_TP) -> float:
    """The (microstep, tp rank) units of one layer with a mismatch in the paper's run, at a
    layer frequency `freq`: each rank's tensor holds 1 / (ONE_EVENT x microsteps x tp)
    elements, so a unit is hit with probability 1 - exp(-freq x that)."""
    per_rank = 1 / (ONE_EVENT * PAPER_MICROSTEPS * tp)
    return PAPER_MICROSTEPS * tp * -math.expm1(-freq * per_rank)


def tail_constant(maxima: list[float], units: list[float], floor: float = BULK_MAX) -> float:
    """c in P(S > t) = c / t, the unit severity's tail, from per-layer maxima over `units`
    units each: the maximum likelihood of the Frechet law P(max <= t) = exp(-c U / t), with a
    maximum at or below `floor` (the bulk alone reaches it) read as "max <= floor":
    c = n_above / (sum_above U / max + sum_below U / floor). Layers without units drop out."""
    above = [(m, u) for m, u in zip(maxima, units) if u > 0 and m > floor]
    below = sum(u for m, u in zip(maxima, units) if u > 0 and m <= floor)
    return tail_constant_of_sums(len(above), sum(u / m for m, u in above), below, floor)


def tail_constant_of_sums(n_above: int, inverse_above: float, units_below: float,
                          floor: float = BULK_MAX) -> float:
    """`tail_constant` from its sums: the maxima above `floor`, their units over their maximum
    summed, and the units of the groups at or below it (what a run's rollup keeps)."""
    weight = inverse_above + units_below / floor
    return n_above / weight if weight > 0 else 0.0


def predicted_maximum(c: float, units: float) -> float:
    """The median of the maximum over `units` units of a tail c / t: c U / ln 2."""
    return c * units / math.log(2)


@lru_cache(maxsize=None)
def layer_fit(node: int, site: str, tp: int = PAPER_TP) -> dict:
    """{"c", "p_tail", "units", "table2"}: the tail constant fitted to the per-layer maxima of
    Table 8 or 9 with Table 6 or 7's layer frequencies as exposure, the tail fraction it
    implies (c / ADDITIVE_TAIL, at most 1), the paper's units of the site (all layers), and
    the median maximum over them of the model's tail (Table 2's statistic)."""
    freq_table, severity_table = PL.tables_for(site)
    maxima = PL.layer_values(severity_table, node, site)
    freqs = PL.layer_values(freq_table, node, site)
    if maxima is None or freqs is None:
        return {"c": 0.0, "p_tail": 0.0, "units": 0.0, "table2": 0.0}
    units = [paper_units(f, tp) for f in freqs]
    c = tail_constant(list(maxima), units)
    p_tail = min(c / ADDITIVE_TAIL, 1.0)
    return {"c": c, "p_tail": p_tail, "units": sum(units),
            "table2": predicted_maximum(p_tail * ADDITIVE_TAIL, sum(units))}


def tail_fraction(node: int, site: str) -> float:
    """The fraction of `node`'s hits at `site` that are accumulator errors (`layer_fit`)."""
    return layer_fit(node, site)["p_tail"]
