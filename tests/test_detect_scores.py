"""A detect run scores its detectors in summary.json: recall, precision, false alarms and
latency against the injector's ground truth. Latency is measured (a loss monitor that fires
only once the loss has grown has latency > 0), and a resumed run scores as an unbroken one."""

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from bitwise import bits, state_bits
from sdcstudy import runner
from sdcstudy.core import config as C
from sdcstudy.detect import tables as DT

ONSET = 6
STEPS = 14


def _cfg(tmp_path, **experiment):
    # From ONSET on, the only rank's gradient has every sign flipped: the run climbs the loss
    # while the gradient norm stays as it was, so only the loss can give it away, steps later.
    profile = tmp_path / "ascent.yaml"
    profile.write_text(yaml.safe_dump({"name": "ascent", "specs": [
        {"site": "grad", "kind": "bitflip", "bits": [31], "rate": 1.0,
         "pattern": {"kind": "onset", "onset_step": ONSET}}]}))
    return C.from_dict({
        "experiment": {"mode": "detect", "steps": STEPS, "batch_size": 4,
                       "checkpoint_every": 0, **experiment},
        "mesh": {"dp": 1}, "suspect": {"profile": str(profile)},
        "detect": {"detectors": "monitor,lockstep", "advance": "primary", "suspect_rank": 0,
                   "spike_window": 4},
        "optim": {"schedule": "constant", "lr": 3e-3, "warmup_steps": 0},
        "model": {"n_layers": 1}, "data": {"seq_len": 32}})


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scores")
    summary = runner.run(_cfg(tmp), tmp / "run", progress=False)
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, tmp / "run"


def test_every_detector_has_the_five_scores(unbroken):
    summary, _, _ = unbroken
    for name in ("monitor", "lockstep"):
        assert {f"detect/{name}/{k}" for k in DT.SCORES} <= set(summary), name


def test_scores_match_the_ground_truth(unbroken):
    summary, rows, _ = unbroken
    truth = [r["detect/truth"] for r in rows]
    assert truth == [int(step >= ONSET) for step in range(1, STEPS + 1)]
    # The lock-step mirror sees every changed gradient at its own step.
    assert summary["detect/lockstep/recall"] == 1.0
    assert summary["detect/lockstep/latency_steps"] == 0.0
    assert summary["detect/lockstep/false_alarms"] == 0
    # The monitor fires only once the loss has climbed: later than the first event.
    flags = [r["detect/monitor"] for r in rows]
    first_flag = flags.index(1) + 1
    assert first_flag > ONSET
    assert summary["detect/monitor/latency_steps"] > 0
    assert summary["detect/monitor/latency_steps_max"] >= summary["detect/monitor/latency_steps"]
    # Recomputed by hand: an event is caught by the first flag within LATENCY_WINDOW steps.
    delays = []
    for event in range(ONSET, STEPS + 1):
        later = [s for s in range(event, min(event + DT.LATENCY_WINDOW, STEPS) + 1)
                 if flags[s - 1]]
        if later:
            delays.append(later[0] - event)
    assert summary["detect/monitor/recall"] == pytest.approx(len(delays) / (STEPS - ONSET + 1))
    assert summary["detect/monitor/latency_steps"] == pytest.approx(np.mean(delays))
    assert summary["detect/monitor/latency_steps_max"] == max(delays)


def test_no_event_means_recall_null_not_zero():
    frame = pd.DataFrame({"step": [1, 2, 3], "detect/truth": [0, 0, 0],
                          "detect/monitor": [0, 1, 0]})
    scores = DT.detector_scores(frame, "monitor")
    assert scores["recall"] is None and scores["false_alarms"] == 1
    assert scores["precision"] == 0.0


def test_with_the_reference_advancing_a_detection_is_at_its_step():
    rows = [{"step": s, "detect/truth": int(s in (2, 5)), "detect/abft": int(s in (2, 3))}
            for s in range(1, 7)]
    scores = DT.run_scores(rows, ("abft",), "reference")
    assert scores["detect/abft/recall"] == 0.5  # step 5 missed; step 3's flag is no detection
    assert scores["detect/abft/false_alarms"] == 1
    assert scores["detect/abft/latency_steps"] == 0.0


