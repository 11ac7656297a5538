"""Scorecard rows of a lock-step run (RQ1): Tables 1 and 2 per site, Tables 6-9 per layer.

Frequencies and severities come from `report.tables` (the run's mismatch table, by the
formulas of docs/metrics.md) with the published values beside them; the bands are `bands`'. Imports
no JAX.
"""

from __future__ import annotations

from sdcstudy.faults import published as PB
from sdcstudy.faults import published_layers as PL
from sdcstudy.report import tables as T
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce.bands import Row


def _cell(table, name: str, column: str) -> float | None:
    return B.num(table.at[name, column]) if name in table.index else None


def site_rows(node: int, name: str, run, entry: dict) -> list[Row]:
    """Table 1 (frequency) and Table 2 (maximum severity) rows, one per site each."""
    runs = {name: run}
    freq, severity = T.frequency_table(runs), T.severity_table(runs)
    by_layer = run.mismatch_rollup.by_layer
    counts = by_layer["mismatches"].groupby(level="site").sum() if len(by_layer) else {}
    note = "" if node in PB.TABLE1_FREQUENCY else " (Tables 1-2 leave the node out: none)"
    paper = PB.published(f"{PB.PAPER_PREFIX}{node}")
    rows = []
    for site in PB.SITES:
        expected = entry["sites"].get(site, B.NO_SITE)
        n = int(counts.get(site, 0))
        pub_f, ours_f = float(paper["freq"][site]), _cell(freq, name, site)
        if ours_f is None:
            rows.append(Row(node, "Table 1", site, pub_f, None, None, "-", "fail",
                            "the run has no mismatch table"))
        elif pub_f == 0:
            rows.append(B.as_zero(node, "Table 1", site, 0.0, n, ours_f, note))
        else:
            rows.append(_frequency_row(node, site, pub_f, ours_f, n, expected, entry))
        pub_s, ours_s = float(paper["max_severity"][site]), _cell(severity, name, site)
        if pub_s == 0:
            rows.append(B.as_zero(node, "Table 2", site, 0.0, n, ours_s, note))
        else:
            rows.append(severity_row(node, site, pub_s, ours_s, n, expected, entry))
    return rows


def severity_row(node: int, site: str, published: float, ours: float | None, n: int,
                 expected: dict, entry: dict) -> Row:
    """Table 2 at a site the paper gives a maximum: ours, the largest of the run's `n`
    mismatches there, within `bands.SEVERITY_FACTOR` of it, once the count is consistent with
    the profile's `expected` (`plan.expectations`' site entry); "no events" without one."""
    lo, hi = published / B.SEVERITY_FACTOR, published * B.SEVERITY_FACTOR
    if wrong := B.count_check(n, expected["mismatches"], entry):
        return Row(node, "Table 2", site, published, ours, B.ratio(ours, published),
                   B.interval(lo, hi), "fail", wrong, published)
    if n == 0:
        return Row(node, "Table 2", site, published, None, None, B.interval(lo, hi),
                   "no events", f"no mismatch at this site (expected "
                                f"{B.g(expected['mismatches'])} over the run)")
    return Row(node, "Table 2", site, published, ours, B.ratio(ours, published),
               B.interval(lo, hi), "pass" if B.within(ours, lo, hi) else "fail",
               f"the largest of {n} mismatches", published)


def _frequency_row(node, site, published, ours, n, expected, entry) -> Row:
    scale = expected["scale"]
    target = published * scale
    lo, hi = target * (1 - B.FREQ_TOLERANCE), target * (1 + B.FREQ_TOLERANCE)
    band = B.interval(lo, hi)
    if abs(scale - 1) > 1e-3:
        band += f" (Table 1 x {B.g(scale)}, the time pattern over this run)"
    verdict, reason = "", B.count_check(n, expected["mismatches"], entry)
    if reason:
        verdict = "fail"
    elif reason := B.too_rare(entry, expected["mismatches"], n):
        verdict = B.TOO_RARE
    chance = B.count_pass_probability(expected["mismatches"], entry)
    if verdict:
        return Row(node, "Table 1", site, published, ours, B.ratio(ours, published), band,
                   verdict, reason, target, pass_probability=chance)
    return Row(node, "Table 1", site, published, ours, B.ratio(ours, published), band,
               "pass" if B.within(ours, lo, hi) else "fail",
               f"{n} mismatches, {B.g(ours / target)}x the expected frequency", target,
               pass_probability=chance)


