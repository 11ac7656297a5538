"""The detector benchmark table and figure, from `experiment.mode: detect` run folders.

Per detector and fault profile:
- events: steps whose result the fault changed (a rank's gradient differs bitwise from its
  healthy mirror's, `detect/truth`);
- recall: events followed by a flag of the detector within a window of steps (the same step
  included), over events. The window is 0 when a corruption never outlives its step, so a
  later flag is not its detection: the run advanced on the clean gradient (`detect.advance:
  reference`), or it rolled back every flagged step (`detect.rollback`; a run with a ground
  truth has the mirror, which flags every event, so no event is trained on). It is
  `LATENCY_WINDOW` when the run trained on the corrupted gradients (`primary`), where a fault
  can surface steps later (a loss spike);
- latency: mean steps from an event to the detector's first flag, over detected events;
  0 with a window of 0, where every detection is at its event's step by definition;
- precision: flags that fall in some event's window, over all flags of the run;
- false alarms: flagged steps over steps of the healthy run(s) (profile `healthy`);
- named (localization only): events at which the named device is the one that was wrong;
- time and memory overhead: the detector alone against no detector (`detect_overhead.json`,
  written by `experiments/detectors.py` beside the run).

Imports no JAX.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sdcstudy.core import reports
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.detect.plan import DETECTORS
from sdcstudy.report.sections import Section

# detections.parquet: one row per flagged step. `class`: the step re-executed on the same
# device from the same state (the reexec detector's execution) gave another result
# ("transient") or the same one ("persistent": a bad unit that will fail again, or a false
# alarm on a clean step, which re-execution alone cannot tell apart);
# "unknown" without the reexec detector. `injected_kind`: what the injector's specs are
# ("transient" draws afresh on a re-execution, anything else repeats; "none": healthy run).
DETECTIONS = "detections.parquet"
DETECTION_COLUMNS = ("step", "detectors", "truth", "class", "injected_kind")
CLASSES = ("transient", "persistent", "unknown")

LATENCY_WINDOW = 5  # steps after an event in which a flag still counts as its detection
OVERHEAD = "detect_overhead.json"
COLUMNS = ("profile", "fault_kind", "detector", "steps", "events", "recall", "latency_steps",
           "precision", "false_alarms", "named", "time_ratio", "memory_ratio")


def _flags(metrics: pd.DataFrame, name: str) -> np.ndarray:
    key = f"detect/{name}"
    return metrics[key].fillna(0).to_numpy(bool) if key in metrics else None


def _latency(delays: list[int], window: int) -> tuple[float | None, int | None]:
    """Mean and most steps from an event to its first flag, over detected events (None, None
    when none was detected). With a window of 0 a detection is at its event's step: 0.0, 0."""
    if not delays:
        return None, None
    if window == 0:
        return 0.0, 0
    return float(np.mean(delays)), int(max(delays))


def detector_scores(metrics: pd.DataFrame, name: str, window: int = LATENCY_WINDOW) -> dict:
    """Recall, latency and precision of one detector in one run's metrics.jsonl frame."""
    flags, truth = _flags(metrics, name), _flags(metrics, "truth")
    if flags is None or truth is None:
        return {}
    steps = metrics["step"].to_numpy()
    events = np.flatnonzero(truth)
    flagged = np.flatnonzero(flags)
    delays = []
    for e in events:
        later = flagged[(flagged >= e) & (steps[flagged] - steps[e] <= window)]
        if len(later):
            delays.append(int(steps[later[0]] - steps[e]))
    covered = np.zeros(len(steps), bool)
    for e in events:
        covered |= (steps >= steps[e]) & (steps - steps[e] <= window)
    named = None
    if name == "localize" and len(events) and "detect/localized" in metrics:
        # Events where the named device is the one whose gradient differed.
        localized = metrics["detect/localized"].to_numpy()[events]
        named = float(np.mean(localized == metrics["detect/truth_device"].to_numpy()[events]))
    latency, latency_max = _latency(delays, window)
    return {"steps": len(steps), "events": len(events), "named": named,
            "recall": len(delays) / len(events) if len(events) else None,
            "latency_steps": latency, "latency_steps_max": latency_max,
            "precision": float(covered[flagged].mean()) if len(flagged) else None,
            "false_alarms": int(np.sum(~covered[flagged])),
            "flags": len(flagged)}


SCORES = ("recall", "precision", "false_alarms", "latency_steps", "latency_steps_max")


def injected_kind(profile) -> str:
    """The ground-truth class of a profile's faults (None: a healthy run)."""
    if profile is None or not profile.specs:
        return "none"
    kinds = {"transient" if spec.transient else "persistent" for spec in profile.specs}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def detection_row(step: int, verdict: dict, detectors, kind: str) -> dict | None:
    """detections.parquet's row for one step, or None when no detector flagged it."""
    flagged = [name for name in detectors if verdict.get(name)]
    if not flagged:
        return None
    cls = ("transient" if verdict["reexec"] else "persistent") if "reexec" in detectors \
        else "unknown"
    return {"step": step, "detectors": ",".join(flagged), "truth": verdict.get("truth"),
            "class": cls, "injected_kind": kind}


def confusion(frame: pd.DataFrame) -> pd.DataFrame:
    """True events (truth 1) by injected kind (rows) and class given (columns)."""
    events = frame[frame["truth"].fillna(0).astype(bool)]
    table = pd.crosstab(events["injected_kind"], events["class"])
    return table.reindex(columns=list(CLASSES), fill_value=0)


