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

from sdcstudy.report import figure_style as FS
from sdcstudy.report.figure_style import log_scale, styles

DPI = 100
PAPER = "Ma et al."
pyplot = reports.pyplot


def save_figure(fig, path: Path) -> Path:
    """`fig` as the PNG `path`, atomically; a file that cannot be written is ReportWriteError."""
    try:
        FS.widen_log_views(fig)
        with reports.writing(path, "figure"):
            return reports.save_png(fig, path, dpi=DPI,
                                    pil_kwargs={"compress_level": 1})  # zlib 6: 0.3 s more
    finally:
        pyplot().close(fig)


def _last_step(rollup: pd.DataFrame) -> int:
    """The last optimizer step of a rollup indexed by step (among other levels)."""
    return int(rollup.index.get_level_values("step").max())


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
    width = max(7.0, 4.2 * ncols)
    lines = FS.wrap(title, width)  # a long title on a narrow figure ran off both sides
    top = 0.43 + 0.17 * len(lines.splitlines())
    height = 2.3 * nrows + 0.7 + top
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), sharex=True, sharey=True,
                             squeeze=False)
    fig.subplots_adjust(left=0.95 / width, right=1 - 0.15 / width, top=1 - top / height,
                        bottom=0.95 / height, wspace=0.08 * 3 / ncols, hspace=0.3)
    fig.suptitle(lines, fontsize=10, y=1 - 0.12 / height, va="top")
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes


def _label_grid(axes, n: int, ylabel: str) -> None:
    """x labels under the lowest visible panel of each column, y labels on the left column,
    whole-step ticks on the shared x axis (after the data: a short run's axis is widened)."""
    nrows, ncols = axes.shape
    FS.step_axis(axes.flat[0], None)
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
    fig, axes = _panel_grid(len(runs), f"Figure 3 ({PAPER}): mismatch frequency (share of the "
                                       "compared elements that differ) per step; steps without "
                                       "mismatches left out")
    site_style = styles(T.SITES)
    for ax, (label, run) in zip(axes.flat, runs.items()):
        for site in T.SITES:
            freq = FS.positive(T.frequency_by_step(run, site))
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
    fig, ax = FS.with_legend_room(plt, 1, list(runs), 7.5, 4.2, left=1.15)  # 2-line y label
    for (label, run), style in zip(runs.items(), styles(runs).values()):
        freq = T.frequency_by_step(run, site)
        smooth = FS.positive(freq.rolling(window, min_periods=1).mean())
        ax.plot(smooth.index, smooth.values, lw=1.2, label=label, marker=".", markersize=3,
                **style)  # the marker keeps a step between two zeros visible
    log_scale(ax)
    FS.step_axis(ax)
    ax.set_ylabel(f"{site} mismatch frequency\n({FS.smoothing(window)})")
    ax.set_title(f"Figure 4 ({PAPER}): smoothed mismatch frequency of {site}", y=1.0)
    ax.grid(alpha=0.3, which="major")
    FS.legend_outside(fig, ax, len(runs))
    return save_figure(fig, path)


def gradients(runs: dict, path: Path) -> Path | None:
    """Figure 5: ||g' - g||_2 per step beside the healthy ||g||_2, one panel per run, titled
    with its WCNTS (eq. 5); a run whose gradients became NaN or infinite is marked from that
    step. Parameter-sync runs (the paper's setting) when there are any, else the other
    synchronized runs (lock-step), whose taps repair the compared sites first: the title then
    says that this is not the paper's quantity (docs/metrics.md)."""
    synced = T.synchronized_runs(runs)
    paramsync = {label: run for label, run in synced.items() if T.run_mode(run) == "paramsync"}
    runs = paramsync or synced
    if not runs:
        return None
    plt = pyplot()
    wcnts = T.wcnts_table(runs)
    title = "gradient difference and ground-truth gradient norm per step (zero differences " \
            "left out)"
    fig, axes = _panel_grid(len(runs), f"Figure 5 ({PAPER}): {title}" if paramsync else
                            f"{title[0].upper()}{title[1:]} of lock-step runs, whose taps "
                            "repair the compared sites first: not Figure 5's quantity")
    for ax, (label, run) in zip(axes.flat, runs.items()):
        FS.line(ax, *_xy(FS.positive(_series(run, "grad/diff_l2"))), lw=0.9, color="tab:red",
                marker=".", markersize=3)
        FS.line(ax, *_xy(FS.positive(_series(run, "grad/norm"))), lw=1.2, color="black",
                ls="--")
        log_scale(ax)
        row = wcnts.loc[label]
        paper = row["wcnts" + T.PUBLISHED_SUFFIX]
        ax.set_title(f"{label}: WCNTS {T.fmt(row['wcnts'])}"
                     + ("" if math.isnan(paper) else f" ({PAPER} {T.fmt(paper)})"), fontsize=9,
                     y=1.0, pad=3)
        ax.grid(alpha=0.3, which="major")
    _label_grid(axes, len(runs), "L2 norm")
    for ax, run in zip(axes.flat, runs.values()):  # after the shared x axis is final
        bad = T.first_nonfinite_step(run, ("grad/diff_l2", "grad/nts", "grad/norm"))
        if bad is not None:
            FS.mark_nonfinite(ax, bad, "gradients not finite")
    handles = [plt.Line2D([], [], color="tab:red", marker=".", lw=0.9),
               plt.Line2D([], [], color="black", ls="--", lw=1.2)]
    fig.legend(handles, ["||g' - g||, suspect minus healthy weight gradients",
                         "||g||, healthy weight gradients"],
               loc="lower center", ncol=2, fontsize=8, frameon=False)
    return save_figure(fig, path)


