"""Paper-style figures from run folders, as PNG files. Imports no JAX.

Ma et al., "Understanding Silent Data Corruption in LLM Training":
- Figure 3: mismatch frequency over optimizer steps, one panel per lock-step run;
- Figure 4: the same, smoothed, one line per run on one axis;
- Figure 5: L2 norm of the gradient difference beside the ground-truth gradient norm, one
  panel per run, titled with its WCNTS (eq. 5);
- Figure 6: parameter difference, gradient norms and training loss of free-running pairs.
Each function takes an ordered {label: Run}, writes one PNG atomically and returns its path,
or None when no run has the data it plots. Figures 3 and 5 give each run a panel (three per
row), so 15 nodes stay readable. Quantities that span decades are on log axes; a zero (a step
without mismatches) is left out of a log axis, so lines break there.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from . import tables as T

DPI = 120


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def styles(labels) -> dict:
    """{label: dict(color, linestyle)}: 20 distinct colours (the dark half of tab20 first),
    then the same colours dashed, so 15 paper nodes stay apart."""
    plt = _pyplot()
    palette = plt.get_cmap("tab20").colors
    order = [*palette[0::2], *palette[1::2]]
    return {label: {"color": order[i % len(order)],
                    "linestyle": ("-", "--", ":")[(i // len(order)) % 3]}
            for i, label in enumerate(labels)}


def _positive(series: pd.Series) -> pd.Series:
    """Values for a log axis: zeros and non-finite values become gaps."""
    values = pd.to_numeric(series, errors="coerce").astype(float)
    return values.where(np.isfinite(values) & (values > 0))


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=DPI)
    _pyplot().close(fig)
    tmp.replace(path)
    return path


def _legend_outside(fig, ax, n: int) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              ncol=1 if n <= 18 else 2)


def _series(run, key: str) -> pd.Series:
    m = run.metrics
    if key not in m or not len(m):
        return pd.Series(dtype=float)
    return pd.Series(pd.to_numeric(m[key], errors="coerce").to_numpy(float),
                     index=m["step"].to_numpy())


def _panel_grid(n: int, title: str):
    """A figure of `n` panels, three per row, with shared axes, room for `title` above and a
    legend below. Margins are fixed in inches (a layout engine costs seconds per figure)."""
    plt = _pyplot()
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    width, height = max(7.0, 4.2 * ncols), 2.3 * nrows + 1.3
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), sharex=True, sharey=True,
                             squeeze=False)
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.15 / width, top=1 - 0.6 / height,
                        bottom=0.95 / height, wspace=0.08 * 3 / ncols, hspace=0.3)
    fig.suptitle(title, fontsize=10, y=1 - 0.12 / height)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes


def _label_grid(axes, n: int, ylabel: str) -> None:
    """x labels under the lowest visible panel of each column, y labels on the left column."""
    nrows, ncols = axes.shape
    for col in range(ncols):
        lowest = max(row for row in range(nrows) if row * ncols + col < n)
        axes[lowest, col].set_xlabel("optimizer step")
        axes[lowest, col].xaxis.set_tick_params(labelbottom=True)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)


def frequency_panels(runs: dict, path: Path) -> Path | None:
    """Figure 3: mismatch frequency per step and site, one panel per lock-step run."""
    runs = T.lockstep_runs(runs)
    if not runs:
        return None
    plt = _pyplot()
    fig, axes = _panel_grid(len(runs), "Mismatch frequency per step "
                                       "(steps without mismatches left out)")
    site_style = styles(T.SITES)
    for ax, (label, run) in zip(axes.flat, runs.items()):
        for site in T.SITES:
            freq = _positive(T.frequency_by_step(run.mismatch, site))
            ax.plot(freq.index, freq.values, marker=".", markersize=3, lw=0.8, label=site,
                    **site_style[site])
        ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, which="major")
    _label_grid(axes, len(runs), "mismatch frequency")
    handles = [plt.Line2D([], [], marker=".", **site_style[s]) for s in T.SITES]
    fig.legend(handles, T.SITES, loc="lower center", ncol=4, fontsize=8, frameon=False)
    return _save(fig, path)


def frequency_smoothed(runs: dict, path: Path, site: str = "fwd/attn",
                       window: int | None = None) -> Path | None:
    """Figure 4: the mismatch frequency of one site, a moving mean over `window` steps (a
    twentieth of the longest run by default), one line per lock-step run."""
    runs = {label: run for label, run in T.lockstep_runs(runs).items()
            if (run.mismatch["site"] == site).any()}
    if not runs:
        return None
    plt = _pyplot()
    longest = max(int(run.mismatch["step"].max()) for run in runs.values())
    window = window or max(1, round(longest / 20))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for (label, run), style in zip(runs.items(), styles(runs).values()):
        freq = T.frequency_by_step(run.mismatch, site)
        smooth = _positive(freq.rolling(window, min_periods=1).mean())
        ax.plot(smooth.index, smooth.values, lw=1.2, label=label, **style)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{site} mismatch frequency\n(moving mean over {window} steps)")
    ax.set_title(f"Smoothed mismatch frequency of {site}")
    ax.grid(alpha=0.3, which="major")
    _legend_outside(fig, ax, len(runs))
    fig.tight_layout()
    return _save(fig, path)


def gradients(runs: dict, path: Path) -> Path | None:
    """Figure 5: ||g' - g||_2 per step beside the healthy ||g||_2, one panel per run, titled
    with its WCNTS (eq. 5). Parameter-sync runs (the paper's setting) when there are any, else
    the other synchronized runs (lock-step)."""
    synced = T.synchronized_runs(runs)
    runs = {label: run for label, run in synced.items() if T.run_mode(run) == "paramsync"} \
        or synced
    if not runs:
        return None
    plt = _pyplot()
    wcnts = T.wcnts_table(runs)
    fig, axes = _panel_grid(len(runs), "Gradient difference and ground-truth gradient norm "
                                       "per step (zero differences left out)")
    for ax, (label, run) in zip(axes.flat, runs.items()):
        diff = _positive(_series(run, "grad/diff_l2"))
        norm = _positive(_series(run, "grad/norm"))
        ax.plot(diff.index, diff.values, lw=0.9, color="tab:red", marker=".", markersize=2)
        ax.plot(norm.index, norm.values, lw=1.2, color="black", ls="--")
        ax.set_yscale("log")
        row = wcnts.loc[label]
        paper = row["wcnts" + T.PUBLISHED_SUFFIX]
        ax.set_title(f"{label}: WCNTS {T.fmt(row['wcnts'])}"
                     + ("" if math.isnan(paper) else f" (Ma et al. {T.fmt(paper)})"), fontsize=9)
        ax.grid(alpha=0.3, which="major")
    _label_grid(axes, len(runs), "L2 norm")
    handles = [plt.Line2D([], [], color="tab:red", marker=".", lw=0.9),
               plt.Line2D([], [], color="black", ls="--", lw=1.2)]
    fig.legend(handles, ["||g' - g||, suspect minus healthy weight gradients",
                         "||g||, healthy weight gradients"],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    return _save(fig, path)


def training(runs: dict, path: Path) -> Path | None:
    """Figure 6: parameter difference, gradient norms and training losses of free-running
    pairs (the healthy node's curves in black)."""
    runs = {label: run for label, run in runs.items()
            if T.run_mode(run) in T.FREE_MODES and "param/diff_l2" in run.metrics}
    if not runs:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    drawn_healthy = []
    for (label, run), style in zip(runs.items(), styles(runs).values()):
        diff = _positive(_series(run, "param/diff_l2"))
        axes[0].plot(diff.index, diff.values, lw=1.0, label=label, **style)
        axes[1].plot(*_xy(_series(run, "grad/norm_suspect")), lw=0.9, **style)
        axes[2].plot(*_xy(_series(run, "loss/suspect")), lw=0.9, **style)
        loss = _series(run, "loss/healthy")
        if not any(loss.equals(seen) for seen in drawn_healthy):
            drawn_healthy.append(loss)
            axes[1].plot(*_xy(_series(run, "grad/norm")), color="black", lw=1.2, ls="--",
                         label="healthy" if len(drawn_healthy) == 1 else None)
            axes[2].plot(*_xy(loss), color="black", lw=1.2, ls="--")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    for ax, ylabel, title in (
            (axes[0], "||theta' - theta||_2", "Parameter difference (suspect - healthy)"),
            (axes[1], "gradient L2 norm (before clipping)", "Gradient norm"),
            (axes[2], "training loss (nats)", "Training loss")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="major")
    handles, labels = axes[0].get_legend_handles_labels()
    h2, l2 = axes[1].get_legend_handles_labels()
    axes[2].legend(handles + h2, labels + l2, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def _xy(series: pd.Series):
    return series.index, series.values


FIGURES = {
    "fig3_mismatch_frequency.png": frequency_panels,
    "fig4_mismatch_frequency_smoothed.png": frequency_smoothed,
    "fig5_gradient_difference.png": gradients,
    "fig6_training_dynamics.png": training,
}
