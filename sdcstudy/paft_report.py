"""PAFT runs in the report: the final-loss table and the divergence and loss curves.

A `paft` run (CONTRACT.md, `experiment.mode: paft`) writes per step `loss/mean` and one
`loss/w{m}` per data-parallel worker, `div/mean_sq` (mean over workers of
||theta_bar - theta_m||^2), `div/max`, `paft/sync` (1 on a step whose parameter average was
applied) and `paft/H` (the current synchronization period). Imports no JAX.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from . import tables as T

FINAL_WINDOW = 0.1  # the final loss: the mean over the last tenth of the steps (at least 1)
WORKER_LOSS = re.compile(r"^loss/w(\d+)$")


def paft_runs(runs: dict) -> dict:
    return {label: run for label, run in runs.items() if T.run_mode(run) == "paft"}


def _flat(section: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in (section or {}).items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _column(run, key: str) -> pd.Series:
    m = run.metrics
    if key not in m or not len(m):
        return pd.Series(dtype=float)
    return pd.Series(pd.to_numeric(m[key], errors="coerce").to_numpy(float),
                     index=m["step"].to_numpy())


def final_loss(run) -> float:
    """Mean `loss/mean` over the last `FINAL_WINDOW` of the run's steps: one noisy last step
    would hide the difference between mitigations that the curves show."""
    loss = _column(run, "loss/mean").dropna()
    if loss.empty:
        return math.nan
    return float(loss.iloc[-max(1, round(len(loss) * FINAL_WINDOW)):].mean())


def worker_losses(run) -> pd.DataFrame:
    """The per-worker losses of one run, one column per worker (w0, w1, ...), by step."""
    columns = sorted((int(match.group(1)), key) for key in run.metrics.columns
                     if (match := WORKER_LOSS.match(key)))
    return pd.DataFrame({f"w{m}": _column(run, key) for m, key in columns})


def final_table(runs: dict) -> pd.DataFrame:
    """One row per PAFT run: the PAFT settings in which the runs differ (noise, H, PAFT-Dyn,
    packet loss, optimizer ...), workers, the final loss, the spread of the workers' final
    losses, the divergence at the end and at its largest, syncs and bytes sent."""
    runs = paft_runs(runs)
    if not runs:
        return pd.DataFrame()
    settings = {label: {**_flat(run.config.get("paft"), "paft."),
                        "optim.name": (run.config.get("optim") or {}).get("name"),
                        "mesh.dp": (run.config.get("mesh") or {}).get("dp")}
                for label, run in runs.items()}
    keys = sorted({k for s in settings.values() for k in s})
    varying = [k for k in keys if len({repr(s.get(k)) for s in settings.values()}) > 1]
    rows = {}
    for label, run in runs.items():
        m = run.metrics
        div = _column(run, "div/mean_sq").dropna()
        workers = worker_losses(run)
        last_workers = workers.iloc[-1] if len(workers) else pd.Series(dtype=float)
        rows[label] = {
            **{k: settings[label].get(k) for k in varying},
            "workers": len(workers.columns) or settings[label].get("mesh.dp"),
            "steps": int(m["step"].max()) if len(m) else 0,
            "final loss": final_loss(run),
            "worker loss spread": float(last_workers.max() - last_workers.min())
            if len(last_workers) else math.nan,
            "div/mean_sq last": float(div.iloc[-1]) if len(div) else math.nan,
            "div/mean_sq max": float(div.max()) if len(div) else math.nan,
            "syncs": int(_column(run, "paft/sync").fillna(0).sum()),
            "H last": float(_column(run, "paft/H").dropna().iloc[-1])
            if _column(run, "paft/H").notna().any() else math.nan,
            "MB sync": _megabytes(run, "bytes/sync"),
            "MB grad": _megabytes(run, "bytes/grad"),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def _megabytes(run, key: str) -> float:
    values = _column(run, key)
    return float(values.fillna(0).sum()) / 1e6 if len(values) else math.nan


def dynamics(runs: dict, path: Path) -> Path | None:
    """Loss, divergence and synchronization period of PAFT runs over steps, one line per run:
    the mean loss over workers (a moving mean over a fiftieth of the steps), `div/mean_sq`
    on a log axis (synchronized runs drop to zero, a gap there) and `paft/H`."""
    from . import plots as PL

    runs = {label: run for label, run in paft_runs(runs).items() if "loss/mean" in run.metrics}
    if not runs:
        return None
    plt = PL._pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    longest = max(int(run.metrics["step"].max()) for run in runs.values())
    window = max(1, round(longest / 50))
    for (label, run), style in zip(runs.items(), PL.styles(runs).values()):
        loss = _column(run, "loss/mean").rolling(window, min_periods=1).mean()
        axes[0].plot(loss.index, loss.values, lw=1.0, label=label, **style)
        div = PL._positive(_column(run, "div/mean_sq"))
        axes[1].plot(div.index, div.values, lw=0.9, **style)
        h = _column(run, "paft/H")
        if h.notna().any():
            axes[2].step(h.index, h.values, where="post", lw=0.9, **style)
    PL._log_y(axes[1])
    for ax, ylabel, title in (
            (axes[0], f"mean training loss over workers (nats)\n(moving mean over {window} "
                      f"steps)", "Loss"),
            (axes[1], "mean_m ||theta_bar - theta_m||^2", "Divergence of the workers"),
            (axes[2], "synchronization period H (steps)", "PAFT period")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="major")
    fig.subplots_adjust(left=0.05, right=0.87, bottom=0.14, top=0.9, wspace=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="center left",
               bbox_to_anchor=(0.88, 0.5), fontsize=8, frameon=False)
    return PL._save(fig, path)
