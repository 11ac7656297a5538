"""`sdcstudy doctor`: two separate processes must agree bit for bit, and a difference must show.

The module runs without the test session's compilation cache (tests/conftest.py, UNCACHED):
each process compiles its own program, so a compiler that is not deterministic would show.
"""

import copy
import json
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdcstudy import doctor
from sdcstudy.core import config as C
from sdcstudy.core import errors
from sdcstudy.core import runfolder as RF
from sdcstudy.core.checkpoint import Checkpointer


def test_two_processes_agree_bitwise(tmp_path, capsys, monkeypatch):
    # The determinism claim of the whole project: the same config in two fresh processes
    # gives the same metrics, the same compiled program and the same final state (parameters
    # and optimizer state), bit for bit. A user's compilation cache in the environment must
    # not reach the two runs: each compiles its own program (nothing is written to it).
    cache = tmp_path / "users-xla-cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    code = doctor.main(json_path=tmp_path / "report.json", keep=tmp_path / "runs")
    out, err = capsys.readouterr()
    assert "sdcstudy doctor: 2/2 runs done [" in err  # the line counting its two runs
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0, out
    assert report["verdict"] == "PASS" and report["steps"] == doctor.DOCTOR["experiment"]["steps"]
    assert report["exit_code"] == 0 and "PASS" in out
    assert not cache.exists() or not any(cache.iterdir())
    for key in ("packages", "xla_flags", "device_kinds", "process_count", "cpu",
                "compiled_step_sha256"):
        assert key in report["env"]
    # Keep the two runs' views for the next assertions: flipping one bit of one loss, or of
    # one element of Adam's second moment alone, must FAIL and name where.
    a = doctor.deterministic_view(tmp_path / "runs" / "a")
    assert report["state_arrays"] == len(a["state"])
    assert any(name.startswith("opt_state/") for name in a["state"])
    assert any(name.startswith("params/") for name in a["state"])
    b = copy.deepcopy(a)
    loss = b["metrics"][7]["loss/healthy"]
    bits = struct.unpack("<Q", struct.pack("<d", loss))[0]
    b["metrics"][7]["loss/healthy"] = flipped = struct.unpack("<d", struct.pack("<Q", bits ^ 1))[0]
    assert doctor.compare(a, a) == []
    assert doctor.compare(a, b) == [f"step 8: loss/healthy {loss!r} vs {flipped!r} (run a vs "
                                    f"run b)"]
    b = copy.deepcopy(a)
    nu = next(name for name in b["state"] if "/nu/" in name)
    b["state"][nu].reshape(-1).view(np.uint32)[5] ^= 1
    problems = doctor.compare(a, b)
    assert len(problems) == 1 and problems[0].startswith(
        f"final state: 1 of {len(a['state'])} arrays differ; first {nu}")
    assert problems[0].endswith(f"1 of {a['state'][nu].size} elements differ")


def test_a_program_loaded_from_the_compilation_cache_hashes_as_compiled(tmp_path, monkeypatch):
    # With JAX's persistent compilation cache on, a second process loads the first one's
    # executable, whose HLO text carries the first one's op metadata: the program's hash in
    # env.json must not see that (it once did, and doctor failed for users of the cache).
    cache = tmp_path / "xla-cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    config = tmp_path / "doctor.yaml"
    RF.atomic_write_text(config, C.dump(C.from_dict(doctor.DOCTOR)))
    hashes = []
    for name in ("compiled", "loaded"):
        subprocess.run([sys.executable, "-m", "sdcstudy", "run", str(config), "--out",
                        str(tmp_path / name), "--set", "experiment.steps=1", "--no-progress"],
                       check=True, capture_output=True, timeout=240)
        assert any(cache.iterdir()), "the premise: the first process filled the cache"
        hashes.append(RF.json_load(tmp_path / name / RF.ENV)["compiled_step_sha256"])
    assert hashes[0] == hashes[1]


def test_doctor_runs_never_use_a_compilation_cache(monkeypatch):
    # A user's compilation cache must not reach doctor's two runs: the second would load the
    # first one's executable, and a compiler that is not deterministic would go unseen.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/a/users/cache")
    env = doctor._uncached_env()
    assert not any(name.startswith("JAX_COMPILATION_CACHE") for name in env)
    assert env["JAX_ENABLE_COMPILATION_CACHE"] == "false"
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.config."
                            "jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.split() == ["False", "None"]


def _fake_run_folder(run_dir, metrics, state):
    """A finished run folder as `sdcstudy run` leaves it, as far as doctor reads it."""
    RF.atomic_write_text(run_dir / RF.METRICS, "".join(json.dumps(row) + "\n" for row in metrics))
    RF.atomic_write_json(run_dir / RF.SUMMARY, {"param_digest": "p" * 64})
    RF.atomic_write_json(run_dir / RF.ENV, {"compiled_step_sha256": "c" * 64})
    ckpt = Checkpointer(run_dir / RF.CHECKPOINTS, asynchronous=False)
    ckpt.save(len(metrics), state, {"step": len(metrics)})
    ckpt.close()


