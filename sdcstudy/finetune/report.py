"""Table 3 and Figure 7 of Ma et al. from fine-tuning run folders (`experiment.mode: finetune`).

- Table 3: test accuracy (TA) and disagreement percentage (DP) per node and task: the model
  before fine-tuning, the healthy node, the healthy node with another shuffle seed, and each
  suspect node. DP is the per cent of test questions whose answer differs from the healthy
  node's: a suspect's against the healthy node of its own run (profiles with `grad` or
  `update` sites compile another step, whose healthy node may differ in rounding from the
  other runs'); the healthy node of a run with another shuffle seed against the reference
  run's, through both runs' `predictions.parquet`. Runs that would share a row (the same
  node twice, or a node and its flip model) each get their folder's name added.
- The loss-spike table: the steps the loss-spike criterion flags (`summary.json`
  `loss_spikes`: a suspect's training loss more than 0.5 nats above the healthy node's), the
  loss spikes among them (at least 2 consecutive flagged steps, `core.metrics.loss_spike_spans`),
  the largest gap, and the TA they left; a Table 3 cell whose run had a spike is marked with *,
  one whose run stopped before its last step (`--stop-after`, an interrupt) with a dagger.
- Figure 7: training loss of the healthy and suspect nodes during fine-tuning, flagged steps
  marked.

Imports no JAX.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pandas as pd

from sdcstudy.core import metrics as MX
from sdcstudy.core import tablelog as TL
from sdcstudy.faults import published as PB
from sdcstudy.report import tables as T
from sdcstudy.report.sections import Section

PREDICTIONS = "predictions.parquet"
TABLE3_CSV = "table3_finetune.csv"
SPIKES_CSV = "finetune_loss_spikes.csv"
FIGURE7 = "fig7_finetune_loss.png"
CSV_FILES = (TABLE3_CSV, SPIKES_CSV)
INITIAL, HEALTHY = "without fine-tuning", "Healthy Node"


def finetune_runs(runs: dict) -> dict:
    return {label: run for label, run in runs.items()
            if T.run_mode(run) == "finetune" and "qa/ta/healthy" in run.summary}


def _task(run) -> str:
    return str(run.summary.get("qa/task", "?"))


def _seed(run) -> int:
    return int(run.summary.get("qa/shuffle_seed", 0))


def _suspect_label(run) -> str:
    profile = T.run_profile(run)
    node = PB.paper_node_number(profile)
    if node is not None:
        return f"Unhealthy Node {node}"
    return Path(profile).stem if profile.endswith((".yaml", ".yml")) else profile


def _final_healthy(run) -> np.ndarray | None:
    path = Path(run.path) / PREDICTIONS
    if not path.exists():
        return None
    frame = TL.read_table(path)
    rows = frame[(frame["stage"] == "final") & (frame["node"] == 0)].sort_values("question")
    return rows["prediction"].to_numpy()


def reference_seed(runs: list) -> int:
    """The shuffle seed most runs of a task share (the smallest on a tie): its healthy node is
    the reference of DP."""
    counts = collections.Counter(_seed(r) for r in runs)
    return min(counts, key=lambda s: (-counts[s], s))


def _spans(run) -> list[tuple[int, int]]:
    """The run's loss spikes, (first, last) step, by the one criterion."""
    return MX.loss_spike_spans(run.summary.get("loss_spikes") or [])


def _partial(run) -> bool:
    """The run stopped before its last step: its model is of the steps done."""
    return bool(T.partial_runs({"run": run}))


def _spiked(run) -> bool:
    return bool(_spans(run))


def _suspect_rows(group: list, seed: int) -> dict:
    """{Table 3 row: run} for a task's runs with a suspect: "Unhealthy Node N" (the profile's
    name for other profiles), with " (seed=S)" off the reference seed. Runs that would share a
    row (the same node twice, say with other fault seeds, or a node and its flip model) each
    get their folder's name added: a row holds one run, and none may hide another."""
    rows = collections.defaultdict(list)
    for run in group:
        if T.run_profile(run) != "healthy":
            tag = "" if _seed(run) == seed else f" (seed={_seed(run)})"
            rows[_suspect_label(run) + tag].append(run)
    out = {}
    for label, shared in rows.items():
        names = [Path(r.path).name for r in shared]
        if len(set(names)) < len(names):  # folders of the same name in other places
            names = [str(r.path) for r in shared]
        out.update({label: shared[0]} if len(shared) == 1 else
                   {f"{label} ({name})": r for name, r in zip(names, shared)})
    return out


