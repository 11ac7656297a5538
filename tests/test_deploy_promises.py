"""deploy/README.md's promises to the fleet engineer that tests/test_deploy.py does not hold
yet: a check that crashed before it could report, or whose log could not be opened, is never a
FAIL; sdcstudy's own FAIL output (its verdict line and report) drains, taints and fails the Job;
missing tools, an empty stack id, the settings file, a stale status of an earlier run, paths
with spaces.

Each runs the scripts for real with the fakes of tests/test_deploy.py (no JAX, no cluster).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_deploy import (DEPLOY, FAIL_REASON, FAIL_REPORT, NODE, PASS_REPORT, TRACEBACK,
                         Fakes, alerts, container_env, drain_call, kubernetes_actions,
                         manifest_container, run_daemonset, run_reproduce, run_slurm)

# A real Python whose `-m` module is not installed: exit 1 and a traceback, as a broken install
# of sdcstudy (its venv without a dependency, an image without the package) ends.
BROKEN_INSTALL = f"{sys.executable} -m sdcstudy_not_installed_here"


@pytest.fixture
def fakes(tmp_path) -> Fakes:
    return Fakes(tmp_path)


# --- exit 1 is a FAIL only with the FAIL verdict ------------------------------------------------


def test_slurm_crash_with_exit_1_never_drains(fakes):
    """A Python stopped by an error before sdcstudy could report exits 1 with no verdict: an
    alert naming the error, the node left as it is, exit 0, even with the drain switch."""
    result = run_slurm(fakes, 0, SDC_CMD=BROKEN_INSTALL, SDC_DRAIN_ON_INCONCLUSIVE="1")
    assert result.returncode == 0, result.stderr
    assert fakes.calls("scontrol") == []
    [message] = alerts(fakes)
    assert f"{NODE} golden check ERROR (exit 1, could not run or report)" in message
    assert "without a FAIL verdict" in message
    assert "No module named sdcstudy_not_installed_here" in message


def test_slurm_fail_verdict_with_no_report_still_drains(fakes):
    """The printed verdict alone is enough (an unwritable --json keeps the verdict's code), and
    a FAIL row in the report alone is enough too."""
    run_slurm(fakes, 1, report=None, FAKE_VERDICT="FAIL")
    run_slurm(fakes, 1, FAKE_VERDICT="")
    generic, from_report = fakes.calls("scontrol")
    assert generic[3].startswith("Reason=sdcstudy golden FAIL: exit 1, no readable report")
    assert from_report == drain_call(FAIL_REASON)


def test_daemonset_crash_with_exit_1_labels_error_and_never_taints(fakes):
    """The DaemonSet: an exit 1 with no FAIL verdict is error, no taint, with the traceback's
    last line as the reason."""
    run_daemonset(fakes, 1, FAKE_REPORT="", FAKE_VERDICT="", FAKE_STDERR=TRACEBACK)
    assert kubernetes_actions(fakes) == {"sdcstudy.io/golden=error"}
    (annotate,) = [c for c in fakes.calls("kubectl") if c[0] == "annotate"]
    assert "sdcstudy.io/golden-exit-code=1" in annotate
    assert ("sdcstudy.io/golden-reason=exit 1 without a FAIL verdict (a crash): "
            "ModuleNotFoundError: No module named 'yaml'") in annotate


def run_job(fakes: Fakes, rc: int, report: dict | None, **extra: str):
    container = manifest_container("job.yaml", "golden-check")
    env = {**container_env(container), **fakes.env(rc, report), "REPORT_DIR": str(fakes.root),
           **extra}
    return subprocess.run(["sh", "-c", container["args"][0]], env=env, capture_output=True,
                          text=True, timeout=30)


def test_job_crash_with_exit_1_is_exit_3(fakes):
    """The Job's exit 1 means FAIL: a crash that exited 1 leaves the container with 3 (ERROR);
    a FAIL with its verdict keeps 1. The check's output still reaches the log."""
    crashed = run_job(fakes, 1, None, FAKE_STDERR=TRACEBACK)
    failed = run_job(fakes, 1, FAIL_REPORT)
    assert crashed.returncode == 3 and failed.returncode == 1, crashed.stdout + failed.stdout
    assert "No module named 'yaml'" in crashed.stdout
    assert f"golden check on {NODE}: exit 3" in crashed.stdout
    assert "golden check FAIL: 3 device(s)" in failed.stdout
    assert json.dumps(FAIL_REPORT) in failed.stdout  # the report, printed after the output


# --- what the real command prints and writes ---------------------------------------------------

# A stand-in `sdcstudy golden check|quorum ... --json J --junit X` that prints and writes what
# the real command does for the device rows in $FAKE_ROWS: sdcstudy's own `_finish` (the table,
# the verdict line, then the report files), without JAX. If the verdict line or the report's
# fields change, the scripts stop seeing a real FAIL, and these tests say so.
REAL_PRINTING = f"""#!{sys.executable}
import argparse, json, os, sys, time
from pathlib import Path
from sdcstudy.golden.cli import _finish
from sdcstudy.golden.report import node_report
argv = sys.argv[1:]
def after(flag):
    return Path(argv[argv.index(flag) + 1]) if flag in argv else None
args = argparse.Namespace(json=after("--json"), junit=after("--junit"))
report = node_report(argv[1], json.loads(os.environ["FAKE_ROWS"]), time.time(), workers=1)
sys.exit(_finish(args, report))
"""


def device_row(index: int, verdict: str, first: dict | None = None, reason=None) -> dict:
    """One device's row as `golden.devices.check_all` makes it."""
    return {"device": index, "kind": "cpu", "verdict": verdict, "reason": reason,
            "first_difference": first, "injected": None, "seconds": 12.5, "coverage": None}


REAL_FAIL_ROWS = json.dumps([
    device_row(0, "PASS"),
    device_row(3, "FAIL", {"step": 3, "microstep": 0, "layer": 2, "site": "fwd/attn_out",
                           "kind": "activation"}, "step 3, microstep 0, layer 2, fwd/attn_out")])
REAL_FAIL_WHERE = "device 3: step 3, microstep 0, layer 2, site fwd/attn_out"


def test_the_real_fail_output_drains_taints_and_fails_the_job(fakes):
    """sdcstudy's own FAIL output and report: the Slurm script drains naming where the device
    first differed (with jq, and with python3 alone), the DaemonSet taints, the Job exits 1."""
    fakes.write("sdcstudy", REAL_PRINTING)
    result = run_slurm(fakes, 1, report=None, FAKE_ROWS=REAL_FAIL_ROWS)
    assert result.returncode == 1, result.stderr
    fakes.write("jq", "#!/bin/sh\nexit 1\n")
    run_slurm(fakes, 1, report=None, FAKE_ROWS=REAL_FAIL_ROWS)
    assert fakes.calls("scontrol") == 2 * [drain_call(f"sdcstudy golden FAIL: {REAL_FAIL_WHERE}")]

    run_daemonset(fakes, 1, FAKE_REPORT="", FAKE_VERDICT="", FAKE_ROWS=REAL_FAIL_ROWS)
    assert "sdcstudy.io/sdc=fail:NoSchedule" in kubernetes_actions(fakes)
    (annotate,) = [c for c in fakes.calls("kubectl") if c[0] == "annotate"]
    assert f"sdcstudy.io/golden-reason=FAIL {REAL_FAIL_WHERE}" in annotate

    job = run_job(fakes, 1, None, FAKE_ROWS=REAL_FAIL_ROWS)
    assert job.returncode == 1, job.stdout


def test_the_real_pass_output_admits(fakes):
    """sdcstudy's own PASS output: logged, the node left as it is, exit 0."""
    fakes.write("sdcstudy", REAL_PRINTING)
    result = run_slurm(fakes, 0, report=None, FAKE_ROWS=json.dumps([device_row(0, "PASS")]))
    assert result.returncode == 0, result.stderr
    assert fakes.calls("scontrol") == [] and alerts(fakes) == []
    assert any(f"{NODE} PASS: every device passed" in c[-1] for c in fakes.calls("logger"))


# --- where the check's files go ---------------------------------------------------------------

UNWRITABLE = Path("/proc")  # exists, and no file can be made in it, not even by root


@pytest.mark.skipif(not (UNWRITABLE / "self").exists(), reason="needs Linux's /proc")
def test_unwritable_report_dir_is_never_a_fail(fakes):
    """A SDC_REPORT_DIR that exists but takes no file (a read-only /var/log): the check runs
    with its files in a new folder under TMPDIR, with a warning; where no folder can be made
    at all, the check is not run and it is ERROR. Either way no drain: bash's exit 1 for a log
    it could not open is no FAIL."""
    tmp = fakes.root / "tmp"
    tmp.mkdir()
    result = run_slurm(fakes, 0, SDC_REPORT_DIR=str(UNWRITABLE), TMPDIR=str(tmp))
    assert result.returncode == 0, result.stderr
    (call,) = fakes.calls("sdcstudy")
    report = Path(call[call.index("--json") + 1])
    assert report.parent.parent == tmp and json.loads(report.read_text()) == PASS_REPORT
    assert any(f"cannot write in {UNWRITABLE}" in c[-1] for c in fakes.calls("logger"))
    assert fakes.calls("scontrol") == []

    result = run_slurm(fakes, 0, SDC_REPORT_DIR=str(UNWRITABLE), TMPDIR=str(UNWRITABLE),
                       SDC_DRAIN_ON_INCONCLUSIVE="1")
    assert result.returncode == 0, result.stderr
    assert len(fakes.calls("sdcstudy")) == 1  # not run the second time
    assert fakes.calls("scontrol") == []
    assert "ERROR (exit 3, could not run or report): no folder to write the check's log in" \
        in alerts(fakes)[-1]


def test_empty_stack_id_is_an_error_without_a_check(fakes):
    """An empty stack-id file names no record: ERROR without running the check (not a check
    of SDC_GOLDEN_ROOT itself), as an unreadable one."""
    stack_id = fakes.root / "stack-id"
    stack_id.write_text(" \n")
    result = run_slurm(fakes, 0, SDC_GOLDEN="", SDC_STACK_ID_FILE=str(stack_id),
                       SDC_DRAIN_ON_INCONCLUSIVE="1")
    assert result.returncode == 0 and fakes.calls("sdcstudy") == []
    assert fakes.calls("scontrol") == []
    assert "ERROR (exit 3, could not run or report): no golden record" in alerts(fakes)[0]


# --- missing tools -----------------------------------------------------------------------------


def path_without(fakes: Fakes, *missing: str) -> str:
    """A PATH of the fakes and the tools the script uses, less `missing` (and less logger)."""
    (fakes.bin / "logger").unlink()
    tools = fakes.root / "tools"
    tools.mkdir()
    for name in ("basename", "bash", "cat", "cp", "cut", "date", "grep", "jq", "mkdir", "mktemp",
                 "sleep", "tail", "timeout", "tr"):
        if name not in missing and shutil.which(name):
            (tools / name).symlink_to(shutil.which(name))
    return f"{fakes.bin}:{tools}"


def test_without_logger_every_line_goes_to_stderr(fakes):
    """No logger: the script's lines go to stderr (tagged and with their priority), and a FAIL
    still drains with the first difference."""
    path = path_without(fakes)
    result = run_slurm(fakes, 0, PATH=path)
    assert result.returncode == 0, result.stderr
    assert f"sdcstudy-golden: info: {NODE} PASS: every device passed" in result.stderr
    result = run_slurm(fakes, 1, PATH=path)
    assert result.returncode == 1, result.stderr
    assert f"sdcstudy-golden: err: draining {NODE}: {FAIL_REASON[:40]}" in result.stderr
    assert fakes.calls("scontrol") == [drain_call(FAIL_REASON)]


def test_without_timeout_the_check_runs_with_a_warning(fakes):
    """No `timeout` command: SDC_TIMEOUT cannot be applied; the check runs unlimited and the
    log says so, instead of silently promising a limit."""
    result = run_slurm(fakes, 0, PATH=path_without(fakes, "timeout"), SDC_TIMEOUT="50")
    assert result.returncode == 0, result.stderr
    assert "sdcstudy-golden: warning: no timeout command: SDC_TIMEOUT=50" in result.stderr
    assert len(fakes.calls("sdcstudy")) == 1


# --- stale state, paths with spaces ---------------------------------------------------------------


def test_daemonset_rerun_reads_nothing_of_the_run_before(fakes):
    """golden-check run again in the same pod (its status emptyDir kept): a crash now must not
    be annotated with the FAIL report of the run before."""
    status = fakes.root / "status"
    status.mkdir()
    (status / "report.json").write_text(json.dumps(FAIL_REPORT))
    (status / "reason").write_text("FAIL device 3: step 3")
    run_daemonset(fakes, 3, FAKE_REPORT="", FAKE_STDERR="sdcstudy: error: could not run: X")
    (annotate,) = [c for c in fakes.calls("kubectl") if c[0] == "annotate"]
    assert "sdcstudy.io/golden-reason=could not run: X" in annotate
    assert kubernetes_actions(fakes) == {"sdcstudy.io/golden=error"}


def test_paths_with_spaces(fakes):
    """A golden folder, report folder and status folder with spaces reach the check as one
    argument each, and a FAIL still drains or taints with its first difference."""
    golden, reports = fakes.root / "gold en", fakes.root / "my reports"
    result = run_slurm(fakes, 1, SDC_GOLDEN=str(golden), SDC_REPORT_DIR=str(reports))
    assert result.returncode == 1, result.stderr
    (call,) = fakes.calls("sdcstudy")
    assert call[2] == str(golden) and Path(call[call.index("--json") + 1]).parent == reports
    assert fakes.calls("scontrol") == [drain_call(FAIL_REASON)]

    run_daemonset(fakes, 1, STATUS_DIR=str(fakes.root / "st atus"),
                  GOLDEN_DIR=str(golden))
    call = fakes.calls("sdcstudy")[-1]
    assert call[2] == str(golden)
    assert call[call.index("--json") + 1] == str(fakes.root / "st atus" / "report.json")
    assert "sdcstudy.io/sdc=fail:NoSchedule" in kubernetes_actions(fakes)



def test_settings_file_wins_over_the_environment(fakes):
    """A value in SDC_CONFIG wins over the same variable in the environment (slurmd gives a
    prolog no environment of the admin's choosing); one it does not set keeps the
    environment's."""
    config = fakes.root / "healthcheck env"
    config.write_text(f"SDC_GOLDEN='{fakes.root / 'from file'}'\n")
    run_slurm(fakes, 0, SDC_CONFIG=str(config), SDC_GOLDEN="/from/environment",
              SDC_EXTRA_ARGS="--repeat 2")
    (call,) = fakes.calls("sdcstudy")
    assert call[2] == str(fakes.root / "from file") and call[-2:] == ["--repeat", "2"]


def test_the_job_changes_nothing_on_the_node():
    """The Job's pod has no API token and its script calls no kubectl: its verdict is its exit
    code alone."""
    (job,) = list(yaml.safe_load_all((DEPLOY / "k8s" / "job.yaml").read_text()))
    spec = job["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    (container,) = spec["containers"]
    assert "kubectl" not in container["args"][0] and "scontrol" not in container["args"][0]


def test_reproduce_array_refuses_an_array_that_is_not_one_range(fakes):
    """--array=3,5 (two failed shards of eight, submitted again) would run shards 0/2 and 2/2,
    other runs than shards 3 and 5: refused in one sentence, exit 2, nothing run. One range
    (5-8) runs as before."""
    for shards in ({}, {"SDC_SHARDS": "8"}):
        result = run_reproduce(fakes, SLURM_ARRAY_TASK_ID="3", SLURM_ARRAY_TASK_MIN="3",
                               SLURM_ARRAY_TASK_MAX="5", SLURM_ARRAY_TASK_COUNT="2", **shards)
        assert result.returncode == 2
        assert "not the one range 3-5" in result.stderr and len(result.stderr.splitlines()) == 1
    assert fakes.calls("sdcstudy") == []
    result = run_reproduce(fakes, SLURM_ARRAY_TASK_ID="7", SLURM_ARRAY_TASK_MIN="5",
                           SLURM_ARRAY_TASK_MAX="8", SLURM_ARRAY_TASK_COUNT="4")
    assert result.returncode == 0, result.stderr
    assert fakes.calls("sdcstudy")[0][5:7] == ["--shard", "2/4"]