def test_a_difference_in_the_optimizer_state_alone_fails(tmp_path, monkeypatch):
    # One bit of Adam's second moment, saved in the last checkpoint, differs while every metric
    # and parameter agree: doctor once compared only metrics and a parameter digest, and PASSed.
    # The run folders are named relative to the working folder, as `--keep DIR` can name them.
    # Starts no process, compiles nothing.
    monkeypatch.chdir(tmp_path)
    state = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
             "opt_state": {"nu": np.full((2, 3), 0.25, np.float32)},
             "step": np.asarray(2, np.int32)}
    _fake_run_folder(Path("a"), [{"step": 1, "lr": 0.0}, {"step": 2, "lr": 0.5}], state)
    state["opt_state"]["nu"].view(np.uint32)[1, 2] ^= 1
    _fake_run_folder(Path("b"), [{"step": 1, "lr": 0.0}, {"step": 2, "lr": 0.5}], state)
    a, b = (doctor.deterministic_view(Path(name)) for name in "ab")
    assert doctor.compare(a, a) == []
    assert doctor.compare(a, b) == [
        "final state: 1 of 3 arrays differ; first opt_state/nu[1, 2]: 0.25 vs "
        f"{float(state['opt_state']['nu'][1, 2])!r} (bits 0x3e800000 vs 0x3e800001), 1 of 6 "
        "elements differ"]


def test_the_tests_state_comparison_sees_one_bit_of_the_optimizer_state(tmp_path):
    # The resume, interrupt, two-process and Pallas-repeat tests compare the final state by
    # tests/bitwise.py's `state_bits`, read by doctor's reader: one bit of Adam's second moment
    # (or a sign bit, which == on values misses) must make two run folders unequal, naming the
    # array, while metrics and parameters agree. Starts no process, compiles nothing.
    from bitwise import state_bits

    state = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
             "opt_state": {"mu": np.zeros((2, 3), np.float32),
                           "nu": np.full((2, 3), 0.25, np.float32)},
             "step": np.asarray(2, np.int32)}
    rows = [{"step": 1, "lr": 0.0}, {"step": 2, "lr": 0.5}]
    _fake_run_folder(tmp_path / "a", rows, state)
    _fake_run_folder(tmp_path / "same", rows, copy.deepcopy(state))
    flipped = copy.deepcopy(state)
    flipped["opt_state"]["nu"].view(np.uint32)[1, 2] ^= 1
    _fake_run_folder(tmp_path / "nu", rows, flipped)
    signed = copy.deepcopy(state)
    signed["opt_state"]["mu"][0, 1] = -0.0  # equal to 0.0 by value
    _fake_run_folder(tmp_path / "mu", rows, signed)
    a = state_bits(tmp_path / "a")
    assert sorted(a) == ["opt_state/mu", "opt_state/nu", "params/w", "step"]
    assert a == state_bits(tmp_path / "same")
    for name, run in (("opt_state/nu", "nu"), ("opt_state/mu", "mu")):
        other = state_bits(tmp_path / run)
        assert [k for k in a if a[k] != other[k]] == [name]
    assert repr(a["opt_state/nu"]).startswith("float32[2, 3] sha256 ")


def test_both_runs_end_before_doctor_reads_a_state_on_the_cpu(tmp_path, monkeypatch):
    # Reading a checkpoint starts a JAX backend in doctor's own process: on a GPU that client
    # held most of the device's memory while run b trained on it (it read run a's state between
    # the runs). Both runs now end first, and the reading backend is the CPU's. No process.
    import jax

    from sdcstudy.core import checkpoint

    events, read = [], checkpoint.final_state
    state = {"params": {"w": np.ones(2, np.float32)}, "step": np.asarray(1, np.int32)}

    def run(config_path, out):
        events.append(f"run {out.name}")
        _fake_run_folder(out, [{"step": 1, "lr": 0.0}], state)
        return subprocess.CompletedProcess([], 0, "", "")

    def final_state(run_dir):
        events.append(f"read {run_dir.name} on {jax.config.jax_platforms}")
        return read(run_dir)

    monkeypatch.setattr(doctor, "_run", run)
    monkeypatch.setattr(checkpoint, "final_state", final_state)
    monkeypatch.setattr(doctor, "fingerprint_lines", lambda env: [])
    was = jax.config.jax_platforms
    try:
        assert doctor.main(keep=tmp_path / "runs", progress=False) == 0
    finally:
        jax.config.update("jax_platforms", was)
    assert events == ["run a", "run b", "read a on cpu", "read b on cpu"]


