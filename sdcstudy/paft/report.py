"""PAFT run folders as tables and figures (no JAX): final losses, loss and divergence curves.

Used by the `experiments/paft_*.py` studies, by `sdcstudy report` for runs of mode `paft` (as
the mode's report section, `SECTION`), and by notebooks/paft.ipynb. Runs come as an ordered
{label: report.Run}.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from sdcstudy.report import figure_style as FS, plots as PL
from sdcstudy.report.sections import Section

LOSS, DIV = "loss/mean", "div/mean_sq"
TAIL = 10  # final numbers average the last TAIL steps (one step's batch is noisy)


def paft_runs(runs: dict) -> dict:
    return {label: r for label, r in runs.items()
            if (r.config.get("experiment") or {}).get("mode") == "paft"}


def method(config: dict) -> str:
    """Oracle, Noised, PAFT-Sync(H=..) or PAFT-Dyn, from a run's config."""
    p = config.get("paft") or {}
    noise = p.get("noise") or {}
    lossy = (p.get("loss") or {}).get("p") or (p.get("loss") or {}).get("param_p")
    if not noise.get("sigma2") and not noise.get("large_sigma2") and not lossy:
        return "Oracle"
    name = "Noised"
    if p.get("dynamic"):
        name = "PAFT-Dyn"
    elif p.get("sync_every"):
        name = f"PAFT-Sync(H={p['sync_every']})"
    if name != "Noised" and p.get("overlap"):
        name += "+overlap"
    if name != "Noised" and p.get("sync_opt_state"):
        name += "+opt"
    return name


def final_table(runs: dict, tail: int = TAIL) -> pd.DataFrame:
    """One row per run: its setting, the mean of `loss/mean` and `div/mean_sq` over its last
    `tail` steps, the largest divergence, syncs and bytes sent for syncs."""
    rows = []
    for label, run in paft_runs(runs).items():
        m, c = run.metrics, run.config.get("paft") or {}
        if m is None or len(m) == 0 or LOSS not in m:
            continue
        loss = c.get("loss") or {}
        rows.append({
            "run": label, "method": method(run.config),
            "sigma2": (c.get("noise") or {}).get("sigma2"),
            "large_sigma2": (c.get("noise") or {}).get("large_sigma2"),
            "packet_loss": loss.get("p"),
            "aggregate": loss.get("aggregate") if loss.get("p") else "",
            "steps": int(m["step"].max()),
            "final_loss": float(m[LOSS].tail(tail).mean()),
            "final_div": float(m[DIV].tail(tail).mean()) if DIV in m else math.nan,
            "max_div": float(m[DIV].max()) if DIV in m else math.nan,
            "syncs": int(m["paft/sync"].sum()) if "paft/sync" in m else 0,
            "sync_MB": float(m["bytes/sync"].sum() / 2**20) if "bytes/sync" in m else 0.0,
            "mean_H": float(m["paft/H"].mean()) if "paft/H" in m else math.nan,
        })
    return pd.DataFrame(rows)


def _smooth(values: pd.Series, window: int) -> pd.Series:
    return values.rolling(window, min_periods=1).mean() if window > 1 else values


def curves(runs: dict, path: Path, key: str = LOSS, title: str = "", log: bool | None = None,
           smooth: int = 1, ylabel: str | None = None) -> Path | None:
    """One line per run of `key` over steps (log y for the divergence unless told); the y label
    names the moving mean when `smooth` > 1, and on a log axis the title says that zeros (a
    divergence right after a sync) are left out."""
    runs = {k: r for k, r in paft_runs(runs).items() if r.metrics is not None and key in r.metrics}
    if not runs:
        return None
    plt = PL.pyplot()
    log = (key == DIV) if log is None else log
    style = PL.styles(list(runs))
    zeros = log and any((pd.to_numeric(r.metrics[key], errors="coerce") <= 0).any()
                        for r in runs.values())
    fig, ax = FS.with_legend_room(plt, 1, list(runs), 6.0, 4.0, top=0.65 if zeros else 0.4)
    for label, run in runs.items():
        m = run.metrics
        y = _smooth(m[key].astype(float), smooth)
        FS.line(ax, m["step"], FS.positive(y) if log else y, label=label, linewidth=1.2,
                **style[label])
    if log:
        PL.log_scale(ax)
    else:
        FS.plain_numbers(ax)
    FS.step_axis(ax)
    ax.set_ylabel((ylabel or {LOSS: "training loss (mean over workers, nats)",
                              DIV: "divergence  mean_m ||θ̄ − θ_m||²"}.get(key, key))
                  + ("" if smooth <= 1 else f"\n({FS.smoothing(smooth)})"))
    if zeros:
        title += "\n(zeros, as right after a sync, are gaps on the log axis)"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    FS.legend_outside(fig, ax, len(runs))
    return PL.save_figure(fig, Path(path))


