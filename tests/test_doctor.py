"""`sdcstudy doctor`: two separate processes must agree bit for bit, and a difference must show."""

import copy
import json
import struct

from sdcstudy import doctor


def test_two_processes_agree_bitwise(tmp_path, capsys, monkeypatch):
    # The determinism claim of the whole project: the same config in two fresh processes
    # gives the same metrics, the same compiled program and the same parameters, bit for bit.
    # With JAX's persistent compilation cache on, the second process loads the first one's
    # executable, whose HLO text carries the first one's op metadata: the program's hash must
    # not see that (it once did, and doctor failed for users of the cache).
    cache = tmp_path / "xla-cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    code = doctor.main(json_path=tmp_path / "report.json", keep=tmp_path / "runs")
    assert any(cache.iterdir()), "the premise: the first process filled the cache"
    out = capsys.readouterr().out
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
