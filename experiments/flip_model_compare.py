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
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from sdcstudy.core import config as C
from sdcstudy.core import yamlsafe
from sdcstudy.faults import flip_model as F
from sdcstudy.faults import profiles as P
from sdcstudy.faults import published_layers as PL
from sdcstudy.faults.published import SITES
from sdcstudy.report.runs import load_run
from sdcstudy.reproduce import plan

AMPLITUDES = (0, 3, 10)


def write_profiles(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for mode, steps in (("paramsync", 200), ("lockstep", 40)):
        req = plan.request("tiny", steps, [10], None, [], [mode])
        (folder / f"{mode}.yaml").write_text(C.dump(plan.run_config(req, 10, mode)))
    for node in (10, 11):
        for amplitude in AMPLITUDES:
            profile = P.paper_node(node, fault_model="flip", spike_amplitude=amplitude)
            path = folder / f"{profile.name}.yaml"
            path.write_text(yamlsafe.dump(P.to_dict(profile), sort_keys=False))
            print(path)


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


def table(run_dirs: list[str]) -> None:
    for name in run_dirs:
        run_dir = Path(name)
        run = load_run(run_dir)
        mode = run.config["experiment"]["mode"]
        node = int(str(run.config["suspect"]["profile"]).split("paper-node-")[1].split("-")[0])
        if mode == "paramsync":
            print(run_dir.name, paramsync_row(run))
        else:
            for site, row in lockstep_rows(run_dir, run, node).items():
                print(run_dir.name, site, {k: f"{v:.3g}" for k, v in row.items()})


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("profiles", "table"):
        sys.exit(__doc__)
    write_profiles(Path(sys.argv[2])) if sys.argv[1] == "profiles" else table(sys.argv[2:])
