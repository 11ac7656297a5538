"""Every number the docs quote from a committed scorecard is read from it here, so a doc and its
scorecard cannot drift apart (issue 55: docs/faults.md quoted WCNTS 0.0496/0.0497 and node 11's
0.14 after the scorecard had moved to 0.0452/0.0478 and 0.151). Pure Python: the scorecards'
markdown is parsed (`reproduce/scorecard_read.py`). When a scorecard is re-run, this test
names each quote that no longer matches: correct the doc to the new scorecard."""

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

from sdcstudy.reproduce import scorecard_read as R

ROOT = Path(__file__).resolve().parents[1]
CARDS = ROOT / "docs" / "scorecards"
FAULTS, FIDELITY = "docs/faults.md", "docs/results/fidelity.md"
REPRODUCTION, RESULTS = "docs/reproduction.md", "RESULTS.md"

# (doc, the quoted words, the number in them, scorecard, node, source, quantity, column)
QUOTES = [
    *[(doc, words, number, "small", node, "Figure 6", "gradient norm, median relative gap",
       "ours") for doc, words in (
        (REPRODUCTION, "nodes 10, 11 and 14 are 4.2%, 7.0% and 2.6% apart"),
        (FAULTS, "nodes 10, 11 and 14 (4.2%, 7.0%, 2.6%;"),
        (FIDELITY, "nodes 10, 11 and 14 fail (4.2%, 7.0%, 2.6%;"),
        (RESULTS, "Figure 6's gradient norms 4.2%, 7.0% and 2.6% apart on nodes 10, 11, 14"))
      for node, number in ((10, "0.042"), (11, "0.070"), (14, "0.026"))],
    *[(REPRODUCTION, words, number, "small", node, "Figure 6", "loss gap", "ours")
      for words, node, number in (("Nodes 1 and 14 reach 3.3% and 3.8%", 1, "0.033"),
                                  ("Nodes 1 and 14 reach 3.3% and 3.8%", 14, "0.038"),
                                  ("reach 6.1% (step 96) and 6.8% (step 13)", 10, "0.061"),
                                  ("reach 6.1% (step 96) and 6.8% (step 13)", 11, "0.068"))],
    (FAULTS, "tiny WCNTS 0.0452 and 0.0478", "0.0452", "tiny", 1, "Figure 5", "WCNTS", "ours"),
    (FAULTS, "tiny WCNTS 0.0452 and 0.0478", "0.0478", "tiny", 14, "Figure 5", "WCNTS", "ours"),
    (FAULTS, "Node 10's Table 1 rates alone reach 0.108", "0.108", "tiny", 10, "Figure 5",
     "WCNTS", "ours"),
    (FAULTS, "in 200 steps (10.8x Figure 5 at step 104", "10.8", "tiny", 10, "Figure 5", "WCNTS",
     "ratio"),
    (FAULTS, "0.066 in 40 tiny steps, 0.151 in 200, 0.092 on small", "0.151", "tiny", 11,
     "Figure 5", "WCNTS", "ours"),
    (FAULTS, "0.066 in 40 tiny steps, 0.151 in 200, 0.092 on small", "0.092", "small", 11,
     "Figure 5", "WCNTS", "ours"),
    (FAULTS, "alone give its WCNTS (0.151 on the tiny model", "0.151", "tiny", 11, "Figure 5",
     "WCNTS", "ours"),
    (FAULTS, "node 7, 2.1x on tiny at 82 corruptions", "2.1", "tiny", 7, "Figure 5", "WCNTS",
     "ratio"),
    (FAULTS, "is 1.34x on small at 18,100 (WCNTS 0.0107", "1.34", "small", 7, "Figure 5",
     "WCNTS", "ratio"),
    (FAULTS, "node 1 (flip model), 1.34x on tiny", "1.34", "tiny-chosen", 1, "Figure 5", "WCNTS",
     "ratio"),
    (FAULTS, "is 1.06x (0.039 against 0.037", "0.039", "small", 1, "Figure 5", "WCNTS", "ours"),
    (FAULTS, "node 14, 1.29x on tiny, is 1.06x (0.039)", "1.29", "tiny", 14, "Figure 5", "WCNTS",
     "ratio"),
    (FAULTS, "node 14, 1.29x on tiny, is 1.06x (0.039)", "1.06", "small", 14, "Figure 5",
     "WCNTS", "ratio"),
    (FAULTS, "Node 11 (Table 1 faults only, additive) is 1.81x (0.092)", "1.81", "small", 11,
     "Figure 5", "WCNTS", "ratio"),
    (FAULTS, "Node 10 under its flip model is 2.11x (0.021, at step 3", "2.11", "small", 10,
     "Figure 5", "WCNTS", "ratio"),
    (FAULTS, "healthy one by up to 3.8% in float32 (step 127 of 200", "0.038", "tiny", 11,
     "Figure 6", "loss gap", "ours"),
    (FAULTS, "and 3.8% in bfloat16 (step 124", "0.038", "tiny-bf16", 11, "Figure 6", "loss gap",
     "ours"),
    (FIDELITY, "node 11 reaches 7.0% in Figure 4's initial spike", "0.070", "small-bf16", 11,
     "Figure 6", "loss gap", "ours"),
    (FIDELITY, "at its edge in both (3.2x here, 2.96x in float32)", "3.2", "tiny-bf16", 11,
     "Figure 5", "WCNTS", "ratio"),
    (FIDELITY, "at its edge in both (3.2x here, 2.96x in float32)", "2.96", "tiny", 11,
     "Figure 5", "WCNTS", "ratio"),
    (FIDELITY, "(nodes 7, 11, 14: 0.0119, 0.0923, 0.0390 against", "0.0119", "small-bf16", 7,
     "Figure 5", "WCNTS", "ours"),
    (FIDELITY, "(nodes 7, 11, 14: 0.0119, 0.0923, 0.0390 against", "0.0923", "small-bf16", 11,
     "Figure 5", "WCNTS", "ours"),
    (FIDELITY, "(nodes 7, 11, 14: 0.0119, 0.0923, 0.0390 against", "0.0390", "small-bf16", 14,
     "Figure 5", "WCNTS", "ours"),
    (FIDELITY, "0.0390 against 0.0107, 0.0923, 0.0391)", "0.0107", "small", 7, "Figure 5",
     "WCNTS", "ours"),
    (FIDELITY, "0.0390 against 0.0107, 0.0923, 0.0391)", "0.0391", "small", 14, "Figure 5",
     "WCNTS", "ours"),
]
# docs/faults.md 5.1's table of WCNTS / Figure 5 on tiny, the exact sampler's column.
OVERSHOOT = {15: "2.9", 2: "5.0", 12: "5.0", 6: "2.6", 8: "2.4", 7: "2.1", 5: "2.3", 9: "1.7",
             4: "1.6", 14: "1.3", 1: "1.2"}
