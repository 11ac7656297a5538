"""Promises of docs/guide.md's sections on ABFT, detectors, benchmarks and configs that no other
test held: each test names the sentence it holds. None compiles a JAX program.

If a test here fails, the guide says something the tool no longer does (or never did): mend the
code, or the guide's sentence with it.
"""

import re
from pathlib import Path

import numpy as np
import pytest

from sdcstudy import cli, modes, runner
from sdcstudy.abft import checker as A
from sdcstudy.abft import checksum as CS
from sdcstudy.abft import tables as AT
from sdcstudy.core import config as C
from sdcstudy.core import errors
from sdcstudy.detect import plan as DP
from sdcstudy.detect.rollback import DetectionError

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"


def _section(title: str) -> str:
    """The text of the guide's section `title` (up to the next heading)."""
    text = GUIDE.read_text()
    start = text.index(f"### {title}")
    return text[start:text.index("\n#", start + 1)]


# --- "ABFT ... in every mode but paft ... never ignored" ---------------------------------------

def _paft(*overrides):
    return C.from_dict({"experiment": {"mode": "paft"}, "mesh": {"dp": 2}}, list(overrides))


def _detect(detectors: str, *overrides):
    return C.from_dict({"experiment": {"mode": "detect"}, "mesh": {"dp": 2},
                        "detect": {"detectors": detectors}}, list(overrides))


def test_abft_enabled_is_refused_where_the_step_would_ignore_it():
    # PAFT's workers' step has no checksummed matmuls, and a detect step checks its matmuls
    # only as the abft detector: both ran without ABFT while config.yaml said it was on.
    with pytest.raises(errors.UserError, match="experiment.mode paft does not run ABFT"):
        modes.check(_paft("abft.enabled=true"))
    with pytest.raises(errors.UserError, match="add abft to detect.detectors"):
        modes.check(_detect("monitor,lockstep", "abft.enabled=true"))
    # Where ABFT does run, or is not asked for, nothing is refused.
    modes.check(_paft())
    modes.check(_detect("all", "abft.enabled=true"))
    modes.check(_detect("abft,lockstep", "abft.enabled=true"))
    modes.check(_detect("monitor,lockstep"))


def test_abft_in_paft_is_one_sentence_exit_2_and_leaves_no_folder(tmp_path, capsys):
    config = tmp_path / "paft.yaml"
    config.write_text("experiment: {mode: paft, steps: 2}\nmesh: {dp: 2}\n"
                      "abft: {enabled: true}\n")
    assert cli.main(["run", str(config), "--out", str(tmp_path / "run"),
                     "--no-progress"]) == errors.EXIT_BAD_INPUT
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("sdcstudy:")]
    assert "experiment.mode paft does not run ABFT" in line and "abft.enabled false" in line
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


# --- "Results: abft.parquet, one row per check, its columns ..." ------------------------------

def test_abft_parquet_columns_are_the_guides_in_its_order():
    text = _section("ABFT: checksummed matmuls")
    listed = text[text.index("Results: `abft.parquet`"):text.index("`abft/checks`")]
    names = [n.strip() for part in re.findall(r"`([^`]*)`", listed) for n in part.split(",")]
    names = [n for n in names if n and n != "abft.parquet"]
    assert tuple(names) == AT.COLUMNS


def _record(flagged: bool, row: int = 0, col: int = 0) -> np.ndarray:
    r = np.zeros(CS.RECORD_LEN, np.float32)
    r[CS.FLAGGED], r[CS.ROW], r[CS.COL] = float(flagged), row, col
    r[CS.K], r[CS.M_ROWS], r[CS.N_COLS], r[CS.OUT_BITS], r[CS.IN_BITS] = 8, 4, 6, 32, 32
    r[CS.ACC_BITS], r[CS.OUTPUT_PARTIALS] = 24, 1
    return r


def test_abft_rows_locate_a_flag_and_give_minus_one_otherwise_and_count_per_step():
    # "the located `row, col` (-1 when not flagged)"; "abft/checks, abft/flags,
    # abft/flags/<matmul> and abft/flags/<direction> per step".
    fwd = {"abft|q|1": _record(False, row=3, col=2), "abft|down|1": _record(True, 3, 5)}
    bwd = {"abft|q|1": np.stack([_record(True, 1, 4), _record(False, 2, 2)]),
           "abft|down|1": np.stack([_record(False), _record(False)])}
    rows = A.Checker.rows(fwd, bwd, step=7, microstep=1, tp_rank=1, node=1, dp_rank=0)
    assert all(tuple(r) == AT.COLUMNS for r in rows) and len(rows) == 6
    where = {(r["matmul"], r["direction"]): (r["flagged"], r["row"], r["col"]) for r in rows}
    assert where == {("q", "fwd"): (False, -1, -1), ("q", "bwd_input"): (True, 1, 4),
                     ("q", "bwd_weight"): (False, -1, -1), ("down", "fwd"): (True, 3, 5),
                     ("down", "bwd_input"): (False, -1, -1),
                     ("down", "bwd_weight"): (False, -1, -1)}
    counters = AT.counters(rows)
    assert (counters["abft/checks"], counters["abft/flags"]) == (6, 2)
    assert (counters["abft/flags/q"], counters["abft/flags/down"], counters["abft/flags/k"]) \
        == (1, 1, 0)
    assert (counters["abft/flags/fwd"], counters["abft/flags/bwd_input"],
            counters["abft/flags/bwd_weight"]) == (1, 1, 0)


