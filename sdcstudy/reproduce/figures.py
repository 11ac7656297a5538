"""The scorecard's figures, as PNG files. Imports no JAX.

- `wcnts.png`: our WCNTS beside Figure 5's, per node;
- `sites.png`: mismatch frequency (Table 1) and maximum severity (Table 2), ours against the
  published value per node and site, with the bands;
- `free_runs.png`: per node, the relative gap of `loss/suspect` to `loss/healthy` and
  `param/diff_l2` over the steps of the free runs (Figure 6's claims);
- `figure6.png` and `figure10.png`: the report's Figure 6 and Figure 10 of the same runs.
Each function writes one figure and returns its path, or None when there is nothing to draw.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sdcstudy.faults import published as PB
from sdcstudy.report import figure_style as FS, plots as P
from sdcstudy.report import tables as T
from sdcstudy.reproduce import bands as B

MARKERS = dict(zip(PB.SITES, ("o", "s", "^", "D")))


def _numbers(rows, source: str) -> list:
    """The rows of `source` with a number on both sides and what their band centres on."""
    return [r for r in rows if r.source == source and r.expected is not None
            and r.ours is not None]


def wcnts_rows(rows) -> list:
    """Figure 5's WCNTS rows, one a node (not its rms of `grad/nts`, which shares the band)."""
    return [r for r in _numbers(rows, "Figure 5") if r.quantity == "WCNTS"]


def wcnts(rows, path: Path) -> Path | None:
    """Bars per node: our WCNTS and Figure 5's, log scale. A WCNTS of zero (no noise in any
    step's weight gradients) has no bar on a log axis: it is written as "0" at the bottom."""
    chosen = wcnts_rows(rows)
    if not chosen:
        return None
    plt = P.pyplot()
    legend = ["Figure 5 (Ma et al.)", "ours"]
    width = max(4.0, 0.5 * len(chosen) + 2)
    title = FS.wrap("Figure 5: worst-case noise-to-signal ratio of the weight gradients",
                    width - 1)
    fig, ax = FS.with_legend_room(plt, 1, legend, width, 3.8,
                                  top=0.25 + 0.18 * len(title.splitlines()), left=0.9)
    x = np.arange(len(chosen))
    floor = min([r.expected for r in chosen] + [r.ours for r in chosen if r.ours > 0]) / 10
    ax.bar(x - 0.2, [r.expected - floor for r in chosen], 0.4, label=legend[0], bottom=floor)
    ax.bar(x + 0.2, [r.ours - floor if r.ours > 0 else 0 for r in chosen], 0.4,
           label=legend[1], bottom=floor)
    for i, r in enumerate(chosen):
        if r.ours <= 0:
            ax.text(i + 0.2, floor, "0", ha="center", va="bottom", fontsize=8, color="tab:orange")
    P.log_scale(ax)
    ax.set_ylim(bottom=floor)
    ax.set_xticks(x, [str(r.node) for r in chosen])
    ax.set_xlabel("paper node")
    ax.set_ylabel("WCNTS (eq. 5)")
    ax.set_title(title, fontsize=10)
    FS.legend_outside(fig, ax, legend)
    return P.save_figure(fig, path)


def sites(rows, path: Path) -> Path | None:
    """Ours against the published value, log-log, per node (colour) and site (marker): Table
    1's frequency (times the time pattern over the run, which the band centres on) and Table
    2's maximum severity, with the line of equality and the band."""
    panels = [(source, [r for r in _numbers(rows, source) if r.expected > 0 and r.ours > 0
                        and r.quantity in MARKERS])  # not Table 2 at the paper's exposure
              for source in ("Table 1", "Table 2")]
    if not any(chosen for _, chosen in panels):
        return None
    plt = P.pyplot()
    nodes = sorted({r.node for _, chosen in panels for r in chosen})
    colour = {node: style["color"] for node, style in P.styles(nodes).items()}
    fig, axes = FS.with_legend_room(plt, 2, ["line of equality", "pass band"], 9.0, 4.4,
                                    wspace=0.3, top=0.65, left=0.9)
    fig.suptitle("Ours against Ma et al. per node (colour) and site (marker)", fontsize=10,
                 y=1 - 0.1 / fig.get_size_inches()[1])
    for ax, (source, chosen), (lo, hi), what in zip(
            axes, panels, ((1 - B.FREQ_TOLERANCE, 1 + B.FREQ_TOLERANCE),
                           (1 / B.SEVERITY_FACTOR, B.SEVERITY_FACTOR)),
            ("mismatch frequency", "maximum severity")):
        ax.set_title(f"{source}: {what}", fontsize=10, y=1.0)
        if not chosen:
            ax.text(0.5, 0.5, f"no {source} row with a number on both sides",
                    transform=ax.transAxes, ha="center", va="center", fontsize=9, color="0.4")
            continue
        for r in chosen:
            ax.scatter(r.expected, r.ours, color=colour[r.node], marker=MARKERS[r.quantity],
                       s=22)
        values = [v for r in chosen for v in (r.expected, r.ours)]
        span = np.array([min(values) / 2, max(values) * 2])
        ax.plot(span, span, color="black", linewidth=0.8)
        ax.fill_between(span, span * lo, span * hi, color="grey", alpha=0.2, linewidth=0)
        P.log_scale(ax, "x")
        P.log_scale(ax, "y")
        ax.set_xlabel(f"Ma et al.: {what}" + (" x time pattern" if source == "Table 1"
                                              else ""))
        ax.set_ylabel(f"ours: {what}")
    handles = [plt.Line2D([], [], color="grey", marker=m, linestyle="", label=site)
               for site, m in MARKERS.items()]
    handles += [plt.Line2D([], [], color=colour[n], marker="o", linestyle="", label=f"node {n}")
                for n in nodes]
    handles += [plt.Line2D([], [], color="black", linewidth=0.8, label="line of equality"),
                plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.2, label="pass band")]
    axes[1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7,
                   frameon=False)
    return P.save_figure(fig, path)