# docs/results/fidelity.md's bfloat16 WCNTS now (tiny-bf16.md), nodes 6, 7, 8 and 15.
BF16_NOW = "(0.0104, 0.0172, 0.0142, 0.00121)"
RESCORED = "re-scored (2026-11-30) with docs/faults.md 5.8's rule for the gradient norms"
# The latest tally line of each scorecard in docs/results/fidelity.md ("Scorecards"), its last
# cell the failing rows no finding explains (scorecard.json's "unexplained").
TALLIES = {
    "tiny": "| the same, run again (2026-11-30) on an Intel Xeon with AVX-512 (the runs before: an "
            "AMD EPYC), with the flip model's and Figure 10's new chance rules | 222 | 109 | 84 | "
            "150 | 12 | 0 | 3 |",
    "tiny-flip": f"| the same, {RESCORED} | 227 | 77 | 67 | 110 | 12 | 15 | 2 |",
    "tiny-chosen": "| tiny, each node's chosen model, run again (2026-11-30) from the two runs "
                   "above (`--reuse`), the new chance rules | 239 | 76 | 85 | 144 | 12 | 3 | 3 |",
    "tiny-bf16": f"| the same, {RESCORED} | 78 | 20 | 27 | 0 | 12 | 105 | 3 |",
    "small": f"| the same, {RESCORED} | 27 | 13 | 0 | 0 | 0 | 37 | 1 |",
    "small-lockstep": "| the same, run again (2026-11-30) on the Intel Xeon, the new chance rules | "
                      "196 | 117 | 49 | 143 | 1 | 12 | 0 |",
    "small-bf16": "| the same, its Figures 5-6 chances from fault seed 1 run here, with "
                  "docs/faults.md 5.8's rule for the gradient norms | 26 | 20 | 0 | 0 | 0 | 35 | 2 |",
}
TALLY_ORDER = ("pass", "fail", "no events", "too rare for this run", "not applicable", "not run")
# docs/results/fidelity.md's table of the chance a correct model passes: judged rows, those
# stating P(pass), the failing and the passing ones under 5%.
CHANCES = {"tiny": (331, 327, 39, 24), "tiny-flip": (304, 304, 41, 1),
           "tiny-chosen": (315, 314, 35, 20), "tiny-bf16": (98, 98, 0, 0), "small": (40, 40, 0, 0),
           "small-lockstep": (313, 313, 75, 21), "small-bf16": (46, 46, 0, 0)}