def bar_final(table: pd.DataFrame, path: Path, x: str, group: str, title: str = "",
              ylabel: str = "final training loss (nats)") -> Path | None:
    """Final loss per `x` (e.g. packet-loss rate), one bar group per value of `group`; the y
    axis spans the losses, not from zero (its label says so), and the legend sits beside the
    axes, where it covers no bar."""
    if table.empty:
        return None
    plt = PL.pyplot()
    pivot = table.pivot_table(index=x, columns=group, values="final_loss")
    labels = [str(col) for col in pivot.columns]
    fig, ax = FS.with_legend_room(plt, 1, labels, 5.5, 4.0)
    width = 0.8 / max(len(pivot.columns), 1)
    for i, (col, colour) in enumerate(zip(pivot.columns, PL.styles(labels).values())):
        ax.bar(np.arange(len(pivot)) + i * width, pivot[col], width, label=str(col),
               color=colour["color"])
    ax.set_xticks(np.arange(len(pivot)) + 0.4 - width / 2, [f"{v:g}" for v in pivot.index])
    ax.set_xlabel(x)
    ax.set_ylabel(f"{ylabel}\n(axis not from zero)")
    low, high = np.nanmin(pivot.values), np.nanmax(pivot.values)
    ax.set_ylim(low - 0.1 * (high - low + 1e-3), high + 0.1 * (high - low + 1e-3))
    FS.plain_numbers(ax)
    ax.set_title(title)
    FS.legend_outside(fig, ax, labels)
    ax.grid(alpha=0.3, axis="y")
    return PL.save_figure(fig, Path(path))


def markdown(table: pd.DataFrame) -> str:
    from sdcstudy.report import tables as T

    return T.markdown(table.set_index(table.columns[0]), [table.columns[0]]) + "\n"


def report_tables(runs: dict) -> dict:
    """For `sdcstudy report`: {csv name: (title, table, index names, fold)} like
    `writer.report_tables`, empty when no run is of mode paft."""
    table = final_table(runs)
    if table.empty:
        return {}
    return {"paft_final.csv": (f"PAFT: final loss and divergence (means of the last {TAIL} "
                               f"steps)", table.set_index("run"), ["run"], False)}


def draw_figures(runs: dict, out: Path) -> list[str]:
    """For `sdcstudy report`: loss and divergence curves of the paft runs (file names)."""
    named = {label if method(run.config) in label else f"{label}: {method(run.config)}": run
             for label, run in paft_runs(runs).items()}  # a folder's name, and its method
    made = [curves(named, Path(out) / "paft_loss.png", LOSS, "PAFT: training loss", smooth=5),
            curves(named, Path(out) / "paft_divergence.png", DIV,
                   "PAFT: divergence of the copies")]
    return [p.name for p in made if p is not None]


FILES = ("paft_final.csv", "paft_loss.png", "paft_divergence.png")  # what the report writes

# The `paft` mode's part of `sdcstudy report` (sdcstudy.modes.REPORT_SECTIONS names it).
SECTION = Section(tables=report_tables, figures=draw_figures, files=FILES,
                  titles={"paft_loss.png": "PAFT: training loss (mean over workers)",
                          "paft_divergence.png": "PAFT: divergence of the workers' parameters"})
