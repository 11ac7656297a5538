"""Which error model each paper node keeps: the additive one or the flip one (docs/faults.md 6.5).

The two models' scorecards are compared node by node on one fixed set of rows, the additive
model's held-out ones (`COMPARED`): Table 2, Tables 8-9, Figure 5 by its maximum and by the root
mean square of `grad/nts`, Figure 6 and Figure 10 of the runs. (Under the flip model Tables 2, 8
and 9 are calibration rows, as its tail is fitted to them; they are compared all the same, since
on the tiny model neither model was fitted to what these runs measure there.) A node keeps the
model that passes more of them, and the additive one on a tie: it is the default and the one
every earlier figure was recorded with. Figure 10 at the paper's sizes, measured for the
additive model only, is left out, and so are Tables 2, 8 and 9 at the paper's exposure: the flip
model's tail is fitted to Tables 8-9 there (`flip_exposure`), so its passes there are
calibration passes that the additive model's held-out rows would be counted against. Imports no
JAX.
"""

from __future__ import annotations

import json
from pathlib import Path

from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import scorecard as S

MODELS = ("additive", "flip")
COMPARED = ("Table 2", "Table 8", "Table 9", "Figure 5", "Figure 6", "Figure 10")


def compared(rows: list[dict], node: int) -> list[dict]:
    """The rows of `node` that the comparison counts, from a scorecard.json's rows."""
    return [r for r in rows if r["node"] == node and r["source"] in COMPARED
            and not r["quantity"].startswith(S.PAPER_ROWS)
            and not r["quantity"].endswith(X.SUFFIX)]


def tally(rows: list[dict]) -> dict:
    """{"pass", "fail", "other", "by_source": {source: "passes/judged"}} of compared rows."""
    by_source = {}
    for source in COMPARED:
        mine = [r for r in rows if r["source"] == source]
        judged = [r for r in mine if r["verdict"] in ("pass", "fail")]
        if mine:
            by_source[source] = f"{sum(r['verdict'] == 'pass' for r in judged)}/{len(judged)}"
    passes = sum(r["verdict"] == "pass" for r in rows)
    fails = sum(r["verdict"] == "fail" for r in rows)
    return {"pass": passes, "fail": fails, "other": len(rows) - passes - fails,
            "by_source": by_source}


def choose(scorecards: dict[str, list[dict]]) -> dict:
    """{node: {"model", model: tally}} from {model: scorecard rows} of the same nodes."""
    nodes = sorted({r["node"] for rows in scorecards.values() for r in rows} - {B.ACROSS_NODES})
    choice = {}
    for node in nodes:
        tallies = {m: tally(compared(scorecards[m], node)) for m in MODELS}
        best = "flip" if tallies["flip"]["pass"] > tallies["additive"]["pass"] else "additive"
        choice[node] = {"model": best, **tallies}
    return choice


def load(folder: Path) -> list[dict]:
    """The rows of a reproduce folder's scorecard.json (or of that file itself)."""
    path = Path(folder)
    path = path / "scorecard.json" if path.is_dir() else path
    return json.loads(path.read_text())["rows"]


def markdown(choice: dict) -> str:
    """The comparison as a table: per node and model, passes / judged of each source."""
    head = ["node", *(f"{s}, additive / flip" for s in COMPARED), "passes, additive / flip",
            "kept"]
    lines = ["| " + " | ".join(head) + " |", "|---:|" + "---|" * (len(head) - 2) + "---|"]
    for node, c in choice.items():
        cells = [f"{c['additive']['by_source'].get(s, '-')} / {c['flip']['by_source'].get(s, '-')}"
                 for s in COMPARED]
        lines.append(f"| {node} | " + " | ".join(cells) +
                     f" | {c['additive']['pass']} / {c['flip']['pass']} | {c['model']} |")
    return "\n".join(lines) + "\n"


def kept(choice: dict) -> dict[int, str]:
    """{node: "flip"} for the nodes that keep the flip model (`flip_model.MODEL_OF_NODE`)."""
    return {node: c["model"] for node, c in choice.items() if c["model"] != "additive"}
