"""Promises of docs/guide.md that no other test held: each test here names the sentence it holds.

If a test here fails, the guide says something the tool no longer does (or never did): mend the
code, or the guide's sentence with it. Every test but one compiles nothing; that one (a signal
during the last step) reuses the program test_tensorboard compiles (its train step).
"""

import os
import signal

import pandas as pd
import pytest
from report_runs import grid_rows, write_run

from sdcstudy import cli, runner
from sdcstudy.core import config as C
from sdcstudy.core import checkpoint, runlock
from sdcstudy.core import runfolder as RF
from sdcstudy.report import writer


def test_report_csv_files_give_every_count_whole(tmp_path):
    # Guide, Reports: "Report tables show three significant digits (the CSV files six, and every
    # count whole)". A lock-step run beside a free one (no mismatch count: NaN) made the runs
    # table's count column float, and runs.csv wrote 1,234,567 mismatches as 1.23457e+06.
    rows = grid_rows(steps=1, layers=1, tp=1, elements=10**9,
                     cell=lambda step, micro, layer, site, rank: (
                         1_234_567 * (site == "fwd/attn"), 0.1))
    lock = write_run(tmp_path / "lock", mode="lockstep", profile="paper-node-1",
                     metrics=[{"step": 1, "loss/healthy": 5.0211864, "faults/landed": 2_345_678}],
                     mismatch=rows)
    free = write_run(tmp_path / "free", mode="free", profile="paper-node-2",
                     metrics=[{"step": 1, "loss/healthy": 2.0, "loss/suspect": 2.5,
                               "param/diff_l2": 0.125}])
    result = writer.write_report([lock, free], tmp_path / "out")
    text = (result["out"] / "runs.csv").read_text()
    csv = pd.read_csv(result["out"] / "runs.csv").set_index("node")
    assert csv.loc["Node 1", "mismatches"] == 1_234_567, text
    assert csv.loc["Node 1", "faults injected"] == 2_345_678, text
    assert pd.isna(csv.loc["Node 2", "mismatches"])  # not measured: still an empty cell
    assert "5.02119," in text  # a measured value keeps six significant digits
    # report.md keeps three significant digits for every number, counts too.
    [row] = [line for line in result["markdown"].splitlines()
             if line.startswith("| Node 1 | lock |")]
    assert "| 2.35e+06 | 1.23e+06 |" in row


def test_a_report_of_a_run_still_being_written_exits_2(tmp_path, capsys):
    # Guide, Reports: "a run still being written has no summary.json yet, so its report exits
    # 2 too": the runs table's figures are of the steps written so far, and the exit code
    # says the report is partial; 1 would be a FAIL, which a report never gives.
    run = write_run(tmp_path / "going", mode="free", profile="paper-node-1",
                    metrics=[{"step": s, "loss/healthy": 3.0, "loss/suspect": 3.0}
                             for s in (1, 2)],
                    config={"experiment": {"mode": "free", "steps": 8, "microsteps": 1}})
    (run / RF.SUMMARY).unlink()
    out = tmp_path / "report"
    with runlock.hold(run, create=False):
        capsys.readouterr()
        assert cli.main(["report", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    [line] = err.strip().splitlines()
    assert line.startswith(f"sdcstudy: {str(run / RF.SUMMARY)!r} is missing; the report "
                           f"leaves Node 1 out of"), err
    assert f"Node 1 at step 2 of 8 (process {os.getpid()})" in (out / writer.REPORT).read_text()


# The configuration of test_tensorboard's runs, whose compiled step this one loads.
TINY = {"experiment": {"steps": 4, "batch_size": 2, "checkpoint_every": 2},
        "data": {"seq_len": 16}, "optim": {"warmup_steps": 0}}


def test_a_signal_during_the_last_step_lets_the_run_finish(tmp_path, monkeypatch, capfd):
    # Guide, Run folders: "A signal during the last step lets the run finish": SIGINT while the
    # last step's checkpoint is written ends the run as if none came (exit 0, summary.json of
    # every step), not with 130 and a resume that would have nothing to do.
    save = checkpoint.Checkpointer.save

    def saving(self, step, state, record):
        save(self, step, state, record)
        if step == TINY["experiment"]["steps"]:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", saving)
    out = tmp_path / "run"
    capfd.readouterr()
    try:
        runner.run(C.from_dict(TINY), out, progress=False)  # no Interrupted: `run` exits 0
    except KeyboardInterrupt as stop:  # pytest would take it for the user's Ctrl-C
        pytest.fail(f"the run stopped: {stop}")
    err = capfd.readouterr().err  # the handler writes to the descriptor, never inside a print
    assert "SIGINT: finishing and checkpointing this step" in err
    summary = RF.json_load(out / RF.SUMMARY)
    assert summary["steps_done"] == summary["steps"] == 4
    assert checkpoint.saved_steps(out / RF.CHECKPOINTS)[-1] == 4


def test_a_damaged_metrics_line_stops_a_resume_before_any_table_is_cut(tmp_path):
    # Guide, When a write fails: a metrics.jsonl line that is not JSON "stops the resume,
    # leaving the metrics and the tables as they were". A resume drops the rows of the steps it
    # redoes from every table, so the metrics file must be read (and refused) before any table
    # is cut back to the checkpoint.
    from types import SimpleNamespace

    from sdcstudy.core import tablelog as TL

    metrics = b'{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n'
    (tmp_path / RF.METRICS).write_bytes(metrics)
    table = TL.TableLog(tmp_path / RF.MISMATCH, TL.MISMATCH_COLUMNS, keep_below_step=1)
    for step in (1, 2, 3):
        table.extend([{"step": step, "microstep": 0, "layer": 1, "site": "fwd/attn",
                       "tp_rank": 0, "mismatches": step, "elements": 10, "severity": 0.5,
                       "max_rel_err": 0.5, "nonfinite": 0}])
        table.flush()
    parts = {p.name: p.read_bytes() for p in TL.table_parts(tmp_path / RF.MISMATCH)}
    mode = SimpleNamespace(trainer=None, loss_key="loss/healthy", shown={},
                           tables={RF.MISMATCH: TL.MISMATCH_COLUMNS})
    with pytest.raises(RF.NotJsonLine, match="line 2 is not JSON"):
        runner._Log(mode, tmp_path, 1, {}, None, bar=None)  # resuming from checkpoint 1
    assert (tmp_path / RF.METRICS).read_bytes() == metrics
    assert {p.name: p.read_bytes() for p in TL.table_parts(tmp_path / RF.MISMATCH)} == parts
