"""`sdcstudy sweep`: one run folder per suspect profile, then the combined report; profiles are
checked before anything runs, folders are never overwritten, an interrupted sweep resumes."""

import json
import math
import shlex
import signal
from pathlib import Path

import pandas as pd
import pytest
from report_runs import grid_rows, write_run

from sdcstudy import cli, runner
from sdcstudy.core import runfolder as RF
from sdcstudy.core.interrupts import Interrupted
from sdcstudy import sweep as SW

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


class FakeRunner:
    """Stands in for `runner.run`: writes a small lock-step run folder for the profile it is
    given, remembers each call, and can be told to be interrupted at one profile."""

    def __init__(self, interrupt_at=None):
        self.calls, self.interrupt_at = [], interrupt_at

    def __call__(self, cfg, out_dir, *, resume=False, progress=True, echo=print, **_):
        profile = cfg.suspect.profile
        self.calls.append((profile, cfg.experiment.steps, cfg.experiment.mode, resume))
        if profile == self.interrupt_at:
            Path(out_dir).mkdir()
            (Path(out_dir) / RF.CONFIG).write_text("experiment: {mode: lockstep}\n")
            raise Interrupted(signal.SIGINT, Path(out_dir))  # as the runner stops on Ctrl-C
        if resume:
            import shutil

            shutil.rmtree(out_dir)
        rows = grid_rows(cfg.experiment.steps, 1, 1, 100,
                         lambda step, micro, layer, site, rank: (len(self.calls), 1.0))
        metrics = [{"step": s, "loss/healthy": 2.0, "grad/nts": 0.0}
                   for s in range(1, cfg.experiment.steps + 1)]
        write_run(Path(out_dir), mode=cfg.experiment.mode, profile=profile, metrics=metrics,
                  mismatch=rows)
        return {"run_dir": str(out_dir)}


@pytest.fixture
def fake(monkeypatch):
    runs = FakeRunner()
    monkeypatch.setattr(runner, "run", runs)
    return runs


def test_sweep_runs_each_profile_then_reports(fake, tmp_path, capsys):
    out = tmp_path / "zoo"
    code = cli.main(["sweep", str(CONFIG), "--profiles", "paper-node-7, exponent-flip",
                     "--set", "experiment.steps=3", "--out", str(out), "--no-progress"])
    assert code == 0
    assert fake.calls == [("paper-node-7", 3, "lockstep", False),
                          ("exponent-flip", 3, "lockstep", False)]
    assert sorted(p.name for p in out.iterdir()) == ["exponent-flip", "paper-node-7", "report",
                                                     SW.SWEEP]
    table1 = pd.read_csv(out / "report" / "table1_frequency.csv")
    # The fake writes 1 mismatch per 100 elements in the first run, 2 in the second.
    assert list(table1["node"]) == ["Node 7", "exponent-flip"]
    assert list(table1["fwd/attn"]) == pytest.approx([0.01, 0.02])
    assert "## Table 1" in capsys.readouterr().out


