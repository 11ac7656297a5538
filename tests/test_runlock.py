"""One writer per run folder, and a write that fails ends a run with one sentence.

Two `sdcstudy run` started together on one --out used to both pass the "never overwrite"
check and write into one folder; two `--resume`s likewise. If a test here fails, a second
writer got in (the folder mixes two runs), or was refused without naming the holder, or a
lock left by a killed run blocks its --resume, or a failed write ends in tracebacks instead of
the sentence that says how to continue.

Every subprocess has a deadline and is killed by its pid, also when a test fails.
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdcstudy import cli
from sdcstudy.core import checkpoint
from sdcstudy.core import runfolder as RF
from sdcstudy.core import runlock
from sdcstudy.core import tablelog as TL

DEADLINE_S = 240  # for one group of processes: start-up, compile and a few tiny steps
TINY = ["--set", "experiment.steps=3", "--set", "optim.schedule=constant",
        "--set", "model.n_layers=1"]
REFUSED = re.compile(r"sdcstudy: error: run folder '(?P<folder>[^']+)' is being written by "
                     r"process (?P<pid>\d+); ")


# --- the lock itself, in one process ------------------------------------------------------------


def test_a_held_folder_refuses_a_second_writer_and_names_the_holder(tmp_path):
    folder = tmp_path / "run"
    with runlock.hold(folder, create=True):
        assert runlock.holder(folder) == os.getpid()
        for create in (True, False):  # flock is per open file: a second open conflicts
            with pytest.raises(runlock.FolderHeld, match=f"process {os.getpid()};"):
                with runlock.hold(folder, create=create):
                    pass
        assert sorted(p.name for p in folder.iterdir()) == [runlock.LOCK]
    assert list(folder.iterdir()) == [] and runlock.holder(folder) is None


def _refused_before_jax(argv: list[str]) -> str:
    """`sdcstudy ARGV` in a fresh process, which must exit 2 without importing JAX; its
    stderr."""
    code = ("import sys; from sdcstudy import cli; "
            f"rc = cli.main({argv!r}); print(rc, 'jax' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=DEADLINE_S, cwd=Path(__file__).parents[1])
    assert done.stdout.split() == ["2", "False"], done.stderr
    return done.stderr


@pytest.mark.parametrize("command, what", [
    (["run", "configs/tiny.yaml"], "run folder"),
    (["sweep", "configs/demo.yaml", "--profiles", "paper-node-1"], "sweep folder"),
    (["reproduce", "--nodes", "1"], "reproduce folder")])
def test_a_second_writer_is_refused_before_jax_is_imported(command, what, tmp_path):
    """`run`, `sweep` and `reproduce` on a held folder say so at once: the sentence comes
    before the command imports JAX, and the folder is unchanged."""
    folder = tmp_path / "out"
    with runlock.hold(folder, create=True):
        (folder / "kept.txt").write_text("the holder's\n")
        stderr = _refused_before_jax([*command, "--out", str(folder)])
        assert f"{what} {str(folder)!r} is being written by process {os.getpid()};" in stderr
        assert sorted(p.name for p in folder.iterdir()) == [runlock.LOCK, "kept.txt"]


def test_a_second_resume_is_refused_before_jax_is_imported(tmp_path):
    folder = tmp_path / "run"
    with runlock.hold(folder, create=True):
        (folder / RF.CONFIG).write_text("experiment:\n  steps: 3\n")
        match = REFUSED.search(_refused_before_jax(
            ["run", "configs/tiny.yaml", "--out", str(folder), "--resume"]))
        assert match and int(match["pid"]) == os.getpid()


def test_a_lock_file_of_a_dead_process_is_not_held(tmp_path):
    # A killed writer leaves its lock file, with its pid; the kernel has released its flock.
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / runlock.LOCK).write_text("999999999\n")
    assert runlock.holder(folder) is None
    with runlock.hold(folder, create=False):
        assert (folder / runlock.LOCK).read_text() == f"{os.getpid()}\n"
    with runlock.hold(folder, create=True):  # nothing but a stale lock: still a new folder
        pass


def test_an_existing_folder_is_refused_unchanged(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "precious.txt").write_text("keep me")
    with pytest.raises(runlock.FolderTaken, match="already exists and is not empty"):
        with runlock.hold(folder, create=True):
            pass
    assert [p.name for p in folder.iterdir()] == ["precious.txt"]


def test_a_new_folder_left_empty_by_a_failure_is_removed(tmp_path):
    folder = tmp_path / "a" / "run"
    with pytest.raises(RuntimeError):
        with runlock.hold(folder, create=True):
            raise RuntimeError("the run failed before writing anything")
    assert not folder.exists()


def test_a_held_folder_that_vanished_is_noticed(tmp_path):
    # Writers that make missing parents (orbax, atomic writes) would carry on into a new,
    # empty folder; the runner checks at every checkpoint that its folder is still the one held.
    folder = tmp_path / "run"
    with runlock.hold(folder, create=True):
        runlock.check(folder)
        shutil.rmtree(folder)
        folder.mkdir()
        with pytest.raises(FileNotFoundError, match="removed or replaced"):
            runlock.check(folder)


# --- two processes ------------------------------------------------------------------------------


class Group:
    """`sdcstudy` subprocesses with their logs; `stop` kills, by pid, any still running."""

    def __init__(self, root: Path):
        self.root, self.procs = root, []
        # The session's compilation cache (tests/conftest.py): the processes of every group
        # run the same tiny step, compiled once.
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(self, *args) -> subprocess.Popen:
        log = open(self.root / f"p{len(self.procs)}.log", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "sdcstudy", *args, "--no-progress"],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc

    def wait(self) -> list[tuple[int, str]]:
        end = time.monotonic() + DEADLINE_S
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        late = [proc.pid for proc, _ in self.procs if proc.poll() is None]
        self.stop()
        assert not late, f"processes {late} still ran after {DEADLINE_S} s"
        return [(proc.returncode, (self.root / f"p{i}.log").read_text(errors="replace"))
                for i, (proc, _) in enumerate(self.procs)]

    def stop(self):
        for proc, log in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


@pytest.fixture
def group(tmp_path):
    g = Group(tmp_path)
    yield g
    g.stop()


def _one_won(results, folder: Path) -> str:
    """The loser's message, after checking that exactly one process succeeded."""
    codes = sorted(code for code, _ in results)
    logs = "\n".join(log[-2000:] for _, log in results)
    assert codes == [0, 2], f"exit codes {codes}, not one success and one refusal:\n{logs}"
    refused = next(log for code, log in results if code == 2)
    match = REFUSED.search(refused)
    assert match, f"the refusal does not name the folder and the holder:\n{refused}"
    assert Path(match["folder"]) == folder
    assert "Traceback" not in refused
    return match["pid"]


