"""The reproduction scorecard: for every number Ma et al. published, ours beside it and a verdict.

`build(plan, runs, stopped)` makes the rows (`bands.Row`) from the planned runs and the run
folders that finished; `write` puts them in `scorecard.md`, `scorecard.csv` and
`scorecard.json`. The bands and verdicts are `bands`'; the rows of each source come from
`mismatch_rows` (Tables 1, 2, 6-9) and `training_rows` (Figures 5, 6, 10); a failing row that
a measured finding explains names it (`findings`). Imports no JAX.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from sdcstudy.core import runfolder as RF
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import findings as F
from sdcstudy.reproduce import mismatch_rows as M
from sdcstudy.reproduce import training_rows as TR
from sdcstudy.reproduce.bands import Row

MARKDOWN, CSV, JSON = "scorecard.md", "scorecard.csv", "scorecard.json"
# The sources each mode's run feeds, in the order the scorecard lists them.
SOURCES = {"lockstep": ("Table 1", "Table 2", "Table 6", "Table 7", "Table 8", "Table 9"),
           "paramsync": ("Figure 5",), "free": ("Figure 6",), "abft": ("Figure 10",)}
ORDER = [source for sources in SOURCES.values() for source in sources]
COLUMNS = ("node", "source", "quantity", "published", "ours", "ratio", "band", "verdict",
           "reason", "expected", "why")


def _rows_of(entry: dict, run) -> list[Row]:
    node, name, mode = entry["node"], entry["name"], entry["mode"]
    if mode == "lockstep":
        return M.site_rows(node, name, run, entry) + M.layer_rows(node, name, run, entry)
    if mode == "paramsync":
        return [TR.figure5_row(node, name, run, entry)]
    if mode == "free":
        return TR.figure6_rows(node, name, run, entry)
    return [TR.figure10_row(node, name, run, entry)]


def build(plan: list[dict], runs: dict, stopped: dict | None = None) -> list[Row]:
    """Rows for every planned run: judged from `runs` ({name: report.runs.Run} of the finished
    runs), "fail" for a run in `stopped` ({name: why it stopped}), else "not run"."""
    stopped = stopped or {}
    rows = []
    for entry in plan:
        name, node = entry["name"], entry["node"]
        if name in stopped:
            rows += [Row(node, source, "-", None, None, None, "-", "fail",
                         f"the run stopped: {stopped[name]}") for source in SOURCES[entry["mode"]]]
        elif runs.get(name) is None:
            rows += [Row(node, source, "-", None, None, None, "-", "not run",
                         f"{name} has not finished") for source in SOURCES[entry["mode"]]]
        else:
            rows += F.explain(_rows_of(entry, runs[name]), entry, runs[name])
    return sorted(rows, key=lambda r: (r.node, ORDER.index(r.source)))


def counts(rows: list[Row]) -> dict:
    """{verdict: rows}, every verdict named."""
    return {v: sum(r.verdict == v for r in rows) for v in B.VERDICTS}


def unexplained(rows: list[Row]) -> int:
    """Failing rows that no measured finding explains."""
    return sum(r.verdict == "fail" and not r.why for r in rows)


def _cell(value) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else B.g(value)


def markdown(rows: list[Row], request: dict) -> str:
    """A verdict count per node, then each node's rows."""
    nodes = sorted({r.node for r in rows})
    lines = ["# Reproduction scorecard", "",
             f"Ma et al., *Understanding Silent Data Corruption in LLM Training*, measured on "
             f"the {request['preset']} model, {request['steps']} steps per run"
             + (f", the {' and '.join(request['modes'])} runs"
                if len(request["modes"]) < len(SOURCES) else "")
             + (f", {request['dtype']}" if request.get("dtype") else "")
             + (f", `--set {' '.join(request['overrides'])}`" if request.get("overrides")
                else "") + " (bands: docs/reproduction.md).", "",
             "| node | " + " | ".join(B.VERDICTS) + " |",
             "|---:|" + "---:|" * len(B.VERDICTS)]
    for node in nodes:
        tally = counts([r for r in rows if r.node == node])
        lines.append(f"| {node} | " + " | ".join(str(tally[v]) for v in B.VERDICTS) + " |")
    total = counts(rows)
    lines.append("| all | " + " | ".join(f"**{total[v]}**" for v in B.VERDICTS) + " |")
    lines += ["", f"Of the {total['fail']} failing rows, {total['fail'] - unexplained(rows)} "
                  f"name the measurement that explains them (docs/faults.md, section 5) and "
                  f"{unexplained(rows)} do not."]
    for node in nodes:
        lines += ["", f"## Node {node}", "",
                  "| source | quantity | published | ours | ratio | band | verdict | reason |",
                  "|---|---|---:|---:|---:|---|---|---|"]
        for r in rows:
            if r.node == node:
                verdict = f"**{r.verdict}**" if r.verdict == "fail" else r.verdict
                reason = f"{r.reason}. Why: {r.why}" if r.why else r.reason
                lines.append(f"| {r.source} | {r.quantity} | {_cell(r.published)} "
                             f"| {_cell(r.ours)} | {_cell(r.ratio)} | {r.band} | {verdict} "
                             f"| {reason} |")
    return "\n".join(lines) + "\n"


def write(root: Path, rows: list[Row], request: dict) -> dict:
    """scorecard.md, .csv and .json in `root`; returns {"markdown", "counts"}."""
    import pandas as pd

    text = markdown(rows, request)
    RF.atomic_write_text(root / MARKDOWN, text)
    frame = pd.DataFrame([asdict(r) for r in rows], columns=list(COLUMNS))
    RF.atomic_write_text(root / CSV, frame.to_csv(index=False, float_format="%.6g"))
    RF.atomic_write_json(root / JSON, {"request": request, "counts": counts(rows),
                                       "unexplained": unexplained(rows),
                                       "rows": [asdict(r) for r in rows]})
    return {"markdown": text, "counts": counts(rows)}
