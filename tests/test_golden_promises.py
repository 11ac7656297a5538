"""Promises of docs/golden.md, docs/fleet.md and docs/pairing.md that no other test held, each
checked without compiling a JAX program: a refusal said before JAX is imported, report files
that never leave an earlier report standing for a refused check, a measured overhead below 1x,
the collective timeout a user already set, the meeting's sentence for a process that comes late
and for many differing settings."""

import json
import os
import socket
import sys
import xml.etree.ElementTree as ET

import pytest

from sdcstudy import cli
from sdcstudy.core import config as C
from sdcstudy.core import rendezvous, runlock, xlaflags
from sdcstudy.fleet import strategies as FS
from sdcstudy.golden import contents as GCon
from sdcstudy.golden import devices as GV
from sdcstudy.golden import manifest as GM
from sdcstudy.golden.contents import Golden

FLIP_NEVER_LANDS = "flip:step=9,site=fwd/attn,layer=1,bit=30"  # a 3-step record below


def _without_the_recorder(monkeypatch):
    """Importing the recorder (and with it JAX's program) fails: a refusal that needs it comes
    too late."""
    monkeypatch.setitem(sys.modules, "sdcstudy.golden.record", None)


@pytest.mark.parametrize("held", [True, False], ids=["held", "not-empty"])
def test_golden_record_refuses_a_taken_folder_before_it_loads_jax(tmp_path, monkeypatch, capsys,
                                                                  held):
    """docs/golden.md: a second `golden record --out` the same folder "is refused at once,
    naming the first one's process", and an existing record is never overwritten. The refusal
    came after JAX was imported (3.5 s against 0.75 s for `run`); without the recorder module
    the command now still refuses, unchanged."""
    folder = tmp_path / "golden"
    folder.mkdir()
    (folder / "MANIFEST.json").write_text("the first record's\n")
    _without_the_recorder(monkeypatch)
    argv = ["golden", "record", "--out", str(folder), "--no-progress"]
    if held:
        (folder / "MANIFEST.json").unlink()
        with runlock.hold(folder, create=False):
            code = cli.main(argv)
    else:
        code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    if held:
        assert f"golden folder {str(folder)!r} is being written by process " in err, err
    else:
        assert "already exists and is not empty; a golden record is never overwritten" in err
        assert (folder / "MANIFEST.json").read_text() == "the first record's\n"
    assert err.count("\n") == 1


def _golden(folder) -> Golden:
    """A record of 3 steps and 2 microsteps with one site, read as `open_record` gives it."""
    cfg = C.from_dict({"experiment": {"mode": "train", "steps": 3, "microsteps": 2}})
    meta = {"steps": 3, "microsteps": 2, "site_order": ["attn_out/1"],
            "sites": {"attn_out/1": {"shape": [4, 8], "dtype": "float32"}}}
    return Golden(folder, "a" * 64, cfg, {"platform": "cpu"}, meta, {})


@pytest.mark.parametrize("argv, said", [
    (["check", "GOLDEN", "--device", "all", "--inject", FLIP_NEVER_LANDS],
     "step must be 1 to 3, not 9"),
    (["check", "GOLDEN", "--device", "all", "--inject", "flip:step=2,site=fwd/attn,layer=1,"
      "bit=30", "--inject-device", "99"], "local devices"),
    (["quorum", "--inject", FLIP_NEVER_LANDS, "--inject-device", "99"], "local devices"),
    (["quorum", "--inject", "no-such-profile"], "unknown fault profile"),
], ids=["check-flip", "check-inject-device", "quorum-inject-device", "quorum-profile"])
def test_a_check_of_every_device_refused_writes_its_reports(tmp_path, monkeypatch, capsys,
                                                            argv, said):
    """docs/golden.md: `--json` and `--junit` are "written for every verdict", and an
    injection that cannot land is INCONCLUSIVE (exit 2). With one device the check wrote its
    INCONCLUSIVE report; with `--device all` (and in a quorum) the refusal wrote nothing, and
    the report of an earlier check (a PASS, here) stood in the file the fleet reads."""
    monkeypatch.setattr(GCon, "open_record", lambda folder, sha=None: _golden(folder))
    # A quorum reads its injection before it prepares the data (seconds, and progress bars on
    # stderr around the one sentence).
    monkeypatch.setattr(GV, "load_tokens", lambda cfg: pytest.fail("the data was prepared"))
    report, junit = tmp_path / "node.json", tmp_path / "node.xml"
    report.write_text(json.dumps({"verdict": "PASS", "exit_code": 0}))
    junit.write_text("<testsuites/>")
    argv = ["golden", *[str(tmp_path / "g") if a == "GOLDEN" else a for a in argv],
            "--json", str(report), "--junit", str(junit)]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1, err
    written = json.loads(report.read_text())
    assert (written["verdict"], written["exit_code"], written["devices"]) == \
        ("INCONCLUSIVE", 2, []), written
    assert said in written["reason"] and written["command"] == argv[1]
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("errors")) == ("1", "1")
    assert said in suite.find("testcase/error").get("message")


