"""Synthetic run folders for the report, sweep and notebook tests: the files a run writes
(CONTRACT.md), written with the runfolder helpers, so reporting is tested without training."""

import math

import numpy as np
import pandas as pd
import yaml

from sdcstudy import runfolder as RF

SITES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")


def write_run(path, *, mode, profile, metrics, mismatch=None, summary=None):
    """A run folder at `path`: config.yaml, metrics.jsonl (a list of dicts), mismatch.parquet
    (a list of row dicts, lock-step runs only) and summary.json."""
    path.mkdir(parents=True)
    config = {"experiment": {"mode": mode, "steps": len(metrics), "microsteps": 1},
              "suspect": {"profile": profile}, "model": {"preset": "tiny"}}
    (path / RF.CONFIG).write_text(yaml.safe_dump(config))
    RF.write_rows(path / RF.METRICS, metrics)
    if mismatch is not None:
        pd.DataFrame(mismatch, columns=list(RF.MISMATCH_COLUMNS)).to_parquet(path / RF.MISMATCH)
    RF.atomic_write_json(path / RF.SUMMARY, {"mode": mode, "steps": len(metrics),
                                             "steps_done": len(metrics), **(summary or {})})
    return path


def grid_rows(steps, layers, tp, elements, cell, microsteps=1):
    """Every (step, microstep, layer, site, tp_rank) row; `cell(step, microstep, layer, site,
    rank)` gives (mismatches, severity)."""
    rows = []
    for step in range(1, steps + 1):
        for micro in range(microsteps):
            for layer in range(1, layers + 1):
                for site in SITES:
                    for rank in range(tp):
                        n, severity = cell(step, micro, layer, site, rank)
                        rows.append({"step": step, "microstep": micro, "layer": layer,
                                     "site": site, "tp_rank": rank, "mismatches": n,
                                     "elements": elements, "severity": severity,
                                     "max_rel_err": severity, "nonfinite": 0})
    return rows


def random_node(root, node: int, steps: int = 60, layers: int = 4, tp: int = 2, seed: int = 0):
    """Lock-step, parameter-sync and free runs of paper node `node` with plausible random
    numbers: mismatch rates spread over decades, spikes, a drifting free pair."""
    rng = np.random.default_rng(seed * 100 + node)
    rate = 10.0 ** rng.uniform(-7, -3)
    elements = 100_000

    def cell(step, micro, layer, site, rank):
        n = int(rng.poisson(rate * elements * (5 if step < 5 else 1)))
        return n, float(10 ** rng.uniform(-2, 3)) if n else 0.0

    grad = [3.0 * math.exp(-s / 30) + 0.5 for s in range(1, steps + 1)]
    base = [{"step": s, "loss/healthy": 5.5 - 3 * (1 - math.exp(-s / 15)), "grad/norm": g,
             "lr": 1e-3} for s, g in zip(range(1, steps + 1), grad)]
    runs = {}
    for mode in ("lockstep", "paramsync", "free"):
        metrics = []
        for row in base:
            noise = row["grad/norm"] * 10 ** rng.uniform(-4, -1)
            diff = noise if rng.random() < 0.7 else 0.0
            drift = 0.0 if mode != "free" else 1e-3 * row["step"] ** 1.5 * (1 + node / 5)
            metrics.append({**row, "loss/suspect": row["loss/healthy"] + drift * 1e-3,
                            "grad/norm_suspect": row["grad/norm"] + diff,
                            "grad/diff_l2": diff, "grad/nts": diff / row["grad/norm"],
                            "param/diff_l2": drift, "faults/landed": int(diff > 0)})
        mismatch = grid_rows(steps, layers, tp, elements, cell) if mode == "lockstep" else None
        summary = {"loss_spikes": []}
        if mode == "lockstep":
            summary["bit_histogram"] = {site: {"sign": node, "exponent": 2 * node,
                                               "mantissa": 3 * node} for site in SITES}
        runs[mode] = write_run(root / f"node{node}-{mode}", mode=mode,
                               profile=f"paper-node-{node}", metrics=metrics, mismatch=mismatch,
                               summary=summary)
    return runs