@pytest.mark.parametrize("advance", ["reference", "primary"])
def test_the_report_table_scores_latency_as_summary_json_does(advance, tmp_path):
    from sdcstudy.report.runs import Run

    rows = [{"step": s, "detect/truth": int(s in (2, 5)), "detect/abft": int(s in (2, 6))}
            for s in range(1, 9)]
    config = {"experiment": {"mode": "detect"}, "suspect": {"profile": "exponent-flip"},
              "detect": {"advance": advance}}
    run = Run(tmp_path, config, {}, pd.DataFrame(rows))
    (row,) = DT.benchmark_table({"faulty": run}).to_dict("records")
    summary = DT.run_scores(rows, ("abft",), advance)
    assert row["latency_steps"] == summary["detect/abft/latency_steps"]
    assert row["latency_steps"] == {"reference": 0.0, "primary": 0.5}[advance]


def test_a_rolled_back_run_counts_only_same_step_flags(tmp_path):
    """With rollback every event is re-run before training goes on, so the corruption dies with
    its step as with the reference advancing: a flag a step later is no detection of it, in
    summary.json and in the report's table alike."""
    from sdcstudy.report.runs import Run

    rows = [{"step": s, "detect/truth": int(s in (2, 5)), "detect/abft": int(s in (2, 6)),
             "detect/rollbacks": int(s in (2, 5))} for s in range(1, 9)]
    summary = DT.run_scores(rows, ("abft",), "primary")
    assert summary["detect/abft/recall"] == 0.5  # step 6's flag is no detection of step 5
    assert summary["detect/abft/false_alarms"] == 1
    config = {"experiment": {"mode": "detect"}, "suspect": {"profile": "exponent-flip"},
              "detect": {"advance": "primary", "rollback": True}}
    (row,) = DT.benchmark_table({"faulty": Run(tmp_path, config, {},
                                               pd.DataFrame(rows))}).to_dict("records")
    assert (row["recall"], row["precision"]) == (0.5, 0.5)
    assert row["latency_steps"] == summary["detect/abft/latency_steps"] == 0.0


def test_a_resumed_run_scores_like_an_unbroken_one(unbroken, tmp_path):
    # The monitor's history is saved with each checkpoint; without it the resumed monitor
    # would start empty and flag later. The training itself resumes bit for bit too.
    summary, rows, folder = unbroken
    cfg = _cfg(tmp_path, checkpoint_every=4)
    runner.run(cfg, tmp_path / "run", stop_after=9, progress=False)
    resumed = runner.run(cfg, tmp_path / "run", resume=True, progress=False)
    again = [json.loads(line)
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["detect/monitor"] for r in again] == [r["detect/monitor"] for r in rows]
    for key in summary:
        if key.startswith("detect/"):
            assert bits(resumed[key]) == bits(summary[key]), key
    assert state_bits(tmp_path / "run") == state_bits(folder)


@pytest.mark.parametrize("fault_kind, expected", [("transient", "transient"),
                                                  ("repeatable", "persistent")])
def test_flagged_events_are_classed_by_re_execution(tmp_path, fault_kind, expected):
    # Exponent flips in the FFN's output on every step: a transient fault draws afresh when the
    # step is re-executed on the same device, a repeatable one gives the same wrong result.
    # (A model site: a `grad` spec would cost the step three times its compile.)
    profile = tmp_path / "flips.yaml"
    profile.write_text(yaml.safe_dump({"name": "flips", "specs": [
        {"site": "fwd/ffn", "kind": "bitflip", "bit_class": "exponent", "rate": 1e-2}]}))
    cfg = C.from_dict({
        "experiment": {"mode": "detect", "steps": 3, "batch_size": 2, "checkpoint_every": 0},
        "mesh": {"dp": 1}, "suspect": {"profile": str(profile), "fault_kind": fault_kind},
        "detect": {"detectors": "lockstep,reexec", "suspect_rank": 0},
        "optim": {"warmup_steps": 0}, "model": {"n_layers": 1}, "data": {"seq_len": 16}})
    runner.run(cfg, tmp_path / "run", progress=False)
    frame = pd.read_parquet(tmp_path / "run" / DT.DETECTIONS)
    assert list(frame["step"]) == [1, 2, 3] and frame["truth"].all()
    assert set(frame["class"]) == {expected} and set(frame["injected_kind"]) == {expected}
    matrix = DT.confusion(frame)
    assert matrix.loc[expected, expected] == 3 and matrix.to_numpy().sum() == 3