def test_a_metric_differs_in_its_sign_bit_alone(tmp_path):
    # -0.0 == 0.0 in Python: a metric compared by value hid a flipped sign bit. Compiles nothing.
    view = {"compiled_step_sha256": "c", "param_digest": "p", "state": {},
            "metrics": [{"step": 1, "lr": 0.0, "faults/landed": 0}]}
    other = copy.deepcopy(view)
    other["metrics"][0]["lr"] = -0.0
    assert doctor.compare(view, other) == ["step 1: lr 0.0 vs -0.0 (run a vs run b)"]
    other["metrics"][0].update(lr=0.0, **{"faults/landed": 0.0})  # another type, other bits
    assert doctor.compare(view, other) == ["step 1: faults/landed 0 vs 0.0 (run a vs run b)"]


@pytest.mark.parametrize("returncode, stderr, garbage, code, sentence", [
    (-signal.SIGKILL, "", False, errors.EXIT_COULD_NOT_RUN,
     "run a was killed by SIGKILL: no output; no verdict"),
    (1, "sdcstudy: error: the loss became nan at step 3.\n", False, errors.EXIT_COULD_NOT_RUN,
     "run a failed (exit 1): sdcstudy: error: the loss became nan at step 3.; no verdict"),
    (errors.EXIT_SIGINT, "sdcstudy: interrupted\n", False, errors.EXIT_SIGINT,
     "run a was interrupted by SIGINT; no verdict: run sdcstudy doctor again"),
    (-signal.SIGTERM, "", False, errors.EXIT_SIGTERM,
     "run a was interrupted by SIGTERM; no verdict: run sdcstudy doctor again"),
    (0, "", True, errors.EXIT_COULD_NOT_RUN, "run a left no readable result (NotJsonLine: "),
])
def test_a_run_that_could_not_finish_is_no_verdict(tmp_path, capsys, monkeypatch, returncode,
                                                   stderr, garbage, code, sentence):
    # A run killed, crashed, interrupted or exiting 0 with a damaged folder is never a FAIL
    # (nor bad input, exit 2, for a file doctor itself made), and an earlier report at --json
    # is replaced, never left to read as this check's verdict. Starts no process.
    def run(config_path, out):
        if garbage:
            RF.atomic_write_text(out / RF.METRICS, "garbage\n")
        return subprocess.CompletedProcess([], returncode, "", stderr)

    monkeypatch.setattr(doctor, "_run", run)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"verdict": "PASS", "exit_code": 0}))
    assert doctor.main(json_path=report, keep=tmp_path / "runs", progress=False) == code
    err = capsys.readouterr().err
    assert f"sdcstudy doctor: {sentence}" in err and "Traceback" not in err
    written = json.loads(report.read_text())
    assert written["verdict"] is None and written["exit_code"] == code
    assert written["error"].startswith(sentence)


def test_the_fingerprint_on_screen_names_the_gpu_stack_and_the_xla_flags():
    # What the bits depend on beyond the Python packages (docs/guide.md, Determinism) is on
    # screen as in env.json: the GPU's driver and libraries where there are any, the XLA flags.
    env = {"packages": {"jax": "0.10.2", "jaxlib": "0.10.2"}, "platform": "gpu",
           "device_kinds": {"NVIDIA H200": 1}, "cpu": {"model": "Xeon", "isa": ["avx2"]},
           "gpu_stack": {"driver": "580.65.06", "cudnn": 91000, "wheels": {"nvidia-cublas": "13"}},
           "xla_flags": "--xla_gpu_deterministic_ops=true", "compiled_step_sha256": "ab" * 32}
    lines = doctor.fingerprint_lines(env)
    assert lines[0] == ("  jax 0.10.2 (jaxlib 0.10.2) on gpu (1 x NVIDIA H200); CPU Xeon "
                        "[avx2]")
    assert "  GPU stack: driver 580.65.06, cudnn 91000" in lines
    assert "  XLA_FLAGS: --xla_gpu_deterministic_ops=true" in lines
    assert lines[-1] == "  compiled step sha256 abababababababab..."
    env["gpu_stack"] = {}
    assert not any("GPU stack" in line for line in doctor.fingerprint_lines(env))


def test_a_run_that_prints_bytes_that_are_not_text_is_no_crash(tmp_path, capsys, monkeypatch):
    # A run whose output is not UTF-8 (a broken library, a dying process) ended doctor in a
    # UnicodeDecodeError; now it is the run's failure, named. The one child is a shell script.
    child = tmp_path / "child.sh"
    child.write_text("#!/bin/sh\nprintf 'garbage \\377\\376 on stdout'\n"
                     "printf 'garbage \\377\\376 on stderr' >&2\nexit 1\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    code = doctor.main(keep=tmp_path / "runs", progress=False)
    assert code == errors.EXIT_COULD_NOT_RUN
    sentence = "run a failed (exit 1): garbage \ufffd\ufffd on stderr; no verdict"
    assert sentence in capsys.readouterr().err
