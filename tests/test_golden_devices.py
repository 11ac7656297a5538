"""Every local device in one command: `golden check --device all` names the one corrupted
device and passes the rest, `golden quorum` finds the same device with no golden record, and
bad input is one sentence and exit 2."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from sdcstudy import cli
from sdcstudy.core import config as C
from sdcstudy.golden import cli as GCLI
from sdcstudy.golden import contents as GCon
from sdcstudy.golden import devices as GV
from sdcstudy.golden import sizing as GS

# A short golden workload (the default's microsteps; one layer, fewer steps and tokens).
SHORT = ["--set", "experiment.steps=3", "--set", "data.seq_len=32", "--set", "model.n_layers=1"]
FLIP = "flip:step=2,site=fwd/attn,layer=1,bit=30"
BAD_DEVICE = 2
N_DEVICES = 3


def _sdcstudy(*argv, timeout=600):
    """The command line in a fresh process with N_DEVICES simulated devices."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={N_DEVICES}")
    return subprocess.run([sys.executable, "-m", "sdcstudy", *argv], env=env, timeout=timeout,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory):
    # Recorded with the devices the checks see: the device count is part of the stack.
    out = tmp_path_factory.mktemp("golden") / "short"
    proc = _sdcstudy("golden", "record", *SHORT, "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def check_all(golden_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("check")
    proc = _sdcstudy("golden", "check", str(golden_dir), "--device", "all", "--inject", FLIP,
                     "--inject-device", str(BAD_DEVICE), "--json", str(folder / "r.json"),
                     "--junit", str(folder / "r.xml"))
    return proc, json.loads((folder / "r.json").read_text()), folder / "r.xml"


def test_check_all_fails_the_injected_device_only(check_all):
    proc, report, _ = check_all
    assert proc.returncode == 1, proc.stderr
    assert report["verdict"] == "FAIL"
    verdicts = {row["device"]: row["verdict"] for row in report["devices"]}
    assert verdicts == {i: "FAIL" if i == BAD_DEVICE else "PASS" for i in range(N_DEVICES)}
    first = report["devices"][BAD_DEVICE]["first_difference"]
    assert (first["step"], first["microstep"], first["layer"], first["site"]) == \
        (2, 0, 1, "fwd/attn_out")
    assert f"device {BAD_DEVICE} FAIL: step 2, microstep 0, layer 1" in proc.stdout
    # Each device's verdict as it came, and the line counting the devices done (stderr).
    assert all(f"  device {i}: {'FAIL' if i == BAD_DEVICE else 'PASS'} (" in proc.stdout
               for i in range(N_DEVICES))
    assert f"golden check: {N_DEVICES}/{N_DEVICES} devices done [" in proc.stderr


def test_check_all_junit_has_one_case_per_device(check_all):
    _, _, junit = check_all
    cases = ET.parse(junit).getroot().findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == [f"device {i}" for i in range(N_DEVICES)]
    assert [c.find("failure") is not None for c in cases] == \
        [i == BAD_DEVICE for i in range(N_DEVICES)]


def test_quorum_finds_the_same_device_without_a_record(check_all, tmp_path):
    _, checked, _ = check_all
    proc = _sdcstudy("golden", "quorum", *SHORT, "--inject", FLIP, "--inject-device",
                     str(BAD_DEVICE), "--json", str(tmp_path / "q.json"))
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "q.json").read_text())
    assert report["verdict"] == "FAIL" and report["reference"] == 0
    assert report["groups"] == [[i for i in range(N_DEVICES) if i != BAD_DEVICE], [BAD_DEVICE]]
    assert [r["device"] for r in report["devices"] if r["verdict"] == "FAIL"] == [BAD_DEVICE]
    assert report["devices"][BAD_DEVICE]["first_difference"] == \
        checked["devices"][BAD_DEVICE]["first_difference"]
    assert f"golden quorum: {N_DEVICES}/{N_DEVICES} devices done [" in proc.stderr


@pytest.mark.parametrize("digests, majority, groups", [
    (["a", "a", "a"], [0, 1, 2], [[0, 1, 2]]),
    (["a", "b", "a", "a"], [0, 2, 3], [[0, 2, 3], [1]]),
    (["a", "a", "b", "b"], None, [[0, 1], [2, 3]]),
    (["a", "b", "c"], None, [[0], [1], [2]]),
])
def test_a_strict_majority_is_the_reference(digests, majority, groups):
    assert GV.vote(digests) == (majority, groups)