# --- detectors ---------------------------------------------------------------------------------

def test_a_step_still_flagged_after_its_retries_exits_1_with_its_sentence(tmp_path, monkeypatch,
                                                                          capsys):
    # "A step still flagged after detect.max_retries re-runs stops the run (exit 1; the error
    # names the detectors ...)": a finding, never a crash (3) nor bad input (2).
    said = ("step 4 was still flagged after 2 rollbacks (by monitor), every attempt giving the "
            "same loss and gradient norm: a repeatable fault")

    def stopped(*args, **kwargs):
        raise DetectionError(said)

    monkeypatch.setattr(runner, "run", stopped)
    config = tmp_path / "detect.yaml"
    config.write_text("experiment: {mode: detect}\nmesh: {dp: 2}\n")
    assert cli.main(["run", str(config), "--out", str(tmp_path / "run")]) == errors.EXIT_FAIL == 1
    err = capsys.readouterr().err
    assert f"sdcstudy: error: {said}" in err and "Traceback" not in err


def test_ground_truth_needs_the_mirror_when_the_ranks_advance():
    # "with detect.advance: primary a run has it (and scores) only with lockstep or localize"
    for detectors in ("lockstep", "localize", "monitor,localize"):
        assert DP.needs_reference(DP.parse_detectors(detectors), "primary")
    for detectors in ("monitor", "abft,shadow,reexec"):
        assert not DP.needs_reference(DP.parse_detectors(detectors), "primary")
        assert DP.needs_reference(DP.parse_detectors(detectors), "reference")
    # Without the mirror the rows hold no detect/truth, and summary.json no score at all.
    from sdcstudy.detect.tables import run_scores

    rows = [{"step": s, "detect/monitor": int(s == 2)} for s in (1, 2, 3)]
    assert run_scores(rows, ("monitor",), "primary") == {}


# --- "Model presets: ..." (Configs) ------------------------------------------------------------

@pytest.mark.parametrize("preset, shape, params", [
    ("tiny", dict(d_model=64, n_layers=2), None),
    ("small", {}, (24e6, 26e6)),
    ("medium", dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=3072),
     (103.5e6, 104.5e6)),
    ("llama3.2-1b", dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                         tie_embeddings=False), (1.495e9, 1.505e9)),
    ("llama3-8b-16l", dict(d_model=4096, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=16384),
     None),
    ("llama3-8b", dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=16384),
     None)])
def test_model_presets_have_the_guides_shapes(preset, shape, params):
    dims = C.model_dims(C.ModelConfig(preset=preset))
    assert {k: getattr(dims, k) for k in shape} == shape
    if params:
        assert params[0] <= dims.n_params <= params[1]


# --- Benchmarks: "a measurement is never overwritten" ------------------------------------------

def test_a_benchmark_file_that_appears_while_measuring_is_kept_and_ours_goes_beside_it(
        tmp_path, capsys):
    # The options are checked before measuring, which takes minutes: another command given
    # the same --json (two terminals, one script run twice) wrote its file meanwhile, and the
    # one finishing last replaced it.
    import argparse
    import json

    from sdcstudy.bench import common as B

    json_path, md_path = tmp_path / "bench.json", tmp_path / "bench.md"
    args = argparse.Namespace(json=json_path, markdown=md_path, plot=None, repeats=2,
                              presets="tiny")
    B.check_outputs(args)  # nothing there yet
    json_path.write_text("theirs\n")
    md_path.write_text("their table\n")
    with pytest.raises(errors.CouldNotRun, match=r"--json '.*bench.json' appeared while "
                                                 r"measuring and is kept; this command's file "
                                                 r"is '.*bench-2.json'"):
        B.finish(args, "faults", [{"preset": "tiny"}], "| table |\n")
    assert json_path.read_text() == "theirs\n" and md_path.read_text() == "their table\n"
    assert json.loads((tmp_path / "bench-2.json").read_text())["results"] == [{"preset": "tiny"}]
    assert (tmp_path / "bench-2.md").read_text() == "| table |\n"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    # Where nothing appeared, each file is at the name given.
    args = argparse.Namespace(json=tmp_path / "new.json", markdown=None, plot=None)
    B.finish(args, "faults", [{"preset": "tiny"}], "| table |\n")
    assert json.loads((tmp_path / "new.json").read_text())["suite"] == "faults"
