"""`sdcstudy reproduce` as a user runs it, with the stand-in runner of test_reproduce.py: input
refused in one sentence with nothing left behind, the exit code of the signal that stopped it,
merges of shards still written or not all there, and what a log without progress bars shows."""

import signal
from pathlib import Path

import pytest
from test_reproduce import FakeRunner, reproduce, scorecard

from sdcstudy import cli, runner
from sdcstudy.core import runlock
from sdcstudy.core.config import UserError
from sdcstudy.core.interrupts import Interrupted


@pytest.fixture
def fake(monkeypatch):
    runs = FakeRunner()
    monkeypatch.setattr(runner, "run", runs)
    return runs


@pytest.mark.parametrize("argv,message", [
    (["--nodes", ""], "--nodes '' names ''"),
    (["--modes", ""], "--modes '' names ''"),
    (["--preset", ""], "--preset '' is not one of"),
    (["--fault-model", ""], "--fault-model '' is not one of"),
    (["--nodes", "\u00b2"], "--nodes '\u00b2' names '\u00b2'"),
    (["--shard", "\u00b2/4"], "must be I/N"),
    (["--set", "experiment.steps=3"], "give --steps instead"),
    (["--set", " model.dtype =bfloat16"], "give --dtype instead"),
])
def test_bad_input_is_refused_not_read_as_a_default(fake, tmp_path, capsys, argv, message):
    """An option given empty (an unset shell variable) is not its default, all 15 nodes; a
    digit that is no decimal digit is bad input, not a crash; --set of a key the command has
    an option for would leave the scorecard's header naming the option's value."""
    assert cli.main(["reproduce", "--out", str(tmp_path / "r"), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0, err
    assert fake.calls == [] and not (tmp_path / "r").exists()


class Refusing(FakeRunner):
    """The stand-in runner, refusing the config of run `refuse` as `runner.run` refuses one it
    only checks when it builds the mode (model.n_heads and mesh.tp, for example)."""

    def __init__(self, refuse):
        super().__init__()
        self.refuse = refuse

    def __call__(self, cfg, out_dir, **kwargs):
        if Path(out_dir).name == self.refuse:
            self.calls.append((Path(out_dir).name, kwargs.get("resume", False)))
            raise UserError("model.n_heads (4) must be a multiple of mesh.tp (3).")
        return super().__call__(cfg, out_dir, **kwargs)


def test_a_config_refused_by_the_first_run_leaves_the_folder_to_the_same_command(
        monkeypatch, tmp_path, capsys):
    """A refusal before any run holds something leaves no reproduce folder, so the command
    with the input corrected runs into the same --out; a refusal after a run finished keeps
    the folder and that run."""
    monkeypatch.setattr(runner, "run", Refusing("paper-node-1-lockstep"))
    assert reproduce(tmp_path / "r") == 2
    assert "mesh.tp (3)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
    monkeypatch.setattr(runner, "run", FakeRunner())
    assert reproduce(tmp_path / "r", "--modes", "free") == 0
    monkeypatch.setattr(runner, "run", Refusing("paper-node-1-paramsync"))
    assert reproduce(tmp_path / "k", "--modes", "lockstep,paramsync") == 2
    assert (tmp_path / "k" / "reproduce.json").is_file()
    assert (tmp_path / "k" / "runs" / "paper-node-1-lockstep" / "summary.json").is_file()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_command_exits_with_its_signals_code(monkeypatch, tmp_path, capsys, signum):
    """SIGTERM (Slurm's preemption) stops with 143, SIGINT with 130, each named, with the
    command that continues the folder."""

    def stop(cfg, out_dir, **_):
        raise Interrupted(signum, Path(out_dir))

    monkeypatch.setattr(runner, "run", stop)
    assert reproduce(tmp_path / "r") == 128 + signum
    err = capsys.readouterr().err
    assert f"interrupted by {signal.Signals(signum).name} in paper-node-1-lockstep" in err
    assert f"--resume --out {tmp_path / 'r'}" in err


def test_merges_refuse_a_shard_still_written_and_name_the_runs_they_lack(fake, tmp_path,
                                                                       capsys):
    """A shard folder another command still writes is refused; a merge into a folder that
    exists is told to choose another --out, not to --resume (which --merge refuses); a merge
    of some shards names the runs it lacks and how to run them."""
    assert reproduce(tmp_path / "s0", "--shard", "0/2") == 0
    merge = ["reproduce", "--merge", str(tmp_path / "s0"), "--no-progress", "--out"]
    with runlock.hold(tmp_path / "s0", create=False):
        assert cli.main([*merge, str(tmp_path / "m")]) == 2
        assert "is still being written by process" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    assert cli.main([*merge, str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    lacking = [f"paper-node-{n}-{m}" for n in (1, 14) for m in ("paramsync", "abft")]
    assert f"4 planned runs are in none of the merged folders ({', '.join(lacking)})" in out
    assert f"--resume --out {tmp_path / 'm'}" in out
    assert {r["verdict"] for r in scorecard(tmp_path / "m") if r["source"] == "Figure 5"} == \
        {"not run"}
    assert cli.main([*merge, str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "choose another --out" in err and "--resume" not in err


def test_without_progress_bars_each_run_is_a_line(fake, tmp_path, capsys):
    """--no-progress (logs, the Slurm script) says which run of how many starts."""
    assert reproduce(tmp_path / "r", "--modes", "free") == 0
    out = capsys.readouterr().out
    assert "paper-node-1-free: run 1 of 2" in out and "paper-node-14-free: run 2 of 2" in out
