"""`sdcstudy.load_run`: run folders as DataFrames, without importing JAX."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy.core.config import UserError


def _fake_run(path):
    path.mkdir()
    (path / RF.CONFIG).write_text("experiment:\n  mode: free\n  steps: 2\n")
    RF.write_rows(path / RF.METRICS, [{"step": 1, "loss/healthy": 2.5, "loss/suspect": 2.5},
                                      {"step": 2, "loss/healthy": 2.4, "loss/suspect": "nan"}])
    RF.atomic_write_json(path / RF.SUMMARY, {"wcnts": 0.5})
    pd.DataFrame([{c: 0 for c in TL.MISMATCH_COLUMNS} | {"site": "fwd/attn", "severity": 1.5}]
                 ).to_parquet(path / RF.MISMATCH)
    return path


def test_load_run_reads_every_file_without_jax(tmp_path):
    run_dir = _fake_run(tmp_path / "run")
    code = (f"import sys, sdcstudy; r = sdcstudy.load_run({str(run_dir)!r}); "
            "import json; print(json.dumps({'jax': 'jax' in sys.modules, "
            "'mode': r.config['experiment']['mode'], 'wcnts': r.summary['wcnts'], "
            "'suspect': [str(x) for x in r.metrics['loss/suspect']], "
            "'severity': float(r.mismatch['severity'][0]), 'faults': list(r.faults.columns), "
            "'abft': len(r.abft)}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    assert out == {"jax": False, "mode": "free", "wcnts": 0.5, "suspect": ["2.5", "nan"],
                   "severity": 1.5, "faults": list(TL.FAULT_COLUMNS), "abft": 0}


def test_load_run_metrics_are_numbers(tmp_path):
    import sdcstudy

    run = sdcstudy.load_run(_fake_run(tmp_path / "run"))
    assert run.metrics["loss/suspect"].dtype == np.float64
    assert np.isnan(run.metrics["loss/suspect"][1]) and run.name == "run"


def test_load_run_refuses_a_folder_that_is_not_a_run(tmp_path):
    import sdcstudy

    with pytest.raises(UserError, match="is not a run folder"):
        sdcstudy.load_run(tmp_path)


def _parted_table(path, columns, rows, cuts):
    """A run table written by TableLog, flushed after each row index in `cuts` (a flush may
    cut a step in two, as a full buffer of waiting rows does)."""
    log = TL.TableLog(path, columns)
    for start, stop in zip((0, *cuts), (*cuts, len(rows))):
        log.extend(rows[start:stop])
        log.flush()
    return path


def test_rollups_equal_the_whole_tables_groupings(tmp_path):
    """What load_run gives the report, made one part file at a time, equals the groupings of
    the whole table (tp 2, a step cut across two parts, severities NaN without a mismatch),
    and the per-site statistics equal summary.json's (`metrics.site_aggregates`)."""
    import sdcstudy
    from sdcstudy.core import metrics as MX

    rng = np.random.default_rng(0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RF.CONFIG).write_text("experiment:\n  mode: lockstep\n")
    keys = [(s, m, layer, site, r) for s in range(1, 6) for m in range(2) for layer in range(3)
            for site in MX.SITES for r in range(2)]
    hits = rng.integers(0, 4, len(keys)) * (rng.random(len(keys)) < 0.4)
    mismatch = [{"step": s, "microstep": m, "layer": layer, "site": site, "tp_rank": r,
                 "mismatches": int(n), "elements": 100 + 10 * layer,
                 "severity": float(rng.lognormal()) if n else math.nan,
                 "max_rel_err": float(n), "nonfinite": 0}
                for (s, m, layer, site, r), n in zip(keys, hits)]
    _parted_table(run_dir / RF.MISMATCH, TL.MISMATCH_COLUMNS, mismatch, (77, 150, 151))
    abft = [{"step": s, "microstep": 0, "layer": layer, "matmul": mm, "direction": d,
             "tp_rank": r, "residual": 0.0, "threshold": 1.0, "flagged": bool(rng.random() < .3)}
            for s in range(1, 5) for layer in range(2) for mm in ("o", "up")
            for d in ("fwd", "bwd_input") for r in range(2)]
    _parted_table(run_dir / RF.ABFT, report.ABFT_COLUMNS, abft, (40,))
    faults = [{"step": int(s), "microstep": 0, "layer": 0, "site": site, "tp_rank": 0,
               "node": 1, "kind": kind, "bit": int(bit), "flat_index": 0, "original": 1.0,
               "corrupted": 2.0}
              for s, site, kind, bit in zip(rng.integers(1, 5, 60), rng.choice(MX.SITES, 60),
                                            rng.choice(["bitflip", "additive"], 60),
                                            rng.integers(-1, 3, 60))]
    _parted_table(run_dir / RF.FAULTS, TL.FAULT_COLUMNS, faults, (30,))
    assert len(TL.table_parts(run_dir / RF.MISMATCH)) == 4

    run = sdcstudy.load_run(run_dir)
    whole = pd.DataFrame(mismatch)
    per_layer = whole.groupby(["site", "step", "microstep", "layer"]).agg(
        m=("mismatches", "sum"), e=("elements", "sum"), severity=("severity", "max"))
    per_layer["freq"] = per_layer["m"] / per_layer["e"]
    micro = run.mismatch_rollup.by_microstep
    expected = per_layer.groupby(level=["site", "step", "microstep"])
    np.testing.assert_allclose(micro["freq"], expected["freq"].mean(), rtol=1e-15)
    np.testing.assert_array_equal(micro["severity"], expected["severity"].max())
    np.testing.assert_array_equal(micro["mismatches"], expected["m"].sum())
    by_layer = run.mismatch_rollup.by_layer
    expected = per_layer.groupby(level=["layer", "site"])
    np.testing.assert_allclose(by_layer["freq"], expected["freq"].mean(), rtol=1e-15)
    np.testing.assert_array_equal(by_layer["severity"], expected["severity"].max())
    np.testing.assert_array_equal(by_layer["units"],
                                  whole.groupby(["layer", "site"])["mismatches"].apply(
                                      lambda m: int((m > 0).sum())))
    aggregates = MX.site_aggregates(whole)
    statistics = T.site_statistics(run)
    assert statistics["freq"].to_dict() == pytest.approx(aggregates["freq"], rel=1e-15)
    assert statistics["max_severity"].to_dict() == aggregates["max_severity"]
    # abft: checks and flags per (step, matmul, direction); faults per (step, site, kind, bit 0).
    flagged = pd.DataFrame(abft).groupby(["step", "matmul", "direction"])["flagged"]
    np.testing.assert_array_equal(run.abft_by_step["checks"], flagged.size())
    np.testing.assert_array_equal(run.abft_by_step["flagged"], flagged.sum())
    counted = pd.DataFrame(faults).assign(last_bit=lambda f: f["bit"] == 0).groupby(
        ["step", "site", "kind", "last_bit"]).size()
    np.testing.assert_array_equal(run.fault_counts["faults"], counted)
    # The whole tables are still there for a notebook, read when first asked for.
    assert len(run.mismatch) == len(mismatch) and run.abft["flagged"].sum() == flagged.sum().sum()


