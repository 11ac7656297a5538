"""Paper-style tables from run folders, as DataFrames, Markdown and CSV. Imports no JAX.

Ma et al., "Understanding Silent Data Corruption in LLM Training", measured here:
- Table 1: mismatch frequency per site, eqs. (1)-(2), averaged over microsteps;
- Table 2: maximum mismatch severity per site, eqs. (3)-(4), maximised over microsteps;
- Tables 6-7: frequency per decoder layer (forward, backward), averaged over microsteps;
- Tables 8-9: severity per decoder layer (forward, backward), maximised over microsteps;
- the WCNTS table of Figure 5, eq. (5);
- which bit fields (sign / exponent / mantissa) the mismatches touched.
Every function takes `runs`, an ordered {label: Run} (`report.label_runs`), and computes from
the run folders' tables (only the bit fields come from summary.json), so an interrupted run
reports what it has.
"""

from __future__ import annotations

import math

import pandas as pd

from . import metrics as MX
from . import published as PB

SITES = MX.SITES
FWD_SITES = ("fwd/attn", "fwd/ffn")
BWD_SITES = ("bwd/ffn", "bwd/attn")  # the order the backward pass meets them (Tables 7, 9)
PUBLISHED_SUFFIX = " (Ma et al.)"
# Modes without parameter synchronization: their gradients are taken at parameters that have
# drifted apart, so ||g' - g|| there is not the per-step noise of eq. (5).
FREE_MODES = ("free", "finetune")


def lockstep_runs(runs: dict) -> dict:
    """The runs with a mismatch table (lock-step runs)."""
    return {label: run for label, run in runs.items() if len(run.mismatch)}


def _site_table(runs: dict, key: str, published_key: str) -> pd.DataFrame:
    rows = {}
    for label, run in lockstep_runs(runs).items():
        measured = MX.site_aggregates(run.mismatch)[key]
        paper = PB.published(run_profile(run))
        rows[label] = {**{site: measured.get(site, math.nan) for site in SITES},
                       **{site + PUBLISHED_SUFFIX: paper[published_key][site] if paper
                          else math.nan for site in SITES}}
    return pd.DataFrame.from_dict(rows, orient="index",
                                  columns=[*SITES, *(s + PUBLISHED_SUFFIX for s in SITES)])


def frequency_table(runs: dict) -> pd.DataFrame:
    """Table 1: per run and site, the mean over microsteps of the mismatch frequency, eqs.
    (1)-(2); `SITE (Ma et al.)` columns hold the published value for paper node profiles."""
    return _site_table(runs, "freq", "freq")


def severity_table(runs: dict) -> pd.DataFrame:
    """Table 2: per run and site, the maximum over microsteps of the severity, eqs. (3)-(4)."""
    return _site_table(runs, "max_severity", "max_severity")


def _per_layer(mismatch: pd.DataFrame, sites: tuple[str, ...], stat: str) -> pd.Series:
    rows = mismatch[mismatch["site"].isin(sites)]
    if stat == "freq":
        # eq. (1) per layer: mismatches summed over tp ranks / elements, then the mean over
        # all microsteps of the run.
        summed = rows.groupby(["step", "microstep", "layer", "site"])[
            ["mismatches", "elements"]].sum()
        per_micro = summed["mismatches"] / summed["elements"]
        return per_micro.groupby(level=["layer", "site"]).mean()
    # eq. (3) per layer: the max over tp ranks, then over all microsteps of the run.
    return rows.groupby(["layer", "site"])["severity"].max()


def layer_table(runs: dict, direction: str, stat: str) -> pd.DataFrame:
    """Tables 6-9: rows (decoder layer, site), one column per run. `direction` is "fwd"
    (layers ascending, as Tables 6 and 8) or "bwd" (descending, as Tables 7 and 9); `stat` is
    "freq" (averaged over microsteps) or "severity" (maximised over microsteps)."""
    if direction not in ("fwd", "bwd") or stat not in ("freq", "severity"):
        raise ValueError(f"layer_table needs direction fwd|bwd and stat freq|severity, not "
                         f"{direction!r}, {stat!r}.")
    sites = FWD_SITES if direction == "fwd" else BWD_SITES
    columns = {label: _per_layer(run.mismatch, sites, stat)
               for label, run in lockstep_runs(runs).items()}
    if not columns:
        return pd.DataFrame()
    table = pd.DataFrame(columns)
    layers = sorted({layer for layer, _ in table.index}, reverse=direction == "bwd")
    order = [(layer, site) for layer in layers for site in sites if (layer, site) in table.index]
    table = table.reindex(pd.MultiIndex.from_tuples(order, names=["layer", "site"]))
    return table


def synchronized_runs(runs: dict) -> dict:
    """The paired runs whose parameters are synchronized every step (lockstep, paramsync)."""
    return {label: run for label, run in runs.items()
            if "grad/nts" in run.metrics and run_mode(run) not in FREE_MODES}