RESULTS_TINY = "222 rows pass (87 calibration, 85 held-out, 50 fixed by construction), 109 fail, 84 no events, 150 too rare"


def _doc(name: str) -> str:
    """A doc's text with its line breaks read as spaces (a quote may span lines)."""
    return re.sub(r"\s+", " ", (ROOT / name).read_text())


_CARDS: dict = {}


def _card(name: str) -> dict:
    if name not in _CARDS:
        _CARDS[name] = R.read((CARDS / f"{name}.md").read_text())
    return _CARDS[name]


def _agrees(quoted: str, value: float) -> bool:
    """`value` rounds to `quoted` at the quoted number's last digit (1.3 holds 1.25 to 1.35)."""
    step = Decimal(1).scaleb(Decimal(quoted).as_tuple().exponent)
    return abs(Decimal(repr(value)) - Decimal(quoted)) <= step / 2


@pytest.mark.parametrize("doc, words, number, card, node, source, quantity, column", QUOTES)
def test_each_quoted_number_is_the_scorecards(doc, words, number, card, node, source, quantity,
                                              column):
    """The doc still says it, and the committed scorecard's row holds it."""
    assert words in _doc(doc), f"{doc} no longer says {words!r}: update QUOTES"
    assert number in words or f"{float(number):.1%}".rstrip("0").rstrip(".") in words
    value = R.find(_card(card), node, source, quantity)[column]
    assert _agrees(number, value), f"{doc} quotes {number}, docs/scorecards/{card}.md has {value}"


def test_the_overshoot_table_is_the_tiny_scorecards():
    """docs/faults.md 5.1: WCNTS / Figure 5 per node, the exact sampler's column."""
    text = _doc(FAULTS)
    for node, ratio in OVERSHOOT.items():
        label = "2, 12" if node in (2, 12) else str(node)
        assert re.search(rf"\| {label} \| [\d.,]+ \([\d.,]+\) \| {re.escape(ratio)} \(", text), node
        value = R.find(_card("tiny"), node, "Figure 5", "WCNTS")["ratio"]
        assert _agrees(ratio, value), (node, ratio, value)


def test_fidelitys_bfloat16_wcnts_are_the_bfloat16_scorecards():
    assert BF16_NOW in _doc(FIDELITY)
    quoted = BF16_NOW.strip("()").split(", ")
    for node, number in zip((6, 7, 8, 15), quoted):
        value = R.find(_card("tiny-bf16"), node, "Figure 5", "WCNTS")["ours"]
        assert _agrees(number, value), (node, number, value)


