"""The reproduction scorecard: for Ma et al.'s Tables 1, 2, 6-9 and Figures 3-6 and 10 and
appendices C.2 and D.3, ours beside each published result and a verdict; Tables 3/5, Figure 7
and appendix D.4, which its runs do not make, have a "not reproducible here" row saying why
(`claim_rows.UNSCORED`; docs/reproduction.md).

`build(plan, runs, stopped)` makes the rows (`bands.Row`) from the planned runs and the run
folders that finished; `write` puts them in `scorecard.md`, `scorecard.csv` and
`scorecard.json`. The bands and verdicts are `bands`'; the rows of each source come from
`mismatch_rows` (Tables 1, 2, 6-9) and `training_rows` (Figures 5, 6, 10), with one row about
all the nodes' free runs (`drift_rows`, listed under "across nodes"); a failing row that
a measured finding explains names it (`findings`), except a row failed by its event count
(excess or missing events: the engine's doing, whatever a finding says). Calibration rows
(the quantities the profiles are fitted to) are tallied and listed apart from the held-out
ones, and so are held-out rows whose verdict the profile fixes (`bands.FIXED`); the rows
that state no chance of a correct model passing get theirs from `pass_chance`, and the summary
counts the judged rows whose band a correct model rarely passes (`LOW_CHANCE`). Figure 10 at
the paper's sizes (`figure10_paper.rows`) joins the rows
of the planned ABFT runs' nodes, from the measurement committed in `PAPER_SCALE`. Imports no
JAX.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from sdcstudy.core import runfolder as RF
from sdcstudy.faults import flip_model
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import claim_rows as CR
from sdcstudy.reproduce import drift_rows as D
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import figure10_paper as F10
from sdcstudy.reproduce import findings as F
from sdcstudy.reproduce import mismatch_rows as M
from sdcstudy.reproduce import pass_chance as PC
from sdcstudy.reproduce import provenance as PV
from sdcstudy.reproduce import seed_scatter as SS
from sdcstudy.reproduce import training_rows as TR
from sdcstudy.reproduce.bands import Row

MARKDOWN, CSV, JSON = "scorecard.md", "scorecard.csv", "scorecard.json"
# The sources each mode's run feeds, in the order the scorecard lists them.
SOURCES = {"lockstep": ("Table 1", "Table 2", "Table 6", "Table 7", "Table 8", "Table 9"),
           "paramsync": ("Figure 5",), "free": ("Figure 6",), "abft": ("Figure 10",)}
# Every source a row can have, in the order the scorecard lists them: those of the modes'
# bands, then the published results of `claim_rows`.
ORDER = ["Figure 3", "Figure 4", *[source for sources in SOURCES.values() for source in sources],
         CR.SHAPE_SOURCE, "Appendix C.2", "Appendix D.3", "Figure 7", "Tables 3/5", "Appendix D.4"]
COLUMNS = ("node", "source", "quantity", "published", "ours", "ratio", "band", "verdict",
           "reason", "expected", "why", "role", "pass_probability", "pass_probability_max")
ROLES = (B.CALIBRATION, B.HELD_OUT, B.FIXED)
# Figure 10 at the paper's sizes: `measure`'s entries, as `python -m sdcstudy.dev.figure10_entries` writes
# them (docs/faults.md 5.4).
PAPER_SCALE = (Path(__file__).resolve().parents[2] / "docs" / "scorecards" /
               "abft_paper_scale.json")
LOW_CHANCE = 0.05  # a band a correct model passes less often than this decides nothing
PAPER_ROWS = "fwd o flagged checks"  # the quantity of every row of Figure 10 at the paper's sizes
PAPER_SCALE_COMMAND = "python -m sdcstudy.dev.figure10_entries --out docs/scorecards"
# Why the row of a run that stopped (its loss non-finite) states no chance: it has no value.
STOPPED_NO_CHANCE = "the run stopped before its last step, so it has no value to judge"


def _rows_of(entry: dict, run) -> list[Row]:
    node, name, mode = entry["node"], entry["name"], entry["mode"]
    if mode == "lockstep":
        burst = CR.burst_row(node, run)
        return (M.site_rows(node, name, run, entry) + X.rows(node, run)
                + M.layer_rows(node, name, run, entry) + X.layer_rows(node, run)
                + ([burst] if burst else []) + CR.layer_trend_rows(node, run))
    if mode == "paramsync":
        return [TR.figure5_row(node, name, run, entry),
                TR.figure5_rms_row(node, name, run, entry), CR.figure5_shape_row(node, run)]
    if mode == "free":
        return TR.figure6_rows(node, name, run, entry) + [CR.figure6_grad_norm_row(node, run)]
    return [TR.figure10_row(node, name, run, entry)]


def _model(entry: dict) -> str:
    """The error model of a planned run's profile (`plan.FAULT_MODELS`)."""
    return entry.get("fault_model", "additive")


