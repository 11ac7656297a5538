"""python experiments/exposure_spread.py DIR DIR ...

The seed-to-seed spread of Table 2 at the paper's exposure (`reproduce.exposure_rows`).

Each DIR is a reproduce folder of lock-step runs of the same nodes, preset and steps under
another fault seed, e.g.

    sdcstudy reproduce --modes lockstep --nodes 1,7,9,10,11 --set suspect.fault_seed=1 --out DIR

For every node and site with at least `MIN_TAIL_UNITS` units above 0.5 in every folder it
prints c U / ln 2 per folder and the largest ratio, either way, between one folder's value and
their median; the largest over nodes and sites is what `EXPOSURE_SPREAD` must cover. Then the
same per decoder layer, for `LAYER_EXPOSURE_SPREAD` (Tables 8-9). A DIR that is not a folder,
or folders that share no lock-step run (`runs/*-lockstep`), are refused (exit 2, one sentence).
"""

from __future__ import annotations

import sys
from pathlib import Path

from sdcstudy.core.errors import ArgumentParser, UserError
from sdcstudy.faults import flip_model as FM
from sdcstudy.faults import published as PB
from sdcstudy.report.runs import load_run
from sdcstudy.reproduce import exposure_rows as X


def shared_runs(dirs: list[Path]) -> list[str]:
    """The lock-step runs' names that two or more of `dirs` hold; a `UserError` where a DIR is
    not a folder or none is shared (there would be nothing to compare)."""
    if missing := [d for d in dirs if not d.is_dir()]:
        raise UserError(f"{str(missing[0])!r} is not a folder; give reproduce folders, one per "
                        f"fault seed.")
    names = [p.name for d in dirs for p in (d / "runs").glob("*-lockstep") if p.is_dir()]
    if not (runs := sorted({n for n in names if names.count(n) >= 2})):
        raise UserError("no lock-step run (runs/*-lockstep) is in two of the folders given; give "
                        "reproduce folders of lock-step runs of the same nodes (sdcstudy "
                        "reproduce --modes lockstep).")
    return runs


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                   help="reproduce folders of lock-step runs, one per fault seed")
    dirs = p.parse_args(argv).dirs
    try:
        if len(dirs) < 2:
            raise UserError("give two or more reproduce folders, one per fault seed.")
        runs = shared_runs(dirs)
        spreads(dirs, runs)
    except UserError as e:  # a damaged run folder (report.runs.load_run)
        print(f"exposure_spread: error: {e}", file=sys.stderr)
        return 2
    return 0


def spreads(dirs: list[Path], runs: list[str]) -> None:
    """Prints the two tables and their largest spreads."""
    worst = 1.0
    print("| run | site | c U / ln 2, per folder | spread |\n|---|---|---|---:|")
    for name in runs:
        node = PB.paper_node_number(name.removesuffix("-lockstep"))
        loaded = [load_run(d / "runs" / name) for d in dirs if (d / "runs" / name).is_dir()]
        if len(loaded) < 2:
            continue
        for site in PB.SITES:
            units = FM.layer_fit(node, site)["units"]
            fits = [X.tail_fit(run, site) for run in loaded]
            if units == 0 or min(above for _, above, _ in fits) < X.MIN_TAIL_UNITS:
                continue
            values = [FM.predicted_maximum(c, units) for c, _, _ in fits]
            s = X.spread(values)
            worst = max(worst, s)
            print(f"| {name} | {site} | {', '.join(f'{v:.3g}' for v in values)} | {s:.2f} |")
    print(f"\nlargest spread: {worst:.2f} (EXPOSURE_SPREAD = {X.EXPOSURE_SPREAD:g})")
    worst = layer_spreads(dirs, runs)
    print(f"\nlargest spread: {worst:.2f} (LAYER_EXPOSURE_SPREAD = "
          f"{X.LAYER_EXPOSURE_SPREAD:g})")


def layer_spreads(dirs: list[Path], runs: list[str]) -> float:
    """The same per layer (`exposure_rows.layer_rows`), each folder's value its row's `ours`."""
    worst = 1.0
    print("\n| run | Table, site and layer | c U / ln 2, per folder | spread |\n|---|---|---|---:|")
    for name in runs:
        node = PB.paper_node_number(name.removesuffix("-lockstep"))
        tables = [{(r.source, r.quantity): r for r in X.layer_rows(node, load_run(d / "runs" /
                                                                                  name))}
                  for d in dirs if (d / "runs" / name).is_dir()]
        for key in tables[0]:
            values = [t[key].ours for t in tables if key in t]
            if len(values) < len(dirs) or None in values:
                continue
            s = X.spread(values)
            worst = max(worst, s)
            print(f"| {name} | {key[0]} {key[1].removesuffix(X.SUFFIX)} | "
                  f"{', '.join(f'{v:.3g}' for v in values)} | {s:.2f} |")
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
