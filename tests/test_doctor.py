"""`sdcstudy doctor`: two separate processes must agree bit for bit, and a difference must show.

The module runs without the test session's compilation cache (tests/conftest.py, UNCACHED):
each process compiles its own program, so a compiler that is not deterministic would show.
"""

import copy
import json
import struct
import subprocess
import sys

from sdcstudy import doctor
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF


def test_two_processes_agree_bitwise(tmp_path, capsys):
    # The determinism claim of the whole project: the same config in two fresh processes
    # gives the same metrics, the same compiled program and the same parameters, bit for bit.
    code = doctor.main(json_path=tmp_path / "report.json", keep=tmp_path / "runs")
    out, err = capsys.readouterr()
    assert "sdcstudy doctor: 2/2 runs done [" in err  # the line counting its two runs
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0, out
    assert report["verdict"] == "PASS" and report["steps"] == doctor.DOCTOR["experiment"]["steps"]
    assert "PASS" in out
    for key in ("packages", "xla_flags", "device_kinds", "process_count", "cpu",
                "compiled_step_sha256"):
        assert key in report["env"]
    # Keep the two runs' views for the next assertion: flipping one bit of one loss must FAIL.
    a = doctor.deterministic_view(tmp_path / "runs" / "a")
    b = copy.deepcopy(a)
    bits = struct.unpack("<Q", struct.pack("<d", b["metrics"][7]["loss/healthy"]))[0]
    b["metrics"][7]["loss/healthy"] = struct.unpack("<d", struct.pack("<Q", bits ^ 1))[0]
    assert doctor.compare(a, a) == []
    assert doctor.compare(a, b) == ["step 8: loss/healthy differ"]


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