def training(runs: dict, path: Path) -> Path | None:
    """Figure 6: parameter difference, gradient norms and training losses of free-running
    pre-training pairs (healthy dashed black, drawn over the suspects; fine-tuning has Figure
    7, `finetune/report.py`). A legend label says from which step a run is not finite, or
    that its parameters never differed (a zero is a gap on the log axis: no line at all)."""
    runs = {label: run for label, run in runs.items()
            if T.run_mode(run) == "free" and "param/diff_l2" in run.metrics}
    if not runs:
        return None
    plt = pyplot()
    labels = {label: T.nonfinite_label(run, label) + (
        " (parameters never differed)" if (_series(run, "param/diff_l2") == 0).all() else "")
        for label, run in runs.items()}  # a log axis shows nothing of such a run: say why
    fig, axes = FS.with_legend_room(plt, 3, [*labels.values(), "healthy"], 13.4, 4.2,
                                    wspace=0.25, top=0.7)
    fig.suptitle(f"Figure 6 ({PAPER}): free-running pairs, suspect against healthy",
                 fontsize=10, y=1 - 0.1 / fig.get_size_inches()[1])
    drawn_healthy = []
    healthy = {"color": "black", "lw": 1.0, "ls": "--", "zorder": 3}
    for (label, run), style in zip(runs.items(), styles(runs).values()):
        diff = FS.positive(_series(run, "param/diff_l2"))
        FS.line(axes[0], *_xy(diff), lw=1.0, label=labels[label], **style)
        FS.line(axes[1], *_xy(_series(run, "grad/norm_suspect")), lw=0.9, **style)
        FS.line(axes[2], *_xy(_series(run, "loss/suspect")), lw=0.9, **style)
        loss = _series(run, "loss/healthy")
        if not any(loss.equals(seen) for seen in drawn_healthy):
            drawn_healthy.append(loss)
            FS.line(axes[1], *_xy(_series(run, "grad/norm")),
                    label="healthy" if len(drawn_healthy) == 1 else None, **healthy)
            FS.line(axes[2], *_xy(loss), **healthy)
    log_scale(axes[0])
    log_scale(axes[1])
    FS.plain_numbers(axes[2])
    for ax, ylabel, title in (
            (axes[0], "||theta' - theta||_2", "Parameter difference (suspect - healthy)"),
            (axes[1], "gradient L2 norm (before clipping)", "Gradient norm"),
            (axes[2], "training loss (nats)", "Training loss")):
        FS.step_axis(ax)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10, y=1.0)
        ax.grid(alpha=0.3, which="major")
    handles, labels = axes[0].get_legend_handles_labels()
    h2, l2 = axes[1].get_legend_handles_labels()
    axes[2].legend(handles + h2, labels + l2, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   fontsize=8, frameon=False, ncol=FS.legend_columns(len(runs) + 1))
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
    _label_grid(axes, len(histograms), "elements")
    axes.flat[0].set_xlim(widest - 0.5, -0.5)  # shared: the sign bit on the left
    mantissa = T.MANTISSA_BITS.get(widest, widest // 2)  # sign, lowest exponent bit, ...
    axes.flat[0].set_xticks(sorted({widest - 1, mantissa, mantissa // 2, 0}, reverse=True))
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
    fig, axes = FS.with_legend_room(plt, 2, list(labels.values()), 11.5, 4.4, left=1.15,
                                    sharex=True, sharey=True)
    drawn = [False, False]
    for (label, run), style in zip(runs.items(), styles(runs).values()):
        for i, (ax, (mm, dr)) in enumerate(zip(axes, ((matmul, direction), (None, None)))):
            freq = T.abft_frequency_by_step(run, mm, dr)
            shown = FS.positive(freq.rolling(window, min_periods=1).mean())
            drawn[i] |= bool(shown.notna().any())
            ax.plot(shown.index, shown.values, lw=1.1, marker=".", markersize=4,
                    label=labels[label], **style)
    for ax, drew, what, title in (
            (axes[0], drawn[0], f"{matmul} ({direction}) ",
             f"{matmul} ({direction}), as Figure 10 of {PAPER}"),
            (axes[1], drawn[1], "", "all checked matmuls and directions")):
        log_scale(ax)
        if not drew:
            ax.text(0.5, 0.5, f"no {what}check flagged in any run", transform=ax.transAxes,
                    ha="center", va="center", fontsize=9, color="0.4")
        ax.set_xlabel("optimizer step")
        ax.set_title(f"ABFT flag frequency: {title}", fontsize=10, y=1.0)
        ax.grid(alpha=0.3, which="major")
    axes[0].set_xlim(first - 0.5, longest + 0.5)  # shared: an empty panel keeps the steps
    FS.step_axis(axes[0], None)
    FS.legend_outside(fig, axes[1], len(runs))
    axes[0].set_ylabel(f"fraction of checks flagged\n({FS.smoothing(window)})")
    return save_figure(fig, path)


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
