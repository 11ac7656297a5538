"""python experiments/compare_fault_models.py ADDITIVE FLIP [--out docs/scorecards]

Each paper node's error model, from its additive and its flip scorecards (docs/faults.md 6.5).

ADDITIVE and FLIP are reproduce folders (or their scorecard.json) of the same nodes, preset
and steps, one per `--fault-model`. Prints the comparison (`reproduce.model_choice`) and, with
--out, writes it there as fault_models.md and fault_models.json; the nodes that keep the flip
model are what `faults/flip_model.py` `MODEL_OF_NODE` must hold (tests/test_reproduce.py
checks the committed JSON against it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sdcstudy.core import runfolder as RF
from sdcstudy.reproduce import model_choice as MC


def _request(folder: Path) -> dict:
    path = Path(folder)
    path = path / "scorecard.json" if path.is_dir() else path
    return json.loads(path.read_text())["request"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("additive", type=Path)
    parser.add_argument("flip", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    requests = {m: _request(getattr(args, m)) for m in MC.MODELS}
    same = ("preset", "steps", "nodes", "dtype", "overrides")
    if any(requests["additive"].get(k) != requests["flip"].get(k) for k in same):
        raise SystemExit("the two scorecards were made with other settings; compare the "
                         "scorecards of one preset, step count, node set and dtype.")
    choice = MC.choose({m: MC.load(getattr(args, m)) for m in MC.MODELS})
    text = MC.markdown(choice)
    print(text)
    print(f"MODEL_OF_NODE = {MC.kept(choice)}")
    if args.out:
        request = {k: requests["additive"].get(k) for k in same}
        RF.atomic_write_text(args.out / "fault_models.md", text)
        RF.atomic_write_json(args.out / "fault_models.json", {
            "request": request, "sources": {m: getattr(args, m).name for m in MC.MODELS},
            "kept": {str(k): v for k, v in MC.kept(choice).items()},
            "nodes": {str(k): v for k, v in choice.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