def _steps(folder: Path) -> list[int]:
    return [row["step"] for row in RF.read_jsonl(folder / RF.METRICS)]


@pytest.mark.slow
def test_two_runs_started_together_on_one_folder(group, tmp_path):
    out = tmp_path / "run"
    procs = [group.start("run", "configs/tiny.yaml", *TINY, "--out", str(out))
             for _ in range(2)]
    results = group.wait()
    pid = _one_won(results, out)
    winner = next(p for p, (code, _) in zip(procs, results) if code == 0)
    assert int(pid) == winner.pid
    # One run's files, whole: its steps once each, its summary, no lock left behind.
    assert _steps(out) == [1, 2, 3]
    summary = json.loads((out / RF.SUMMARY).read_text())
    assert summary["steps_done"] == summary["steps"] == 3
    assert checkpoint.saved_steps(out / RF.CHECKPOINTS) == [3]
    assert not (out / runlock.LOCK).exists()


@pytest.mark.slow
def test_two_resumes_together_one_is_refused(group, tmp_path):
    out = tmp_path / "run"
    group.start("run", "configs/tiny.yaml", *TINY, "--set", "experiment.steps=6",
                "--stop-after", "2", "--out", str(out))
    assert group.wait()[0][0] == 0
    group.procs.clear()
    for _ in range(2):
        group.start("run", str(out / RF.CONFIG), "--out", str(out), "--resume")
    _one_won(group.wait(), out)
    assert _steps(out) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_killed_run_does_not_block_its_resume(group, tmp_path):
    out = tmp_path / "run"
    proc = group.start("run", "configs/tiny.yaml", *TINY, "--set", "experiment.steps=100000",
                       "--set", "experiment.checkpoint_every=2", "--out", str(out))
    end = time.monotonic() + DEADLINE_S
    while not checkpoint.saved_steps(out / RF.CHECKPOINTS) and proc.poll() is None:
        assert time.monotonic() < end, "the run wrote no checkpoint in time"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / runlock.LOCK).read_text().strip() == str(proc.pid)  # left, with its pid
    group.procs.clear()
    last = checkpoint.saved_steps(out / RF.CHECKPOINTS)[-1]
    group.start("run", str(out / RF.CONFIG), "--out", str(out), "--resume",
                "--stop-after", str(last + 2))
    [(code, log)] = group.wait()
    assert code == 0, log[-3000:]
    assert _steps(out) == list(range(1, last + 3))


# --- a write that fails -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("where", ["checkpoint", "table"])
def test_a_failed_write_ends_with_one_sentence_and_resume_completes(where, tmp_path,
                                                                   monkeypatch, capsys):
    # A full disk at step 4: the run ends with exit 3 and one sentence naming the folder, the
    # last good checkpoint (2) and the --resume command; the resumed run logs every step once.
    config = tmp_path / "c.yaml"
    config.write_text("experiment: {steps: 6, batch_size: 2, checkpoint_every: 2}\n"
                      "data: {seq_len: 16}\noptim: {warmup_steps: 0}\n")
    out = tmp_path / "run"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "checkpoint":
        save = checkpoint.Checkpointer.save

        def failing_save(self, step, state, record):
            if step == 4:
                raise checkpoint.CheckpointWriteError(checkpoint.write_reason(full))
            save(self, step, state, record)

        monkeypatch.setattr(checkpoint.Checkpointer, "save", failing_save)
    else:
        flush = TL.TableLog.flush
        calls = []

        def failing_flush(self):
            calls.append(1)
            if len(calls) >= 2:  # the flush before checkpoint 4, and every one after it
                raise full
            flush(self)

        monkeypatch.setattr(TL.TableLog, "flush", failing_flush)
    capsys.readouterr()
    assert cli.main(["run", str(config), "--out", str(out), "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    [err] = [line for line in err.splitlines() if line.startswith("sdcstudy")]  # data progress aside
    assert f"could not write run folder {str(out)!r}" in err
    assert "No space left on device" in err
    assert "last good checkpoint is step 2" in err
    command = f"sdcstudy run {out / RF.CONFIG} --out {out} --resume"
    assert err.endswith(command), err
    assert not (out / runlock.LOCK).exists()

    monkeypatch.undo()
    assert cli.main(command.split()[1:] + ["--no-progress"]) == 0
    assert _steps(out) == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / RF.SUMMARY).read_text())["steps_done"] == 6
