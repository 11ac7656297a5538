"""python experiments/flip_model_compare.py profiles DIR   # configs and spike profiles
   python experiments/flip_model_compare.py table RUN...   # the comparison of finished runs

Nodes 10 and 11 under the default and the flip fault model (docs/faults.md, section 6).

`profiles` writes into DIR `paramsync.yaml` (200 steps) and `lockstep.yaml` (40 steps), the
configs `sdcstudy reproduce --preset tiny` gives node 10's runs, and
`paper-node-N-flip-spikeA.yaml` (A = 0, 3, 10) for nodes 10 and 11, for
`sdcstudy run DIR/paramsync.yaml --set suspect.profile=DIR/...yaml`. `table` prints, per run
folder, the Figure 5 WCNTS (the maximum of `grad/nts`) and the mean of `grad/nts` over the
steps of a paramsync run, and for a lock-step run Table 2's maximum per site, the units (step,
microstep, layer, tp rank) it spans, the tail constant fitted to those units' severities
(`flip_model.tail_constant`) extrapolated to the paper's units, and its layers within the
scorecard's Tables 8-9 band.

`profiles` refuses a DIR that already holds one of the files it writes, and `table` a RUN that
is not a paramsync or lock-step run folder of a paper node's profile (exit 2, one sentence).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from sdcstudy.core import config as C
from sdcstudy.core import yamlsafe
from sdcstudy.core.errors import ArgumentParser, UserError
from sdcstudy.faults import flip_model as F
from sdcstudy.faults import profiles as P
from sdcstudy.faults import published_layers as PL
from sdcstudy.faults.published import SITES
from sdcstudy.report.runs import load_run
from sdcstudy.reproduce import plan

AMPLITUDES = (0, 3, 10)


def write_profiles(folder: Path) -> None:
    """The two configs and the six spike profiles in `folder`; a `UserError` before anything is
    written where `folder` is a file or already holds one of them."""
    files = {f"{mode}.yaml": C.dump(plan.run_config(plan.request("tiny", steps, [10], None, [],
                                                                 [mode]), 10, mode))
             for mode, steps in (("paramsync", 200), ("lockstep", 40))}
    for node in (10, 11):
        for amplitude in AMPLITUDES:
            profile = P.paper_node(node, fault_model="flip", spike_amplitude=amplitude)
            files[f"{profile.name}.yaml"] = yamlsafe.dump(P.to_dict(profile), sort_keys=False)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{str(folder)!r} is a file, not a folder; give a folder for the "
                        f"profiles.")
    if taken := [name for name in files if (folder / name).exists()]:
        raise UserError(f"{str(folder / taken[0])!r} already exists; remove the earlier "
                        f"profiles or give another folder.")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
        print(folder / name)


def paramsync_row(run) -> dict:
    nts = pd.to_numeric(run.metrics["grad/nts"], errors="coerce")
    return {"wcnts": float(nts.max()), "worst step": int(run.metrics["step"][nts.idxmax()]),
            "mean nts": float(nts.mean()), "median nts": float(nts.median())}


def lockstep_rows(run_dir: Path, run, node: int) -> dict:
    """Per site: Table 2's maximum, the units with a mismatch, the tail constant fitted to
    those units' severities, extrapolated to the paper's units of the site, and how many of
    our layers' maxima lie in the scorecard's Tables 8-9 band ([min / 3, max x 3] of the
    paper's 16 layers)."""
    table = pd.concat(pd.read_parquet(p) for p in sorted(run_dir.glob("mismatch*.parquet")))
    table = table[table["mismatches"] > 0]
    layers = run.mismatch_rollup.by_layer["severity"]
    out = {}
    for site in SITES:
        rows = table[table["site"] == site]
        severities = rows["severity"].to_numpy(float)
        c = F.tail_constant(list(severities), [1.0] * len(severities))
        paper = F.layer_fit(node, site)["units"]
        lo, hi = PL.layer_range(PL.tables_for(site)[1], node, site)
        ours = layers.xs(site, level="site")
        out[site] = {"max": float(severities.max()) if len(severities) else math.nan,
                     "units": len(severities), "c": c,
                     "at paper units": F.predicted_maximum(c, paper),
                     "layers in band": int(((ours >= lo / 3) & (ours <= hi * 3)).sum()),
                     "layers": len(ours)}
    return out


def paper_node_run(run_dir: Path):
    """(the run folder as a `Run`, its mode, its paper node); a `UserError` naming the folder
    where it is not a paramsync or lock-step run of a paper node's profile."""
    run = load_run(run_dir)
    mode = run.config.get("experiment", {}).get("mode")
    profile = str(run.config.get("suspect", {}).get("profile"))
    node = profile.split("paper-node-")[1].split("-")[0] if "paper-node-" in profile else ""
    if mode not in ("paramsync", "lockstep") or not node.isdigit():
        raise UserError(f"{str(run_dir)!r} is a {mode} run of the profile {profile!r}; give "
                        f"paramsync or lock-step runs of a paper-node-N profile.")
    if mode == "lockstep" and not any(run_dir.glob("mismatch*.parquet")):
        raise UserError(f"{str(run_dir)!r} holds no mismatch*.parquet; give finished "
                        f"lock-step runs.")
    return run, mode, int(node)


def table(run_dirs: list[str]) -> None:
    found = [(Path(name), *paper_node_run(Path(name))) for name in run_dirs]  # all, then print
    for run_dir, run, mode, node in found:
        if mode == "paramsync":
            print(run_dir.name, paramsync_row(run))
        else:
            for site, row in lockstep_rows(run_dir, run, node).items():
                print(run_dir.name, site, {k: f"{v:.3g}" for k, v in row.items()})


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[1])
    commands = p.add_subparsers(dest="command", required=True)
    commands.add_parser("profiles", help="write the configs and spike profiles into DIR"
                        ).add_argument("dir", type=Path, metavar="DIR")
    commands.add_parser("table", help="print the comparison of finished run folders"
                        ).add_argument("runs", nargs="+", metavar="RUN")
    args = p.parse_args(argv)
    try:
        write_profiles(args.dir) if args.command == "profiles" else table(args.runs)
    except UserError as e:
        print(f"flip_model_compare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