def _judged(entry: dict, run) -> list[Row]:
    """The run's rows with their roles, and the findings' whys on the failing rows that their
    event counts did not fail."""
    rows = _rows_of(entry, run)
    PC.annotate(rows, entry, run)
    for row in rows:
        row.role = B.role(row.node, row.source, _model(entry))
        if row.role == B.HELD_OUT and B.fixed(row):
            row.role = B.FIXED
    F.explain([r for r in rows if not B.count_failed(r)], entry, run)
    return rows


def paper_scale_rows(plan: list[dict], path: Path | None = None) -> list[Row]:
    """Figure 10 at the paper's sizes for the nodes of the planned ABFT runs, from the entries
    at `path` (default `PAPER_SCALE`), failing rows explained (`figure10_paper.explain`);
    where the file is missing, one "not run" row a node that says how to measure it. A node
    under the flip model has one "not run" row: the measurement injects additive errors."""
    path = Path(path or PAPER_SCALE)
    abft = [e for e in plan if e["mode"] == "abft"]
    flips = sorted(e["node"] for e in abft if _model(e) != "additive")
    unmeasured = [Row(node, "Figure 10", f"{PAPER_ROWS}, the paper's sizes", None, None, None,
                      "-", "not run", "measured for the additive model only (its faults are "
                      "additive errors in the product)", role=B.HELD_OUT) for node in flips]
    nodes = sorted(e["node"] for e in abft if _model(e) == "additive")
    if not nodes:
        return unmeasured
    if not path.is_file():
        return [Row(node, "Figure 10", f"{PAPER_ROWS}, the paper's sizes", None, None,
                    None, "-", "not run", f"{path} is missing; `{PAPER_SCALE_COMMAND}` "
                    f"measures it (5 to 11 minutes)") for node in nodes] + unmeasured
    entries = RF.json_load(path)
    rows = [r for r in F10.rows(entries) if r.node in nodes]
    for row in rows:
        row.role = B.role(row.node, row.source)
    return F10.explain(rows, entries) + unmeasured


def build(plan: list[dict], runs: dict, stopped: dict | None = None,
          paper_scale: Path | None = None, scatter: dict[int, dict] | None = None) -> list[Row]:
    """Rows for every planned run: judged from `runs` ({name: report.runs.Run} of the finished
    runs), "fail" for a run in `stopped` ({name: why it stopped}), else "not run"; then
    `paper_scale_rows` from `paper_scale`. Figures 5-6 take their chances from `scatter`, each
    node's `seed_scatter` entry (`seed_scatter.by_node`), where given."""
    stopped = stopped or {}
    rows = []
    for entry in plan:
        name, node = entry["name"], entry["node"]
        if name in stopped:
            rows += [Row(node, source, "-", None, None, None, "-", "fail",
                         f"the run stopped: {stopped[name]}{PC.NO_CHANCE}{STOPPED_NO_CHANCE}",
                         role=B.role(node, source, _model(entry)))
                     for source in SOURCES[entry["mode"]]]
        elif runs.get(name) is None:
            rows += [Row(node, source, "-", None, None, None, "-", "not run",
                         f"{name} has not finished",
                         role=B.role(node, source, _model(entry)))
                     for source in SOURCES[entry["mode"]]]
        else:
            rows += _judged(entry, runs[name])
    rows += paper_scale_rows(plan, paper_scale) + D.rows(plan, runs)
    if d3 := CR.d3_row(rows):
        d3.role = B.HELD_OUT
        d3.pass_probability = PC.d3_chance(d3, rows)
        rows.append(d3)
    SS.annotate(rows, scatter)
    PC.say_why_none(rows)
    rows += CR.unscored_rows()
    return sorted(rows, key=lambda r: (r.node == B.ACROSS_NODES, r.node,
                                       ORDER.index(r.source)))


