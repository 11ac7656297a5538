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