# --- sdcstudy report: paper-style tables and figures --------------------------------------------

import math  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from report_runs import bit_histogram, grid_rows, paft_runs, random_node, write_run  # noqa: E402

from sdcstudy import cli  # noqa: E402
from sdcstudy.core import runlock  # noqa: E402
from sdcstudy.paft import report as paft_report  # noqa: E402
from sdcstudy.report import plots, runs as report, writer  # noqa: E402
from sdcstudy.faults import published  # noqa: E402
from sdcstudy.report import tables as T  # noqa: E402

# A lock-step run worked out by hand: 2 steps x 2 microsteps, 2 layers, tp=2, 100 elements per
# row; mismatches only in microstep 0. {(step, layer, site): ((rank 0, rank 1) counts,
# (rank 0, rank 1) severities)}.
HAND = {(1, 1, "fwd/attn"): ((1, 3), (0.5, 2.0)),
        (2, 2, "fwd/attn"): ((2, 0), (7.0, 0.0)),
        (1, 2, "bwd/ffn"): ((0, 5), (0.0, 0.25))}


def _hand_cell(step, micro, layer, site, rank):
    counts, severities = HAND.get((step, layer, site), ((0, 0), (0.0, 0.0)))
    return (counts[rank], severities[rank]) if micro == 0 else (0, 0.0)


def _metrics(steps, **columns):
    return [{"step": s, "loss/healthy": 3.0, **{k: v[s - 1] for k, v in columns.items()}}
            for s in range(1, steps + 1)]


@pytest.fixture
def hand_run(tmp_path):
    rows = grid_rows(steps=2, layers=2, tp=2, elements=100, cell=_hand_cell, microsteps=2)
    return write_run(tmp_path / "hand", mode="lockstep", profile="paper-node-1",
                     metrics=_metrics(2, **{"grad/nts": [0.0, 0.0]}), mismatch=rows)


def _runs(*dirs):
    return report.label_runs([report.load_run(d) for d in dirs])


def test_table1_and_table2_follow_equations_1_to_4(hand_run):
    # fwd/attn: microstep (1, 0): layer 1 (1+3)/200, layer 2 0 -> 0.01; (2, 0): layer 2 2/200
    # -> 0.005; microsteps (1, 1), (2, 1) are clean: mean over 4 microsteps 0.00375. A wrong
    # sum over ranks, mean over layers or over microsteps gives another number.
    runs = _runs(hand_run)
    freq, severity = T.frequency_table(runs), T.severity_table(runs)
    assert list(freq.index) == ["Node 1"]
    assert freq.loc["Node 1", "fwd/attn"] == pytest.approx(0.00375, rel=1e-12)
    assert freq.loc["Node 1", "bwd/ffn"] == pytest.approx(0.025 / 2 / 4, rel=1e-12)
    assert freq.loc["Node 1", "fwd/ffn"] == 0 and freq.loc["Node 1", "bwd/attn"] == 0
    assert severity.loc["Node 1", "fwd/attn"] == 7.0
    assert severity.loc["Node 1", "bwd/ffn"] == 0.25
    # The published columns are Ma et al.'s Tables 1-2 for node 1.
    assert freq.loc["Node 1", "bwd/attn" + T.PUBLISHED_SUFFIX] == 1.56e-4
    assert severity.loc["Node 1", "bwd/attn" + T.PUBLISHED_SUFFIX] == 7392


