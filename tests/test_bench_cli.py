"""`sdcstudy bench` as a user meets it, with the timed parts stubbed out (nothing here is timed):
output files checked before anything is measured, what a JSON names (its command, versions and
machine), the goals' meanings, progress while programs compile, and the train suite's phases.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from sdcstudy import cli
from sdcstudy.bench import common as B
from sdcstudy.bench import faults as bench_faults
from sdcstudy.bench import goals as G
from sdcstudy.bench import logging as bench_logging
from sdcstudy.bench import timing as BT
from sdcstudy.bench import train as bench_train
from sdcstudy.core import errors


def never(*args, **kwargs):
    raise AssertionError("measured although an output file was bad")


@pytest.fixture
def no_measuring(monkeypatch):
    """The suites' measurements fail the test if they are reached."""
    monkeypatch.setattr(bench_faults, "measure_faults", never)
    monkeypatch.setattr(bench_logging, "measure", never)
    monkeypatch.setattr(bench_train, "measure_train", never)


def one_error(err: str) -> str:
    [line] = [line for line in err.splitlines() if line.startswith("sdcstudy:")]
    assert "Traceback" not in err and line.startswith("sdcstudy: error: ")
    return line


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_an_existing_output_file_is_refused_before_measuring_and_kept(tmp_path, capsys,
                                                                      no_measuring, option):
    mine = tmp_path / "mine.out"
    mine.write_text("a user's file\n")
    code = cli.main(["bench", "faults", "--presets", "tiny", option, str(mine)])
    line = one_error(capsys.readouterr().err)
    assert code == errors.EXIT_BAD_INPUT, line
    assert f"{option} {str(mine)!r} already exists" in line
    assert mine.read_text() == "a user's file\n"


def test_logging_refuses_an_existing_json_before_logging(tmp_path, capsys, no_measuring):
    mine = tmp_path / "bench.json"
    mine.write_text("{}\n")
    code = cli.main(["bench", "logging", "--steps", "2", "--json", str(mine)])
    assert code == errors.EXIT_BAD_INPUT
    assert "already exists" in one_error(capsys.readouterr().err)
    assert mine.read_text() == "{}\n"


@pytest.mark.parametrize("suite", ["faults", "logging"])
def test_a_json_that_cannot_be_written_stops_before_measuring_with_exit_3(tmp_path, capsys,
                                                                          no_measuring, suite):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "bench.json"
    extra = ["--presets", "tiny"] if suite == "faults" else ["--steps", "2"]
    code = cli.main(["bench", suite, *extra, "--json", str(path)])
    line = one_error(capsys.readouterr().err)
    assert code == errors.EXIT_COULD_NOT_RUN, line
    assert f"could not write the benchmark file {str(path)!r} (a folder on its path" in line


def test_a_read_only_folder_stops_before_measuring(tmp_path, capsys, no_measuring, monkeypatch):
    # Root writes anywhere, so the folder's mode is stood in for by os.access.
    folder = tmp_path / "read-only"
    folder.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: (
        False if str(p) == str(folder) else access(p, mode)))
    path = folder / "new" / "bench.json"  # a missing folder is made, so its parent counts
    code = cli.main(["bench", "faults", "--presets", "tiny", "--json", str(path)])
    line = one_error(capsys.readouterr().err)
    assert code == errors.EXIT_COULD_NOT_RUN
    assert "(Permission denied)" in line and repr(str(path)) in line


def test_a_json_path_that_is_a_folder_stops_before_measuring(tmp_path, capsys, no_measuring):
    (tmp_path / "bench.json").mkdir()
    code = cli.main(["bench", "faults", "--presets", "tiny", "--json",
                     str(tmp_path / "bench.json")])
    assert code == errors.EXIT_COULD_NOT_RUN
    assert "(it is a folder)" in one_error(capsys.readouterr().err)


def test_an_hlo_folder_that_cannot_be_made_stops_before_measuring(tmp_path, capsys,
                                                                  no_measuring):
    (tmp_path / "file").write_text("")
    code = cli.main(["bench", "train", "--no-torch", "--presets", "tiny", "--hlo",
                     str(tmp_path / "file" / "hlo")])
    line = one_error(capsys.readouterr().err)
    assert code == errors.EXIT_COULD_NOT_RUN
    assert "could not write the HLO folder" in line


def test_the_json_names_its_command_versions_and_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["sdcstudy", "bench", "faults", "--repeats", "2"])
    args = argparse.Namespace(json=tmp_path / "b.json", markdown=None, plot=None, repeats=2,
                              presets="tiny", bench=never)
    B.finish(args, "faults", [{"preset": "tiny"}], "| table |\n", environment=B.host())
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["command"]["argv"] == ["sdcstudy", "bench", "faults", "--repeats", "2"]
    assert report["command"]["options"] == {"json": str(tmp_path / "b.json"), "markdown": None,
                                            "plot": None, "repeats": 2, "presets": "tiny"}
    env = report["environment"]
    assert {"python", "sdcstudy", "numpy"} <= set(env["versions"])
    assert env["cpu"]["cores"] >= 1 and env["hostname"] and env["os"]


