"""How sdcstudy's figures look: run colours, log and step axes, legends and margins. No JAX.

Shared by the report's figures (`plots.py`), the PAFT and scorecard figures and the bench
plot, so that every figure reads the same way:
- a log axis always shows at least two labelled ticks: decades over many decades, 1-2-5
  under 2.5 decades, and a view under one decade is widened to one (a run whose values
  stay within a decade had no labelled tick at all);
- an optimizer-step axis has whole-number ticks, also for a run of one or two steps;
- a point without a finite neighbour (a one-step run, a value between two gaps of a log axis)
  gets a marker, since a line alone does not show it;
- legends sit beside or below the axes, in margins sized for their longest label.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sdcstudy.core import reports

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


def positive(series: pd.Series) -> pd.Series:
    """Values for a log axis: zeros and non-finite values become gaps."""
    values = pd.to_numeric(series, errors="coerce").astype(float)
    return values.where(np.isfinite(values) & (values > 0))


def _readable_log_locator():
    from matplotlib.ticker import LogLocator

    class ReadableLogLocator(LogLocator):
        """At most ~5 labelled decades; 1-2-5 ticks under 2.5 decades; 1-9 under one."""

        def tick_values(self, vmin, vmax):
            if vmin > 0 and vmax > 0 and vmin != vmax:
                decades = abs(math.log10(vmax / vmin))
                self.set_params(subs=(1.0,) if decades >= 2.5 else (1.0, 2.0, 5.0)
                                if decades >= 1 else np.arange(1.0, 10.0))
            return super().tick_values(vmin, vmax)

    return ReadableLogLocator(numticks=5)


def log_scale(ax, which: str = "y") -> None:
    """A log axis (`which`: "x" or "y") whose ticks stay readable at any span (the module's
    docstring) and has no minor ticks: matplotlib makes every tick an object, and on 15-20
    shared panels spanning many decades that takes seconds per figure."""
    from matplotlib.ticker import LogFormatterSciNotation, NullLocator

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_locator(_readable_log_locator())
    axis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False,
                                                     minor_thresholds=(math.inf, math.inf)))
    axis.set_minor_locator(NullLocator())


def widen_log_views(fig) -> None:
    """Every log axis of `fig` whose view spans under a decade (a run whose values stay close)
    widened to one decade around its centre, where 1-2-5 ticks label at least three values;
    the tick labels of a narrower view are long (1.12x10^-3) and run off the margin. Called
    once the figure holds all its data, as `plots.save_figure` does."""
    for ax in fig.axes:
        for which in ("x", "y"):
            if getattr(ax, f"get_{which}scale")() != "log":
                continue
            low, high = getattr(ax, f"get_{which}lim")()
            if 0 < low and 0 < high and abs(math.log10(high / low)) < 1:
                centre = math.sqrt(low * high)
                limits = (centre / math.sqrt(10), centre * math.sqrt(10))
                getattr(ax, f"set_{which}lim")(limits[::-1] if low > high else limits)


def step_axis(ax, label: str | None = "optimizer step") -> None:
    """Whole-number ticks on the x axis of optimizer steps (a short run got 0.95, 0.975, ...),
    at least two steps wide, labelled `label` (None: no label, as on inner panels)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True, min_n_ticks=1))
    low, high = ax.get_xlim()
    if high - low < 2:
        middle = (low + high) / 2
        ax.set_xlim(middle - 1, middle + 1)
    if label:
        ax.set_xlabel(label)


def plain_numbers(ax, which: str = "y") -> None:
    """A linear axis labelled with the values themselves, never an offset ("1e-6+5.3"), and
    at least a thousandth of its values wide, so that a flat or one-step curve does not get
    tick labels of eight digits."""
    ax.ticklabel_format(axis=which, useOffset=False)
    low, high = getattr(ax, f"get_{which}lim")()
    middle, least = (low + high) / 2, 1e-3 * max(abs(low), abs(high))
    if 0 < high - low < least:
        getattr(ax, f"set_{which}lim")(middle - least / 2, middle + least / 2)


def alone(values) -> np.ndarray:
    """Which values are finite without a finite neighbour: a line through them draws
    nothing."""
    finite = np.isfinite(np.asarray(values, float))
    before = np.r_[False, finite[:-1]]
    after = np.r_[finite[1:], False]
    return finite & ~before & ~after


def line(ax, x, y, **style):
    """`ax.plot(x, y, **style)` with a marker on each point `alone` (unless `style` sets its
    own markers)."""
    lone = alone(y)
    if "marker" not in style and lone.any():
        style = {"marker": ".", "markevery": lone.tolist(), **style}
    return ax.plot(x, y, **style)


def mark_nonfinite(ax, step: int, what: str = "not finite") -> None:
    """A dotted red line at `step` and the words "`what` from step N" at the top of the
    panel: the curves end there for a reason, not for lack of data."""
    ax.axvline(step, color="tab:red", linestyle=":", linewidth=1.0)
    low, high = ax.get_xlim()
    right = (step - low) / max(high - low, 1e-9) > 0.6
    ax.text(step, 0.97, f" {what} from step {step} ",
            transform=ax.get_xaxis_transform(), ha="right" if right else "left", va="top",
            fontsize=7, color="tab:red")


def wrap(title: str, width: float, fontsize: float = 10) -> str:
    """`title` broken into lines that fit a figure `width` inches wide (about 0.085 inch per
    character at font size 10)."""
    import textwrap

    return "\n".join(textwrap.wrap(title, max(20, int(width / (0.0085 * fontsize)))))


def smoothing(window: int) -> str:
    return "per step" if window == 1 else f"moving mean over {window} steps"


def legend_columns(n: int) -> int:
    return 1 if n <= 18 else 2


def _count(entries) -> int:
    """The number of legend entries: `entries` is their count or their labels."""
    return entries if isinstance(entries, int) else len(entries)


def legend_width(entries, fontsize: float = 8) -> float:
    """Inches for one legend column of `entries` (a count, or the labels, whose longest sets
    the width, so that no label runs off the figure): the line sample and about 0.068 inch
    per character at font size 8."""
    if isinstance(entries, int) or not entries:
        return LEGEND_WIDTH
    per_char = 0.068 * fontsize / 8
    return max(LEGEND_WIDTH, 0.5 + per_char * max(len(str(label)) for label in entries))


def legend_outside(fig, ax, n, **kw) -> None:
    """The legend of `ax` beside it, right of the axes (room made by `with_legend_room`)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              ncol=legend_columns(_count(n)), **kw)


def margins(fig, left: float = 0.95, right: float = 0.15, bottom: float = 0.6,
            top: float = 0.4, wspace: float | None = None) -> None:
    """Fixed margins around the axes of `fig`, in inches (`wspace`: the gap between panels, a
    fraction of a panel's width). A layout engine (`tight_layout`) would measure every tick
    label by drawing the figure once more: most of a second per figure of log axes."""
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height,
                        top=1 - top / height, wspace=wspace)


def with_legend_room(plt, ncols: int, n, plot_width: float, height: float,
                     wspace: float = 0.08, top: float = 0.4, left: float = 0.95, **kw):
    """`plt.subplots(1, ncols)` with fixed margins in inches and room on the right for a
    legend of `n` entries (a count: `LEGEND_WIDTH` inches per legend column; or the labels:
    as wide as the longest needs)."""
    legend = legend_width(n) * legend_columns(_count(n))
    fig, axes = plt.subplots(1, ncols, figsize=(plot_width + legend, height), **kw)
    margins(fig, left=left, right=0.15 + legend, wspace=wspace, top=top)
    return fig, axes