def counts(rows: list[Row]) -> dict:
    """{verdict: rows}, every verdict named."""
    return {v: sum(r.verdict == v for r in rows) for v in B.VERDICTS}


def counts_by_role(rows: list[Row]) -> dict:
    """{role: {verdict: rows}}: calibration, held-out and fixed-by-construction rows tallied
    apart."""
    return {role: counts([r for r in rows if r.role == role]) for role in ROLES}


def unexplained(rows: list[Row]) -> int:
    """Failing rows that no measured finding explains."""
    return sum(r.verdict == "fail" and not r.why for r in rows)


def engine_failures(rows: list[Row]) -> int:
    """Rows failed by their event count (excess or missing events)."""
    return sum(B.count_failed(r) for r in rows)


def most_chance(row: Row) -> float:
    """The most the row's chance can be: its upper bound where it states one."""
    if row.pass_probability_max is not None:
        return row.pass_probability_max
    return row.pass_probability


def chance_cell(row: Row) -> str:
    """P(pass) as the table shows it: the value, or its bounds where it is a measured share."""
    if row.pass_probability is None:
        return "-"
    if row.pass_probability_max is None:
        return f"{row.pass_probability:.3g}"
    return f"{row.pass_probability:.2g} to {row.pass_probability_max:.2g}"


def chance_words(rows: list[Row]) -> str:
    """What the judged rows' P(pass) says: how many state one, and the passes and failures
    whose band a correct model passes with a chance below `LOW_CHANCE`."""
    judged = [r for r in rows if r.verdict in ("pass", "fail")]
    stated = [r for r in judged if r.pass_probability is not None]
    low = {v: sum(r.verdict == v and most_chance(r) < LOW_CHANCE for r in stated)
           for v in ("pass", "fail")}
    return (f"Of the {len(judged)} judged rows, {len(stated)} state the chance that a correct "
            f"model passes them (P(pass), docs/reproduction.md); {low['fail']} failing and "
            f"{low['pass']} passing rows have a band a correct model passes less than "
            f"{LOW_CHANCE:.0%} of the time: such a failure is no evidence against the model, "
            f"and such a pass no support for it.")


def _cell(value) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else B.g(value)


TALLY = [(role, verdict) for role in ROLES for verdict in ("pass", "fail")] + [
    (None, verdict) for verdict in B.VERDICTS if verdict not in ("pass", "fail")]


def _tally_line(label: str, rows: list[Row], bold: bool = False) -> str:
    by_role, total = counts_by_role(rows), counts(rows)
    cells = [by_role[role][v] if role else total[v] for role, v in TALLY]
    return f"| {label} | " + " | ".join(f"**{c}**" if bold else str(c) for c in cells) + " |"


def _node_label(node: int) -> str:
    return "across nodes" if node == B.ACROSS_NODES else str(node)