def test_the_logging_json_names_versions_and_machine(tmp_path, capsys):
    path = tmp_path / "logging.json"
    assert cli.main(["bench", "logging", "--steps", "2", "--rows-per-step", "4",
                     "--flush-every", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert "sdcstudy" in report["environment"]["versions"]
    assert report["environment"]["cpu"]["cores"] >= 1
    assert report["command"]["options"]["rows_per_step"] == 4


def test_the_goals_table_says_what_each_value_is_a_ratio_of():
    table = G.goals_table([G.goal("paft.dyn_overlap_over_dp", 1.02, preset="tiny", workers=4),
                           G.goal("paft.dyn_overlap_over_dp", 1.03, preset="tiny", workers=8)])
    meaning = G.GOALS["paft.dyn_overlap_over_dp"].meaning
    assert "under the same simulated error" in meaning
    assert table.count(f"- paft.dyn_overlap_over_dp: {meaning}\n") == 1


class _Trainer:
    """The smallest thing `build_runners` compiles: a state of four numbers and a step."""

    def __init__(self, factor: float):
        self.factor = factor

    def init_state(self):
        import jax.numpy as jnp

        return {"w": jnp.ones(4), "step": jnp.zeros((), jnp.int32)}

    def make_batch(self, tokens):
        return tokens

    def shardings(self, state, batch):
        return None

    def train_step(self, state, batch):
        w = state["w"] * self.factor + batch.sum()
        return {"w": w, "step": state["step"] + 1}, {"loss/healthy": w.sum()}, {}


def test_a_log_gets_a_line_per_compiled_program(monkeypatch):
    import numpy as np

    monkeypatch.setattr(B, "live_line", lambda: False)  # stderr is a log file, not a terminal
    lines = []
    trainers = {"plain": _Trainer(2.0), "same": _Trainer(2.0), "other": _Trainer(3.0)}
    runners, phases = BT.build_runners(trainers, np.zeros((1, 1, 2), np.float32), 2,
                                       preset="tiny", echo=lines.append)
    assert phases["programs"] == 2 and runners["same"].shares_program_of == "plain"
    compiled = sorted(line for line in lines if " compiled " in line)
    assert [line.split(" in ")[0] for line in compiled] == ["tiny: compiled other",
                                                           "tiny: compiled plain"]
    assert all(line.endswith("programs so far)") for line in compiled)


class _Runner:
    """A compiled step that is never run: `measure_train`'s own bookkeeping is what is tested."""

    def __init__(self, trainer, tokens):
        self.trainer, self.compile_s, self.hlo = trainer, 1.5, ""

    def warm_up(self, n):
        return [{"loss/healthy": 1.0}] * n

    def run(self, n):
        pass


def test_the_train_suite_records_its_phases(monkeypatch):
    monkeypatch.setattr(BT, "StepRunner", _Runner)
    monkeypatch.setattr(bench_train.roofline, "matmul_peak", lambda **kw: {"jax": 1e3})
    monkeypatch.setattr(bench_train.census, "census", lambda hlo: {})
    def interleaved(runners, steps, repeats, tokens, label, echo=None):
        return {"ours": [0.5]}, {"ours": {"minor_faults_per_step": 0, "system_s_per_step": 0.0}}

    monkeypatch.setattr(BT, "interleaved", interleaved)
    args = cli.build_parser().parse_args(["bench", "train", "--no-torch", "--presets", "tiny",
                                          "--repeats", "1", "--steps", "1"])
    lines = []
    result = bench_train.measure_train("tiny", args, (), echo=lines.append)
    assert set(result["phases"]) == {"compile_s", "torch_setup_s", "warmup_s", "timed_s",
                                     "peak_s"}
    assert all(seconds >= 0 for seconds in result["phases"].values())
    assert "tiny: our step compiled in 1.5 s" in lines
    assert "tiny: warming up 1 contender, 2 steps each" in lines


def test_two_outputs_naming_one_file_are_refused(tmp_path, capsys, no_measuring):
    path = tmp_path / "bench.out"
    code = cli.main(["bench", "faults", "--presets", "tiny", "--json", str(path), "--markdown",
                     str(tmp_path / "." / "bench.out")])
    assert code == errors.EXIT_BAD_INPUT
    assert "--json and --markdown name the same file" in one_error(capsys.readouterr().err)


def test_the_warm_up_is_announced_before_it_runs():
    lines = []

    class Announced(_Runner):
        def warm_up(self, n):
            assert lines[-1] == "tiny: warming up 2 contenders, 2 steps each"
            return super().warm_up(n)

    phases = {"init_s": 0.0, "lower_s": 0.0, "compile_s": 0.0, "programs": 1}
    BT.warm_up_and_time({"a": Announced(None, None), "b": Announced(None, None)}, 1, 1, 8,
                        "tiny", phases, lines.append)
    assert "warmup_s" in phases and any("repetition 1/1" in line for line in lines)


def test_bench_plot_refuses_what_is_no_bench_result_and_keeps_an_existing_figure(tmp_path,
                                                                                  capsys):
    # A JSON holding a number crashed ("could not run: TypeError ... a bug", exit 3); the
    # sentence for a JSON that is no bench result did not name the file; --out replaced a
    # figure already there.
    from sdcstudy import cli

    number = tmp_path / "num.json"
    number.write_text("5")
    out = tmp_path / "fig.png"
    assert cli.main(["bench", "plot", str(number), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"bench result {str(number)!r} is not a `sdcstudy bench` result" in err
    assert err.count("\n") == 1 and not out.exists()
    out.write_bytes(b"mine")
    assert cli.main(["bench", "plot", str(number), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == b"mine"


def test_the_abft_goal_is_in_the_goals_list():
    # The abft table judged each checked step against 1.10x, but its JSON's goals list (what
    # `bench all`'s goals table and the GPU acceptance read) was empty.
    from sdcstudy.bench import abft

    ratio = {"median": 1.2, "min": 1.1, "max": 1.3}
    results = [{"preset": "tiny", "variants": {"off": {}, "on": {"ratio": ratio},
                                               "recompute": {"ratio": ratio}}}]
    assert abft.abft_goals(results) == [{"name": "abft.on_over_off", "preset": "tiny",
                                         "value": 1.2, "limit": 1.1, "bound": "upper",
                                         "met": False}]
