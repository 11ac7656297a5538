"""`sdcstudy report`'s bit-position and ABFT tables and figures, on hand-made run folders."""

import math

import pandas as pd
import pytest
import yaml
from report_runs import abft_rows, grid_rows, write_run

from sdcstudy.report import runs as report
from sdcstudy.report import writer
from sdcstudy.core import runfolder as RF
from sdcstudy.report import tables as T


def _metrics(steps):
    return [{"step": s, "loss/healthy": 3.0} for s in range(1, steps + 1)]


def _lockstep_run(path, profile):
    rows = grid_rows(steps=2, layers=2, tp=2, elements=100,
                     cell=lambda step, micro, layer, site, rank: (1, 0.5))
    return write_run(path, mode="lockstep", profile=profile, metrics=_metrics(2), mismatch=rows)


def _runs(*dirs):
    return report.label_runs([report.load_run(d) for d in dirs])


def test_bit_position_table_and_figure(tmp_path):
    # float32: index 0 of summary.json's "bits" is the lowest mantissa bit, 31 the sign; a
    # bfloat16 run shares the sign and exponent columns and has no mantissa bits above 6.
    bits32 = [0] * 32
    bits32[31], bits32[30], bits32[23], bits32[22], bits32[0] = 5, 4, 3, 2, 1
    bits16 = [0] * 16
    bits16[15], bits16[7], bits16[6] = 9, 8, 7
    hand_run = _lockstep_run(tmp_path / "hand", "paper-node-1")
    half = _lockstep_run(tmp_path / "half", "paper-node-7")
    RF.atomic_write_json(hand_run / RF.SUMMARY, {"bit_histogram": {"fwd/attn": {"bits": bits32}}})
    RF.atomic_write_json(half / RF.SUMMARY, {"bit_histogram": {"bwd/ffn": {"bits": bits16}}})
    runs = _runs(hand_run, half)
    table = T.bit_position_table(runs)
    assert list(table.index) == [("Node 1", "fwd/attn"), ("Node 7", "bwd/ffn")]
    assert list(table.columns) == T.bit_labels(32)
    assert T.bit_labels(32)[:3] == ["sign", "exp 7", "exp 6"] and T.bit_labels(32)[-1] == "man 0"
    row = table.loc[("Node 1", "fwd/attn")]
    assert (row["sign"], row["exp 7"], row["exp 0"], row["man 22"], row["man 0"]) == (5, 4, 3, 2, 1)
    assert row.sum() == 15
    half_row = table.loc[("Node 7", "bwd/ffn")]
    assert (half_row["sign"], half_row["exp 0"], half_row["man 6"]) == (9, 8, 7)
    assert math.isnan(half_row["man 7"]) and half_row.sum() == 24
    result = writer.write_report([hand_run, half], tmp_path / "out")
    assert "bit_positions.png" in result["files"]
    # Markdown shows the bit positions that differ anywhere; the CSV all 32.
    section = result["markdown"].split("## Differing bits per bit position")[1].split("##")[0]
    assert "| node | site | sign | exp 7 | exp 0 | man 22 | man 6 | man 0 |" in section
    assert len(pd.read_csv(result["out"] / "bit_positions.csv").columns) == 2 + 32


def _abft_run(tmp_path, name, flagged):
    return write_run(tmp_path / name, mode="abft", profile="paper-node-14",
                     metrics=_metrics(3), abft=abft_rows(3, 2, 2, flagged))