# docs/faults.md 5.8's rule for the gradient norms, per committed card: the rows it explains, with
# the 10-step means' gap at the median step their why gives, and the rows it leaves unexplained.
GRAD_NORM_EXPLAINED = [
    *[("nodes 7, 11 and 14 (0.8%, 1.7% and 1.2% over their 100 steps)", "small-bf16", node,
       apart) for node, apart in ((7, "0.8%"), (11, "1.7%"), (14, "1.2%"))],
    ("it explains tiny-flip's node 11 (1.4%)", "tiny-flip", 11, "1.4%"),
    ("tiny-bf16's node 10 (1.2%)", "tiny-bf16", 10, "1.2%"),
    ("small's nodes 10 and 14 (1.4%, 1.2%)", "small", 10, "1.4%"),
    ("small's nodes 10 and 14 (1.4%, 1.2%)", "small", 14, "1.2%"),
]
GRAD_NORM_UNEXPLAINED = [("tiny", 11), ("tiny-chosen", 11), ("tiny-bf16", 11), ("small", 11),
                         ("small-bf16", 1), ("small-bf16", 10)]


@pytest.mark.parametrize("words, card, node, apart", GRAD_NORM_EXPLAINED)
def test_the_gradient_norm_rows_faults_58_explains_are_the_scorecards(words, card, node, apart):
    assert words in _doc(FAULTS) and apart in words
    row = R.find(_card(card), node, "Figure 6", "gradient norm, median relative gap")
    assert row["verdict"] == "fail"
    assert "5.8, one batch's gradient norm" in row["reason"]
    assert f"their means over 10 steps are {apart} apart at the median step" in row["reason"]


def test_the_gradient_norm_rows_faults_58_leaves_unexplained_are_the_scorecards():
    assert ("leaves unexplained node 11 on tiny (float32, additive, 4.5%; tiny-chosen's is the "
            "same run), on tiny in bfloat16 (4.3%) and on small (2.9%), and small bfloat16's "
            "nodes 1 (2.8%) and 10 (2.1%)") in _doc(FAULTS)
    for card, node in GRAD_NORM_UNEXPLAINED:
        row = R.find(_card(card), node, "Figure 6", "gradient norm, median relative gap")
        assert row["verdict"] == "fail" and "Why:" not in row["reason"], (card, node)


@pytest.mark.parametrize("card", sorted(TALLIES))
def test_each_tally_quoted_is_the_scorecards(card):
    """docs/results/fidelity.md's latest tally line of each committed scorecard."""
    assert TALLIES[card] in (ROOT / FIDELITY).read_text()
    *cells, unexplained = [int(c) for c in TALLIES[card].strip("| ").split(" | ")[1:]]
    totals = R.totals(_card(card))
    assert cells == [totals[v] for v in TALLY_ORDER]
    assert unexplained == json.loads((CARDS / f"{card}.json").read_text())["unexplained"]


@pytest.mark.parametrize("card", sorted(CHANCES))
def test_fidelitys_chance_table_is_the_scorecards(card):
    judged = [r for r in _card(card)["rows"] if r["verdict"] in ("pass", "fail")]
    stated = [r for r in judged if r["P(pass)"] is not None]
    low = [sum(r["verdict"] == v and r.get("P(pass) max", r["P(pass)"]) < 0.05 for r in stated)
           for v in ("fail", "pass")]
    assert CHANCES[card] == (len(judged), len(stated), *low)
    assert f"| {card} | {' | '.join(map(str, CHANCES[card]))} |" in (ROOT / FIDELITY).read_text()


def test_results_quotes_the_tiny_scorecards_tally():
    totals, tally = R.totals(_card("tiny")), _card("tiny")["tally"]["all"]
    roles = (f"{tally['calibration pass']} calibration, {tally['held-out pass']} held-out, "
             f"{tally['fixed by construction pass']} fixed by construction")
    assert RESULTS_TINY == (f"{totals['pass']} rows pass ({roles}), {totals['fail']} fail, "
                            f"{totals['no events']} no events, "
                            f"{totals['too rare for this run']} too rare")
    assert RESULTS_TINY in _doc(RESULTS)


