"""Paper-style tables from run folders, as DataFrames, Markdown and CSV. Imports no JAX.

Ma et al., "Understanding Silent Data Corruption in LLM Training", measured here:
- Table 1: mismatch frequency per site, eqs. (1)-(2), averaged over microsteps;
- Table 2: maximum mismatch severity per site, eqs. (3)-(4), maximised over microsteps;
- Tables 6-7: frequency per decoder layer (forward, backward), averaged over microsteps;
- Tables 8-9: severity per decoder layer (forward, backward), maximised over microsteps;
- the WCNTS table of Figure 5, eq. (5);
- which bit fields (sign / exponent / mantissa) and bit positions the mismatches touched;
- ABFT per run (threshold rule, flags, recall and precision), flag rates per checked matmul
  and direction, and per step (Appendix D, Figure 10).
Every function takes `runs`, an ordered {label: Run} (`report.label_runs`), and computes from
the run folders' tables (bit histograms: summary.json), so an interrupted run reports what it has.
"""

from __future__ import annotations

import math

import pandas as pd

from sdcstudy.core import metrics as MX
from sdcstudy.faults import published as PB

SITES = MX.SITES
FWD_SITES = ("fwd/attn", "fwd/ffn")
BWD_SITES = ("bwd/ffn", "bwd/attn")  # the order the backward pass meets them (Tables 7, 9)
PUBLISHED_SUFFIX = " (Ma et al.)"
# Modes without parameter synchronization: their gradients are taken at parameters that have
# drifted apart, so ||g' - g|| there is not the per-step noise of eq. (5).
FREE_MODES = ("free", "finetune")
MANTISSA_BITS = {32: 23, 16: 7}  # float32, bfloat16 (8 exponent bits each, 1 sign bit)
# abft.parquet's matmuls in the order a decoder layer runs them (abft.MATMULS; that module
# imports JAX), and its check directions.
ABFT_MATMULS = ("q", "k", "v", "o", "gate", "up", "down", "head")
ABFT_DIRECTIONS = ("fwd", "bwd_input", "bwd_weight")


def lockstep_runs(runs: dict) -> dict:
    """The runs with a mismatch table (lock-step runs)."""
    return {label: run for label, run in runs.items() if len(run.mismatch_rollup)}


def site_statistics(run) -> pd.DataFrame:
    """Rows per site: "freq", eqs. (1)-(2) averaged over microsteps, and "max_severity", eqs.
    (3)-(4) maximised over microsteps (`metrics.site_aggregates`, from the run's rollup)."""
    by_site = run.mismatch_rollup.by_microstep.groupby(level="site")
    return pd.DataFrame({"freq": by_site["freq"].mean(), "max_severity": by_site["severity"].max()})


def _site_table(runs: dict, key: str, published_key: str) -> pd.DataFrame:
    rows = {}
    for label, run in lockstep_runs(runs).items():
        measured = site_statistics(run)[key]
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


def _per_layer(run, sites: tuple[str, ...], stat: str) -> pd.Series:
    """Eq. (1) per layer averaged over all microsteps of the run ("freq"), or eq. (3) per
    layer, the max over tp ranks and microsteps ("severity"), of `sites`."""
    by_layer = run.mismatch_rollup.by_layer
    rows = by_layer[by_layer.index.get_level_values("site").isin(sites)]
    return rows["freq" if stat == "freq" else "severity"]