def test_abft_flag_rate_table_and_figure_10(tmp_path):
    # Node 14 flags o/fwd at every check of step 2 and on tp rank 1 of layer 2 at step 3:
    # 4 + 1 of the 12 o/fwd checks (3 steps x 2 layers x 2 ranks), and nothing else.
    def flagged(step, micro, layer, matmul, direction, rank):
        return (matmul, direction) == ("o", "fwd") and (step == 2 or (step, layer, rank) ==
                                                        (3, 2, 1))

    noisy = _abft_run(tmp_path, "noisy", flagged)
    quiet = _abft_run(tmp_path, "quiet", lambda *_: False)
    (quiet / RF.CONFIG).write_text(yaml.safe_dump({"experiment": {"mode": "abft"},
                                                   "suspect": {"profile": "healthy"}}))
    runs = _runs(noisy, quiet)
    table = T.abft_rate_table(runs)
    assert list(table.columns) == ["Node 14", "healthy"]
    assert table.index[0] == ("q", "fwd") and table.index[-1] == ("down", "bwd_weight")
    assert len(table) == 7 * 3
    assert table.loc[("o", "fwd"), "Node 14"] == pytest.approx(5 / 12, rel=1e-12)
    assert table["Node 14"].drop(("o", "fwd")).eq(0).all() and table["healthy"].eq(0).all()
    per_step = T.abft_frequency_by_step(runs["Node 14"], "o", "fwd")
    assert list(per_step.index) == [1, 2, 3]
    assert list(per_step) == pytest.approx([0, 1, 0.25], rel=1e-12)
    everything = T.abft_frequency_by_step(runs["Node 14"])
    assert list(everything) == pytest.approx([0, 4 / 84, 1 / 84], rel=1e-12)
    result = writer.write_report([noisy, quiet], tmp_path / "out")
    assert {"abft_flag_rate.csv", "fig10_abft_flag_frequency.png"} <= set(result["files"])
    csv = pd.read_csv(result["out"] / "abft_flag_rate.csv").set_index(["matmul", "direction"])
    assert csv.loc[("o", "fwd"), "Node 14"] == pytest.approx(5 / 12, rel=1e-5)
    assert "| o | fwd | 0.417 | 0 |" in result["markdown"]


def _drawn_figure(monkeypatch, draw, runs, path):
    """The matplotlib figure `draw(runs, path)` saves, kept open for inspection."""
    from sdcstudy.report import plots

    kept = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, p: kept.append(fig) or p)
    assert draw(runs, path) == path
    return kept[0]


def test_figure_10_shows_a_single_flagged_step_and_says_what_never_flagged(tmp_path,
                                                                          monkeypatch):
    # A short run with one flag (down/fwd at step 2) beside one that never flagged: on a log
    # axis a step between two zeros is a lone point, invisible without a marker; a panel (the
    # o/fwd one) where nothing flagged must say so rather than be blank; a run without flags
    # is named as such; steps are whole numbers; and no legend label runs off the figure.
    from sdcstudy.report import plots

    def once(step, micro, layer, matmul, direction, rank):
        return (step, layer, matmul, direction, rank) == (2, 1, "down", "fwd", 0)

    flagged = write_run(tmp_path / "a-rather-long-run-folder-name", mode="abft",
                        profile="exponent-flip", metrics=_metrics(3),
                        abft=abft_rows(3, 2, 1, once))
    quiet = write_run(tmp_path / "quiet-run-with-another-long-name", mode="abft",
                      profile="exponent-flip", metrics=_metrics(3),
                      abft=abft_rows(3, 2, 1, lambda *_: False))
    runs = _runs(flagged, quiet)
    fig = _drawn_figure(monkeypatch, plots.abft_flags, runs, tmp_path / "fig10.png")
    left, right = fig.axes[:2]
    lines = {line.get_label(): line for line in right.get_lines()}
    loud, silent = list(runs)
    assert set(lines) == {loud, f"{silent} (no flags)"}
    line = lines[loud]
    assert line.get_marker() not in (None, "", "None") and line.get_markersize() > 0
    assert list(line.get_xdata()) == [1, 2, 3]
    assert [v == v for v in line.get_ydata()] == [False, True, False]  # one point, NaN gaps
    assert [t.get_text() for t in left.texts] == ["no o (fwd) check flagged in any run"]
    assert len(right.texts) == 0
    low, high = left.get_xlim()
    assert low < 1 and high > 3 and right.get_xlim() == (low, high)
    assert all(float(tick).is_integer() for tick in left.get_xticks())
    fig.canvas.draw()
    legend = right.get_legend().get_window_extent()
    assert legend.x1 <= fig.bbox.x1, "a legend label runs off the figure"