def test_a_detector_measured_faster_than_none_costs_nothing(tmp_path):
    """docs/fleet.md: `--bench-detect` takes "median ratio to none minus 1 (at least 0)"; a
    noisy machine measured the monitor at 0.93x (docs/fleet.md), which must not become a
    negative overhead (a detector that speeds the job up)."""
    ratios = {"none": 1.0, "monitor": 0.93, "abft": 1.25, "shadow": 0.9}
    path = tmp_path / "detect.json"
    path.write_text(json.dumps({"suite": "detect", "results": [
        {"preset": "tiny", "n_params": 1, "ranks": 2,
         "variants": {k: {"ratio": {"median": v}} for k, v in ratios.items()}}]}))
    overheads, source = FS.bench_overheads(path)
    assert overheads["monitor"] == 0.0 and overheads["shadow"] == 0.0
    assert overheads["abft"] == pytest.approx(0.25)
    assert source["preset"] == "tiny" and source["ranks"] == 2


def test_the_collective_timeout_is_added_unless_one_is_set(monkeypatch):
    """docs/pairing.md, Timeouts: on CPU `--xla_cpu_collective_timeout_seconds=S` "is added to
    XLA_FLAGS unless it is already there" (a user's own value wins)."""
    flag = xlaflags.COLLECTIVE_TIMEOUT_FLAG
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert xlaflags.set_collective_timeout(300)
    assert f"{flag}=300" in os.environ["XLA_FLAGS"].split()
    monkeypatch.setenv("XLA_FLAGS", f"{flag}=7 --xla_force_host_platform_device_count=2")
    assert xlaflags.set_collective_timeout(300)
    assert os.environ["XLA_FLAGS"] == \
        f"{flag}=7 --xla_force_host_platform_device_count=2"


def test_a_process_that_comes_after_the_meeting_is_told_so():
    """docs/pairing.md, Launch mistakes: a process that comes after the others met finds jax's
    coordinator, not a process 0 waiting, and says so in one sentence at once (not after the
    whole timeout, blaming process 0). jax's own coordinator service stands for the run."""
    from jax._src.lib import _jax

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = _jax.get_distributed_runtime_service(f"127.0.0.1:{port}", 2)
    try:
        with pytest.raises(C.UserError) as refused:
            rendezvous.meet(f"127.0.0.1:{port}", 2, 1, 10, environ={})
    finally:
        service.shutdown()
    assert str(refused.value) == (
        f"process 1 of 2: what listens at 127.0.0.1:{port} is not a process 0 waiting for its "
        f"peers: that run has already met all its processes (was --process-id 1 given "
        f"twice?), or another program holds the port; check --coordinator.")


def test_many_differing_settings_are_named_three_and_counted():
    """docs/pairing.md: another config or --set names "up to three keys, then (and N more)"."""
    me = rendezvous.hello(2, 0, {f"optim.k{i}": i for i in range(5)})
    said = rendezvous.hello(2, 1, {f"optim.k{i}": i + 10 for i in range(5)})
    sentence = rendezvous.settings_problem(said, me)
    assert "with optim.k0=10, optim.k1=11 and optim.k2=12 and process 0 (" in sentence
    assert "with optim.k0=0, optim.k1=1 and optim.k2=2 (and 2 more): start every process " \
        "with the same config file and --set values." in sentence


def _sealed(folder, sizes=None) -> None:
    """A folder of the record's files, its manifest sealed over `sizes` (name -> bytes) in place
    of the files' own."""
    folder.mkdir()
    for name in GM.FILES:
        (folder / name).write_text("{}")
    manifest = GM.write_manifest(folder)
    body = manifest["body"]
    for name, size in (sizes or {}).items():
        body["files"][name]["bytes"] = size
    (folder / GM.MANIFEST).write_text(json.dumps({"body": body, "sha256": GM.body_sha256(body)}))


@pytest.mark.parametrize("name, limit", [(GM.CONFIG, 1 << 20), (GM.ENV, 1 << 20),
                                         (GM.META, 16 << 20)])
def test_a_record_file_larger_than_its_bound_is_refused_before_it_is_read(tmp_path, name, limit):
    """docs/golden.md: each file's size must be the manifest's before it is read, "and at most
    1 MiB for config.yaml, env.json and MANIFEST.json, 16 MiB for golden.json"."""
    _sealed(tmp_path / "at", {name: limit})
    with pytest.raises(GM.GoldenError, match=f"golden file {name} in .* is damaged "
                                             f"\\(2 bytes, the manifest says {limit}\\)"):
        GM.verify(tmp_path / "at")
    _sealed(tmp_path / "over", {name: limit + 1})
    with pytest.raises(GM.GoldenError, match=f"gives {name} a size of {limit + 1} bytes; at "
                                             f"most {limit} are read"):
        GM.read_manifest(tmp_path / "over")
