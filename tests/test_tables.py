"""Run tables appended as they grow (tablelog.TableLog) and metrics.jsonl written live.

What would be wrong if these failed: a table that loses or repeats rows on resume, that holds
the run's rows in memory, that a kill leaves unreadable, or that only our reader can read; a
run killed with SIGKILL that `sdcstudy report` or `--resume` cannot take up; a logging bench
whose JSON lacks the figures RESULTS.md quotes.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from sdcstudy import cli
from sdcstudy.core import metrics as MX
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.core.errors import UserError
from sdcstudy.report.writer import REPORT

COLUMNS = ("step", "site", "value")
ROOT = Path(__file__).resolve().parents[1]


def _rows(step, n=3):
    return [{"step": step, "site": f"s{i}", "value": step + i / 10} for i in range(n)]


def test_append_flush_read_round_trip(tmp_path):
    path = tmp_path / "t.parquet"
    log = TL.TableLog(path, COLUMNS, keep_below_step=1)
    log.flush()  # before any row: the table exists with its columns
    assert list(TL.read_table(path).columns) == list(COLUMNS) and len(TL.read_table(path)) == 0
    for step in range(1, 4):
        log.extend(_rows(step))
        log.flush()
    log.extend(_rows(4))
    # frame(): what was flushed and what waits; read_table only what was flushed.
    assert sorted(set(log.frame()["step"])) == [1, 2, 3, 4]
    assert sorted(set(TL.read_table(path)["step"])) == [1, 2, 3]
    log.flush()
    assert len(TL.table_parts(path)) == 5  # the empty first part, then one per flush
    frame = TL.read_table(path)
    assert frame.to_dict("records") == [r for s in range(1, 5) for r in _rows(s)]
    pd.testing.assert_frame_equal(pd.read_parquet(path), frame)  # the folder reads as one table
    assert TL.read_table(path, ["value"]).columns.tolist() == ["value"]


def test_columns_that_widen_keep_one_schema(tmp_path):
    """A column all None at first gets its type later, ints meet floats: every part is cast to
    the wider schema, or `pd.read_parquet` on the folder would fail on the narrower part."""
    path = tmp_path / "d.parquet"
    log = TL.TableLog(path, ("step", "truth", "value"), keep_below_step=1)
    for step, truth, value in ((1, None, 1), (2, 1, 2), (3, 0, 2.5)):
        log.extend([{"step": step, "truth": truth, "value": value}])
        log.flush()
    frame = pd.read_parquet(path)
    assert frame["value"].tolist() == [1.0, 2.0, 2.5] and frame["truth"].tolist()[1:] == [1, 0]
    pd.testing.assert_frame_equal(frame, TL.read_table(path))
    # A kill while the parts were being cast leaves part 0 narrower: read_table still reads the
    # table, and a resume makes the schema one again.
    part = TL.table_parts(path)[0]
    narrow = pq.read_table(part)
    pq.write_table(narrow.cast(narrow.schema.set(2, pa.field("value", pa.int64()))), part)
    pd.testing.assert_frame_equal(TL.read_table(path), frame)
    TL.TableLog(path, ("step", "truth", "value"), keep_below_step=10)
    pd.testing.assert_frame_equal(pd.read_parquet(path), frame)


def test_resume_drops_later_steps(tmp_path):
    path = tmp_path / "t.parquet"
    log = TL.TableLog(path, COLUMNS, keep_below_step=1)
    for steps in ((1, 2), (3, 4), (5, 6)):  # three parts of two steps each
        for step in steps:
            log.extend(_rows(step))
        log.flush()
    (path / ".part-000009.parquet.x.tmp").write_bytes(b"a write a kill cut short")
    log = TL.TableLog(path, COLUMNS, keep_below_step=4)  # resume from the checkpoint at 3
    assert sorted(set(TL.read_table(path)["step"])) == [1, 2, 3]
    assert [p.name for p in TL.table_parts(path)] == ["part-000000.parquet", "part-000001.parquet"]
    assert not list(path.glob(".*"))
    log.extend(_rows(4))
    log.flush()
    assert TL.read_table(path)["step"].value_counts().to_dict() == {1: 3, 2: 3, 3: 3, 4: 3}
    TL.TableLog(path, COLUMNS, keep_below_step=1)  # back to the start: the columns stay
    assert len(TL.read_table(path)) == 0 and list(TL.read_table(path).columns) == list(COLUMNS)
    TL.TableLog(path, COLUMNS)  # no keep_below_step: a new table replaces the old one
    assert not path.exists()


def test_single_file_tables_of_older_runs(tmp_path):
    """Run folders written before tables were appended hold one Parquet file: read as it is,
    and on resume it becomes the folder's first part."""
    path = tmp_path / RF.MISMATCH
    pd.DataFrame([r for s in (1, 2, 3) for r in _rows(s)]).to_parquet(path)
    assert len(TL.read_table(path)) == 9
    log = TL.TableLog(path, COLUMNS, keep_below_step=3)
    assert path.is_dir() and sorted(set(TL.read_table(path)["step"])) == [1, 2]
    log.extend(_rows(3))
    log.flush()
    assert sorted(set(pd.read_parquet(path)["step"])) == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [RF.MISMATCH]