def test_reproductions_tiny_table_is_the_tiny_scorecards():
    """docs/reproduction.md's per-node table of the tiny scorecard: WCNTS ours (Figure 5) and
    the largest loss gap, node by node."""
    text = (ROOT / REPRODUCTION).read_text()
    table = text.split("[scorecards/tiny.md](scorecards/tiny.md).", 1)[1].split("\n\n", 2)[1]
    lines = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(lines) == 15
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        node = int(cells[0])
        wcnts, published = re.match(r"([\d.e-]+) \(([\d.e-]+)\)", cells[4]).groups()
        row = R.find(_card("tiny"), node, "Figure 5", "WCNTS")
        assert _agrees(wcnts, row["ours"]) and _agrees(published, row["published"]), node
        gap = re.match(r"([\d.e-]+) \(", cells[6])
        if gap:
            assert _agrees(gap.group(1), R.find(_card("tiny"), node, "Figure 6",
                                                 "loss gap")["ours"]), node


NUMBER = r"([\d.e-]+)"  # a quoted number in a table cell


def _node_rows(doc: str, heading: str) -> list[list[str]]:
    """The cells of each "| N |" row of the tables under `heading` in `doc`, to its next
    heading."""
    section = (ROOT / doc).read_text().split(heading, 1)[1].split("\n### ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if re.match(r"\| \d+ \|", line)]


def _wcnts_cell(cell: str, card: dict, node: int) -> dict:
    """A table's "ours (published)" cell checked against the card's Figure 5 WCNTS row: the row."""
    wcnts = R.find(card, node, "Figure 5", "WCNTS")
    ours, published = re.fullmatch(rf"{NUMBER} \({NUMBER}\)", cell).groups()
    assert _agrees(ours, wcnts["ours"] or 0.0) and _agrees(published, wcnts["published"]), node
    return wcnts


def _small_table(heading: str) -> tuple[list[list[str]], dict]:
    """The five rows of a small per-node table of reproduction.md, and small's model of each
    node."""
    rows = _node_rows(REPRODUCTION, heading)
    assert len(rows) == 5
    return rows, json.loads((CARDS / "small.json").read_text())["provenance"]["node_models"]


def test_reproductions_bfloat16_table_is_the_bfloat16_scorecards():
    """docs/reproduction.md's per-node table of tiny-bf16: WCNTS (published) and its verdict,
    the rms and its verdict, the loss gap, its verdict and float32's (tiny), drift's verdict."""
    rows = _node_rows(REPRODUCTION, "### tiny, every node, 200 steps, bfloat16")
    assert len(rows) == 15
    number, bf16 = NUMBER, _card("tiny-bf16")
    for cells in rows:
        node = int(cells[0])
        assert cells[2] == _wcnts_cell(cells[1], bf16, node)["verdict"], node
        rms = R.find(bf16, node, "Figure 5", "rms grad/nts")
        value, verdict = re.fullmatch(rf"{number} \(([a-z ]+)\)", cells[3]).groups()
        assert _agrees(value, rms["ours"] or 0.0) and verdict == rms["verdict"], node
        gap = R.find(bf16, node, "Figure 6", "loss gap")
        value, verdict, f32 = re.fullmatch(rf"{number} \(([a-z ]+); {number}\)", cells[4]).groups()
        assert _agrees(value, gap["ours"] or 0.0) and verdict == gap["verdict"], node
        assert _agrees(f32, R.find(_card("tiny"), node, "Figure 6", "loss gap")["ours"] or 0.0)
        assert cells[5] == R.find(bf16, node, "Figure 6", "param/diff_l2 grows")["verdict"], node


def _judged(card: dict, node: int, sources: tuple[str, ...]) -> str:
    """"pass / judged" of a node's rows from `sources` (a row too rare or without events is
    neither)."""
    rows = [r for r in card["rows"] if r["node"] == node and r["source"] in sources
            and r["verdict"] in ("pass", "fail")]
    return f"{sum(r['verdict'] == 'pass' for r in rows)} / {len(rows)}"


def test_reproductions_small_table_is_the_small_scorecards():
    """docs/reproduction.md's per-node table of small: the model, Figures 5-6 from small.md,
    the lock-step columns (Tables 1, 2, 6-9 judged, Figure 10's run) from small-lockstep.md."""
    rows, models = _small_table("### small, nodes 1, 7, 10, 11 and 14, float32")
    number, small, lockstep = NUMBER, _card("small"), _card("small-lockstep")
    for cells in rows:
        node = int(cells[0])
        assert node in models[cells[1]], node
        assert cells[3] == _wcnts_cell(cells[2], small, node)["verdict"], node
        for cell, quantity in ((cells[4], ("Figure 5", "rms grad/nts")),
                               (cells[5], ("Figure 6", "loss gap"))):
            value, verdict = re.fullmatch(rf"{number} \(([a-z ]+)\)", cell).groups()
            row = R.find(small, node, *quantity)
            assert _agrees(value, row["ours"]) and verdict == row["verdict"], (node, quantity)
        assert cells[6] == R.find(small, node, "Figure 6", "param/diff_l2 grows")["verdict"]
        assert cells[7:10] == [_judged(lockstep, node, ("Table 1",)),
                               _judged(lockstep, node, ("Table 2",)),
                               _judged(lockstep, node, ("Table 6", "Table 7", "Table 8",
                                                        "Table 9"))], node
        run = R.find(lockstep, node, "Figure 10", "fwd o flagged steps")
        value, verdict = re.fullmatch(rf"{number} \(([a-z ]+)\)", cells[10]).groups()
        assert _agrees(value, run["ours"]) and verdict == run["verdict"], node


def test_reproductions_small_bfloat16_table_is_the_small_bf16_scorecard():
    """docs/reproduction.md's per-node table of small-bf16: WCNTS (published) against small's
    float32 (and its model), Figure 5's verdict (and ratio), the loss gap's maximum, its step
    and verdict, the card's 10-step means, the gradient norm's gap and verdict, the drift
    against float32's."""
    rows, models = _small_table("### small, nodes 1, 7, 10, 11 and 14, bfloat16")
    number, bf16, small = NUMBER, _card("small-bf16"), _card("small")
    for cells in rows:
        node = int(cells[0])
        wcnts = _wcnts_cell(cells[1], bf16, node)
        f32, model = re.fullmatch(rf"{number}(?: \((flip)\))?", cells[2]).groups()
        assert _agrees(f32, R.find(small, node, "Figure 5", "WCNTS")["ours"]), node
        assert (node in models.get("flip", [])) == (model == "flip"), node
        verdict, ratio = re.fullmatch(rf"([a-z]+)(?: \({number}x\))?", cells[3]).groups()
        assert verdict == wcnts["verdict"] and (ratio is None or _agrees(ratio, wcnts["ratio"]))
        gap = R.find(bf16, node, "Figure 6", "loss gap")
        value, step, verdict = re.fullmatch(rf"{number}% \((\d+)\), ([a-z]+)", cells[4]).groups()
        assert _agrees(value, 100 * gap["ours"]) and verdict == gap["verdict"], node
        assert f"largest relative gap at step {step}" in gap["reason"], node
        means = re.search(r"means over 10 steps stay within ([\d.]+%)", gap["reason"])
        assert cells[6] == (means.group(1) if means else "-"), node
        norm = R.find(bf16, node, "Figure 6", "gradient norm, median relative gap")
        value, verdict = re.fullmatch(rf"{number}%, ([a-z]+)", cells[7]).groups()
        assert _agrees(value, 100 * norm["ours"]) and verdict == norm["verdict"], node
        drift, f32 = re.fullmatch(rf"{number} \({number}\)", cells[8]).groups()
        assert _agrees(drift, R.find(bf16, node, "Figure 6", "param/diff_l2 grows")["ours"])
        assert _agrees(f32, R.find(small, node, "Figure 6", "param/diff_l2 grows")["ours"])


def _scorecards() -> list[str]:
    return [p.stem for p in sorted(CARDS.glob("*.md")) if p.stem != "fault_models"]


def test_every_scorecard_is_of_the_exact_sampler():
    """Every committed scorecard has the calibration columns (the event-count check and the
    roles came with the exact sampler) and a header that names the exact sampler
    (`reproduce/provenance.py`): the old sampler's cards are all re-run."""
    for name in _scorecards():
        card = _card(name)
        assert any(c.startswith("calibration") for c in card["tally"]["all"]), name
        measured = [line for line in card["header"] if line.startswith("Measured with:")]
        assert len(measured) == 1 and "sampler exact" in measured[0], name


def test_each_scorecard_json_is_its_markdown():
    """docs/scorecards/NAME.json is the scorecard.json of NAME.md's run, or, where those runs
    are gone, derived from NAME.md; either way it holds what the markdown does."""
    for name in _scorecards():
        data = json.loads((CARDS / f"{name}.json").read_text())
        card = _card(name)
        assert data["counts"] == R.totals(card), name
        if "derived" in data:
            assert data["rows"] == card["rows"], name
        else:
            assert len(data["rows"]) == len(card["rows"]), name
            assert data["provenance"]["sampler"].startswith("exact"), name


def test_the_figure10_tally_docs_quote_is_the_committed_measurements():
    """docs/reproduction.md and fidelity.md give 17 passes and 10 failures (18 no events) for
    Figure 10 at the paper's sizes over the 15 nodes, scored today from the committed
    docs/scorecards/abft_paper_scale.json."""
    from collections import Counter

    from sdcstudy.reproduce import scorecard as S

    plan = [{"name": f"n{n}", "node": n, "mode": "abft"} for n in range(1, 16)]
    tally = Counter(r.verdict for r in S.paper_scale_rows(plan))
    assert (tally["pass"], tally["fail"], tally["no events"]) == (17, 10, 18)
    assert "(node 4 at tp 32 passes) | - | - | 17 | 10 | 18 |" in _doc(REPRODUCTION)
    assert "now passes) | - | - | 17 | 10 | - |" in _doc(FIDELITY)


def test_the_reader_reads_what_the_scorecard_writes_today():
    """`scorecard_read` on today's markdown (roles, fixed-by-construction columns, P(pass),
    the rows across nodes) gives back every row and the tally `scorecard.counts` gives, so
    re-run scorecards stay readable by these tests."""
    from sdcstudy.reproduce import scorecard as S

    plan = [{"name": "n", "node": 14, "mode": "abft", "steps": 10}]
    rows = S.build(plan, {})
    card = R.read(S.markdown(rows, {"preset": "tiny", "steps": 10, "modes": ["abft"]}))
    assert len(card["rows"]) == len(rows) and R.totals(card) == S.counts(rows)
    assert {r["node"] for r in card["rows"]} == {r.node for r in rows}
    stated = sorted((r.pass_probability is not None, float(f"{r.pass_probability:.3g}")
                     if r.pass_probability is not None else 0.0) for r in rows)
    assert sorted((r["P(pass)"] is not None, r["P(pass)"] or 0.0) for r in card["rows"]) == stated
    assert any(flag for flag, _ in stated)  # the paper-size rows the draws decide state one


def test_the_table_of_what_measured_each_scorecard_is_their_provenance():
    """docs/results/fidelity.md names, per committed scorecard, the machine its runs ran on and
    the commit that scored it, as its scorecard.json's provenance says; every committed card
    names its machine."""
    text = _doc(FIDELITY)
    for name in _scorecards():
        facts = json.loads((CARDS / f"{name}.json").read_text()).get("provenance", {})
        assert facts.get("runs_machine"), f"{name}: its provenance names no machine"
        machine = "; ".join(facts["runs_machine"])
        assert f"| {name} | {machine} | {facts['commit'][:7]} |" in text, name