def layer_rows(node: int, name: str, run, entry: dict) -> list[Row]:
    """Tables 6-9: each of our decoder layers against the paper's range over its 16."""
    counts = run.mismatch_rollup.by_layer["mismatches"]
    if not len(counts):
        return []
    runs = {name: run}
    layers = entry.get("layers") or counts.index.get_level_values("layer").nunique()
    rows = []
    for direction, sites in (("fwd", T.FWD_SITES), ("bwd", T.BWD_SITES)):
        for stat, pick in (("freq", 0), ("severity", 1)):
            table = T.layer_table(runs, direction, stat)
            for site in sites:
                source = PL.tables_for(site)[pick]
                paper = PL.layer_range(source, node, site)
                if paper is None:  # the table leaves the node out (Table 1 has it as zero)
                    continue
                for layer, at in table.index:
                    if at == site:
                        rows.append(_layer_row(
                            node, source, site, layer, stat, paper,
                            B.num(table.at[(layer, site), name]),
                            int(counts.get((layer, site), 0)),
                            entry["sites"].get(site, B.NO_SITE), layers, entry))
    return rows


def _layer_row(node, source, site, layer, stat, paper, ours, n, expected, layers,
               entry) -> Row:
    quantity = f"{site} layer {layer}"
    published = f"{B.interval(*paper)} over {PL.PAPER_LAYERS} layers"
    if paper[1] == 0:
        return B.as_zero(node, source, quantity, published, n, ours)
    per_layer = expected["mismatches"] / max(layers, 1)
    chance = None
    if stat == "freq":
        before_pattern = paper[0] * (1 - B.FREQ_TOLERANCE), paper[1] * (1 + B.FREQ_TOLERANCE)
        lo, hi = (bound * expected["scale"] for bound in before_pattern)
        chance = _layer_chance(node, site, *before_pattern, per_layer, entry)
    else:
        lo, hi = paper[0] / B.SEVERITY_FACTOR, paper[1] * B.SEVERITY_FACTOR
    if wrong := B.count_check(n, per_layer, entry):
        return Row(node, source, quantity, published, ours, None, B.interval(lo, hi), "fail",
                   f"{wrong} in this layer", pass_probability=chance)
    if stat == "freq" and (rare := B.too_rare(entry, per_layer, n, "in this layer")):
        return Row(node, source, quantity, published, ours, None, B.interval(lo, hi),
                   B.TOO_RARE, rare, pass_probability=chance)
    if stat != "freq" and n == 0:
        return Row(node, source, quantity, published, None, None, B.interval(lo, hi),
                   "no events", "no mismatch in this layer")
    return Row(node, source, quantity, published, ours, None, B.interval(lo, hi),
               "pass" if B.within(ours, lo, hi) else "fail", f"{n} mismatches in this layer",
               pass_probability=chance)


def _layer_chance(node, site, lo, hi, per_layer, entry) -> float | None:
    """The probability that a correct model (its layer's rate Table 1's, as the profiles' are)
    passes a Tables 6-7 band [lo, hi] (before the time pattern): its count, of mean
    `per_layer`, within per_layer x [lo, hi] / Table 1."""
    table1 = float(PB.published(f"{PB.PAPER_PREFIX}{node}")["freq"][site])
    if table1 <= 0:
        return None
    return B.count_between(per_layer * lo / table1, per_layer * hi / table1, per_layer, entry)