def test_memory_is_bounded_by_one_flush(tmp_path):
    log = TL.TableLog(tmp_path / "t.parquet", COLUMNS, keep_below_step=1, max_pending_rows=10)
    log.extend(_rows(1, 4))
    assert log.pending_rows == 4
    log.flush()
    assert log.pending_rows == 0 and not log._pending
    for step in range(2, 8):  # 24 rows: more than 10 wait -> they flush on their own
        log.extend(_rows(step, 4))
        assert log.pending_rows < 10
    assert len(TL.table_parts(tmp_path / "t.parquet")) == 3
    assert len(log.frame()) == 28


def test_site_aggregates_part_by_part_equal_eqs_1_to_4_on_the_whole_table(tmp_path):
    """A paired run's summary sums its mismatch table up one part at a time; with parts cut in
    the middle of steps (flushes forced by max_pending_rows) and rows still waiting, it gives
    eqs. (1)-(4) computed here on every row at once."""
    rng = random.Random(0)
    log = TL.TableLog(tmp_path / "m.parquet", TL.MISMATCH_COLUMNS, keep_below_step=1,
                      max_pending_rows=37)
    rows = []
    for step in range(1, 7):
        for micro in range(2):
            for layer in range(3):
                for site in MX.SITES:
                    for rank in range(2):
                        n = rng.choice([0, 0, rng.randint(1, 50)])
                        rows.append({"step": step, "microstep": micro, "layer": layer,
                                     "site": site, "tp_rank": rank, "mismatches": n,
                                     "elements": 1000 + rank, "severity": rng.random() * n,
                                     "max_rel_err": 0.0, "nonfinite": rng.randint(0, 1)})
    for row in rows:  # one at a time: a part ends wherever 37 rows wait, mid-step
        log.extend([row])
    parts = list(log.frames(MX.AGGREGATE_COLUMNS))
    assert {len(set(part["step"])) for part in parts} >= {2} and log.pending_rows > 0
    got = MX.site_aggregates_of_parts(iter(parts))
    for site in MX.SITES:
        mine = [r for r in rows if r["site"] == site]
        micro_freqs = []
        for step in range(1, 7):
            for micro in range(2):
                layer_freqs = []
                for layer in range(3):
                    cell = [r for r in mine if (r["step"], r["microstep"], r["layer"]) ==
                            (step, micro, layer)]
                    layer_freqs.append(sum(r["mismatches"] for r in cell)
                                       / sum(r["elements"] for r in cell))
                micro_freqs.append(sum(layer_freqs) / len(layer_freqs))
        assert got["freq"][site] == pytest.approx(sum(micro_freqs) / len(micro_freqs), rel=1e-12)
        assert got["max_severity"][site] == max(r["severity"] for r in mine)
        assert got["mismatches"][site] == sum(r["mismatches"] for r in mine)
        assert got["nonfinite"][site] == sum(r["nonfinite"] for r in mine)
    whole = MX.site_aggregates(log.frame())
    for key, values in got.items():
        assert whole[key] == pytest.approx(values, rel=1e-12), key