def test_layer_tables_6_to_9_order_and_values(hand_run):
    runs = _runs(hand_run)
    fwd_freq = T.layer_table(runs, "fwd", "freq")["Node 1"]
    bwd_freq = T.layer_table(runs, "bwd", "freq")["Node 1"]
    fwd_sev = T.layer_table(runs, "fwd", "severity")["Node 1"]
    # Forward layers ascending, backward descending with bwd/ffn first, as in the paper.
    assert list(fwd_freq.index) == [(1, "fwd/attn"), (1, "fwd/ffn"), (2, "fwd/attn"),
                                    (2, "fwd/ffn")]
    assert list(bwd_freq.index) == [(2, "bwd/ffn"), (2, "bwd/attn"), (1, "bwd/ffn"),
                                    (1, "bwd/attn")]
    # Layer 1 fwd/attn: 4/200 in one microstep of four; layer 2: 2/200 in one of four.
    assert fwd_freq[(1, "fwd/attn")] == pytest.approx(0.005, rel=1e-12)
    assert fwd_freq[(2, "fwd/attn")] == pytest.approx(0.0025, rel=1e-12)
    assert bwd_freq[(2, "bwd/ffn")] == pytest.approx(0.00625, rel=1e-12)
    assert fwd_sev[(1, "fwd/attn")] == 2.0 and fwd_sev[(2, "fwd/attn")] == 7.0
    # The per-step series behind Figures 3-4 averages microsteps within a step.
    by_step = T.frequency_by_step(runs["Node 1"], "fwd/attn")
    assert list(by_step.index) == [1, 2]
    assert list(by_step) == pytest.approx([0.005, 0.0025], rel=1e-12)


def test_wcnts_table_is_eq_5_over_synchronized_runs(tmp_path):
    sync = write_run(tmp_path / "sync", mode="paramsync", profile="paper-node-11",
                     metrics=_metrics(4, **{"grad/nts": [0.01, "nan", 0.03, 0.02]}))
    free = write_run(tmp_path / "free", mode="free", profile="paper-node-11",
                     metrics=_metrics(4, **{"grad/nts": [1.0, 2.0, 3.0, 4.0]}))
    clean = write_run(tmp_path / "clean", mode="lockstep", profile="healthy",
                      metrics=_metrics(2, **{"grad/nts": [0.0, 0.0]}))
    lock = write_run(tmp_path / "lock", mode="lockstep", profile="paper-node-11",
                     metrics=_metrics(2, **{"grad/nts": [0.0, 0.0]}))
    table = T.wcnts_table(_runs(sync, free, clean, lock))
    # Free-running pairs drift apart: their gradient ratio is not eq. (5), so no row.
    node = "Node 11 (paramsync)"
    assert list(table.index) == [node, "Node 11 (lockstep)", "healthy"]
    assert table.loc[node, "wcnts"] == 0.03 and table.loc[node, "step"] == 3
    assert table.loc[node, "wcnts" + T.PUBLISHED_SUFFIX] == 0.051
    # The NaN step is left out of the max, and said: a run gone NaN does not read as clean.
    assert table.loc[node, "non-finite steps"] == 1
    assert table.loc["healthy", "wcnts"] == 0 and math.isnan(table.loc["healthy", "step"])
    assert math.isnan(table.loc["healthy", "wcnts" + T.PUBLISHED_SUFFIX])
    # Figure 5 is of parameter synchronization: under lock-step the taps repair the sites
    # before any weight gradient reads them, so no published value beside a lock-step row.
    assert math.isnan(table.loc["Node 11 (lockstep)", "wcnts" + T.PUBLISHED_SUFFIX])


def test_a_value_gone_nan_is_told_from_one_never_measured(tmp_path):
    # runs_table showed a suspect loss that went NaN as "-", the same as a loss the run does not
    # measure; and Figure 6 drew the run's curves up to the NaN with nothing to say why they end.
    gone = write_run(tmp_path / "gone", mode="free", profile="paper-node-11",
                     metrics=_metrics(3, **{"loss/suspect": [3.0, "nan", "nan"],
                                            "param/diff_l2": [0.1, 0.2, "nan"]}))
    one = write_run(tmp_path / "one", mode="train", profile="healthy", metrics=_metrics(2))
    runs = _runs(gone, one)
    table = T.runs_table(runs)
    assert table.loc["Node 11", "loss/suspect"] == "nan"
    assert table.loc["Node 11", "param/diff_l2"] == "nan"
    assert table.loc["Node 11", "loss/healthy"] == 3.0
    assert T.fmt(table.loc["healthy", "loss/suspect"]) == "-"
    assert T.nonfinite_label(runs["Node 11"], "Node 11") == "Node 11 (not finite from step 2)"
    assert T.nonfinite_label(runs["healthy"], "healthy") == "healthy"


