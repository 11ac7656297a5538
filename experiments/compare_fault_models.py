"""python experiments/compare_fault_models.py ADDITIVE FLIP [--out docs/scorecards [--replace]]

Each paper node's error model, from its additive and its flip scorecards (docs/faults.md 6.5).

ADDITIVE and FLIP are reproduce folders (or their scorecard.json) of the same nodes, preset
and steps, one per `--fault-model`. Prints the comparison (`reproduce.model_choice`) and, with
--out, writes it there as fault_models.md and fault_models.json; the nodes that keep the flip
model are what `faults/flip_model.py` `MODEL_OF_NODE` must hold (tests/test_reproduce.py
checks the committed JSON against it). An --out that holds fault_models.md or .json already
(the committed copy in docs/scorecards) is refused unless --replace says to write over them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sdcstudy.core import runfolder as RF
from sdcstudy.core.errors import ArgumentParser, UserError
from sdcstudy.reproduce import model_choice as MC

FILES = ("fault_models.md", "fault_models.json")  # what --out receives


def scorecard(folder: Path) -> dict:
    """The scorecard.json of a reproduce folder (or that file itself); a `UserError` naming the
    path where it is missing or not a scorecard."""
    path = Path(folder)
    path = path / "scorecard.json" if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"{str(path)!r} does not exist; give a reproduce folder (one with "
                        f"scorecard.json) or its scorecard.json.")
    try:
        card = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{str(path)!r} is not a scorecard: it is not JSON ({e}).") from None
    if not isinstance(card, dict) or not {"request", "rows"} <= set(card):
        raise UserError(f"{str(path)!r} is not a scorecard: it has no request and rows; give "
                        f"the scorecard.json of `sdcstudy reproduce`.")
    return card


def check_out(out: Path | None, replace: bool) -> None:
    """Refuse an --out that is a file, or one that holds a comparison already, unless
    --replace."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file, not a folder; give a folder.")
    if not replace and (taken := [f for f in FILES if (out / f).exists()]):
        raise UserError(f"--out {str(out)!r} already holds {taken[0]}; pass --replace to write "
                        f"over it, or give another --out.")


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("additive", type=Path, help="the additive model's reproduce folder")
    parser.add_argument("flip", type=Path, help="the flip model's reproduce folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write fault_models.md and fault_models.json here")
    parser.add_argument("--replace", action="store_true",
                        help="write over the fault_models.md and .json --out holds")
    args = parser.parse_args(argv)
    try:
        check_out(args.out, args.replace)
        cards = {m: scorecard(getattr(args, m)) for m in MC.MODELS}
    except UserError as e:
        print(f"compare_fault_models: error: {e}", file=sys.stderr)
        return 2
    requests = {m: cards[m]["request"] for m in MC.MODELS}
    same = ("preset", "steps", "nodes", "dtype", "overrides")
    if any(requests["additive"].get(k) != requests["flip"].get(k) for k in same):
        print("compare_fault_models: error: the two scorecards were made with other settings; "
              "compare the scorecards of one preset, step count, node set and dtype.",
              file=sys.stderr)
        return 2
    choice = MC.choose({m: cards[m]["rows"] for m in MC.MODELS})
    text = MC.markdown(choice)
    print(text)
    print(f"MODEL_OF_NODE = {MC.kept(choice)}")
    if args.out:
        request = {k: requests["additive"].get(k) for k in same}
        RF.atomic_write_text(args.out / FILES[0], text)
        RF.atomic_write_json(args.out / FILES[1], {
            "request": request, "sources": {m: getattr(args, m).name for m in MC.MODELS},
            "kept": {str(k): v for k, v in MC.kept(choice).items()},
            "nodes": {str(k): v for k, v in choice.items()}})
        print(f"wrote {args.out / FILES[0]} and {FILES[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
