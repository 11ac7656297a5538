"""The exit-code contract (core/errors.py) where a command's report file cannot be written.

A command with a verdict (doctor, fleet simulate) prints its verdict first and keeps its code,
with one warning naming the file it could not write; a command whose output is the file
(`bench --json`, `plan --json`) ends with one sentence naming it and exit 3, never a
traceback and never 1 (a FAIL, which drains a node). If a test here fails, an unwritable file
turned into a traceback, a FAIL's exit code or a lost verdict. The files are made unwritable
in ways that hold for root too (tests run as root in CI): a folder on the path that is a
file, a path that is a folder, and a full disk (fsync fails with ENOSPC).

Nothing here compiles a JAX program: doctor's two runs are stood in for by run folders written
here (a final checkpoint included, which doctor reads back), plan's compilation by a stub, and
bench logging measures no model.
"""

import errno
import os
from pathlib import Path
import subprocess

import numpy as np
import pytest

from sdcstudy import cli, doctor
from sdcstudy.core import errors
from sdcstudy.core import runfolder as RF
from sdcstudy.core.checkpoint import Checkpointer

UNWRITABLE = ["folder is a file", "is a folder", "disk full"]


def unwritable(tmp_path, how: str, monkeypatch, name: str = "report.json"):
    """A path that cannot be written, in one of the UNWRITABLE ways."""
    if how == "folder is a file":
        (tmp_path / "file").write_text("")
        return tmp_path / "file" / name
    if how == "is a folder":
        (tmp_path / name).mkdir()
        return tmp_path / name
    fsync = os.fsync

    def no_room(fd):  # the atomic write of this file fails as on a full disk
        # Its hidden temporary file, or the one that writes a temporary of it (a command that
        # takes the name only once the file is whole: core/reports.publish).
        written = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if written.parent == tmp_path and written.name.lstrip(".").startswith(
                f"{Path(name).stem}.") and written.name.startswith("."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", no_room)
    return tmp_path / name


def one_warning(err: str, path) -> str:
    """The one stderr line, a warning naming `path` that says the result stands."""
    [line] = err.strip().splitlines()
    assert line.startswith("sdcstudy: warning: could not write the ") and repr(str(path)) in line
    assert line.endswith("the result printed above stands."), line
    return line


def _fake_run(config_path, out):
    """A stand-in for doctor's `sdcstudy run` subprocess: a finished run folder."""
    out.mkdir(parents=True)
    RF.write_rows(out / RF.METRICS, [{"step": s, "loss/healthy": 5.0 - s, "time/step_s": s}
                                     for s in (1, 2)])
    RF.atomic_write_json(out / RF.SUMMARY, {"param_digest": "ab" * 32})
    RF.atomic_write_json(out / RF.ENV, {
        "compiled_step_sha256": "cd" * 32, "platform": "cpu", "device_kinds": {"cpu": 8},
        "packages": {"jax": "0.10.2"}, "cpu": {"model": "test", "isa": ["avx2"]}})
    checkpoints = Checkpointer(out / RF.CHECKPOINTS, asynchronous=False)  # the final state
    checkpoints.save(2, {"params": {"w": np.ones(3, np.float32)}, "step": np.asarray(2)},
                     {"step": 2})
    checkpoints.close()
    return subprocess.CompletedProcess([], 0, "", "")


@pytest.mark.parametrize("how", UNWRITABLE)
def test_doctor_prints_its_verdict_and_keeps_its_code_when_json_cannot_be_written(
        tmp_path, monkeypatch, capsys, how):
    monkeypatch.setattr(doctor, "_run", _fake_run)
    path = unwritable(tmp_path, how, monkeypatch)
    assert cli.main(["doctor", "--json", str(path), "--no-progress"]) == errors.EXIT_PASS
    out, err = capsys.readouterr()
    assert "PASS: 2 steps" in out
    one_warning(err, path)


def test_doctor_whose_run_failed_could_not_run(tmp_path, monkeypatch, capsys):
    """A training that did not finish is no verdict on the machine: exit 3, not 1 or 2."""
    monkeypatch.setattr(doctor, "_run", lambda config, out: subprocess.CompletedProcess(
        [], 1, "", "sdcstudy: error: something broke\n"))
    assert doctor.main() == errors.EXIT_COULD_NOT_RUN
    assert "run a failed (exit 1): sdcstudy: error: something broke" in capsys.readouterr().err


@pytest.mark.parametrize("how", UNWRITABLE)
def test_fleet_prints_its_table_and_exits_0_when_json_cannot_be_written(tmp_path, monkeypatch,
                                                                        capsys, how):
    path = unwritable(tmp_path, how, monkeypatch, "fleet.json")
    code = cli.main(["fleet", "simulate", "--trials", "1", "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == errors.EXIT_PASS, err
    assert "cheapest strategy" in out.splitlines()[-1]
    one_warning(err, path)


def test_fleet_plot_that_cannot_be_written_is_one_warning_and_leaves_nothing(
        tmp_path, monkeypatch, capsys):
    """The figure is drawn for real (only its curves are stubbed: they cost seconds) and saved
    beside a folder of its name, so the temporary file is written and then cannot replace it."""
    from sdcstudy.fleet import plot

    monkeypatch.setattr(plot, "goodput_curve", lambda cfg, names, sizes: {
        name: sizes * 0.0 + 0.5 for name in names})
    path = unwritable(tmp_path, "is a folder", monkeypatch, "fleet.png")
    code = cli.main(["fleet", "simulate", "--trials", "1", "--plot", str(path)])
    out, err = capsys.readouterr()
    assert code == errors.EXIT_PASS, err
    assert "cheapest strategy" in out.splitlines()[-1]
    one_warning(err, path)
    assert not list(tmp_path.rglob(".fleet.png*"))  # no temporary file left behind


@pytest.mark.parametrize("how", UNWRITABLE)
def test_bench_json_that_cannot_be_written_is_one_sentence_and_exit_3(tmp_path, monkeypatch,
                                                                      capsys, how):
    path = unwritable(tmp_path, how, monkeypatch, "bench.json")
    code = cli.main(["bench", "logging", "--steps", "2", "--rows-per-step", "8",
                     "--flush-every", "1", "--json", str(path)])
    err = capsys.readouterr().err
    assert code == errors.EXIT_COULD_NOT_RUN, err
    [line] = [line for line in err.splitlines() if line.startswith("sdcstudy:")]
    assert line.startswith(f"sdcstudy: error: could not write the benchmark file "
                           f"{str(path)!r} ("), line
    assert "Traceback" not in err


@pytest.mark.parametrize("how", UNWRITABLE)
def test_plan_json_that_cannot_be_written_is_one_sentence_and_exit_3(tmp_path, monkeypatch,
                                                                     capsys, how):
    """The plan is printed, then its file: exit 3 naming the file (compilation stubbed)."""
    from sdcstudy.plan import aot, summary, text

    monkeypatch.setattr(aot, "compile_program", lambda cfg: None)
    monkeypatch.setattr(summary, "make_plan", lambda *args: {"plan": 1})
    monkeypatch.setattr(text, "render", lambda plan: "the plan")
    config = tmp_path / "c.yaml"
    config.write_text("experiment: {mode: train}\n")
    path = unwritable(tmp_path, how, monkeypatch, "plan.json")
    code = cli.main(["plan", str(config), "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == errors.EXIT_COULD_NOT_RUN and out.startswith("the plan"), err
    [line] = err.strip().splitlines()
    assert line.startswith(f"sdcstudy: error: could not write the plan file {str(path)!r} ("), line


def test_sigterm_outside_a_runs_loop_exits_143_and_an_unforeseen_error_3(monkeypatch, capsys):
    """SIGTERM during any command (a Slurm or Kubernetes timeout) is an interrupt, exit 143,
    and the caller's own SIGTERM handler is back afterwards; an exception nobody foresaw is one
    sentence and 3. If this fails, a terminated or crashed check read as FAIL (1) or as a
    traceback, or the CLI left its handler in the caller's process."""
    import signal

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    def crashed(args):
        raise AssertionError("backend did not start")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "cmd_profiles", terminated)
    assert cli.main(["profiles"]) == errors.EXIT_SIGTERM == 143
    assert signal.getsignal(signal.SIGTERM) is before
    assert "terminated (SIGTERM)" in capsys.readouterr().err
    monkeypatch.setattr(cli, "cmd_profiles", crashed)
    assert cli.main(["profiles"]) == errors.EXIT_COULD_NOT_RUN
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "AssertionError: backend did not start" in err
    assert "Traceback" not in err


def test_a_device_out_of_memory_is_one_sentence_naming_the_fix_and_exit_3(monkeypatch, capsys):
    """XLA's allocation failure (a data.seq_len of 100,000 on tiny asked for 17.9 TB) is a setup
    too large for the device: one sentence that says so and how to shrink it, exit 3, never a
    FAIL. If this fails, it reads as "a bug or a broken environment" again, or as a verdict."""
    def too_large(args):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 17932051265668 bytes.")

    monkeypatch.setattr(cli, "cmd_profiles", too_large)
    assert cli.main(["profiles"]) == errors.EXIT_COULD_NOT_RUN
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ran out of memory (XLA asked for 17.9 TB at once)" in err
    assert "sdcstudy plan CONFIG" in err and "a bug" not in err


def test_ctrl_c_during_any_command_says_interrupted_and_exits_130(monkeypatch, capsys):
    """A bare KeyboardInterrupt (Ctrl-C where no run names what it kept) is exit 130 and the
    word "interrupted". If this fails, the line read "sdcstudy: " and nothing more."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_profiles", interrupted)
    assert cli.main(["profiles"]) == errors.EXIT_SIGINT == 130
    assert capsys.readouterr().err == "sdcstudy: interrupted\n"


def test_version_names_the_package_and_exits_0(capsys):
    # A bug report's first line: `sdcstudy --version` prints the installed version (and the
    # commit of a git checkout), exits 0, and needs no command.
    from importlib import metadata

    with pytest.raises(SystemExit) as ended:
        cli.main(["--version"])
    assert ended.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"sdcstudy {metadata.version('sdcstudy')}")


@pytest.mark.parametrize("argv, says", [
    (["plan", "configs/tiny.yaml", "--mfu", "abc"], "argument --mfu: invalid float value"),
    (["golden", "check"], "the following arguments are required: golden_dir"),
    (["bogus"], "argument COMMAND: invalid choice: 'bogus'"),
    (["bench", "faults", "--bogus"],
     "sdcstudy bench faults: error: unrecognized arguments: --bogus (sdcstudy bench faults --help"),
    (["golden", "record", "--out", "x", "--bogus"],
     "sdcstudy golden record: error: unrecognized arguments: --bogus (sdcstudy golden record"),
    (["run", "configs/tiny.yaml", "--bogus"], "(sdcstudy run --help lists the options)"),
])
def test_a_mistyped_command_line_is_one_line_and_exit_2(argv, says, capsys):
    # argparse's own refusals keep the contract of every other bad input: one line (no usage
    # block), exit 2, and where the options are listed.
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and says in err and err.count("\n") == 1
    assert "--help lists the options" in err
