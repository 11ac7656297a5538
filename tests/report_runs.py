"""Synthetic run folders for the report, sweep and notebook tests: the files a run writes
(docs/metrics.md has their columns' meaning), written with the runfolder helpers, so reporting is tested without training.

    python tests/report_runs.py /tmp/zoo20 --steps 200 --layers 2 --tp 2

writes a sweep folder of 20 lock-step runs (the whole zoo but `healthy`) with mismatch,
ABFT and bit-histogram data, to time `sdcstudy report /tmp/zoo20` on.
"""

import argparse
import math

import numpy as np
import pandas as pd
import yaml

from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL

SITES = ("fwd/attn", "fwd/ffn", "bwd/attn", "bwd/ffn")
ABFT_COLUMNS = ("step", "microstep", "layer", "matmul", "direction", "tp_rank", "residual",
                "threshold", "flagged")
MATMULS = ("q", "k", "v", "o", "gate", "up", "down")
DIRECTIONS = ("fwd", "bwd_input", "bwd_weight")
ZOO = (*(f"paper-node-{n}" for n in range(1, 16)), "exponent-flip", "mantissa-noise",
       "stuck-lane", "nan-burst", "repeatable")


def write_run(path, *, mode, profile, metrics, mismatch=None, summary=None, abft=None,
              config=None):
    """A run folder at `path`: config.yaml (the sections of `config` added), metrics.jsonl (a
    list of dicts), mismatch.parquet (a list of row dicts, lock-step runs only), abft.parquet
    (row dicts) and summary.json."""
    path.mkdir(parents=True)
    config = {"experiment": {"mode": mode, "steps": len(metrics), "microsteps": 1},
              "suspect": {"profile": profile}, "model": {"preset": "tiny"}, **(config or {})}
    (path / RF.CONFIG).write_text(yaml.safe_dump(config))
    RF.write_rows(path / RF.METRICS, metrics)
    if mismatch is not None:
        pd.DataFrame(mismatch, columns=list(TL.MISMATCH_COLUMNS)).to_parquet(path / RF.MISMATCH)
    if abft is not None:
        pd.DataFrame(abft, columns=list(ABFT_COLUMNS)).to_parquet(path / RF.ABFT)
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


def abft_rows(steps, layers, tp, flagged, microsteps=1):
    """Every (step, microstep, layer, matmul, direction, tp_rank) check; `flagged(step, micro,
    layer, matmul, direction, rank)` says whether it flagged."""
    rows = []
    for step in range(1, steps + 1):
        for micro in range(microsteps):
            for layer in range(1, layers + 1):
                for matmul in MATMULS:
                    for direction in DIRECTIONS:
                        for rank in range(tp):
                            hit = bool(flagged(step, micro, layer, matmul, direction, rank))
                            rows.append({"step": step, "microstep": micro, "layer": layer,
                                         "matmul": matmul, "direction": direction,
                                         "tp_rank": rank, "residual": 2e-3 if hit else 1e-6,
                                         "threshold": 1e-3, "flagged": hit})
    return rows


def bit_histogram(sign, exponent, mantissa, width=32):
    """A summary.json bit histogram of one site: `sign` at the top bit, `exponent` at the
    lowest exponent bit, `mantissa` spread over the three lowest mantissa bits."""
    bits = [0] * width
    bits[-1], bits[{32: 23, 16: 7}[width]] = sign, exponent
    for i in range(3):
        bits[i] = mantissa // 3 + (i < mantissa % 3)
    return {"bits": bits, "sign": sign, "exponent": exponent, "mantissa": mantissa}


def random_node(root, node: int, steps: int = 60, layers: int = 4, tp: int = 2, seed: int = 0):
    """Lock-step, parameter-sync and free runs of paper node `node` with plausible random
    numbers: mismatch rates spread over decades, spikes, a drifting free pair; the lock-step
    run has bit histograms and ABFT checks."""
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
        summary, abft = {"loss_spikes": []}, None
        if mode == "lockstep":  # ABFT flags rarely, and often on node 14 (Ma et al., App. D)
            flags = np.random.default_rng(1000 + node)
            abft = abft_rows(steps, layers, tp, lambda *_: flags.random() < (
                0.3 if node == 14 else 0.002 * (node % 4)))
            summary["bit_histogram"] = {site: bit_histogram(node, 2 * node, 3 * node)
                                        for site in SITES}
        runs[mode] = write_run(root / f"node{node}-{mode}", mode=mode,
                               profile=f"paper-node-{node}", metrics=metrics, mismatch=mismatch,
                               summary=summary, abft=abft)
    return runs


