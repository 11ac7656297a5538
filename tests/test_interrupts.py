"""Interrupts lose nothing, and resuming does what it says.

A lock-step run with faults, stopped by SIGINT or SIGTERM at many moments (before its first
step, between a step's dispatch and its flush, while a checkpoint is written, while the tables
are flushed, twice in a row) and continued each time with the command the stop printed, must
end equal to the uninterrupted run bit for bit: the parameters (summary's param_digest), the
whole final state of the last checkpoint (both nodes' parameters and optimizer state, the step
counter), every metrics.jsonl row once, every row of the faults and mismatch tables, every
counter in summary.json. If a test here fails, a checkpoint was saved ahead of the rows of its
step (a resume then never writes them), or restored a part of the state wrong, a row or counter
was written twice, a signal was ignored or ended the process without a checkpoint, the printed
command does not continue the run, a finished run was run again, or a run refused before its
first step left a folder that blocks the corrected command.

Every run here has one configuration, so the runs in this process share one compiled step
(`compile_step` is memoized below): each costs its steps and checkpoints, not a compile.
"""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pandas as pd
import pytest
import yaml

from bitwise import bits, state_bits
from sdcstudy import cli, runner
from sdcstudy.core import checkpoint
from sdcstudy.core import runfolder as RF
from sdcstudy.core import runlock, train
from sdcstudy.core import tablelog as TL
from sdcstudy.paired.trainer import PairedTrainer

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 12, 4
TIMES = ("compile_s", "wall_time_s", "tokens_per_s")  # wall-clock figures of summary.json


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    """`sdcstudy run ...` of the killed-and-resumed lock-step run of test_tables, as argv without
    the program name: faults at two compared sites, one layer, batch 4; 12 steps of its
    60-step schedule (optim.decay_steps), so that its compiled step serves here too, loaded
    from the session's compilation cache."""
    profile = tmp_path_factory.mktemp("profile") / "two sites.yaml"  # a space to quote
    profile.write_text(yaml.safe_dump({"name": "two-sites", "specs": [
        {"site": site, "kind": "additive", "rate": 2e-4} for site in ("fwd/attn", "bwd/ffn")]}))
    return ["run", str(ROOT / "configs" / "demo.yaml"), "--set", f"suspect.profile={profile}",
            "--set", f"experiment.steps={STEPS}", "--set", f"experiment.checkpoint_every={EVERY}",
            "--set", "experiment.batch_size=4", "--set", "model.n_layers=1",
            "--set", "optim.decay_steps=60", "--no-progress"]


class Hooks:
    """Signals delivered to this process at named points of a run: "compiling" (before the
    first step), "dispatched" (a step's dispatch returned; its rows are not written yet),
    "recording" (a step's rows are being made, the next step dispatched), "saving" (a
    checkpoint's save returned and orbax writes it in the background) and "flushing" (the
    tables of a checkpoint are being flushed). `at[(point, step)]` lists the signals to send
    there; `step` is the step recorded or saved, else the step dispatched last."""

    def __init__(self):
        self.at, self.step, self.compiled, self.may_compile = {}, 0, None, True

    def fire(self, point: str, step: int | None = None) -> None:
        for name in self.at.pop((point, self.step if step is None else step), []):
            number = getattr(signal, name)
            if signal.getsignal(number) in (signal.SIG_DFL, signal.SIG_IGN, None):
                pytest.fail(f"{name} would end the test process: the run installed no handler")
            os.kill(os.getpid(), number)
            _python_call()  # where the interpreter runs the handler, before the next signal

    def compile_step(self, step_fn, state, batch, shardings=None, compiler_options=None):
        assert self.may_compile, "compiled a step"
        self.fire("compiling", 0)
        if self.compiled is None:
            self.compiled = train.compile_step(step_fn, state, batch, shardings,
                                               compiler_options)
        compiled, hlo, seconds = self.compiled

        def step(state, batch):
            out = compiled(state, batch)
            self.step = int(jax.device_get(out[0]["step"]))
            self.fire("dispatched")
            return out

        return step, hlo, seconds