def test_figure_6_is_of_pre_training_pairs_only(tmp_path):
    # The paper's Figure 6 is pre-training; a fine-tuning pair (its own Figure 7) was drawn
    # beside the free runs.
    diff = {"param/diff_l2": [0.1, 0.2], "loss/suspect": [3.0, 3.1]}
    fine = write_run(tmp_path / "fine", mode="finetune", profile="paper-node-11",
                     metrics=_metrics(2, **diff))
    assert plots.training(_runs(fine), tmp_path / "fig6.png") is None
    free = write_run(tmp_path / "free", mode="free", profile="paper-node-11",
                     metrics=_metrics(2, **diff))
    assert plots.training(_runs(fine, free), tmp_path / "fig6.png").is_file()


def test_labels_name_paper_nodes_order_them_and_tell_clashes_apart(tmp_path):
    dirs = [write_run(tmp_path / name, mode=mode, profile=profile, metrics=_metrics(1))
            for name, mode, profile in [("a", "free", "paper-node-11"),
                                        ("b", "lockstep", "profiles/custom.yaml"),
                                        ("c", "paramsync", "paper-node-2"),
                                        ("d", "lockstep", "paper-node-2"),
                                        ("e", "free", "exponent-flip"),
                                        ("f", "free", "exponent-flip")]]
    runs = _runs(*dirs)
    assert list(runs) == ["Node 2 (paramsync)", "Node 2 (lockstep)", "Node 11", "custom",
                          "exponent-flip (e)", "exponent-flip (f)"]
    assert runs["Node 11"].path == dirs[0]


@pytest.fixture(scope="module")
def zoo_dirs(tmp_path_factory):
    """Lock-step, parameter-sync and free runs of all 15 paper nodes (random numbers)."""
    root = tmp_path_factory.mktemp("zoo")
    dirs = []
    for node in range(1, 16):
        dirs += list(random_node(root, node, steps=20, layers=2).values())
    return dirs


def test_report_of_three_nodes_writes_every_table_and_figure(zoo_dirs, tmp_path):
    three = [d for d in zoo_dirs if d.name.startswith(("node1-", "node7-", "node13-"))]
    result = writer.write_report(three, tmp_path / "report")
    assert set(result["files"]) == {writer.REPORT, *writer.CSV_FILES, *plots.FIGURES}
    for name in plots.FIGURES:
        assert (result["out"] / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{name}]({name})" in result["markdown"]


def test_report_of_15_nodes_tables(zoo_dirs, tmp_path, monkeypatch):
    # Figures of 15 panels take seconds each; three nodes above draw every figure.
    monkeypatch.setattr(plots, "FIGURES", {})
    result = writer.write_report(zoo_dirs, tmp_path / "report")
    out = result["out"]
    assert set(result["files"]) == {writer.REPORT, *writer.CSV_FILES}
    runs = report.label_runs([report.load_run(d) for d in zoo_dirs])
    # The CSV holds the table's numbers for all 15 lock-step runs, in node order.
    table1 = pd.read_csv(out / "table1_frequency.csv")
    assert list(table1["node"]) == [f"Node {n} (lockstep)" for n in range(1, 16)]
    expected = T.frequency_table(runs)
    assert np.allclose(table1["fwd/attn"], expected["fwd/attn"], rtol=1e-5)
    assert list(table1["fwd/attn (Ma et al.)"].fillna(-1)) == [
        published.TABLE1_FREQUENCY.get(n, (0.0,))[0] for n in range(1, 16)]
    table7 = pd.read_csv(out / "table7_layer_frequency_bwd.csv")
    assert list(table7[["layer", "site"]].itertuples(index=False, name=None)) == [
        (2, "bwd/ffn"), (2, "bwd/attn"), (1, "bwd/ffn"), (1, "bwd/attn")]
    assert len(pd.read_csv(out / "wcnts.csv")) == 30  # lock-step and parameter-sync runs
    bits = pd.read_csv(out / "bit_fields.csv").set_index("node")
    assert bits.loc["Node 7 (lockstep)", "bwd/ffn"] == "7 / 14 / 21"  # from summary.json
    markdown = (out / writer.REPORT).read_text()
    for heading in ("Table 1", "Table 2", "Table 6", "Table 7", "Table 8", "Table 9", "WCNTS"):
        assert f"## {heading}" in markdown
    assert "| Node 11 (lockstep) |" in markdown and "(0.0289)" in markdown  # Table 1, node 11


def test_report_without_lockstep_runs_says_what_is_missing(tmp_path):
    free = write_run(tmp_path / "free", mode="free", profile="paper-node-13",
                     metrics=_metrics(3, **{"param/diff_l2": [0.0, 0.1, 0.2],
                                            "loss/suspect": [3.0, 3.0, 3.1],
                                            "grad/norm": [1.0, 0.9, 0.8],
                                            "grad/norm_suspect": [1.0, 0.95, 0.8]}))
    result = writer.write_report([free], tmp_path / "out")
    assert set(result["files"]) == {writer.REPORT, "runs.csv", "fig6_training_dynamics.png"}
    assert "need lock-step runs" in result["markdown"]