def test_abft_runs_table_names_each_runs_threshold_and_its_recall(tmp_path):
    # 3 steps x 2 layers x 7 matmuls x 3 directions x 2 tp ranks = 252 checks each. A flag
    # rate means nothing without the rule that raised it (the paper's eq. (6) flags
    # nearly every healthy bfloat16 check; the rounding bound none), and abft mode's recall and
    # precision live in summary.json: the report shows both per run, on the terminal too, and
    # "-" where a run has no detection score (abft.enabled in another mode).
    def two(step, micro, layer, matmul, direction, rank):
        return (matmul, direction, step, layer, rank) in {("o", "fwd", 2, 1, 0),
                                                          ("q", "bwd_input", 3, 2, 1)}

    scored = write_run(tmp_path / "scored", mode="abft", profile="paper-node-14",
                       metrics=_metrics(3), abft=abft_rows(3, 2, 2, two),
                       config={"abft": {"threshold": "rounding", "recompute": False},
                               "model": {"dtype": "bfloat16"}},
                       summary={"abft/detection": {"corrupted_products": 4,
                                                   "detected_products": 1, "recall": 0.25,
                                                   "flags": 2, "precision": 0.5}})
    plain = write_run(tmp_path / "plain", mode="lockstep", profile="healthy",
                      metrics=_metrics(3), abft=abft_rows(3, 2, 2, lambda *_: False),
                      config={"abft": {"enabled": True, "recompute": True}},
                      summary={"abft/detection": {"recall": None, "precision": None}})
    table = T.abft_runs_table(_runs(scored, plain))
    assert list(table.index) == ["Node 14", "healthy"]
    assert table.loc["Node 14"].tolist() == ["rounding", "bfloat16", "no", 252, 2, 4, 1,
                                             0.25, 0.5]
    row = table.loc["healthy"]
    assert row[:5].tolist() == ["paper", "float32", "yes", 252, 0]
    assert row[5:].isna().all()
    result = writer.write_report([scored, plain], tmp_path / "out")
    line = "| Node 14 | rounding | bfloat16 | no | 252 | 2 | 4 | 1 | 0.25 | 0.5 |"
    assert line in result["markdown"] and line in result["summary"]
    assert "| healthy | paper | float32 | yes | 252 | 0 | - | - | - | - |" in result["markdown"]
    assert pd.read_csv(result["out"] / "abft_runs.csv")["threshold"].tolist() == [
        "rounding", "paper"]
    assert "eq. (6), that flagged" not in result["markdown"]  # not every rule is eq. (6)


def test_a_run_without_differing_bits_gets_a_sentence_not_an_empty_table(tmp_path):
    # A lock-step run without mismatches has bit histograms of zeros: the bit-position table
    # would have no column and the figure an empty panel.
    run = _lockstep_run(tmp_path / "clean", "exponent-flip")
    RF.atomic_write_json(run / RF.SUMMARY, {"bit_histogram": {
        site: {"bits": [0] * 32, "sign": 0, "exponent": 0, "mantissa": 0}
        for site in ("fwd/attn", "bwd/ffn")}})
    result = writer.write_report([run], tmp_path / "out")
    section = result["markdown"].split("## Differing bits per bit position")[1].split("##")[0]
    assert "No mismatching element differs in any bit position." in section
    assert "left out here" not in section and "| node | site |" not in section
    assert "bit_positions.png" not in result["files"]
    assert not (result["out"] / "bit_positions.png").exists()


def test_published_values_are_announced_only_where_there_are_some(tmp_path):
    # Tables 1, 2 and WCNTS fold Ma et al.'s values in for paper nodes; a report of other
    # profiles has none and must not say they are in parentheses.
    other = _lockstep_run(tmp_path / "other", "exponent-flip")
    result = writer.write_report([other], tmp_path / "out")
    assert "## Table 1" in result["markdown"]
    assert "published value in parentheses" not in result["markdown"]
    node = _lockstep_run(tmp_path / "node", "paper-node-1")
    result = writer.write_report([other, node], tmp_path / "both")
    table1 = result["markdown"].split("## Table 1")[1].split("##")[0]
    # ... and says they are of the paper's whole run, not of this run's few steps
    assert "Ma et al.'s published value in parentheses, of their whole run (Figure 3 spans " \
        "4,000 optimizer steps)" in table1


def test_a_missing_run_folder_is_named_as_missing(tmp_path):
    # load_run takes one run folder; the report also takes a folder of them, and says so.
    with pytest.raises(report.UserError, match=r"'.*nowhere' does not exist; give a run "
                                               r"folder \(one with config.yaml\)\.$"):
        report.load_run(tmp_path / "nowhere")
    with pytest.raises(report.UserError, match=r"'.*nowhere' does not exist; give a run "
                                               r"folder \(one with config.yaml\) or a folder "
                                               r"of them\.$"):
        writer.write_report([tmp_path / "nowhere"], tmp_path / "report")