def _python_call() -> None:
    pass


@pytest.fixture(scope="module")
def hooks():
    h = Hooks()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "compile_step", h.compile_step)
        save, flush = checkpoint.Checkpointer.save, TL.TableLog.flush
        host_tables = PairedTrainer.host_tables

        def recording(self, step, records):
            h.fire("recording", step)
            return host_tables(self, step, records)

        def saving(self, step, state, record):
            save(self, step, state, record)
            h.fire("saving", step)

        def flushing(self):
            h.fire("flushing")
            flush(self)

        patch.setattr(checkpoint.Checkpointer, "save", saving)
        patch.setattr(TL.TableLog, "flush", flushing)
        patch.setattr(PairedTrainer, "host_tables", recording)
        yield h


def _view(run_dir: Path) -> dict:
    """Everything of a run that must be bitwise reproducible (wall-clock times excluded)."""
    summary = RF.json_load(run_dir / RF.SUMMARY)
    return {"metrics": [{k: v for k, v in row.items() if not k.startswith("time/")}
                        for row in RF.read_jsonl(run_dir / RF.METRICS)],
            "summary": {k: v for k, v in summary.items() if k not in TIMES},
            "state": state_bits(run_dir),
            **{name: TL.read_table(run_dir / name) for name in (RF.FAULTS, RF.MISMATCH)}}


def _assert_same(a: dict, b: dict) -> None:
    assert bits(a["summary"]) == bits(b["summary"])
    assert a["state"] == b["state"]
    assert bits(a["metrics"]) == bits(b["metrics"])
    for name in (RF.FAULTS, RF.MISMATCH):
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=True)
        assert bits(a[name]) == bits(b[name])


@pytest.fixture(scope="module")
def uninterrupted(command, hooks, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "uninterrupted"
    assert cli.main(command + ["--out", str(out)]) == 0
    view = _view(out)
    assert len(view[RF.FAULTS]) > 0 and len(view[RF.MISMATCH]) > 0  # both tables have rows
    return view


def _stopped(capsys, argv: list[str], code: int) -> list[str]:
    """Run `sdcstudy ARGV`, which a signal must stop with `code`; the command its one-line
    message says to run next (argv)."""
    capsys.readouterr()
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("sdcstudy:")
              and "a second signal stops at once" not in line]
    assert "Traceback" not in err and line.startswith("sdcstudy: interrupted by SIG"), err
    words = shlex.split(line.rpartition("with: ")[2])
    assert words[:2] == ["sdcstudy", "run"], line
    return words[1:]


# (where, step, signals, exit code, the latest checkpoint after the stop); checkpoints are
# due at steps 4, 8 and 12.
STOPS = [
    ("compiling", 0, ["SIGINT"], 130, None),  # a new run, before its first step: no folder
    ("dispatched", 2, ["SIGINT"], 130, 2),  # between step 2's dispatch and its rows
    ("dispatched", 3, ["SIGINT", "SIGINT"], 130, 2),  # twice: at once, checkpoint 2 stays
    ("saving", 4, ["SIGTERM"], 143, 4),  # while orbax writes checkpoint 4
    ("recording", 5, ["SIGINT"], 130, 6),  # while step 5's rows are made, step 6 dispatched
    ("flushing", 8, ["SIGTERM"], 143, 8),  # while checkpoint 8's tables are flushed
    ("compiling", 0, ["SIGTERM"], 143, 8),  # a resume, before its first step: nothing changes
    ("saving", 12, ["SIGINT", "SIGINT"], 130, 12),  # twice, the last save in flight: it ends
]