def test_runs_stopped_before_their_last_step_are_named_under_the_runs_table(tmp_path):
    # A run stopped by --stop-after, an interrupt or a crash reports the steps it did; the
    # report must say so, or its numbers read as the whole run's.
    curves = {"param/diff_l2": [0.0, 0.1, 0.2], "loss/suspect": [3.0, 3.0, 3.1]}
    whole = write_run(tmp_path / "whole", mode="free", profile="paper-node-13",
                      metrics=_metrics(3, **curves))
    cut = write_run(tmp_path / "cut", mode="free", profile="paper-node-1",
                    metrics=_metrics(3, **curves),
                    config={"experiment": {"mode": "free", "steps": 8, "microsteps": 1}})
    markdown = writer.write_report([whole, cut], tmp_path / "out")["markdown"]
    runs_section = markdown[markdown.index("## Runs"):].split("\n## ")[0]
    assert "every figure here is of the steps done: Node 1 at step 3 of 8." in runs_section
    assert "Node 13 at step" not in markdown
    only_whole = writer.write_report([whole], tmp_path / "out2")["markdown"]
    assert "Stopped before their last step" not in only_whole


def _runs_section(markdown: str) -> str:
    return markdown[markdown.index("## Runs"):].split("\n## ")[0]


def test_a_run_still_being_written_is_not_called_stopped(tmp_path):
    # `sdcstudy report` of a sweep under way: the run a live process writes has not stopped.
    curves = {"param/diff_l2": [0.0, 0.1, 0.2], "loss/suspect": [3.0, 3.0, 3.1]}
    going = write_run(tmp_path / "going", mode="free", profile="paper-node-1",
                      metrics=_metrics(3, **curves),
                      config={"experiment": {"mode": "free", "steps": 8, "microsteps": 1}})
    (going / RF.SUMMARY).unlink()  # a run writes it at its end
    with runlock.hold(going, create=False):
        markdown = writer.write_report([going], tmp_path / "out")["markdown"]
    section = _runs_section(markdown)
    assert ("Still being written, so every figure here is of the steps written so far: Node 1 "
            f"at step 3 of 8 (process {os.getpid()}).") in section
    assert "Stopped" not in section
    # Once its writer is gone, the same folder is a run that stopped.
    after = _runs_section(writer.write_report([going], tmp_path / "out2")["markdown"])
    assert "Stopped before their last step" in after and "Still being written" not in after


def test_a_run_whose_metrics_cannot_be_read_keeps_its_step_count(tmp_path):
    # A finished run whose metrics.jsonl is damaged read as "0 steps, stopped at step 0 of 3".
    run = write_run(tmp_path / "run", mode="free", profile="paper-node-1",
                    metrics=_metrics(3, **{"param/diff_l2": [0.0, 0.1, 0.2]}))
    (run / RF.METRICS).write_text("{not json\n")
    result = writer.write_report([run], tmp_path / "out")
    assert pd.read_csv(result["out"] / "runs.csv")["steps"].tolist() == [3]  # summary.json's
    assert "Stopped" not in result["markdown"]


def test_runs_table_shows_the_digits_that_tell_two_losses_apart(tmp_path):
    # A free pair's losses 5.021186 and 5.021536 read "5.02 | 5.02", as if equal; equal
    # losses, and losses that three digits tell apart, keep three.
    runs = [write_run(tmp_path / name, mode="free", profile=profile,
                      metrics=[{"step": 1, "loss/healthy": healthy, "loss/suspect": suspect}])
            for name, profile, healthy, suspect in (
                ("close", "paper-node-1", 5.021186, 5.021536),
                ("same", "paper-node-2", 5.021186, 5.021186),
                ("apart", "paper-node-3", 5.021186, 5.9),
                ("nan", "paper-node-4", 5.021186, "nan"))]
    result = writer.write_report(runs, tmp_path / "out")
    section = _runs_section(result["markdown"])
    assert "| 5.021 | 5.022 |" in section.splitlines()[4]  # Node 1
    assert "| 5.02 | 5.02 |" in section.splitlines()[5]
    assert "| 5.02 | 5.9 |" in section.splitlines()[6]
    assert "| 5.02 | nan |" in section.splitlines()[7]
    # The CSV keeps the numbers, not the text shown.
    csv = pd.read_csv(result["out"] / "runs.csv")
    assert csv["loss/healthy"].tolist() == [5.02119] * 4


def test_bit_field_table_counts_bits_not_elements(tmp_path):
    # summary.json's fields sum the per-position counts: 2 elements that differ in 3 mantissa
    # bits each count 6, more than the 2 mismatches; the table must not call them elements.
    rows = grid_rows(steps=1, layers=1, tp=1, elements=100,
                     cell=lambda step, micro, layer, site, rank: (2 * (site == "fwd/attn"), 0.1))
    run = write_run(tmp_path / "run", mode="lockstep", profile="paper-node-1",
                    metrics=_metrics(1), mismatch=rows,
                    summary={"bit_histogram": {"fwd/attn": bit_histogram(0, 0, 6)}})
    markdown = writer.write_report([run], tmp_path / "out")["markdown"]
    [heading] = [line for line in markdown.splitlines() if "sign / exponent / mantissa" in line]
    assert heading.startswith("## Differing bits of the mismatching elements per field")
    assert "an element counts once per differing bit" in heading
    assert "| Node 1 | 0 / 0 / 6 |" in markdown