def layer_table(runs: dict, direction: str, stat: str) -> pd.DataFrame:
    """Tables 6-9: rows (decoder layer, site), one column per run. `direction` is "fwd"
    (layers ascending, as Tables 6 and 8) or "bwd" (descending, as Tables 7 and 9); `stat` is
    "freq" (averaged over microsteps) or "severity" (maximised over microsteps)."""
    if direction not in ("fwd", "bwd") or stat not in ("freq", "severity"):
        raise ValueError(f"layer_table needs direction fwd|bwd and stat freq|severity, not "
                         f"{direction!r}, {stat!r}.")
    sites = FWD_SITES if direction == "fwd" else BWD_SITES
    columns = {label: _per_layer(run, sites, stat)
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


def bit_histograms(run) -> dict:
    """{site: histogram dict} of summary.json's `bit_histogram`, the four compared sites only."""
    histograms = run.summary.get("bit_histogram")
    if not isinstance(histograms, dict):
        return {}
    return {site: h for site, h in histograms.items() if site in SITES and isinstance(h, dict)}


def _bit_fields(histogram: dict):
    """(sign, exponent, mantissa) counts: as summary.json gives them, else from the bits."""
    if all(k in histogram for k in ("sign", "exponent", "mantissa")):
        return histogram["sign"], histogram["exponent"], histogram["mantissa"]
    bits = histogram.get("bits") or []
    mantissa = MANTISSA_BITS.get(len(bits))
    if mantissa is None:
        return None
    return bits[-1], sum(bits[mantissa:-1]), sum(bits[:mantissa])


def bit_field_table(runs: dict) -> pd.DataFrame:
    """Per run and site, the differing bits of the mismatching elements in the sign, exponent
    and mantissa fields (summary.json's bit histograms), "sign / exponent / mantissa": an
    element counts once per differing bit, so a field may count more than the mismatches.
    Single bit flips touch one field, wrong arithmetic mostly low mantissa bits."""
    rows = {}
    for label, run in runs.items():
        fields = {site: _bit_fields(h) for site, h in bit_histograms(run).items()}
        fields = {site: f for site, f in fields.items() if f is not None}
        if fields:
            rows[label] = {site: " / ".join(map(str, f)) for site, f in fields.items()}
    return pd.DataFrame.from_dict(rows, orient="index", columns=list(SITES)).fillna("-")


def bit_labels(width: int) -> list[str]:
    """Names of the bit positions of a `width`-bit float, highest first: "sign", "exp 7" ...
    "exp 0", "man 22" ... "man 0" for float32 (16 bits: bfloat16, mantissa 6 ... 0)."""
    if width not in MANTISSA_BITS:
        return [f"bit {i}" for i in reversed(range(width))]
    mantissa = MANTISSA_BITS[width]
    exponent = width - 1 - mantissa
    return (["sign"] + [f"exp {i}" for i in reversed(range(exponent))]
            + [f"man {i}" for i in reversed(range(mantissa))])


def bit_position_table(runs: dict) -> pd.DataFrame:
    """Rows (run, site), one column per bit position (sign, exponent bits, mantissa bits,
    highest first): how many mismatching elements differ in that bit, from summary.json's
    `bit_histogram[site]["bits"]` (index 0 = the lowest mantissa bit). Runs of float32 and
    bfloat16 share the sign and exponent columns; bits a format lacks are empty."""
    rows = {}
    for label, run in runs.items():
        for site, histogram in bit_histograms(run).items():
            bits = histogram.get("bits")
            if bits:
                rows[(label, site)] = dict(zip(bit_labels(len(bits)), reversed(bits)))
    if not rows:
        return pd.DataFrame()
    columns = {c for row in rows.values() for c in row}
    known = [c for width in sorted(MANTISSA_BITS, reverse=True) for c in bit_labels(width)]
    order = list(dict.fromkeys([*(c for c in known if c in columns),
                                *sorted(columns - set(known))]))
    table = pd.DataFrame.from_dict(rows, orient="index", columns=order)
    table.index = pd.MultiIndex.from_tuples(table.index, names=["node", "site"])
    return table


def abft_runs(runs: dict) -> dict:
    """The runs with a non-empty abft.parquet."""
    return {label: run for label, run in runs.items() if len(run.abft_by_step)}


def _order_rank(order: tuple, value) -> tuple:
    return (order.index(value), "") if value in order else (len(order), str(value))


def abft_runs_table(runs: dict) -> pd.DataFrame:
    """One row per run with ABFT checks: the threshold rule its flags are of (`paper`, eq. (6);
    `rounding`, our bound), the model's dtype, whether a flagged product was recomputed,
    checks and flags, and, for `experiment.mode: abft`, summary.json's `abft/detection`
    (corrupted products, those detected, recall, precision; `-` where a run has none)."""
    rows = {}
    for label, run in abft_runs(runs).items():
        abft = run.config.get("abft") or {}
        detection = run.summary.get("abft/detection")
        detection = detection if isinstance(detection, dict) else {}
        sums = run.abft_by_step.sum()
        rows[label] = {
            "threshold": str(abft.get("threshold", "paper")),
            "dtype": str((run.config.get("model") or {}).get("dtype", "float32")),
            "recompute": "yes" if abft.get("recompute") else "no",
            "checks": int(sums["checks"]), "flags": int(sums["flagged"]),
            **{column: _number(detection.get(key)) for key, column in ABFT_DETECTION.items()}}
    return pd.DataFrame.from_dict(
        rows, orient="index",
        columns=["threshold", "dtype", "recompute", "checks", "flags", *ABFT_DETECTION.values()])


# summary.json's abft/detection keys -> the ABFT runs table's columns
ABFT_DETECTION = {"corrupted_products": "corrupted products",
                  "detected_products": "detected", "recall": "recall",
                  "precision": "precision"}


def _number(value) -> float:
    """A summary value as a float: NaN (shown as -) where it is absent, null or not a number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else math.nan


def abft_rate_table(runs: dict) -> pd.DataFrame:
    """Rows (matmul, direction), one column per run with ABFT checks: the fraction of checks
    (over steps, microsteps, layers and tp ranks) that flagged under the run's threshold rule
    (`abft_runs_table` names it)."""
    columns = {}
    for label, run in abft_runs(runs).items():
        sums = run.abft_by_step.groupby(level=["matmul", "direction"]).sum()
        columns[label] = sums["flagged"] / sums["checks"]
    if not columns:
        return pd.DataFrame()
    table = pd.DataFrame(columns)
    order = sorted(table.index, key=lambda key: (_order_rank(ABFT_MATMULS, key[0]),
                                                 _order_rank(ABFT_DIRECTIONS, key[1])))
    return table.reindex(pd.MultiIndex.from_tuples(order, names=["matmul", "direction"]))


def abft_frequency_by_step(run, matmul: str | None = None,
                           direction: str | None = None) -> pd.Series:
    """Per optimizer step, the fraction of the run's ABFT checks flagged over microsteps,
    layers and tp ranks, for one matmul and direction (None: all of them)."""
    rows = run.abft_by_step
    if matmul is not None:
        rows = rows[rows.index.get_level_values("matmul") == matmul]
    if direction is not None:
        rows = rows[rows.index.get_level_values("direction") == direction]
    sums = rows.groupby(level="step").sum()
    return (sums["flagged"] / sums["checks"]).astype(float)


def wcnts_table(runs: dict) -> pd.DataFrame:
    """The WCNTS table of Figure 5, eq. (5): per synchronized run, the worst noise-to-signal
    ratio of the weight gradients, the step where it occurred, the steps whose ratio is not
    finite (a suspect gradient holding a NaN or an Inf: left out of the max, so a run that
    went NaN does not read as clean), and the published value. Figure 5 is of parameter
    synchronization: a `lockstep` run's taps repair the compared sites before any weight
    gradient reads them, so only `paramsync` rows carry the published value."""
    rows = {}
    for label, run in synchronized_runs(runs).items():
        nts = pd.to_numeric(run.metrics["grad/nts"], errors="coerce")
        finite = nts[nts.map(math.isfinite)]
        worst = MX.wcnts(run.metrics.to_dict("records"))
        paper = PB.published(run_profile(run)) if run_mode(run) == "paramsync" else None
        rows[label] = {"mode": run_mode(run), "wcnts": math.nan if worst is None else worst,
                       "step": int(run.metrics["step"][finite.idxmax()])
                       if len(finite) and finite.max() > 0 else math.nan,
                       "non-finite steps": int(len(nts) - len(finite)),
                       "wcnts" + PUBLISHED_SUFFIX: paper["wcnts"] if paper else math.nan}
    return pd.DataFrame.from_dict(
        rows, orient="index",
        columns=["mode", "wcnts", "step", "non-finite steps", "wcnts" + PUBLISHED_SUFFIX])


def first_nonfinite_step(run, keys) -> int | None:
    """The first step at which any metric of `keys` is NaN or infinite; None when none is."""
    m = run.metrics
    steps = [int(m["step"][bad].min()) for key in keys if key in m
             for bad in [~pd.to_numeric(m[key], errors="coerce").map(math.isfinite)]
             if bad.any()]
    return min(steps) if steps else None


def nonfinite_label(run, label: str,
                    keys=("loss/suspect", "grad/norm_suspect", "param/diff_l2")) -> str:
    """`label`, and the first step at which any of the suspect's curves `keys` is NaN or
    infinite (from there its plotted line vanishes, so the legend says why)."""
    step = first_nonfinite_step(run, keys)
    return label if step is None else f"{label} (not finite from step {step})"


def runs_table(runs: dict) -> pd.DataFrame:
    """One row per run: what it ran and its headline numbers (the last step's values)."""
    rows = {}
    for label, run in runs.items():
        m = run.metrics
        last = m.iloc[-1] if len(m) else pd.Series(dtype=float)
        faults = (int(pd.to_numeric(m["faults/landed"]).sum()) if "faults/landed" in m
                  else int(run.fault_counts["faults"].sum()))
        spikes = run.summary.get("loss_spikes")
        rows[label] = {
            "run": run.name, "mode": run_mode(run), "profile": run_profile(run),
            "steps": steps_done(run),
            "faults injected": faults,
            "mismatches": int(run.mismatch_rollup.by_microstep["mismatches"].sum())
            if len(run.mismatch_rollup) else math.nan,
            **{key: _measured(last, key) for key in ("loss/healthy", "loss/suspect",
                                                     "param/diff_l2")},
            "loss spikes": len(MX.loss_spike_spans(spikes)) if isinstance(spikes, list)
            else math.nan,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def partial_runs(runs: dict) -> dict[str, tuple[int, int]]:
    """{label: (steps done, experiment.steps)} of the runs that stopped before their last step
    (`--stop-after`, an interrupt, a crash): their tables and figures are of the steps done."""
    partial = {}
    for label, run in runs.items():
        asked, done = run.config.get("experiment", {}).get("steps"), steps_done(run)
        if isinstance(asked, int) and done < asked:  # NaN (not known) is not below
            partial[label] = (done, asked)
    return partial


def steps_done(run):
    """The run's last step: metrics.jsonl's, else (that file unreadable) summary.json's
    `steps_done`, else NaN, shown as -: not known, rather than 0."""
    done = run.metrics["step"].max() if len(run.metrics) else run.summary.get("steps_done")
    done = pd.to_numeric(done, errors="coerce")
    return int(done) if math.isfinite(done) else math.nan


def frequency_by_step(run, site: str) -> pd.Series:
    """Mismatch frequency of `site` per optimizer step of `run` (eqs. (1)-(2) per microstep,
    averaged over the step's microsteps); zero where a step has rows but no mismatch."""
    micro = run.mismatch_rollup.by_microstep["freq"]
    if site not in micro.index.get_level_values("site"):
        return pd.Series(dtype=float, name=site)
    return micro.xs(site, level="site").groupby(level="step").mean().rename(site)


def _measured(last: pd.Series, key: str):
    """The last step's `key`: NaN (shown as -) where the run does not measure it, and the text
    `nan` or `inf` where it measured a value that is not finite."""
    value = pd.to_numeric(pd.Series([last.get(key, math.nan)]), errors="coerce")[0]
    if key in last and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


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
    """CSV text with the index as leading columns named `index_names`: six significant digits,
    but whole numbers (counts, made float by a run without one) in full."""
    frame = table.copy()
    frame.index = frame.index.set_names(index_names)
    for c in [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c])]:
        if ((frame[c].dropna() % 1 == 0) & (frame[c].dropna().abs() < 2 ** 53)).all():
            frame[c] = frame[c].astype("Int64")  # inf % 1 is NaN: such a column stays float
    return frame.reset_index().to_csv(index=False, float_format="%.6g")