@pytest.mark.parametrize("profiles, message", [
    ("paper-node-1,paper-node-99", "unknown fault profile 'paper-node-99'"),
    ("paper-node-1,paper-node-1", "names paper-node-1 more than once"),
    ("paper-node-1,", "needs profile names separated by commas"),
])
def test_sweep_checks_every_profile_before_running(fake, tmp_path, capsys, profiles, message):
    out = tmp_path / "zoo"
    assert cli.main(["sweep", str(CONFIG), "--profiles", profiles, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert fake.calls == [] and not out.exists()


def test_sweep_checks_every_profile_against_the_run_before_running(fake, tmp_path, capsys):
    # A spec the run's model cannot fire (layer 9 of a 2-layer model) was found only when its
    # run started, after the runs before it had finished.
    late = tmp_path / "late.yaml"
    late.write_text("specs:\n  - {site: fwd/attn, kind: bitflip, rate: 1.0e-3, layers: [9]}\n")
    out = tmp_path / "zoo"
    assert cli.main(["sweep", str(CONFIG), "--profiles", f"paper-node-1,{late}",
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "layers [9]" in err and len(err.strip().splitlines()) == 1, err
    assert fake.calls == [] and not out.exists()


def test_sweep_never_writes_into_a_folder_it_did_not_make(fake, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    assert cli.main(["sweep", str(CONFIG), "--profiles", "healthy", "--out", str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and fake.calls == []
    with pytest.raises(Exception, match="experiment.mode train does neither; use lockstep, "
                                        "paramsync or free .paired., or abft"):
        SW.sweep(CONFIG, ["healthy"], tmp_path / "train", ["experiment.mode=train"])


def test_interrupted_sweep_resumes_and_keeps_finished_runs(monkeypatch, tmp_path, capsys):
    out = tmp_path / "zoo"
    argv = ["sweep", str(CONFIG), "--profiles", "paper-node-1,paper-node-10",
            "--set", "experiment.steps=2", "--out", str(out), "--no-progress"]
    first = FakeRunner(interrupt_at="paper-node-10")
    monkeypatch.setattr(runner, "run", first)
    capsys.readouterr()
    assert cli.main(argv) == 130
    # The sentence names the command that continues the sweep, not the one run it stopped in
    # (`sdcstudy run .../paper-node-10/config.yaml --resume` left the report and the rest undone).
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sdcstudy")]
    assert line.startswith(f"sdcstudy: interrupted by SIGINT; run "
                           f"{str(out / 'paper-node-10')!r} has no checkpoint yet, and the runs "
                           f"finished before it are kept: continue the sweep with: "), line
    again = shlex.split(line.rpartition("continue the sweep with: ")[2])
    assert again == ["sdcstudy", *argv[:-1], "--resume", "--no-progress"]
    finished = (out / "paper-node-1" / RF.METRICS).read_text()
    # A resume with another request is refused; the same one continues.
    assert cli.main([*argv[:3], "paper-node-1", *argv[4:], "--resume"]) == 2
    assert "different profiles" in capsys.readouterr().err
    second = FakeRunner()
    monkeypatch.setattr(runner, "run", second)
    assert cli.main(again[1:]) == 0
    assert second.calls == [("paper-node-10", 2, "lockstep", True)]
    assert (out / "paper-node-1" / RF.METRICS).read_text() == finished
    assert (out / "report" / "report.md").is_file()


def test_sweep_end_to_end_report_matches_the_runs_summary(tmp_path):
    # One real lock-step run (Ma et al.'s node 10 corrupts about 0.5% of the attention outputs,
    # so two steps of the tiny model see mismatches): the report, computed from the Parquet
    # table on disk, must give the runner's summary.json numbers.
    out = tmp_path / "real"
    code = cli.main(["sweep", str(CONFIG), "--profiles", "paper-node-10",
                     "--set", "experiment.steps=2", "--set", "mesh.tp=1",
                     "--set", "model.n_layers=1", "--set", "experiment.batch_size=4",
                     "--set", "data.seq_len=32", "--out", str(out), "--no-progress"])
    assert code == 0
    summary = json.loads((out / "paper-node-10" / RF.SUMMARY).read_text())
    assert summary["mismatches"]["fwd/attn"] > 0
    table1 = pd.read_csv(out / "report" / "table1_frequency.csv").set_index("node")
    table2 = pd.read_csv(out / "report" / "table2_max_severity.csv").set_index("node")
    for site, freq in summary["freq"].items():
        assert table1.loc["Node 10", site] == pytest.approx(freq, rel=1e-5)
        assert table2.loc["Node 10", site] == pytest.approx(summary["max_severity"][site],
                                                            rel=1e-5)
    wcnts = pd.read_csv(out / "report" / "wcnts.csv").set_index("node")
    assert math.isclose(wcnts.loc["Node 10", "wcnts"], summary["wcnts"], rel_tol=1e-5,
                        abs_tol=1e-12)


def test_sweep_profiles_all_runs_the_whole_zoo_but_healthy(fake, tmp_path, monkeypatch):
    # `--profiles all` is every zoo profile except `healthy` (the node each suspect is paired
    # with), in the zoo's order, one run folder each, then one report of them all.
    from sdcstudy.report import plots
    from sdcstudy.faults import profiles

    monkeypatch.setattr(plots, "FIGURES", {})  # 20 panels per figure; the report tests draw them
    zoo = [name for name in profiles.zoo() if name != "healthy"]
    assert len(zoo) >= 20 and "paper-node-14" in zoo and "exponent-flip" in zoo
    out = tmp_path / "zoo"
    assert cli.main(["sweep", str(CONFIG), "--profiles", "all", "--set", "experiment.steps=1",
                     "--out", str(out), "--no-progress"]) == 0
    assert [call[0] for call in fake.calls] == zoo
    assert json.loads((out / SW.SWEEP).read_text())["profiles"] == zoo
    assert sorted(p.name for p in out.iterdir()) == sorted([*zoo, "report", SW.SWEEP])
    table1 = pd.read_csv(out / "report" / "table1_frequency.csv")
    assert len(table1) == len(zoo) and table1["node"].iloc[0] == "Node 1"
    # "all" combines with a profile file and refuses a zoo name twice.
    assert SW.parse_profiles("all, my.yaml") == [*zoo, "my.yaml"]
    with pytest.raises(Exception, match="names paper-node-3 more than once"):
        SW.parse_profiles("paper-node-3,all")


@pytest.mark.parametrize("damage", ['{"config": ', "[1, 2]"])
def test_a_resume_whose_sweep_file_cannot_be_read_is_one_sentence(fake, tmp_path, capsys,
                                                                   damage):
    # A damaged sweep.json (a copy cut short, an edit) ended the resume as "could not run: a
    # bug or a broken environment" (exit 3).
    out = tmp_path / "zoo"
    argv = ["sweep", str(CONFIG), "--profiles", "paper-node-1", "--set", "experiment.steps=2",
            "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    (out / SW.SWEEP).write_text(damage)
    before = sorted(p.name for p in out.rglob("*"))
    capsys.readouterr()
    assert cli.main([*argv, "--resume"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"cannot resume {str(out)!r}: its {SW.SWEEP} can not be read (" in line
    assert line.endswith(f"start the sweep again with another --out (the runs in it can still "
                         f"be reported: sdcstudy report {out}).")
    assert sorted(p.name for p in out.rglob("*")) == before and len(fake.calls) == 1


@pytest.mark.parametrize("damage", ['{"steps_done": 2, "ste', "[]", '{"mode": "lockstep"}'])
def test_a_resume_redoes_a_run_whose_summary_cannot_be_read(fake, tmp_path, capsys, damage):
    # A finished run's damaged summary.json ended the resume as a bug (exit 3); the run resumes
    # instead, from its last checkpoint, as `sdcstudy run --resume` does, which writes it again.
    # A summary that names no step counts (an edit) was kept as finished: None == None.
    out = tmp_path / "zoo"
    argv = ["sweep", str(CONFIG), "--profiles", "paper-node-1,paper-node-7",
            "--set", "experiment.steps=2", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    (out / "paper-node-7" / RF.SUMMARY).write_text(damage)
    fake.calls.clear()
    assert cli.main([*argv, "--resume"]) == 0
    assert fake.calls == [("paper-node-7", 2, "lockstep", True)]
    assert json.loads((out / "paper-node-7" / RF.SUMMARY).read_text())["steps_done"] == 2


@pytest.mark.parametrize("stem", ["report", "sweep.json"])
def test_a_profile_file_named_as_the_sweeps_own_files_is_refused_first(fake, tmp_path, capsys,
                                                                       stem):
    # report.yaml's run folder was the sweep's report folder: the report was refused after
    # every run had finished.
    profile = tmp_path / f"{stem}.yaml"
    profile.write_text("specs:\n  - {site: fwd/attn, kind: bitflip, rate: 1.0e-3}\n")
    out = tmp_path / "zoo"
    assert cli.main(["sweep", str(CONFIG), "--profiles", f"paper-node-1,{profile}",
                     "--out", str(out)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"profile {str(profile)!r} would have the run folder {stem!r}, the name of the " \
           f"sweep's" in line and line.endswith("; rename the file.")
    assert fake.calls == [] and not out.exists()


def test_a_sweep_refused_at_its_first_run_leaves_no_folder(monkeypatch, tmp_path, capsys):
    # A run refused before its first step (a data.source that does not exist) left the sweep
    # folder with its sweep.json: the corrected command was refused ("already exists"), and so
    # was its --resume ("different overrides"). As with `run`, nothing is left: it runs again.
    def refused(cfg, out_dir, **_):
        raise runner.UserError(f"data.source {cfg.data.source!r} does not exist.")

    monkeypatch.setattr(runner, "run", refused)
    out = tmp_path / "zoo"
    argv = ["sweep", str(CONFIG), "--profiles", "paper-node-1", "--set", "experiment.steps=2",
            "--out", str(out), "--no-progress"]
    assert cli.main([*argv, "--set", "data.source=/no/such/corpus.txt"]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()
    fake = FakeRunner()
    monkeypatch.setattr(runner, "run", fake)
    assert cli.main(argv) == 0
    assert fake.calls == [("paper-node-1", 2, "lockstep", False)]
    # Stopped at once (Ctrl-C as the first run compiles): the same command, not a --resume.
    out2 = tmp_path / "zoo2"

    def stopped(cfg, out_dir, **_):
        raise Interrupted(signal.SIGINT, Path(out_dir))  # the runner removed its new folder

    monkeypatch.setattr(runner, "run", stopped)
    argv2 = [*argv[:-2], str(out2), "--no-progress"]
    assert cli.main(argv2) == 130
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sdcstudy")]
    assert line.endswith(f"no run had done a step, so {str(out2)!r} was not kept: run again "
                         f"with: {shlex.join(['sdcstudy', *argv2])}"), line
    assert not out2.exists()