def table3(runs: dict) -> pd.DataFrame:
    """Rows: configurations; columns `TASK TA`, `TASK DP` per task (NaN DP for the reference)."""
    runs = finetune_runs(runs)
    by_task = collections.defaultdict(list)
    for run in runs.values():
        by_task[_task(run)].append(run)
    cells: dict = collections.defaultdict(dict)
    rank: dict = {}  # suspect row -> its paper node's number (others after them)
    for task, group in by_task.items():
        seed = reference_seed(group)
        ref = next(r for r in group if _seed(r) == seed)
        s = ref.summary
        cells[INITIAL][task] = (s["qa/ta/initial"], s["qa/dp/initial"], False, False)
        cells[HEALTHY][task] = (s["qa/ta/healthy"], float("nan"), False, _partial(ref))
        reference = _final_healthy(ref)
        for run in group:
            s = run.summary
            tag = "" if _seed(run) == seed else f" (seed={_seed(run)})"
            if tag:
                mine = _final_healthy(run)
                dp = (float(100.0 * np.mean(mine != reference))
                      if mine is not None and reference is not None
                      and len(mine) == len(reference) else float("nan"))
                cells[HEALTHY + tag][task] = (s["qa/ta/healthy"], dp, False, _partial(run))
        for label, run in _suspect_rows(group, seed).items():
            s = run.summary
            cells[label][task] = (s["qa/ta/suspect"], s["qa/dp/suspect"], _spiked(run),
                                  _partial(run))
            rank[label] = PB.paper_node_number(T.run_profile(run)) or 10**6
    tasks = list(by_task)
    order = [INITIAL, HEALTHY] + sorted(
        (k for k in cells if k.startswith(HEALTHY + " ")), key=str) + sorted(
        (k for k in cells if not k.startswith((INITIAL, HEALTHY))), key=lambda k: (rank[k], k))
    records = []
    for label in order:
        record = {"configuration": label}
        for task in tasks:
            ta, dp, spike, partial = cells[label].get(task, (float("nan"),) * 2 + (False,) * 2)
            record[f"{task} TA"], record[f"{task} DP"] = ta, dp
            record[f"{task} spike"], record[f"{task} partial"] = spike, partial
        records.append(record)
    return pd.DataFrame(records).set_index("configuration") if records else pd.DataFrame()