def bit_field_table(runs: dict) -> pd.DataFrame:
    """Per lock-step run and site, how many mismatching elements differ in the sign, exponent
    and mantissa fields (from summary.json's bit histograms), written "sign / exponent /
    mantissa": single bit flips touch one field, wrong arithmetic mostly low mantissa bits."""
    rows = {}
    for label, run in lockstep_runs(runs).items():
        histograms = run.summary.get("bit_histogram") or {}
        if histograms:
            rows[label] = {site: f"{h['sign']} / {h['exponent']} / {h['mantissa']}"
                           for site, h in histograms.items() if site in SITES}
    return pd.DataFrame.from_dict(rows, orient="index", columns=list(SITES)).fillna("-")


def wcnts_table(runs: dict) -> pd.DataFrame:
    """The WCNTS table of Figure 5, eq. (5): per synchronized run, the worst noise-to-signal
    ratio of the weight gradients, the step where it occurred, and the published value."""
    rows = {}
    for label, run in synchronized_runs(runs).items():
        nts = pd.to_numeric(run.metrics["grad/nts"], errors="coerce")
        finite = nts[nts.map(math.isfinite)]
        worst = MX.wcnts(run.metrics.to_dict("records"))
        paper = PB.published(run_profile(run))
        rows[label] = {"mode": run_mode(run), "wcnts": math.nan if worst is None else worst,
                       "step": int(run.metrics["step"][finite.idxmax()])
                       if len(finite) and finite.max() > 0 else math.nan,
                       "wcnts" + PUBLISHED_SUFFIX: paper["wcnts"] if paper else math.nan}
    return pd.DataFrame.from_dict(rows, orient="index",
                                  columns=["mode", "wcnts", "step", "wcnts" + PUBLISHED_SUFFIX])


def runs_table(runs: dict) -> pd.DataFrame:
    """One row per run: what it ran and its headline numbers (the last step's values)."""
    rows = {}
    for label, run in runs.items():
        m = run.metrics
        last = m.iloc[-1] if len(m) else pd.Series(dtype=float)
        faults = (int(pd.to_numeric(m["faults/landed"]).sum()) if "faults/landed" in m
                  else len(run.faults))
        spikes = run.summary.get("loss_spikes")
        rows[label] = {
            "run": run.name, "mode": run_mode(run), "profile": run_profile(run),
            "steps": int(m["step"].max()) if len(m) else 0,
            "faults injected": faults,
            "mismatches": int(run.mismatch["mismatches"].sum()) if len(run.mismatch)
            else math.nan,
            "loss/healthy": last.get("loss/healthy", math.nan),
            "loss/suspect": last.get("loss/suspect", math.nan),
            "param/diff_l2": last.get("param/diff_l2", math.nan),
            "loss spikes": len(spikes) if isinstance(spikes, list) else math.nan,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def frequency_by_step(mismatch: pd.DataFrame, site: str) -> pd.Series:
    """Mismatch frequency of `site` per optimizer step (eqs. (1)-(2) per microstep, averaged
    over the step's microsteps); zero where a step has rows but no mismatch."""
    rows = mismatch[mismatch["site"] == site]
    if rows.empty:
        return pd.Series(dtype=float, name=site)
    per_layer = rows.groupby(["step", "microstep", "layer"])[["mismatches", "elements"]].sum()
    per_micro = (per_layer["mismatches"] / per_layer["elements"]).groupby(
        level=["step", "microstep"]).mean()
    return per_micro.groupby(level="step").mean().rename(site)


def run_profile(run) -> str:
    return str(run.config.get("suspect", {}).get("profile", "healthy"))


def run_mode(run) -> str:
    return str(run.config.get("experiment", {}).get("mode", "train"))


# --- rendering --------------------------------------------------------------------------------


def fmt(value) -> str:
    """Three significant digits; '-' for a missing value; integers as they are."""
    if isinstance(value, str):
        return value
    if value is None or math.isnan(float(value)):
        return "-"
    value = float(value)
    if value.is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"


def markdown(table: pd.DataFrame, index_names: list[str] | None = None,
             with_published: bool = False) -> str:
    """A GitHub Markdown table. With `with_published`, a column `X (Ma et al.)` is folded into
    column X as `measured (published)`."""
    columns = [c for c in table.columns
               if not (with_published and str(c).endswith(PUBLISHED_SUFFIX))]
    names = index_names or [table.index.name or ""] * max(1, table.index.nlevels)
    head = [*names, *map(str, columns)]
    numeric = [pd.api.types.is_numeric_dtype(table[c]) for c in columns]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "---|" * len(names) + "".join("---:|" if n else "---|" for n in numeric)]
    for key, row in table.iterrows():
        keys = key if isinstance(key, tuple) else (key,)
        cells = []
        for c in columns:
            cell = fmt(row[c])
            paper = row.get(str(c) + PUBLISHED_SUFFIX) if with_published else None
            if paper is not None and not (isinstance(paper, float) and math.isnan(paper)):
                cell += f" ({fmt(paper)})"
            cells.append(cell)
        lines.append("| " + " | ".join([*map(str, keys), *cells]) + " |")
    return "\n".join(lines)


def csv(table: pd.DataFrame, index_names: list[str]) -> str:
    """CSV text with the index as leading columns named `index_names`."""
    frame = table.copy()
    frame.index = frame.index.set_names(index_names)
    return frame.reset_index().to_csv(index=False, float_format="%.6g")
