"""Paper-style figures from run folders, as PNG files. Imports no JAX.

Ma et al., "Understanding Silent Data Corruption in LLM Training":
- Figure 3: mismatch frequency over optimizer steps, one panel per lock-step run;
- Figure 4: the same, smoothed, one line per run on one axis;
- Figure 5: L2 norm of the gradient difference beside the ground-truth gradient norm, one
  panel per run, titled with its WCNTS (eq. 5);
- Figure 6: parameter difference, gradient norms and training loss of free-running pairs;
- bit positions: differing-bit counts per bit position and site, one panel per lock-step run;
- Figure 10: ABFT flag frequency over steps, attention output projection (forward) and all
  checked matmuls.
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

from sdcstudy.core import reports
from sdcstudy.report import tables as T

DPI = 100
LEGEND_WIDTH = 1.6  # inches per column of a legend beside the axes


pyplot = reports.pyplot


def styles(labels) -> dict:
    """{label: dict(color, linestyle)}: 20 distinct colours (the dark half of tab20 first),
    then the same colours dashed, so 15 paper nodes stay apart."""
    plt = pyplot()
    palette = plt.get_cmap("tab20").colors
    order = [*palette[0::2], *palette[1::2]]
    return {label: {"color": order[i % len(order)],
                    "linestyle": ("-", "--", ":")[(i // len(order)) % 3]}
            for i, label in enumerate(labels)}


def _positive(series: pd.Series) -> pd.Series:
    """Values for a log axis: zeros and non-finite values become gaps."""
    values = pd.to_numeric(series, errors="coerce").astype(float)
    return values.where(np.isfinite(values) & (values > 0))


def _last_step(rollup: pd.DataFrame) -> int:
    """The last optimizer step of a rollup indexed by step (among other levels)."""
    return int(rollup.index.get_level_values("step").max())


def log_scale(ax, which: str = "y") -> None:
    """A log axis (`which`: "x" or "y") with at most ~5 labelled decades and no minor ticks:
    matplotlib makes every tick an object, and on 15-20 shared panels spanning many decades
    that takes seconds per figure."""
    from matplotlib.ticker import LogLocator, NullLocator

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_locator(LogLocator(numticks=5))
    axis.set_minor_locator(NullLocator())


def save_figure(fig, path: Path) -> Path:
    """`fig` as the PNG `path`, atomically; a file that cannot be written is ReportWriteError."""
    try:
        with reports.writing(path, "figure"):
            return reports.save_png(fig, path, dpi=DPI,
                                    pil_kwargs={"compress_level": 1})  # zlib 6: 0.3 s more
    finally:
        pyplot().close(fig)


def _legend_columns(n: int) -> int:
    return 1 if n <= 18 else 2


def _count(entries) -> int:
    """The number of legend entries: `entries` is their count or their labels."""
    return entries if isinstance(entries, int) else len(entries)


def _legend_width(entries) -> float:
    """Inches for one legend column of `entries` (a count, or the labels, whose longest sets
    the width, so that no label runs off the figure): the line sample and about 0.068 inch
    per character at font size 8."""
    if isinstance(entries, int) or not entries:
        return LEGEND_WIDTH
    return max(LEGEND_WIDTH, 0.5 + 0.068 * max(len(str(label)) for label in entries))


def _legend_outside(fig, ax, n) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              ncol=_legend_columns(_count(n)))


def margins(fig, left: float = 0.95, right: float = 0.15, bottom: float = 0.6,
            top: float = 0.4, wspace: float | None = None) -> None:
    """Fixed margins around the axes of `fig`, in inches (`wspace`: the gap between panels, a
    fraction of a panel's width). A layout engine (`tight_layout`) would measure every tick
    label by drawing the figure once more: most of a second per figure of log axes."""
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height,
                        top=1 - top / height, wspace=wspace)


def _with_legend_room(plt, ncols: int, n, plot_width: float, height: float,
                      wspace: float = 0.08, **kw):
    """`plt.subplots(1, ncols)` with fixed margins in inches and room on the right for a
    legend of `n` entries (a count: `LEGEND_WIDTH` inches per legend column; or the labels:
    as wide as the longest needs)."""
    legend = _legend_width(n) * _legend_columns(_count(n))
    fig, axes = plt.subplots(1, ncols, figsize=(plot_width + legend, height), **kw)
    margins(fig, right=0.15 + legend, wspace=wspace)
    return fig, axes


def _series(run, key: str) -> pd.Series:
    m = run.metrics
    if key not in m or not len(m):
        return pd.Series(dtype=float)
    return pd.Series(pd.to_numeric(m[key], errors="coerce").to_numpy(float),
                     index=m["step"].to_numpy())


def _panel_grid(n: int, title: str):
    """A figure of `n` panels, three per row, with shared axes, room for `title` above and a
    legend below. Margins are fixed in inches (a layout engine costs seconds per figure), and
    panel titles are given a fixed height (`y=1.0`: placing them by the tick labels costs
    about as much)."""
    plt = pyplot()
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
    from matplotlib.ticker import MaxNLocator

    axes.flat[0].xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # shared
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
    plt = pyplot()
    fig, axes = _panel_grid(len(runs), "Mismatch frequency per step "
                                       "(steps without mismatches left out)")
    site_style = styles(T.SITES)
    for ax, (label, run) in zip(axes.flat, runs.items()):
        for site in T.SITES:
            freq = _positive(T.frequency_by_step(run, site))
            ax.plot(freq.index, freq.values, marker=".", markersize=3, lw=0.8, label=site,
                    **site_style[site])
        log_scale(ax)
        ax.set_title(label, fontsize=9, y=1.0, pad=3)
        ax.grid(alpha=0.3, which="major")
    _label_grid(axes, len(runs), "mismatch frequency")
    handles = [plt.Line2D([], [], marker=".", **site_style[s]) for s in T.SITES]
    fig.legend(handles, T.SITES, loc="lower center", ncol=4, fontsize=8, frameon=False)
    return save_figure(fig, path)


def frequency_smoothed(runs: dict, path: Path, site: str = "fwd/attn",
                       window: int | None = None) -> Path | None:
    """Figure 4: the mismatch frequency of one site, a moving mean over `window` steps (a
    twentieth of the longest run by default), one line per lock-step run."""
    runs = {label: run for label, run in T.lockstep_runs(runs).items()
            if site in run.mismatch_rollup.by_microstep.index.get_level_values("site")}
    if not runs:
        return None
    plt = pyplot()
    longest = max(_last_step(run.mismatch_rollup.by_microstep) for run in runs.values())
    window = window or max(1, round(longest / 20))
    fig, ax = _with_legend_room(plt, 1, list(runs), 7.5, 4.2)
    for (label, run), style in zip(runs.items(), styles(runs).values()):
        freq = T.frequency_by_step(run, site)
        smooth = _positive(freq.rolling(window, min_periods=1).mean())
        ax.plot(smooth.index, smooth.values, lw=1.2, label=label, marker=".", markersize=3,
                **style)  # the marker keeps a step between two zeros visible
    log_scale(ax)
    _integer_steps(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{site} mismatch frequency\n({_smoothing(window)})")
    ax.set_title(f"Smoothed mismatch frequency of {site}", y=1.0)
    ax.grid(alpha=0.3, which="major")
    _legend_outside(fig, ax, len(runs))
    return save_figure(fig, path)


def gradients(runs: dict, path: Path) -> Path | None:
    """Figure 5: ||g' - g||_2 per step beside the healthy ||g||_2, one panel per run, titled
    with its WCNTS (eq. 5). Parameter-sync runs (the paper's setting) when there are any, else
    the other synchronized runs (lock-step)."""
    synced = T.synchronized_runs(runs)
    runs = {label: run for label, run in synced.items() if T.run_mode(run) == "paramsync"} \
        or synced
    if not runs:
        return None
    plt = pyplot()
    wcnts = T.wcnts_table(runs)
    fig, axes = _panel_grid(len(runs), "Gradient difference and ground-truth gradient norm "
                                       "per step (zero differences left out)")
    for ax, (label, run) in zip(axes.flat, runs.items()):
        diff = _positive(_series(run, "grad/diff_l2"))
        norm = _positive(_series(run, "grad/norm"))
        ax.plot(diff.index, diff.values, lw=0.9, color="tab:red", marker=".", markersize=2)
        ax.plot(norm.index, norm.values, lw=1.2, color="black", ls="--")
        log_scale(ax)
        row = wcnts.loc[label]
        paper = row["wcnts" + T.PUBLISHED_SUFFIX]
        ax.set_title(f"{label}: WCNTS {T.fmt(row['wcnts'])}"
                     + ("" if math.isnan(paper) else f" (Ma et al. {T.fmt(paper)})"), fontsize=9,
                     y=1.0, pad=3)
        ax.grid(alpha=0.3, which="major")
    _label_grid(axes, len(runs), "L2 norm")
    handles = [plt.Line2D([], [], color="tab:red", marker=".", lw=0.9),
               plt.Line2D([], [], color="black", ls="--", lw=1.2)]
    fig.legend(handles, ["||g' - g||, suspect minus healthy weight gradients",
                         "||g||, healthy weight gradients"],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    return save_figure(fig, path)


def training(runs: dict, path: Path) -> Path | None:
    """Figure 6: parameter difference, gradient norms and training losses of free-running
    pre-training pairs (healthy in black; fine-tuning has Figure 7, `finetune/report.py`)."""
    runs = {label: run for label, run in runs.items()
            if T.run_mode(run) == "free" and "param/diff_l2" in run.metrics}
    if not runs:
        return None
    plt = pyplot()
    fig, axes = _with_legend_room(plt, 3, [*runs, "healthy"], 13.4, 4.2, wspace=0.25)
    drawn_healthy = []
    for (label, run), style in zip(runs.items(), styles(runs).values()):
        diff = _positive(_series(run, "param/diff_l2"))
        axes[0].plot(*_xy(diff), lw=1.0, label=T.nonfinite_label(run, label), **style)
        axes[1].plot(*_xy(_series(run, "grad/norm_suspect")), lw=0.9, **style)
        axes[2].plot(*_xy(_series(run, "loss/suspect")), lw=0.9, **style)
        loss = _series(run, "loss/healthy")
        if not any(loss.equals(seen) for seen in drawn_healthy):
            drawn_healthy.append(loss)
            axes[1].plot(*_xy(_series(run, "grad/norm")), color="black", lw=1.2, ls="--",
                         label="healthy" if len(drawn_healthy) == 1 else None)
            axes[2].plot(*_xy(loss), color="black", lw=1.2, ls="--")
    log_scale(axes[0])
    log_scale(axes[1])
    for ax, ylabel, title in (
            (axes[0], "||theta' - theta||_2", "Parameter difference (suspect - healthy)"),
            (axes[1], "gradient L2 norm (before clipping)", "Gradient norm"),
            (axes[2], "training loss (nats)", "Training loss")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10, y=1.0)
        ax.grid(alpha=0.3, which="major")
    handles, labels = axes[0].get_legend_handles_labels()
    h2, l2 = axes[1].get_legend_handles_labels()
    axes[2].legend(handles + h2, labels + l2, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   fontsize=8, frameon=False, ncol=_legend_columns(len(runs) + 1))
    return save_figure(fig, path)


def bit_positions(runs: dict, path: Path) -> Path | None:
    """Differing-bit counts per bit position (sign left, lowest mantissa bit right), one bar
    per site, one panel per run whose summary.json's bit histograms count a differing bit
    (a run without mismatches has histograms of zeros: nothing to draw)."""
    histograms = {}
    for label, run in runs.items():
        sites = {site: np.asarray(h["bits"], float)
                 for site, h in T.bit_histograms(run).items() if any(h.get("bits") or ())}
        if sites:
            histograms[label] = sites
    if not histograms:
        return None
    plt = pyplot()
    fig, axes = _panel_grid(len(histograms), "Mismatching elements that differ in each bit "
                                             "position (log scale; zero counts left out)")
    site_style = styles(T.SITES)
    bar = 0.8 / len(T.SITES)
    widest = max(len(bits) for sites in histograms.values() for bits in sites.values())
    for ax, (label, sites) in zip(axes.flat, histograms.items()):
        width = max(len(bits) for bits in sites.values())
        mantissa = T.MANTISSA_BITS.get(width)
        if mantissa is not None:  # shade the exponent field; the sign bit is the leftmost
            ax.axvspan(mantissa - 0.5, width - 1.5, color="0.92", zorder=0)
        for i, site in enumerate(T.SITES):
            if site in sites:
                bits = sites[site]  # one vertical line per bar: patches are slow to draw
                shown = bits > 0
                ax.vlines(np.arange(len(bits))[shown] + (i - 1.5) * bar, 0.7, bits[shown],
                          lw=2.0, color=site_style[site]["color"], label=site)
        log_scale(ax)
        ax.set_title(f"{label} ({width}-bit)", fontsize=9, y=1.0, pad=3)
        ax.grid(alpha=0.3, which="major", axis="y")
    axes.flat[0].set_xlim(widest - 0.5, -0.5)  # shared: the sign bit on the left
    mantissa = T.MANTISSA_BITS.get(widest, widest // 2)  # sign, lowest exponent bit, ...
    axes.flat[0].set_xticks(sorted({widest - 1, mantissa, mantissa // 2, 0}, reverse=True))
    _label_grid(axes, len(histograms), "elements")
    for ax in axes.flat:
        if ax.get_xlabel():
            ax.set_xlabel("bit position (sign | exponent, shaded | mantissa)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=site_style[s]["color"]) for s in T.SITES]
    fig.legend(handles, T.SITES, loc="lower center", ncol=4, fontsize=8, frameon=False)
    return save_figure(fig, path)


def abft_flags(runs: dict, path: Path, matmul: str = "o", direction: str = "fwd",
               window: int | None = None) -> Path | None:
    """Figure 10: per step, the fraction of ABFT checks flagged (over microsteps, layers and tp
    ranks) for the attention output projection's forward product (left, as Ma et al.'s Figure
    10) and for every checked product (right), one line per run with ABFT checks; a moving
    mean over `window` steps (a twentieth of the longest run by default) keeps 15-20 runs
    apart. Steps without a flag are gaps on the log axis, so every flagged step has a marker
    (a single one is a point), a run that never flagged says so in the legend, and a panel
    without any flag says so inside. The flag rate table has the unsmoothed rates."""
    runs = T.abft_runs(runs)
    if not runs:
        return None
    plt = pyplot()
    first = min(int(run.abft_by_step.index.get_level_values("step").min())
                for run in runs.values())
    longest = max(_last_step(run.abft_by_step) for run in runs.values())
    window = window or max(1, round(longest / 20))
    labels = {label: label if run.abft_by_step["flagged"].sum() else f"{label} (no flags)"
              for label, run in runs.items()}
    fig, axes = _with_legend_room(plt, 2, list(labels.values()), 11.5, 4.4, sharex=True,
                                  sharey=True)
    drawn = [False, False]
    for (label, run), style in zip(runs.items(), styles(runs).values()):
        for i, (ax, (mm, dr)) in enumerate(zip(axes, ((matmul, direction), (None, None)))):
            freq = T.abft_frequency_by_step(run, mm, dr)
            shown = _positive(freq.rolling(window, min_periods=1).mean())
            drawn[i] |= bool(shown.notna().any())
            ax.plot(shown.index, shown.values, lw=1.1, marker=".", markersize=4,
                    label=labels[label], **style)
    for ax, drew, what, title in (
            (axes[0], drawn[0], f"{matmul} ({direction}) ",
             f"{matmul} ({direction}), as Figure 10 of Ma et al."),
            (axes[1], drawn[1], "", "all checked matmuls and directions")):
        log_scale(ax)
        if not drew:
            ax.text(0.5, 0.5, f"no {what}check flagged in any run", transform=ax.transAxes,
                    ha="center", va="center", fontsize=9, color="0.4")
        ax.set_xlabel("optimizer step")
        ax.set_title(f"ABFT flag frequency: {title}", fontsize=10, y=1.0)
        ax.grid(alpha=0.3, which="major")
    axes[0].set_xlim(first - 0.5, longest + 0.5)  # shared: an empty panel keeps the steps
    _integer_steps(axes[0])
    _legend_outside(fig, axes[1], len(runs))
    axes[0].set_ylabel(f"fraction of checks flagged\n({_smoothing(window)})")
    return save_figure(fig, path)


def _smoothing(window: int) -> str:
    return "per step" if window == 1 else f"moving mean over {window} steps"


def _integer_steps(ax) -> None:
    """Ticks at whole optimizer steps only (a short run would get 1.25, 1.5, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))


def _xy(series: pd.Series):
    return series.index, series.values


FIGURES = {
    "fig3_mismatch_frequency.png": frequency_panels,
    "fig4_mismatch_frequency_smoothed.png": frequency_smoothed,
    "fig5_gradient_difference.png": gradients,
    "fig6_training_dynamics.png": training,
    "bit_positions.png": bit_positions,
    "fig10_abft_flag_frequency.png": abft_flags,
}