def table3_markdown(table: pd.DataFrame) -> str:
    """`TA (DP)` per task as in Table 3; `*` marks a run with a loss spike, a dagger a run
    stopped before its last step."""
    tasks = [c[:-3] for c in table.columns if c.endswith(" TA")]
    lines = ["| configuration | " + " | ".join(f"{t} TA (DP)" for t in tasks) + " |",
             "|---|" + "---:|" * len(tasks)]
    for label, row in table.iterrows():
        cells = []
        for t in tasks:
            ta, dp, spike = row[f"{t} TA"], row[f"{t} DP"], row[f"{t} spike"]
            text = "-" if pd.isna(ta) else f"{ta:.2f} ({'-' if pd.isna(dp) else f'{dp:.2f}'})"
            cells.append(text + (" *" if spike else "") + (" †" if row[f"{t} partial"] else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spike_table(runs: dict, threshold: float | None = None) -> pd.DataFrame:
    """One row per fine-tuning run with a suspect: flagged steps, loss spikes (the first
    one's first step, the last one's last), the largest loss gap, TA."""
    records = []
    for label, run in finetune_runs(runs).items():
        if T.run_profile(run) == "healthy":
            continue
        m = run.metrics
        gap = (pd.to_numeric(m["loss/suspect"], errors="coerce")
               - pd.to_numeric(m["loss/healthy"], errors="coerce")) \
            if {"loss/suspect", "loss/healthy"} <= set(m.columns) else pd.Series(dtype=float)
        flagged, spans = list(run.summary.get("loss_spikes") or []), _spans(run)
        records.append({"run": label, "task": _task(run), "profile": T.run_profile(run),
                        "flagged steps": len(flagged), "spikes": len(spans),
                        "first spike": spans[0][0] if spans else None,
                        "last spike": spans[-1][1] if spans else None,
                        "max loss gap (nats)": float(np.nanmax(gap)) if len(gap) else None,
                        "TA suspect": run.summary.get("qa/ta/suspect"),
                        "TA healthy": run.summary.get("qa/ta/healthy"),
                        "DP": run.summary.get("qa/dp/suspect")})
    return pd.DataFrame(records).set_index("run") if records else pd.DataFrame()


def sections(runs: dict) -> tuple[list[str], dict]:
    """(Markdown sections, {csv name: csv text}) for `sdcstudy report`; empty without
    fine-tuning runs."""
    table = table3(runs)
    if table.empty:
        return [], {}
    spikes = spike_table(runs)
    text = [f"## Table 3: test accuracy (TA) and disagreement percentage (DP) after "
            f"fine-tuning\n\n{table3_markdown(table)}\n\n[{TABLE3_CSV}]({TABLE3_CSV}) DP: per "
            f"cent of test questions answered differently from the healthy node. * marks a run "
            f"whose suspect had a loss spike; † a run stopped before its last step, its "
            f"accuracy that of the steps done.\n"]
    files = {TABLE3_CSV: T.csv(table, ["configuration"])}
    if not spikes.empty:
        spiked = spikes[spikes["spikes"] > 0]
        note = ("No suspect had a loss spike (at least 2 consecutive steps more than 0.5 nats "
                "above the healthy loss)." if spiked.empty else
                "LOSS SPIKE: " + "; ".join(
                    f"{run} at steps {int(r['first spike'])}-{int(r['last spike'])} "
                    f"({int(r['spikes'])} spike(s), {int(r['flagged steps'])} flagged steps, "
                    f"up to {r['max loss gap (nats)']:.3g} nats above the healthy loss), TA "
                    f"{r['TA suspect']:.2f} against {r['TA healthy']:.2f}"
                    for run, r in spiked.iterrows()) + ".")
        text.append(f"## Loss spikes during fine-tuning\n\n"
                    f"{T.markdown(spikes, ['run'])}\n\n{note}\n\n[{SPIKES_CSV}]({SPIKES_CSV})\n")
        files[SPIKES_CSV] = T.csv(spikes, ["run"])
    return text, files


def loss_figure(runs: dict, path: Path) -> Path | None:
    """Figure 7: training loss during fine-tuning, one panel per task; the healthy node in
    black, each suspect in colour, flagged steps marked with x. Log y: a spike spans
    decades."""
    from sdcstudy.report import figure_style as FS
    from sdcstudy.report import plots

    runs = finetune_runs(runs)
    if not runs:
        return None
    tasks = list(dict.fromkeys(_task(r) for r in runs.values()))
    # The legend's entries (for its width and columns): the healthy nodes of each seed and
    # the suspects.
    labels = list(dict.fromkeys([HEALTHY, *(f"{HEALTHY} (seed={_seed(r)})" for r in
                                            runs.values()),
                                 *(_suspect_label(r) for r in runs.values()
                                   if T.run_profile(r) != "healthy")]))
    plt = plots.pyplot()
    fig, axes = FS.with_legend_room(plt, len(tasks), labels, 6.5 * len(tasks), 4.2,
                                    wspace=0.25, squeeze=False)
    styles = plots.styles(list(runs))
    for ax, task in zip(axes[0], tasks):
        group = {k: r for k, r in runs.items() if _task(r) == task}
        seed = reference_seed(list(group.values()))
        drawn = set()
        for label, run in group.items():
            if _seed(run) not in drawn:
                drawn.add(_seed(run))
                name = HEALTHY + ("" if _seed(run) == seed else f" (seed={_seed(run)})")
                FS.line(ax, *plots._xy(plots._series(run, "loss/healthy")), lw=1.3,
                        color="black", ls="-" if _seed(run) == seed else "--", label=name)
            if T.run_profile(run) == "healthy":
                continue
            loss = plots._series(run, "loss/suspect")
            FS.line(ax, loss.index, loss.values, lw=1.0, label=_suspect_label(run),
                    **styles[label])
            spikes = [s for s in run.summary.get("loss_spikes") or [] if s in loss.index]
            if spikes:
                ax.plot(spikes, loss.loc[spikes].clip(upper=1e6).values, "x", ms=6,
                        color=styles[label]["color"])
        plots.log_scale(ax)
        FS.step_axis(ax)
        ax.set_title(f"Figure 7 (Ma et al.): {task}: training loss", fontsize=10)
        ax.set_ylabel("training loss (nats per counted token)")
        ax.grid(alpha=0.3)
    FS.legend_outside(fig, axes[0, -1], labels)
    return plots.save_figure(fig, path)


def draw_figures(runs: dict, out: Path) -> list[str]:
    """For `sdcstudy report`: Figure 7 into the folder `out` (its name, if there was data)."""
    return [FIGURE7] if loss_figure(runs, Path(out) / FIGURE7) else []


# The `finetune` mode's part of `sdcstudy report` (sdcstudy.modes.REPORT_SECTIONS names it).
SECTION = Section(text=sections, figures=draw_figures, files=(*CSV_FILES, FIGURE7),
                  titles={FIGURE7: "Figure 7: training loss during fine-tuning, loss spikes "
                                   "marked"})
