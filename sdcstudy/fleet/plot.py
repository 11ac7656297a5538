"""`sdcstudy fleet simulate --plot F.png`: goodput against fleet size, one line per strategy.

The lines are the analytic expectation (model.py) at 1 to 100,000 nodes on a log axis; the
markers are the Monte Carlo means at the configured fleet size. Written atomically.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sdcstudy.core import reports
from sdcstudy.fleet.config import MAX_NODES, FleetConfig
from sdcstudy.fleet.model import goodput_curve

DPI = 100


def fleet_sizes(points: int = 31) -> np.ndarray:
    """Whole node counts from 1 to MAX_NODES, evenly spaced on a log axis."""
    return np.unique(np.round(np.logspace(0, np.log10(MAX_NODES), points)).astype(int))


def _save(fig, path: Path) -> Path:
    try:
        return reports.save_png(fig, path, dpi=DPI)
    finally:
        reports.pyplot().close(fig)


def plot_goodput(cfg: FleetConfig, rows: list[dict], path: Path,
                 sizes: np.ndarray | None = None) -> Path:
    """Goodput of each strategy in `rows` (cli.simulate's output) against the fleet size."""
    plt = reports.pyplot()
    sizes = fleet_sizes() if sizes is None else sizes
    names = [row["name"] for row in rows]
    curves = goodput_curve(cfg, names, sizes)
    palette = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(9.5, 5.2))
    nodes = cfg["fleet.nodes"]
    for i, row in enumerate(rows):
        style = {"color": palette[i % len(palette)], "linestyle": ("-", "--", ":")[i // 10 % 3]}
        ax.plot(sizes, curves[row["name"]], label=row["name"], linewidth=1.6, **style)
        if row.get("goodput_mc") is not None:
            ax.plot([nodes], [row["goodput_mc"]], marker="o", markersize=4,
                    color=style["color"], linestyle="none")
    ax.axvline(nodes, color="0.6", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_xlim(sizes[0], sizes[-1])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("nodes in the job")
    ax.set_ylabel("goodput (useful share of fleet time)")
    job = cfg["job"]
    ax.set_title(f"SDC cost: {job['hours']:g} h job, {job['step_seconds']:g} s steps, "
                 f"SDC {cfg['sdc.transient_per_node_hour']:.3g} transient + "
                 f"{cfg['sdc.persistent_per_node_hour']:.3g} persistent per node-hour\n"
                 f"lines: analytic; dots: Monte Carlo at {nodes:,} nodes "
                 f"(dotted line); rollback: {job['rollback']}", fontsize=9)
    ax.grid(True, which="major", color="0.9")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(fig, path)
