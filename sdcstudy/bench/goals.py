"""The project's performance goals, one row per measured ratio or share, and the `goals` list
each bench JSON carries: `{"name", "preset" (and "workers" or "tp" where the row depends on
them), "value", "limit", "bound", "met"}`. `value` is the median over the suite's interleaved
repetitions; `bound` says whether the value must stay at most (`upper`) or reach at least
(`lower`) the limit. RESULTS.md explains each row a machine cannot meet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Goal:
    limit: float
    bound: str  # "upper": value <= limit; "lower": value >= limit
    meaning: str
    presets: tuple[str, ...] | None = None  # None: every preset the suite measures


GOALS = {
    "faults.idle_over_plain": Goal(1.10, "upper", "step time with the fault engine compiled "
                                   "in but idle / the plain step"),
    "faults.additive_over_scale": Goal(1.10, "upper", "step time with `additive` faults "
                                       "landing at every step / with `scale` faults at the "
                                       "same rate and sites"),
    "paft.dyn_overlap_over_dp": Goal(1.05, "upper", "PAFT-Dyn with overlap / data parallel "
                                     "under the same simulated error"),
    "train.ours_over_torch": Goal(1.0, "lower", "our plain step's tokens/s / transformers + "
                                  "torch's (the faster attention)"),
    "train.peak_share": Goal(0.75, "lower", "our plain step's model FLOP/s / the machine's "
                             "matmul peak", presets=("small",)),
    "abft.on_over_off": Goal(1.10, "upper", "step time with row and column checksums of every "
                             "matmul, forward and backward / without ABFT"),
    "paired.lockstep_over_free": Goal(1.10, "upper", "lock-step step time / free running, "
                                      "at each tp degree"),
    "logging.peak_rss_mb": Goal(1024, "upper", "peak RSS (MiB) of logging a paper-scale "
                                "lock-step run's tables and metrics"),
    "logging.last_over_first_flush": Goal(1.5, "upper", "the last flush's seconds / the "
                                          "first's, at the paper's row rate"),
}


def goal(name: str, value: float | None, **where) -> dict:
    """One entry of a `goals` list; `where` names the row's preset and workers or tp."""
    g = GOALS[name]
    met = value is not None and (value <= g.limit if g.bound == "upper" else value >= g.limit)
    return {"name": name, **where, "value": value, "limit": g.limit, "bound": g.bound,
            "met": met}


def applies(name: str, preset: str) -> bool:
    presets = GOALS[name].presets
    return presets is None or preset in presets


def _where(entry: dict) -> str:
    keys = [k for k in entry if k not in ("name", "value", "limit", "bound", "met")]
    return ", ".join(f"{k} {entry[k]}" for k in keys)


def goals_table(goals: list[dict]) -> str:
    """The goals as a Markdown table (empty when there are none), then what each goal's value
    is a ratio or a share of: a goal's name alone can mislead (`paft.dyn_overlap_over_dp` is
    taken over data parallel *under the same simulated error*, not over the `dp` contender)."""
    if not goals:
        return ""
    lines = ["| goal | where | value | limit | met |", "|---|---|---:|---:|---|"]
    for e in goals:
        value = "-" if e["value"] is None else f"{e['value']:.3f}"
        limit = ("<= " if e["bound"] == "upper" else ">= ") + f"{e['limit']:g}"
        lines.append(f"| {e['name']} | {_where(e)} | {value} | {limit} | "
                     f"{'yes' if e['met'] else 'NO'} |")
    names = [n for n in dict.fromkeys(e["name"] for e in goals) if n in GOALS]
    if names:
        lines += ["", "What each value is (a step-time ratio: its median over the repetitions):"]
        lines += [f"- {name}: {GOALS[name].meaning}" for name in names]
    return "\n".join(lines) + "\n"