def test_a_device_whose_optimizer_state_alone_differs_is_outvoted():
    """A flipped bit of Adam's second moment at the end changes no step digest and no
    parameter: the vote must still see it (each device's final state is in its fingerprint),
    and the outvoted device's reason must say that its optimizer state differs."""
    import numpy as np

    def work(flip: bool):
        nu = np.ones(4, np.float32)
        if flip:
            nu.view(np.uint32)[0] ^= np.uint32(1)
        state = {"params": {"w": np.zeros(4, np.float32)}, "step": np.int32(1),
                 "opt_state": {"mu": np.zeros(4, np.float32), "nu": nu}}
        out = {"params": {"w": np.zeros((1, 2), np.uint32)}, "loss": np.uint32(7)}
        return SimpleNamespace(steps=1, run=lambda: iter([(0, out, state), (1, out, state)]))

    runs = []
    for device, flip in enumerate((False, True, False)):
        outs, final = GV._run(work(flip))
        runs.append({"device": device, "final": final, "digest": GV._fingerprint(outs, final)})
    majority, groups = GV.vote([run["digest"] for run in runs])
    assert (majority, groups) == ([0, 2], [[0, 2], [1]])
    assert GV._final_difference(runs[1], runs[0]) == "optimizer state"


def test_the_node_fails_if_any_device_fails():
    assert GV.node_verdict(["PASS", "INCONCLUSIVE", "FAIL"]) == "FAIL"
    assert GV.node_verdict(["PASS", "INCONCLUSIVE"]) == "INCONCLUSIVE"
    assert GV.node_verdict(["PASS", "PASS"]) == "PASS"


def test_a_reason_every_device_shares_is_printed_once():
    # Another software stack made every device INCONCLUSIVE with one reason, printed once per
    # device; now once for them all, in device order, apart from another device's own reason.
    stack = "the environment differs from the golden record's in device_count 8 -> 4."
    rows = [{"device": i, "verdict": "INCONCLUSIVE", "reason": stack} for i in (0, 1, 3)]
    rows.insert(2, {"device": 2, "verdict": "FAIL", "reason": "step 2 differs"})
    assert GCLI.same_reasons(rows) == [("devices 0, 1, 3", "INCONCLUSIVE", stack),
                                       ("device 2", "FAIL", "step 2 differs")]
    assert GCLI.device_names([4, 5, 6, 7]) == "devices 4 to 7"