def sweep_folder(root, steps=200, layers=2, tp=2, profiles=ZOO, seed=0):
    """A sweep folder with one lock-step run per profile (with ABFT checks): mismatch rates and
    bit histograms spread over decades, ABFT flags at a per-run rate."""
    rng = np.random.default_rng(seed)
    elements = 100_000
    dirs = []
    for i, profile in enumerate(profiles):
        rate, flag_rate = 10.0 ** rng.uniform(-7, -3), 10.0 ** rng.uniform(-4, -1)

        def cell(step, micro, layer, site, rank):
            n = int(rng.poisson(rate * elements))
            return n, float(10 ** rng.uniform(-2, 3)) if n else 0.0

        metrics = []
        for s in range(1, steps + 1):
            grad = 3.0 * math.exp(-s / 30) + 0.5
            diff = grad * 10 ** rng.uniform(-4, -1)
            metrics.append({"step": s, "loss/healthy": 5.5 - 3 * (1 - math.exp(-s / 15)),
                            "loss/suspect": 5.5 - 3 * (1 - math.exp(-s / 15)),
                            "grad/norm": grad, "grad/diff_l2": diff, "grad/nts": diff / grad,
                            "param/diff_l2": 0.0, "lr": 1e-3})
        counts = rng.integers(0, 10 ** rng.integers(1, 6), size=(len(SITES), 3))
        summary = {"loss_spikes": [], "bit_histogram": {
            site: bit_histogram(*map(int, c)) for site, c in zip(SITES, counts)}}
        dirs.append(write_run(
            root / profile, mode="lockstep", profile=profile, metrics=metrics,
            mismatch=grid_rows(steps, layers, tp, elements, cell), summary=summary,
            abft=abft_rows(steps, layers, tp, lambda *_: rng.random() < flag_rate)))
    return dirs


def paft_runs(root, steps=40, workers=4, seed=0):
    """Three PAFT runs (noised, PAFT-Sync every 8 steps, PAFT-Dyn) whose divergence grows as a
    random walk, drops to zero at every sync, and whose losses fall with the divergence."""
    rng = np.random.default_rng(seed)
    settings = {"noised": {"sync_every": 0, "dynamic": False},
                "sync-8": {"sync_every": 8, "dynamic": False},
                "dyn": {"sync_every": 4, "dynamic": True}}
    dirs = []
    for name, paft in settings.items():
        div, h, since, metrics = 0.0, paft["sync_every"], 0, []
        for s in range(1, steps + 1):
            div += 1e-3 * rng.uniform(0.5, 1.5)
            since += 1
            sync = bool(h) and since >= h
            if sync:
                div, since = 0.0, 0
                h = h * 2 if paft["dynamic"] else h
            base = 5.5 - 3 * (1 - math.exp(-s / 15)) + 50 * div
            losses = base + rng.normal(0, 0.01, workers)
            metrics.append({"step": s, **{f"loss/w{m}": float(v) for m, v in enumerate(losses)},
                            "loss/mean": float(losses.mean()), "div/mean_sq": div,
                            "div/max": 1.5 * div, "paft/sync": float(sync), "paft/H": float(h),
                            "bytes/grad": 4e5, "bytes/sync": 4e5 * sync, "grad/norm": 1.0,
                            "lr": 1e-3})
        dirs.append(write_run(root / name, mode="paft", profile="healthy", metrics=metrics,
                              config={"mesh": {"dp": workers, "tp": 1},
                                      "paft": {"noise": {"sigma2": 1e-3}, **paft}}))
    return dirs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write a synthetic sweep folder")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    from pathlib import Path

    made = sweep_folder(Path(args.out), args.steps, args.layers, args.tp)
    print(f"{len(made)} run folders in {args.out}")