def window_of(advance: str, rollback: bool = False) -> int:
    """Steps after an event in which a flag counts as its detection: 0 when the corruption dies
    with its step (the run trains on the clean gradient, or re-runs every flagged step from a
    verified state), LATENCY_WINDOW otherwise."""
    return 0 if advance == "reference" or rollback else LATENCY_WINDOW


# metrics.jsonl's count of re-runs, which only a run with `detect.rollback` writes (rollback.py).
ROLLBACKS = "detect/rollbacks"


def run_scores(rows: list[dict], detectors, advance: str) -> dict:
    """summary.json's `detect/<name>/<score>` of one run, from its metrics.jsonl rows.

    With `advance: reference` or rollback a detection can only be at its event's step, so a
    detected event's latency is 0 (reported as 0.0); a detector that saw no event has recall
    null. Whether the run rolled back is read from its rows (`ROLLBACKS`)."""
    frame = pd.DataFrame(rows)
    if "detect/truth" not in frame:
        return {}
    window = window_of(advance, ROLLBACKS in frame)
    out = {}
    for name in detectors:
        scores = detector_scores(frame, name, window)
        if not scores:
            continue
        out.update({f"detect/{name}/{k}": scores[k] for k in SCORES})
    return out


def run_label(config: dict) -> tuple[str, str]:
    suspect = config.get("suspect") or {}
    return str(suspect.get("profile", "healthy")), str(suspect.get("fault_kind", "profile"))


def detect_runs(runs: dict) -> dict:
    """The runs of `runs` ({label: report.Run}) made in detect mode."""
    return {k: r for k, r in runs.items()
            if (r.config.get("experiment") or {}).get("mode") == "detect"}


def benchmark_table(runs: dict) -> pd.DataFrame:
    """One row per (profile, fault kind, detector) over detect-mode runs."""
    runs = detect_runs(runs)
    healthy = [r for r in runs.values() if run_label(r.config)[0] == "healthy"]
    alarms = {}
    for name in DETECTORS:
        flags = [_flags(r.metrics, name) for r in healthy]
        flags = [f for f in flags if f is not None]
        alarms[name] = float(np.mean(np.concatenate(flags))) if flags else None
    rows = []
    for run in runs.values():
        profile, kind = run_label(run.config)
        if profile == "healthy":
            continue
        overhead = _overhead(run.path)
        detect = run.config.get("detect") or {}
        window = window_of(detect.get("advance", "reference"), bool(detect.get("rollback")))
        for name in DETECTORS:
            scores = detector_scores(run.metrics, name, window)
            if not scores:
                continue
            cost = overhead.get(name, {})
            rows.append({"profile": profile, "fault_kind": kind, "detector": name,
                         **{k: scores[k] for k in ("steps", "events", "recall",
                                                   "latency_steps", "precision")},
                         "false_alarms": alarms[name], "named": scores["named"],
                         "time_ratio": cost.get("time_ratio"),
                         "memory_ratio": cost.get("memory_ratio")})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _overhead(path) -> dict:
    file = Path(path) / OVERHEAD
    return RF.json_load(file) if file.is_file() else {}


def recall_figure(table: pd.DataFrame, path: Path) -> Path | None:
    """Recall per detector (bars) for each profile, with each detector's step-time overhead."""
    if table.empty:
        return None
    plt = reports.pyplot()

    table = table.assign(case=table["profile"] + " / " + table["fault_kind"])
    cases = list(dict.fromkeys(table["case"]))
    names = [n for n in DETECTORS if n in set(table["detector"])]
    fig, (ax, cost) = plt.subplots(1, 2, figsize=(13, 4.8),
                                   gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        part = table[table["detector"] == name].set_index("case").reindex(cases)
        ax.bar(np.arange(len(cases)) + i * width, part["recall"].fillna(0), width, label=name)
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
    ax.set_xticklabels(cases, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("recall (events that changed a step)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Events that changed a step's result, caught per detector")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ratios = table.groupby("detector")["time_ratio"].median().reindex(names)
    cost.bar(range(len(names)), ratios.fillna(0), color="gray")
    cost.axhline(1.0, color="black", lw=0.8, ls="--")
    cost.set_xticks(range(len(names)))
    cost.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    cost.set_ylabel("step time / no detector (median)")
    cost.set_title("Step-time overhead")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


INDEX = ["profile", "fault_kind", "detector"]
TITLE = ("Detector benchmark: recall over events that changed a step's result, latency, "
         "precision, false alarms on healthy runs, step-time and memory overhead against no "
         "detector")


def indexed(table: pd.DataFrame) -> pd.DataFrame:
    return table.set_index(INDEX)


CONFUSION_TITLE = ("Transient or persistent: flagged true events by the injected kind (rows) "
                   "and the class re-execution gave them (columns)")


def report_tables(runs: dict) -> dict:
    """The report's entry ({csv name: (title, table, index names, fold published)}) for the
    detect-mode runs among `runs`; empty when there are none."""
    out = {}
    table = benchmark_table(runs)
    if not table.empty:
        out["detectors.csv"] = (TITLE, indexed(table), INDEX, False)
    frames = [TL.read_table(Path(r.path) / DETECTIONS) for r in detect_runs(runs).values()
              if (Path(r.path) / DETECTIONS).exists()]
    frames = [f for f in frames if not f.empty]
    if frames:
        matrix = confusion(pd.concat(frames, ignore_index=True))
        if not matrix.empty:
            out["detections_confusion.csv"] = (CONFUSION_TITLE, matrix, ["injected_kind"], False)
    return out


# The `detect` mode's part of `sdcstudy report` (sdcstudy.modes.REPORT_SECTIONS names it).
SECTION = Section(tables=report_tables, files=("detectors.csv", "detections_confusion.csv"))
