"""A committed scorecard.md read back: its tally and its rows, as `scorecard.markdown` writes them
(and as the scorecards before the provenance header, the roles and the P(pass) column wrote
them). What tests read the numbers docs quote from, and what `derive_json` turns a markdown
scorecard into where its run folders are gone. Imports no JAX.

    python -m sdcstudy.reproduce.scorecard_read docs/scorecards/tiny.md   # writes tiny.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from sdcstudy.reproduce import bands as B

SECTION = re.compile(r"^## (Node (?P<node>\d+)|Across nodes)(, (?P<role>[^,]+) rows)?\s*$")
TALLY_HEADER = "| node |"
ROW_HEADER = "| source |"
DERIVED = ("derived from {name} by sdcstudy.reproduce.scorecard_read: numbers at the three "
           "significant digits the markdown prints; no `expected` column")


def _cells(line: str, width: int) -> list[str]:
    """The cells of a markdown table line; a last cell holding " | " keeps it."""
    parts = line.strip().removeprefix("|").removesuffix("|").split(" | ")
    parts = [p.strip() for p in parts]
    return parts[:width - 1] + [" | ".join(parts[width - 1:])] if len(parts) > width else parts


def _value(cell: str):
    """A number where the cell is one (bold stripped), None for "-", else the text."""
    text = cell.strip().strip("*")
    if text == "-":
        return None
    number = B.num(text.replace(",", ""))
    return number if number is not None and not text.startswith("[") else text


def _chance_bounds(row: dict) -> None:
    """A measured share's P(pass), "LOW to HIGH", as "P(pass)" LOW and "P(pass) max" HIGH."""
    chance = row.get("P(pass)")
    if isinstance(chance, str) and " to " in chance:
        low, high = chance.split(" to ")
        row["P(pass)"], row["P(pass) max"] = B.num(low), B.num(high)


def read(text: str) -> dict:
    """{"tally": {node label: {column: count}}, "rows": [{column: value, "node", "role"}],
    "header": the lines before the tally}."""
    lines = text.splitlines()
    tally, rows, header = {}, [], []
    node, role, columns, in_tally = None, None, None, False
    for line in lines:
        if line.startswith(TALLY_HEADER):
            columns, in_tally = _cells(line, 99), True
            continue
        if (match := SECTION.match(line)):
            node = int(match["node"]) if match["node"] else B.ACROSS_NODES
            role, columns, in_tally = match["role"], None, False
            continue
        if line.startswith(ROW_HEADER):
            columns, in_tally = _cells(line, 99), False
            continue
        if not line.startswith("|") or line.startswith("|---") or columns is None:
            if columns is None and not tally and not line.startswith("|"):
                header.append(line)
            continue
        cells = _cells(line, len(columns))
        if in_tally:
            label = cells[0].strip("*")
            tally[label] = {c: int(_value(v)) for c, v in zip(columns[1:], cells[1:])}
        else:
            row = {c: _value(v) for c, v in zip(columns, cells)}
            row["verdict"] = cells[columns.index("verdict")].strip("*")
            row["reason"] = cells[columns.index("reason")]
            _chance_bounds(row)
            rows.append({"node": node, "role": role, **row})
    return {"tally": tally, "rows": rows, "header": [h for h in header if h.strip()]}


def find(card: dict, node: int, source: str, quantity: str) -> dict:
    """The one row of `card` (`read`'s) at node, source and quantity."""
    found = [r for r in card["rows"] if r["node"] == node and r["source"] == source
             and r["quantity"] == quantity]
    if len(found) != 1:
        raise KeyError(f"{len(found)} rows of node {node}, {source}, {quantity!r}")
    return found[0]


def totals(card: dict) -> dict:
    """{verdict: rows} of the "all" tally line, the roles' pass and fail columns summed."""
    out: dict = {}
    for column, count in card["tally"]["all"].items():
        verdict = column.split(" ", 1)[1] if column.split(" ", 1)[0] in (
            B.CALIBRATION, B.HELD_OUT) else column.removeprefix(f"{B.FIXED} ")
        out[verdict] = out.get(verdict, 0) + count
    return out


def derive_json(markdown: Path) -> Path:
    """`markdown`'s rows and tally as JSON beside it (NAME.json), marked as derived."""
    card = read(markdown.read_text())
    path = markdown.with_suffix(".json")
    path.write_text(json.dumps({"derived": DERIVED.format(name=markdown.name),
                                "header": card["header"], "counts": totals(card),
                                "tally": card["tally"], "rows": card["rows"]}, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write NAME.json beside each scorecard "
                                                 "NAME.md, derived from its markdown.")
    parser.add_argument("markdown", type=Path, nargs="+")
    for path in parser.parse_args(argv).markdown:
        print(derive_json(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