def test_metrics_reach_the_disk_while_the_run_goes_on(tmp_path, monkeypatch):
    path = tmp_path / RF.METRICS
    writer = RF.MetricsWriter(path, keep_below_step=1)
    writer.write({"step": 1, "loss": 1.0})
    assert RF.read_jsonl(path) == []  # within FLUSH_SECONDS of the last flush: it waits
    monkeypatch.setattr(RF, "FLUSH_SECONDS", 0.0)
    writer.write({"step": 2, "loss": float("nan")})
    assert [r["step"] for r in RF.read_jsonl(path)] == [1, 2]  # on disk, not closed
    writer.close()
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # a kill cut this write short
    assert [r["step"] for r in RF.read_jsonl(path)] == [1, 2]
    RF.MetricsWriter(path, keep_below_step=2).close()
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n'


@pytest.mark.parametrize("damage", [b'{"step": 2, "lo\n', b'{"step": 2, "loss": \xff}\n'])
def test_a_metrics_line_that_is_not_json_is_named_by_its_line_in_the_file(tmp_path, damage):
    # JSON alone says "line 1 column 16", within the one line it parsed: useless in a long file.
    path = tmp_path / RF.METRICS
    text = b'{"step": 1}\n\n' + damage + b'{"step": 3}\n'
    path.write_bytes(text)
    reason = "Invalid control character at" if b"lo\n" in damage else "not UTF-8 text"
    with pytest.raises(UserError, match=f"^{re.escape(repr(str(path)))} line 3 is not JSON "
                                        f"\\({reason}"):
        RF.read_jsonl(path)
    # A resume filters the file line by line: the same sentence (exit 2), the file as it was.
    with pytest.raises(UserError, match="line 3 is not JSON"):
        RF.MetricsWriter(path, keep_below_step=3)
    assert path.read_bytes() == text and [p.name for p in tmp_path.iterdir()] == [RF.METRICS]


@pytest.mark.parametrize("row", [b"3", b'{"loss": 1.0}', b'{"step": "2"}', b'{"step": true}'])
def test_a_metrics_line_that_is_no_step_row_stops_a_resume_by_its_line(tmp_path, row):
    # JSON, but no row of a step: a resume was a TypeError or KeyError (exit 3, "a bug").
    path = tmp_path / RF.METRICS
    text = b'{"step": 1}\n' + row + b'\n{"step": 3}\n'
    path.write_bytes(text)
    with pytest.raises(UserError, match=f"^{re.escape(repr(str(path)))} line 2 is not a metrics "
                                        f'row \\(no whole-number "step"\\)'):
        RF.MetricsWriter(path, keep_below_step=3)
    assert path.read_bytes() == text and [p.name for p in tmp_path.iterdir()] == [RF.METRICS]


# A child that appends a table as fast as it can, each flush one step of ROWS rows.
WRITER = """
import sys
from sdcstudy.core import tablelog as TL
from sdcstudy.report.writer import REPORT
log = TL.TableLog(sys.argv[1], ("step", "site", "value"), keep_below_step=1)
step = 0
while True:
    log.extend([{"step": step, "site": "fwd/attn", "value": i / 7} for i in range(ROWS)])
    log.flush()
    print(step, flush=True)
    step += 1
"""
ROWS = 50_000