def free_runs(runs: dict, path: Path) -> Path | None:
    """Two panels over steps, one line per free run ({label: Run}): the relative loss gap
    |loss/suspect - loss/healthy| / loss/healthy with the 2% band, and param/diff_l2. Zeros
    are gaps on the log axes, so a run that is zero throughout, or not finite from some step,
    says so in the legend."""
    chosen = {label: run for label, run in runs.items()
              if {"loss/healthy", "loss/suspect", "param/diff_l2"} <= set(run.metrics)}
    if not chosen:
        return None
    plt = P.pyplot()
    style = P.styles(list(chosen))
    curves, labels = {}, {}
    for label, run in chosen.items():
        m = run.metrics
        healthy = pd.to_numeric(m["loss/healthy"], errors="coerce").to_numpy(float)
        suspect = pd.to_numeric(m["loss/suspect"], errors="coerce").to_numpy(float)
        gap = np.abs(suspect - healthy) / np.abs(healthy)
        diff = pd.to_numeric(m["param/diff_l2"], errors="coerce").to_numpy(float)
        curves[label] = (m["step"].to_numpy(), gap, diff)
        name = T.nonfinite_label(run, label, ("loss/suspect", "param/diff_l2"))
        labels[label] = name + (" (always 0)" if not (diff > 0).any() else "")
    band = f"loss gap band ({B.LOSS_GAP:.0%})"
    fig, (gap_ax, diff_ax) = FS.with_legend_room(plt, 2, [*labels.values(), band], 9.6, 4.2,
                                                 wspace=0.25, top=0.65, left=0.9)
    fig.suptitle("Figure 6 (Ma et al.): free runs, suspect against healthy", fontsize=10,
                 y=1 - 0.1 / fig.get_size_inches()[1])
    for label, (steps, gap, diff) in curves.items():
        FS.line(gap_ax, steps, np.where(gap > 0, gap, np.nan), **style[label])
        FS.line(diff_ax, steps, np.where(diff > 0, diff, np.nan), label=labels[label],
                **style[label])
    diff_ax.plot([], [], color="black", linewidth=0.8, linestyle="--", label=band)
    gap_ax.axhline(B.LOSS_GAP, color="black", linewidth=0.8, linestyle="--")
    gap_ax.set_title("|loss/suspect - loss/healthy| / loss/healthy", fontsize=10, y=1.0)
    gap_ax.set_ylabel("relative loss gap")
    diff_ax.set_title("param/diff_l2", fontsize=10, y=1.0)
    diff_ax.set_ylabel("||theta' - theta||_2")
    for ax in (gap_ax, diff_ax):
        P.log_scale(ax)
        FS.step_axis(ax)
    FS.legend_outside(fig, diff_ax, len(labels) + 1)
    return P.save_figure(fig, path)


def draw(rows, runs_by_mode: dict, out: Path) -> list[Path]:
    """Every figure into `out`; `runs_by_mode` is {mode: {label: Run}}. Returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    free = runs_by_mode.get("free", {})
    made = [wcnts(rows, out / "wcnts.png"), sites(rows, out / "sites.png"),
            free_runs(free, out / "free_runs.png"),
            P.training(free, out / "figure6.png") if free else None,
            P.abft_flags(runs_by_mode.get("abft", {}), out / "figure10.png")
            if runs_by_mode.get("abft") else None]
    return [path for path in made if path is not None]