def _row_table(rows: list[Row]) -> list[str]:
    lines = ["| source | quantity | published | ours | ratio | band | P(pass) | verdict | "
             "reason |", "|---|---|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        verdict = f"**{r.verdict}**" if r.verdict == "fail" else r.verdict
        reason = f"{r.reason}. Why: {r.why}" if r.why else r.reason
        chance = chance_cell(r)
        lines.append(f"| {r.source} | {r.quantity} | {_cell(r.published)} | {_cell(r.ours)} "
                     f"| {_cell(r.ratio)} | {r.band} | {chance} | {verdict} | {reason} |")
    return lines


def _model_words(request: dict) -> tuple[str, str]:
    """(the title's words for the request's --fault-model, the calibration sources' words)."""
    model = request.get("fault_model", "additive")
    flips = [n for n in request.get("nodes", []) if flip_model.MODEL_OF_NODE.get(n) == "flip"]
    if model == "flip":
        return (", the flip model (`paper-node-N-flip`)",
                "Tables 1, 2 and 6-9 (the flip model's tail is fitted to Tables 8-9)")
    if model == "chosen" and flips:
        names = ", ".join(map(str, flips))
        return (f", each node's chosen model (docs/faults.md 6.5: the flip model for node(s) "
                f"{names}, the additive one for the others)", f"Tables 1, 6 and 7; Tables 2, 8 "
                f"and 9 too for node(s) {names}, whose flip model's tail is fitted to them")
    if model == "chosen":
        return ", each node's chosen model (the additive one for these)", "Tables 1, 6 and 7"
    return "", "Tables 1, 6 and 7"


def markdown(rows: list[Row], request: dict, facts: dict | None = None) -> str:
    """The header (with `facts`, `provenance.collect`'s: what it was measured with), a verdict
    count per node (calibration, held-out and fixed-by-construction passes and failures apart),
    then each node's rows of each role."""
    nodes = sorted({r.node for r in rows}, key=lambda n: (n == B.ACROSS_NODES, n))
    lines = ["# Reproduction scorecard", "",
             f"Ma et al., *Understanding Silent Data Corruption in LLM Training*, measured on "
             f"the {request['preset']} model, {request['steps']} steps per run"
             + (f", the {' and '.join(request['modes'])} runs"
                if len(request["modes"]) < len(SOURCES) else "")
             + (f", {request['dtype']}" if request.get("dtype") else "")
             + _model_words(request)[0]
             + (f", `--set {' '.join(request['overrides'])}`" if request.get("overrides")
                else "") + " (bands: docs/reproduction.md).", "",
             *([PV.line(facts), ""] if facts else []),
             "| node | " + " | ".join(f"{role} {v}" if role else v for role, v in TALLY) + " |",
             "|---:|" + "---:|" * len(TALLY)]
    lines += [_tally_line(_node_label(node), [r for r in rows if r.node == node])
              for node in nodes]
    lines.append(_tally_line("all", rows, bold=True))
    failing = counts(rows)["fail"]
    fitted = _model_words(request)[1]
    lines += ["", f"Calibration rows are the quantities the profiles are fitted to ({fitted}; "
                  f"Figure 5 where the weight-gradient rate is set from it; Figures 3-4, the "
                  f"time patterns measured back): their "
                  f"passes test the engine, not the model. So do the held-out rows fixed by "
                  f"construction: a zero published where Table 1's rate is 0 (the profile "
                  f"fires nothing there), the parameters' difference before an onset, "
                  f"appendix C.2's layers (the rates are the same in each) and Figure 10's "
                  f"run passes where no attention-output fault landed. Only "
                  f"held-out rows could have failed a right engine with a wrong model. Of "
                  f"the {failing} failing rows, "
                  f"{engine_failures(rows)} fail on their event count (excess or missing "
                  f"events), {failing - unexplained(rows)} name the measurement that explains "
                  f"them (docs/faults.md, section 5) and "
                  f"{unexplained(rows) - engine_failures(rows)} do neither."]
    lines[-1] += " " + chance_words(rows)
    if any(r.quantity.startswith(PAPER_ROWS) for r in rows):
        lines[-1] += (f" The Figure 10 rows of \"{PAPER_ROWS}\" at the paper's sizes are not "
                      f"from these runs: they score these nodes in the measurement of "
                      f"docs/faults.md 5.4 (docs/scorecards/{PAPER_SCALE.name}).")
    for node in nodes:
        for role in ROLES:
            mine = [r for r in rows if r.node == node and r.role == role]
            if mine:
                title = "Across nodes" if node == B.ACROSS_NODES else f"Node {node}"
                lines += ["", f"## {title}, {role} rows", "", *_row_table(mine)]
    return "\n".join(lines) + "\n"


def write(root: Path, rows: list[Row], request: dict, plan: list[dict] | None = None,
          runs: dict | None = None) -> dict:
    """scorecard.md, .csv and .json in `root`, headed by what they were measured with
    (`provenance`, from the request, the plan and the finished runs); returns {"markdown",
    "counts"}."""
    import pandas as pd

    facts = PV.collect(request, plan or [], runs or {})
    text = markdown(rows, request, facts)
    RF.atomic_write_text(root / MARKDOWN, text)
    frame = pd.DataFrame([asdict(r) for r in rows], columns=list(COLUMNS))
    RF.atomic_write_text(root / CSV, frame.to_csv(index=False, float_format="%.6g"))
    RF.atomic_write_json(root / JSON, {"request": request, "provenance": facts,
                                       "counts": counts(rows),
                                       "counts_by_role": counts_by_role(rows),
                                       "engine_failures": engine_failures(rows),
                                       "unexplained": unexplained(rows),
                                       "rows": [asdict(r) for r in rows]})
    return {"markdown": text, "counts": counts(rows)}