def test_interrupted_anywhere_and_resumed_equals_the_uninterrupted_run(
        command, hooks, uninterrupted, tmp_path, capsys):
    out = tmp_path / "run"
    argv = command + ["--out", str(out)]
    for where, step, signals, code, saved in STOPS:
        hooks.at = {(where, step): signals}
        argv = _stopped(capsys, argv, code)
        assert not hooks.at, f"{where} at step {step} was never reached"
        if saved is None:  # nothing kept: the same command again
            assert not out.exists()
            assert argv == command[:-1] + ["--out", str(out), "--no-progress"]
            continue
        assert argv == command[:-1] + ["--out", str(out), "--resume", "--no-progress"]
        assert checkpoint.saved_steps(out / RF.CHECKPOINTS)[-1] == saved, (where, step)
        # Every step up to the checkpoint is on disk, once: a resume redoes only later ones.
        steps = [row["step"] for row in RF.read_jsonl(out / RF.METRICS)]
        assert steps[:saved] == list(range(1, saved + 1)), (where, step, steps)
    assert cli.main(argv) == 0
    _assert_same(_view(out), uninterrupted)

    # Resumed again, the finished run says so, compiles nothing and changes no file.
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    hooks.may_compile = False
    try:
        capsys.readouterr()
        assert cli.main(argv) == 0
    finally:
        hooks.may_compile = True
    assert f"already finished at step {STEPS} of {STEPS}; nothing to do" in capsys.readouterr().out
    assert {p: (p.stat().st_mtime_ns, p.read_bytes())
            for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_sigterm_in_a_process_exits_143_with_the_command_that_continues(
        command, hooks, uninterrupted, tmp_path, capsys):
    # A real process that a SIGTERM reaches while checkpoint 4 is written: it saves, exits
    # 143 with one sentence, and the command in it (--set flags and all) finishes the run.
    out = tmp_path / "run"
    code = ("import os, signal, sys\n"
            "from sdcstudy import cli\n"
            "from sdcstudy.core import checkpoint\n"
            "save = checkpoint.Checkpointer.save\n"
            "def saving(self, step, state, record):\n"
            "    save(self, step, state, record)\n"
            "    if step == 4:\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "checkpoint.Checkpointer.save = saving\n"
            "sys.exit(cli.main(sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-c", code, *command, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("sdcstudy:")
              and "a second signal stops at once" not in line]
    assert line.startswith("sdcstudy: interrupted by SIGTERM; the latest checkpoint is step 4"), \
        line
    argv = shlex.split(line.rpartition("continue with: ")[2])
    assert argv == ["sdcstudy"] + command[:-1] + ["--out", str(out), "--resume", "--no-progress"]
    assert cli.main(argv[1:]) == 0
    _assert_same(_view(out), uninterrupted)


def test_a_run_refused_before_its_first_step_leaves_no_folder(command, tmp_path, capsys):
    # The data-source check refuses the run after it has claimed its folder: the corrected
    # command, to the same --out, must not be refused for a folder holding only config.yaml.
    out = tmp_path / "a" / "run"
    missing = tmp_path / "corpus.txt"
    assert cli.main(command + ["--set", f"data.source={missing}", "--out", str(out)]) == 2
    assert "data.source" in capsys.readouterr().err
    assert not out.exists()
    runlock.refuse_early(out, create=True)  # what the corrected command checks first


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_the_step_compiles_exits_with_its_code(tmp_path, signum, code):
    # Ctrl-C cuts XLA's compile short in the main thread while the compile goes on in a thread
    # of XLA's own; the interpreter's clean-up then freed what that thread used, and the
    # process died of a segmentation fault (exit 139) after its sentence. The command must end
    # with its code. Uncached, so that the step really compiles.
    out, log = tmp_path / "run", tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "sdcstudy", "run", "configs/demo.yaml",
                                 "--set", "experiment.steps=2", "--out", str(out)], cwd=ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 120
            while "compiling the step: 00:05" not in log.read_text():  # well into compiling
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            proc.send_signal(signum)
            assert proc.wait(timeout=120) == code, log.read_text()[-2000:]
        finally:
            proc.kill()
    said = log.read_text()
    assert "before its first step" in said and "Fatal Python error" not in said
    assert not out.exists()