@pytest.mark.parametrize("argv, message", [
    (["golden", "quorum", "--device", "0"], "give --device all"),
    (["golden", "quorum", "--inject-device", "1"], "--inject-device needs --inject"),
    (["golden", "quorum", "--inject", FLIP, "--inject-device", "99"], "has 8 local devices"),
    (["golden", "quorum", "--workers", "0"], "--workers must be at least 1"),
    (["golden", "check", "GOLDEN", "--device", "x"], "a device index or 'all'"),
    (["golden", "check", "GOLDEN", "--device", "1", "--inject", FLIP, "--inject-device", "1"],
     "--inject-device chooses among the devices of --device all"),
    # A flip that cannot land is refused once, before any device runs (it was one
    # INCONCLUSIVE row and reason per device).
    (["golden", "check", "GOLDEN", "--device", "all", "--inject",
      "flip:step=9,site=fwd/attn,layer=1,bit=30"], "step must be 1 to 3, not 9"),
    (["golden", "check", "GOLDEN", "--device", "all", "--inject",
      "flip:step=1,site=fwd/attn,layer=5,bit=30"], "has layers [1], not 5"),
    # The same in a quorum: refused before any device runs (it was refused after every device
    # had compiled and run the workload).
    (["golden", "quorum", *SHORT, "--inject", "flip:step=1,site=fwd/attn,layer=5,bit=30",
      "--inject-device", "1"], "has layers [1], not 5"),
    (["golden", "quorum", *SHORT, "--inject", "flip:step=9,site=fwd/attn,layer=1,bit=30",
      "--inject-device", "1"], "step must be 1 to 3, not 9"),
])
def test_bad_input_is_one_sentence_and_exit_2(argv, message, capsys, golden_dir):
    argv = [str(golden_dir) if a == "GOLDEN" else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_quorum_needs_three_devices(monkeypatch, capsys):
    import jax

    monkeypatch.setattr(jax, "local_devices", lambda: jax.devices()[:2])
    assert cli.main(["golden", "quorum"]) == 2
    assert "at least 3 local devices" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["golden", "check", "NOWHERE", "--device", "all"],
    ["golden", "check", "NOWHERE"],
    ["golden", "check", "DAMAGED", "--device", "all"],
    ["golden", "check", "AFILE", "--device", "all"],
    ["golden", "quorum", "NOWHERE.yaml"],
], ids=["check-all", "check-one", "check-all-damaged", "check-all-file", "quorum"])
def test_an_unusable_record_is_refused_once_before_jax(argv, tmp_path):
    # A typo in the golden path must cost one sentence and exit 2, not a line, a table row and
    # a reason per device: refused before JAX is imported and any device touched.
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "MANIFEST.json").write_text("{}")
    (tmp_path / "afile").write_text("")
    argv = [str(tmp_path / "nowhere") if a == "NOWHERE" else
            str(tmp_path / "damaged") if a == "DAMAGED" else
            str(tmp_path / "afile") if a == "AFILE" else
            str(tmp_path / "nowhere.yaml") if a == "NOWHERE.yaml" else a for a in argv]
    code = ("import sys; from sdcstudy import cli; "
            f"rc = cli.main({argv!r}); print(rc, 'jax' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("sdcstudy: error: ")
    if argv[2].endswith("afile"):  # named as a file (it was said not to exist)
        assert "is a file, not a folder" in done.stderr, done.stderr
    else:
        assert ("does not exist" in done.stderr) or ("damaged" in done.stderr)


class _Recorder:
    """A progress line that keeps what is written and counts the devices done."""

    def __init__(self):
        self.lines, self.count = [], 0
        self.changed = threading.Condition()

    def write(self, text):
        with self.changed:
            self.lines.append(text)

    def advance(self, n=1):
        with self.changed:
            self.count += n
            self.changed.notify_all()


def test_device_lines_come_in_device_order_whichever_finishes_first(monkeypatch, capsys):
    # The devices finish last to first (each waits until every higher-numbered one is counted
    # done): each device's line must still come in device order (it came in the order they
    # finished), and the summary must say the devices ran at once, so that their seconds,
    # which add up to more than the total, are not read as a sequence.
    n = 3
    line = _Recorder()

    def last_to_first(golden, *, inject=None, device_index=0, **options):
        with line.changed:
            assert line.changed.wait_for(lambda: line.count >= n - 1 - device_index, 30)
        return {"verdict": "PASS", "reason": "equal", "first_difference": None,
                "inject": inject, "coverage": None, "device": {"kind": "cpu"},
                "timing": {"total_s": 10.0 + device_index}}

    monkeypatch.setattr(GV, "check", last_to_first)
    monkeypatch.setattr(GV, "backend_devices", lambda: [object()] * n)
    monkeypatch.setattr(GV, "ticking", lambda *a, **k: contextlib.nullcontext(line))
    golden = GCon.Golden(Path("g"), "0" * 64, C.from_dict(GS.TINY), {}, {}, {})
    report = GV.check_all(golden, workers=n)
    assert line.lines == [f"  device {i}: PASS ({10.0 + i:.1f} s)" for i in range(n)]
    assert [row["device"] for row in report["devices"]] == list(range(n))
    for row in report["devices"]:
        row.pop("report")
    GCLI._finish(SimpleNamespace(json=None, junit=None), report)
    out = capsys.readouterr().out
    assert f"golden check PASS: {n} device(s), 0 not PASS, " in out
    assert f" s wall time ({n} devices at a time: their seconds overlap)" in out


def test_an_interrupt_does_not_wait_for_the_devices_still_running():
    # Ctrl-C or SIGTERM reaches the main thread while devices compile or run (minutes on a
    # GPU): the command must stop at once (exit 130, 143), not after every device started or
    # queued has finished, which a scheduler's grace period would end with SIGKILL.
    release = threading.Event()
    ran = []

    def device(index):
        if index == 0:
            raise KeyboardInterrupt
        ran.append(index)
        release.wait(30)
        return index

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        GV.in_threads(device, 4, 2)
    waited = time.monotonic() - started
    release.set()
    assert waited < 10, f"the interrupt waited {waited:.0f} s for the running devices"
    assert 3 not in ran  # a device not started never starts


def test_sigterm_during_a_check_of_every_device_is_143_never_fail(golden_dir):
    # An interrupted check is no verdict: exit 143, one sentence, and no FAIL anywhere that a
    # fleet script would read as "drain this node".
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={N_DEVICES}")
    proc = subprocess.Popen([sys.executable, "-m", "sdcstudy", "golden", "check",
                             str(golden_dir), "--device", "all", "--workers", "1",
                             "--no-progress"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # device 0 done; device 1 runs, device 2 waits
        assert first.startswith("  device 0: PASS"), first
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, (out, err)
    assert "FAIL" not in first + out + err
    assert err.strip().splitlines()[-1] == "sdcstudy: terminated (SIGTERM)"
