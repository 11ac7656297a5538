"""`sdcstudy doctor`: two separate processes must agree bit for bit, and a difference must show."""

import copy
import json
import struct

from sdcstudy import doctor


def test_two_processes_agree_bitwise(tmp_path, capsys):
    # The determinism claim of the whole project: the same config in two fresh processes
    # gives the same metrics, the same compiled program and the same parameters, bit for bit.
    code = doctor.main(json_path=tmp_path / "report.json", keep=tmp_path / "runs")
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
