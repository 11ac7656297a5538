"""`python -m sdcstudy.dev.card_figures CARD.json --out DIR`: a scorecard's figures that need only
its rows (`wcnts.png`, Figure 5's WCNTS per node; `sites.png`, Tables 1 and 2 per node and
site; reproduce/figures.py draws both), from a scorecard.json, by the code of this checkout.

docs/figures/reproduce-tiny-wcnts.png, reproduce-tiny-sites.png and reproduce-small-wcnts.png
are drawn so from docs/scorecards/tiny.json and small.json (docs/reproduction.md). The free-run
figures read the runs' metrics, which the repository does not keep: `sdcstudy reproduce` draws
them with the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

NAMES = {"wcnts": "wcnts.png", "sites": "sites.png"}


def card_rows(path: Path) -> list:
    """The scorecard's rows as `bands.Row`s; ValueError naming the file if it holds none."""
    from sdcstudy.reproduce.bands import Row

    try:
        rows = json.loads(Path(path).read_text())["rows"]
        fields = {f.name for f in dataclasses.fields(Row)}
        return [Row(**{k: v for k, v in row.items() if k in fields}) for row in rows]
    except OSError as e:
        raise ValueError(f"{str(path)!r} can not be read ({e.strerror}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{str(path)!r} is not a scorecard.json (sdcstudy reproduce writes "
                         f"one into its folder; docs/scorecards/ holds the committed ones)."
                         ) from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("card", type=Path, help="a scorecard.json (e.g. docs/scorecards/tiny.json)")
    p.add_argument("--out", type=Path, required=True, help="the folder the figures go to")
    p.add_argument("--prefix", default="",
                   help="put before each file's name (e.g. reproduce-tiny- for docs/figures)")
    args = p.parse_args(argv)
    try:
        rows = card_rows(args.card)
    except ValueError as e:
        print(f"card_figures: {e}", file=sys.stderr)
        return 2
    from sdcstudy.reproduce import figures as F

    args.out.mkdir(parents=True, exist_ok=True)
    for kind, name in NAMES.items():
        path = getattr(F, kind)(rows, args.out / f"{args.prefix}{name}")
        print(f"{kind}: {path}" if path else f"{kind}: no rows to draw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