def test_paft_table_and_curves_follow_the_metrics(tmp_path):
    dirs = paft_runs(tmp_path / "runs", steps=40, workers=4)
    result = writer.write_report(dirs, tmp_path / "out")
    assert set(paft_report.FILES) <= set(result["files"])
    csv = pd.read_csv(result["out"] / "paft_final.csv").set_index("run")
    table = paft_report.final_table(report.label_runs([report.load_run(d) for d in dirs]))
    table = table.set_index("run")
    assert np.allclose(csv["final_loss"], table["final_loss"], rtol=1e-5)  # 6 digits in CSV
    assert dict(table["method"]) == {"noised": "Noised", "sync-8": "PAFT-Sync(H=8)",
                                     "dyn": "PAFT-Dyn"}
    tail = paft_report.TAIL
    for d in dirs:
        rows = RF.read_jsonl(d / RF.METRICS)
        row = table.loc[d.name]
        assert row["final_loss"] == pytest.approx(
            np.mean([r["loss/mean"] for r in rows[-tail:]]), rel=1e-12)
        assert row["syncs"] == sum(r["paft/sync"] for r in rows)
        assert row["max_div"] == max(r["div/mean_sq"] for r in rows)
    assert table.loc["noised", "syncs"] == 0 and table.loc["sync-8", "syncs"] == 5
    assert "## PAFT: final loss" in result["markdown"]
    for name in ("paft_loss.png", "paft_divergence.png"):
        assert f"![{name}]({name})" in result["markdown"]


def test_report_folder_is_new_or_an_earlier_report(hand_run, tmp_path, monkeypatch):
    # An earlier report into the same folder is replaced, and its files that the new report
    # does not make (here the lock-step tables and figures) are removed with it.
    out = tmp_path / "out"
    first = writer.write_report([hand_run], out)
    assert (out / "fig3_mismatch_frequency.png").exists()
    free = write_run(tmp_path / "free", mode="free", profile="healthy",
                     metrics=_metrics(2, **{"param/diff_l2": [0.0, 0.0]}))
    second = writer.write_report([free], out)
    assert not (out / "fig3_mismatch_frequency.png").exists()
    assert not (out / "table1_frequency.csv").exists()
    assert first["markdown"] != second["markdown"] == (out / writer.REPORT).read_text()
    # A folder with other content is never written into.
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="holds no report.md"):
        writer.write_report([hand_run], other)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    with pytest.raises(UserError, match="given twice"):
        writer.write_report([hand_run, hand_run], tmp_path / "twice")
    # Without --out: a new timestamped folder under runs/.
    monkeypatch.chdir(tmp_path)
    default = writer.write_report([hand_run])["out"]
    assert default.parent == RF.default_run_dir("x").parent and default.name.startswith(
        "report-")