def test_kill_during_flush_leaves_a_readable_table(tmp_path):
    """SIGKILL at random moments of a loop that mostly flushes: the table reads cleanly, whole
    steps only, at least up to the last flush the child reported."""
    rng = random.Random()
    for attempt in range(3):
        path = tmp_path / f"t{attempt}.parquet"
        child = subprocess.Popen([sys.executable, "-c", WRITER.replace("ROWS", str(ROWS)),
                                  str(path)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "0", "the child never flushed"
        time.sleep(rng.uniform(0.0, 1.5))
        os.kill(child.pid, signal.SIGKILL)
        reported = [int(line) for line in child.stdout.read().split()]
        child.wait(timeout=30)
        frame = TL.read_table(path)
        steps = frame["step"].value_counts().sort_index()
        assert steps.index.tolist() == list(range(len(steps))), "steps missing or out of order"
        assert (steps == ROWS).all(), "a flush written in part"
        assert len(steps) >= 1 + (reported[-1] if reported else 0)
        pd.testing.assert_frame_equal(pd.read_parquet(path), frame)
        TL.TableLog(path, COLUMNS, keep_below_step=0)  # resume: leftovers go, the table stays
        assert not list(path.glob(".*")) and len(TL.read_table(path)) == 0


def _sdcstudy(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "sdcstudy", *args], cwd=ROOT,
                          capture_output=True, text=True, **kwargs)


@pytest.mark.slow
def test_run_killed_with_sigkill_reports_and_resumes(tmp_path):
    """A lock-step run with faults, killed mid-run: `sdcstudy report` reads it, `--resume`
    finishes it, and every step's metrics line and table rows are there once."""
    steps, every, out = 60, 10, tmp_path / "run"
    # Faults at two compared sites, no weight-gradient faults (which only make the step slower
    # to compile here).
    profile = tmp_path / "two-sites.yaml"
    profile.write_text(yaml.safe_dump({"name": "two-sites", "specs": [
        {"site": site, "kind": "additive", "rate": 2e-4} for site in ("fwd/attn", "bwd/ffn")]}))
    cmd = [sys.executable, "-m", "sdcstudy", "run", "configs/demo.yaml", "--no-progress",
           "--set", f"suspect.profile={profile}", "--set", f"experiment.steps={steps}",
           "--set", f"experiment.checkpoint_every={every}", "--set", "experiment.batch_size=4",
           "--set", "model.n_layers=1", "--out", str(out)]
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    target = random.randint(2, 4)  # flushes to wait for, of steps / every
    deadline = time.monotonic() + 300
    while len(TL.table_parts(out / RF.MISMATCH)) < target and child.poll() is None:
        assert time.monotonic() < deadline, "the run made no progress in 300 s"
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 0.3))
    assert child.poll() is None, "the run ended before it could be killed"
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)

    # An unfinished run has no summary.json: the report says so (exit 2: input partly
    # unreadable, never 1, a FAIL) and shows the rest.
    report = _sdcstudy("report", str(out), "--out", str(tmp_path / "report"), timeout=300)
    problems = [line for line in report.stderr.splitlines() if line.startswith("sdcstudy:")]
    assert report.returncode in (0, 2) and (tmp_path / "report" / REPORT).is_file(), report.stderr
    assert all(RF.SUMMARY in line and "damaged" not in line for line in problems), problems
    resumed = subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout + resumed.stderr

    metrics = RF.read_jsonl(out / RF.METRICS)
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    mismatch = TL.read_table(out / RF.MISMATCH)
    keys = ["step", "microstep", "layer", "site", "tp_rank"]
    assert not mismatch.duplicated(keys).any()
    assert sorted(set(mismatch["step"])) == list(range(1, steps + 1))
    assert mismatch.groupby("step").size().nunique() == 1  # the same sites every step
    faults = TL.read_table(out / RF.FAULTS)
    logged = {r["step"]: r["faults/landed"] - r["faults/unlogged"] for r in metrics}
    assert sum(logged.values()) > 0
    assert faults.groupby("step").size().reindex(list(logged), fill_value=0).to_dict() == logged


def test_bench_logging_small(tmp_path, capsys):
    json_path = tmp_path / "logging.json"
    code = cli.main(["bench", "logging", "--steps", "12", "--rows-per-step", "64",
                     "--flush-every", "5", "--json", str(json_path),
                     "--out", str(tmp_path / "tables")])
    assert code == 0, capsys.readouterr().err
    report = json.loads(json_path.read_text())
    (result,) = report["results"]
    assert result["rows"] == 12 * 64 and len(result["flush_s"]) == 3  # steps 5, 10, 12
    assert result["peak_rss_mb"] > 0 and result["first_flush_s"] > 0 < result["last_flush_s"]
    assert result["pending_rows_after_flush"] == 0 and result["summary_s"] > 0
    assert {g["name"] for g in report["goals"]} == {"logging.peak_rss_mb",
                                                   "logging.last_over_first_flush"}
    frame = TL.read_table(tmp_path / "tables" / RF.MISMATCH)
    assert list(frame.columns) == list(TL.MISMATCH_COLUMNS) and len(frame) == 12 * 64
    assert len(RF.read_jsonl(tmp_path / "tables" / RF.METRICS)) == 12
    assert cli.main(["bench", "logging", "--steps", "0"]) == 2  # one sentence, exit 2
    assert "--steps must be at least 1" in capsys.readouterr().err
