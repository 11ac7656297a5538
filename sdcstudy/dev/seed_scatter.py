"""Figures 5-6's seed-to-seed scatter, measured into the file the scorecard reads.

    sdcstudy reproduce --preset tiny --modes paramsync,free --set suspect.fault_seed=1 --out S1
    python -m sdcstudy.dev.seed_scatter --out docs/scorecards BASE S1 [S2 ...] [--keep]

Scores the paramsync and free runs of each reproduce folder (one command, other fault seeds;
BASE may be the scorecard's own folder, with every mode) with this version of the scorer and
writes their rows' verdicts and values as the command's entry of OUT/seed_scatter.json
(`reproduce.seed_scatter`), in place of any older entry of that command; with `--keep`, the
older entry's seeds these folders do not score again stay in it, as scored then (for seeds
whose folders are gone). Re-merge the scorecard afterwards to state the chances. Seconds a
folder; no JAX.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def scored(folder: Path) -> tuple[dict, list]:
    """(request, rows) of the folder's finished paramsync and free runs."""
    from sdcstudy.core import runfolder as RF
    from sdcstudy.report.runs import load_run
    from sdcstudy.reproduce import cli as RC
    from sdcstudy.reproduce import scorecard as S
    from sdcstudy.reproduce import seed_scatter as SS

    manifest = RC.read_manifest(folder)
    plan = [e for e in manifest["plan"] if e["mode"] in SS.MODES]
    runs = {e["name"]: load_run(folder / RC.RUNS / e["name"], strict=False) for e in plan
            if RF.finished(folder / RC.RUNS / e["name"])}
    missing = [e["name"] for e in plan if e["name"] not in runs]
    if not plan or missing:
        raise ValueError(f"{str(folder)!r} has not finished "
                         f"{', '.join(missing) or 'any paramsync or free run'}; a scatter "
                         f"counts whole commands.")
    return manifest["request"], S.build(plan, runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path, help="reproduce folders, one a fault seed")
    p.add_argument("--out", type=Path, required=True,
                   help="the folder of seed_scatter.json (docs/scorecards for the scorecard's)")
    p.add_argument("--keep", action="store_true",
                   help="keep the command's earlier seeds that these folders do not score")
    args = p.parse_args(argv)
    from sdcstudy.core import runfolder as RF
    from sdcstudy.reproduce import cli as RC
    from sdcstudy.reproduce import provenance as PV
    from sdcstudy.reproduce import seed_scatter as SS

    start = time.perf_counter()
    path = args.out / SS.SCATTER.name
    try:
        existing = SS.read(path)  # refused before any scoring if it is not a scatter
        found = []
        for folder in args.folders:
            print(f"scoring {folder} ...", flush=True)
            found.append(scored(folder))
        entry = SS.collect(found)
        older = next((e for e in existing if SS.command_key(e) == SS.command_key(entry)), None)
        if args.keep and older is not None:
            entry = SS.extend(older, entry)
    except (ValueError, RC.UserError) as e:
        print(f"seed_scatter: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    entry["scored_by"] = PV.commit()  # the version whose verdicts these are
    RF.atomic_write_json(path, {"schema": SS.SCHEMA,
                                "entries": SS.with_entry(existing, entry)})
    for row in entry["rows"]:
        passed, judged = SS.share(row)
        print(f"node {row['node']:2d} | {row['source']} | {row['quantity']} | {row['band']} | "
              f"{passed} of {judged} seeds pass | {row['values']}")
    print(f"{time.perf_counter() - start:.0f} s; fault seeds {entry['fault_seeds']} in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