def test_cli_report_imports_no_jax_and_prints_the_tables(hand_run, tmp_path):
    code = (f"import sys; from sdcstudy import cli; "
            f"rc = cli.main(['report', {str(hand_run)!r}, '--out', {str(tmp_path / 'r')!r}]); "
            f"print('jax imported:', 'jax' in sys.modules); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # The figures' forked workers, stopped once they are drawn, end quietly (they had the
    # CLI's SIGTERM handler, which raised in each of them and printed a traceback).
    assert "Traceback" not in done.stderr, done.stderr
    assert "jax imported: False" in done.stdout
    assert "## Table 1" in done.stdout and "| Node 1 | 0.00375 (1.55e-05) |" in done.stdout
    assert (tmp_path / "r" / writer.REPORT).is_file()


def _second_lockstep_run(tmp_path):
    rows = grid_rows(steps=2, layers=2, tp=2, elements=100,
                     cell=lambda step, micro, layer, site, rank: (1, 0.5))
    return write_run(tmp_path / "other", mode="lockstep", profile="paper-node-7",
                     metrics=_metrics(2, **{"grad/nts": [0.0, 0.1]}), mismatch=rows,
                     summary={"bit_histogram": {"fwd/attn": bit_histogram(1, 2, 3)}})


@pytest.mark.parametrize("damage", ["mismatch", "metrics", "summary"])
def test_cli_report_leaves_out_only_what_needs_an_unreadable_file(hand_run, tmp_path, capsys,
                                                                  damage):
    # Node 1's file is damaged or missing; node 7 is whole. The report names the file in one
    # sentence on stderr and in report.md, writes everything else, and exits 2 (input partly
    # unreadable; 1 is a FAIL verdict, which drains a node, core/errors.py).
    other = _second_lockstep_run(tmp_path)
    RF.atomic_write_json(hand_run / RF.SUMMARY, {"bit_histogram": {
        "bwd/ffn": bit_histogram(4, 5, 6)}})
    if damage == "mismatch":
        (hand_run / RF.MISMATCH).write_bytes(b"PAR1 this is not parquet")
    elif damage == "metrics":
        (hand_run / RF.METRICS).unlink()
    else:
        (hand_run / RF.SUMMARY).write_text('{"bit_histogram": {')
    out = tmp_path / "out"
    assert cli.main(["report", str(hand_run), str(other), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    file = {"mismatch": RF.MISMATCH, "metrics": RF.METRICS, "summary": RF.SUMMARY}[damage]
    state = "is missing" if damage == "metrics" else "is damaged and can not be read"
    [line] = captured.err.strip().splitlines()
    assert line.startswith(f"sdcstudy: {str(hand_run / file)!r} {state}")
    assert line.endswith(f"the report leaves Node 1 out of {writer.NEEDED_BY[file]}.")
    assert line.count(str(hand_run)) == 1  # pyarrow's repetition of the path is cut
    markdown = (out / writer.REPORT).read_text()
    assert "## Files that could not be read" in markdown and line[len("sdcstudy: "):] in markdown
    # Left out exactly where the file is needed; the whole node 7 and everything else stay.
    assert list(pd.read_csv(out / "runs.csv")["node"]) == ["Node 1", "Node 7"]
    table1 = pd.read_csv(out / "table1_frequency.csv")["node"]
    bits = pd.read_csv(out / "bit_positions.csv")["node"].unique()
    wcnts = pd.read_csv(out / "wcnts.csv")["node"]
    assert list(table1) == (["Node 7"] if damage == "mismatch" else ["Node 1", "Node 7"])
    assert list(bits) == (["Node 7"] if damage == "summary" else ["Node 1", "Node 7"])
    assert list(wcnts) == (["Node 7"] if damage == "metrics" else ["Node 1", "Node 7"])
    assert (out / "fig3_mismatch_frequency.png").is_file()
    # The same damage is an error to the strict loader a notebook uses.
    if damage != "metrics":
        with pytest.raises(UserError, match=f"{file}' is damaged"):
            report.load_run(hand_run)


def test_cli_report_names_the_line_of_metrics_jsonl_that_is_not_json(tmp_path, capsys):
    # JSON's own position ("line 2 column 1") counts within the one line it was given; the
    # user needs the line in the file to find the damage (here line 3 of 4, after a blank one).
    run = write_run(tmp_path / "run", mode="free", profile="paper-node-1", metrics=_metrics(3))
    lines = (run / RF.METRICS).read_text().splitlines(keepends=True)
    (run / RF.METRICS).write_text("".join([lines[0], "\n", lines[1][:10] + "\n", lines[2]]))
    assert cli.main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"sdcstudy: {str(run / RF.METRICS)!r} is damaged and can not be read "
                           f"(line 3 is not JSON: Expecting ',' delimiter); the report leaves "
                           f"Node 1 out of")
    with pytest.raises(UserError, match=r"metrics\.jsonl' is damaged and can not be read \(line 3 "):
        report.load_run(run)


@pytest.mark.parametrize("damage", ["not a run", "config only", "config"])
def test_cli_report_with_nothing_to_report_is_one_sentence_and_exit_2(hand_run, tmp_path, capsys,
                                                                      damage):
    target = hand_run
    if damage == "not a run":
        target = tmp_path / "empty"
        target.mkdir()
    elif damage == "config only":
        for name in (RF.MISMATCH, RF.METRICS, RF.SUMMARY):
            (hand_run / name).unlink()
    else:
        (hand_run / RF.CONFIG).write_text("experiment: [mode: lockstep\n")
    assert cli.main(["report", str(target), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sdcstudy: error: ") and len(err.splitlines()) == 1
    assert {"not a run": "is not a run folder",
            "config only": f"nothing to report: no run folder has a readable metrics.jsonl, "
                           f"summary.json or table ({str(hand_run / RF.METRICS)!r} is missing)",
            "config": "config.yaml' is damaged and can not be read"}[damage] in err
    assert not (tmp_path / "out").exists()


def test_a_folder_of_run_folders_stands_for_its_runs(tmp_path):
    # `sdcstudy report runs/zoo` after a sweep: the run folders inside, not the report folder.
    sweep = tmp_path / "zoo"
    for name in ("b", "a"):
        write_run(sweep / name, mode="free", profile=f"exponent-flip-{name}",
                  metrics=_metrics(1))
    (sweep / "report").mkdir()
    (sweep / "report" / "report.md").write_text("# an earlier report\n")
    assert report.expand_run_dirs(sweep) == [sweep / "a", sweep / "b"]
    assert report.expand_run_dirs(sweep / "a") == [sweep / "a"]
    result = writer.write_report([sweep], tmp_path / "out")
    assert list(pd.read_csv(result["out"] / "runs.csv")["run"]) == ["a", "b"]
    with pytest.raises(UserError, match="is not a run folder"):
        writer.write_report([sweep / "report"], tmp_path / "out2")


@pytest.mark.parametrize("how", ["folder is a file", "a table is a folder", "disk full"])
def test_cli_report_that_cannot_be_written_is_one_sentence_and_exit_3(hand_run, tmp_path,
                                                                     capsys, monkeypatch, how):
    # The report's output is its files: one that cannot be written ends it with one sentence
    # naming the file, exit 3 (could not report), never a traceback or 1 (a FAIL).
    import errno
    import os

    out = tmp_path / "out"
    if how == "folder is a file":
        (tmp_path / "file").write_text("")
        out = unwritten = tmp_path / "file" / "report"
    elif how == "a table is a folder":  # an earlier report's folder, one of its CSVs a folder
        (out / "runs.csv").mkdir(parents=True)
        (out / writer.REPORT).write_text("# an earlier report\n")
        unwritten = out / "runs.csv"
    else:
        unwritten, fsync = out / writer.REPORT, os.fsync

        def no_room(fd):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(out / f".{writer.REPORT}.")):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            fsync(fd)

        monkeypatch.setattr(os, "fsync", no_room)
    capsys.readouterr()
    assert cli.main(["report", str(hand_run), "--out", str(out)]) == 3
    [line] = capsys.readouterr().err.strip().splitlines()
    what = "report folder" if how == "folder is a file" else "report file"
    assert line.startswith(f"sdcstudy: error: could not write the {what} {str(unwritten)!r} ("), \
        line


def test_report_and_run_files_honour_the_umask(hand_run, tmp_path):
    # Results are for others to read where the umask lets them: report.md, the CSVs and the
    # atomically written run files (config.yaml, summary.json, --json reports) get 0666 less the
    # umask, as `open`, the PNGs and metrics.jsonl give (atomic writes once made them all 0600,
    # which umask 022 tells apart; 077 checks that no file is more open than the umask says).
    import os

    modes = {}
    for umask in (0o022, 0o077):
        folder = tmp_path / f"umask-{umask:03o}"
        old = os.umask(umask)
        try:
            if umask == 0o022:  # one report: its files are written as the run files below
                out = writer.write_report([hand_run], folder / "report")["out"]
                files = [out / writer.REPORT, out / "runs.csv", out / "fig3_mismatch_frequency.png"]
            else:
                folder.mkdir()
                files = []
            RF.atomic_write_json(folder / RF.SUMMARY, {"steps": 1})
            RF.atomic_write_text(folder / RF.CONFIG, "experiment: {}\n")
            RF.write_rows(folder / RF.METRICS, [{"step": 1}])
            with open(folder / "opened.txt", "w") as f:  # what `open` gives, to compare with
                f.write("x")
        finally:
            os.umask(old)
        files += [folder / name for name in (RF.SUMMARY, RF.CONFIG, RF.METRICS, "opened.txt")]
        modes[umask] = {f.name: oct(f.stat().st_mode & 0o777) for f in files}
        assert modes[umask] == {f.name: oct(0o666 & ~umask) for f in files}


def _notebook_script(name: str) -> str:
    """The code cells of notebooks/`name` as one script (what a kernel would run, in order)."""
    book = json.loads((Path(__file__).resolve().parent.parent / "notebooks" / name).read_text())
    return "\n".join("".join(cell["source"]) for cell in book["cells"]
                     if cell["cell_type"] == "code")


def test_notebooks_take_a_sweep_folder_and_say_when_they_have_nothing_to_show(tmp_path):
    # SDCSTUDY_RUNS=runs/zoo (a sweep folder, which `sdcstudy report` takes) stopped the
    # notebooks at load_run ("is not a run folder"); paft.ipynb without PAFT runs raised an
    # IndexError two cells later instead of saying so; the divergence table named step 1 as
    # the step of the largest loss gap of a pair whose losses never differed.
    zoo = tmp_path / "zoo"
    curves = {"param/diff_l2": [0.0, 0.1, 0.2], "grad/diff_l2": [0.0, 0.1, 0.1],
              "grad/norm": [1.0, 1.0, 1.0], "grad/norm_suspect": [1.0, 1.1, 1.0]}
    write_run(zoo / "apart", mode="free", profile="paper-node-1",
              metrics=_metrics(3, **curves, **{"loss/suspect": [3.0, 3.2, 3.1]}))
    write_run(zoo / "same", mode="free", profile="paper-node-7",
              metrics=_metrics(3, **curves, **{"loss/suspect": [3.0, 3.0, 3.0]}))
    env = {**os.environ, "SDCSTUDY_RUNS": str(zoo), "SDCSTUDY_FIGURES": str(tmp_path / "f"),
           "MPLBACKEND": "Agg"}

    def run(name):
        return subprocess.run([sys.executable, "-c", _notebook_script(name)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)

    done = run("training_dynamics.ipynb")
    assert done.returncode == 0, done.stderr
    assert "2 runs:\n  Node 1\n  Node 7" in done.stdout
    divergence = subprocess.run(
        [sys.executable, "-c", _notebook_script("training_dynamics.ipynb").split(
            "for name in (")[0] + "\nprint(divergence.to_json())"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    table = json.loads(divergence.stdout.splitlines()[-1])
    assert table["step of max gap"] == {"Node 1": 2, "Node 7": None}
    assert table["first step apart"] == {"Node 1": 2, "Node 7": 2}
    paft = run("paft.ipynb")
    assert paft.returncode == 1 and "Traceback" not in paft.stderr, paft.stderr
    assert paft.stderr.strip().splitlines()[-1] == (
        "no PAFT run folder given: set SDCSTUDY_RUNS or make runs under ../runs")
