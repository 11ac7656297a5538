"""`logging.tensorboard: true`: the scalars of metrics.jsonl as TensorBoard event files.

If a test here fails, TensorBoard shows a run other than metrics.jsonl says (a key missing, a
value or step off, a resumed run's redone steps twice), or a missing tensorboardX ends in a
traceback instead of one sentence.
"""

import shutil
import struct
import sys

import numpy as np
import pytest
from tensorboardX.proto import event_pb2  # the `tensorboard` extra, which `test` includes

from sdcstudy import cli, runner
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.core import tensorboard as TB


CONFIG = {"experiment": {"steps": 4, "batch_size": 2, "checkpoint_every": 2},
          "data": {"seq_len": 16}, "optim": {"warmup_steps": 0},
          "logging": {"tensorboard": True}}


def read_events(path):
    """Every event of an event file, or of every file in a folder in name order (TensorBoard's
    order). A record is: length (uint64), its checksum (uint32), the Event proto, its checksum.
    """
    if path.is_dir():
        return [e for file in sorted(path.glob("events.out.tfevents.*")) for e in read_events(file)]
    events, data, at = [], path.read_bytes(), 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
        at += 12 + length + 4
    return events


def scalars(events) -> dict[tuple[int, str], float]:
    out = {}
    for event in events:
        for value in event.summary.value:
            assert (event.step, value.tag) not in out, f"step {event.step} {value.tag} twice"
            out[(event.step, value.tag)] = value.simple_value
    return out


def expected(out) -> dict[tuple[int, str], float]:
    """metrics.jsonl's numeric fields, as float32 (TensorBoard's simple_value)."""
    return {(row["step"], key): float(np.float32(value))
            for row in RF.read_jsonl(out / RF.METRICS)
            for key, value in row.items() if key != "step" and isinstance(value, (int, float))}


def test_event_files_hold_every_metric_of_every_step(tmp_path):
    out = tmp_path / "run"
    runner.run(C.from_dict(CONFIG, ["experiment.mode=lockstep", "suspect.profile=paper-node-11",
                                    "model.n_layers=1"]),
               out, progress=False)
    logged = scalars(read_events(out / TB.FOLDER))
    want = expected(out)
    assert {step for step, _ in want} == {1, 2, 3, 4}
    assert {"loss/healthy", "grad/norm"} <= {key for _, key in want}
    assert logged == want
    # The live view's mismatch frequency per site is the step's mismatch table, eqs. (1)-(2).
    table = TL.read_table(out / RF.MISMATCH)
    sums = table.groupby(["step", "site"])[["mismatches", "elements"]].sum()
    assert len(sums) == 4 * 4 and sums["mismatches"].sum() > 0  # steps x sites
    for (step, site), row in sums.iterrows():
        assert want[(step, f"freq/{site}")] == float(np.float32(row.mismatches / row.elements))


def test_a_resumed_run_shows_each_step_once(tmp_path):
    # A run that died after logging step 4 but before its checkpoint 4 was whole resumes from
    # 2 and redoes steps 3 and 4. The resumed file starts with a session start at step 3:
    # TensorBoard then drops the earlier file's events from that step on, as metrics.jsonl
    # drops their lines; without it, steps 3 and 4 would show twice.
    out = tmp_path / "run"
    cfg = C.from_dict(CONFIG)
    runner.run(cfg, out, progress=False)
    shutil.rmtree(out / RF.CHECKPOINTS / "4")
    runner.run(cfg, out, resume=True, progress=False)
    first, second = sorted((out / TB.FOLDER).glob("events.out.tfevents.*"))
    starts = [(e.step, e.session_log.status) for e in read_events(second)
              if e.HasField("session_log")]
    assert starts == [(3, event_pb2.SessionLog.START)]
    assert {step for step, _ in scalars(read_events(first))} == {1, 2, 3, 4}
    assert {step for step, _ in scalars(read_events(second))} == {3, 4}
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(out / TB.FOLDER))
    acc.Reload()
    want = expected(out)
    for tag in {key for _, key in want}:
        shown = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert shown == sorted((s, v) for (s, k), v in want.items() if k == tag), tag


def test_missing_tensorboardx_is_one_sentence(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    config = tmp_path / "c.yaml"
    config.write_text("experiment: {steps: 1}\nlogging: {tensorboard: true}\n")
    out = tmp_path / "run"
    assert cli.main(["run", str(config), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "logging.tensorboard needs tensorboardX" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was made
