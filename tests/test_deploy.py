"""The deployment examples under deploy/ run and do what deploy/README.md says.

The Slurm script and the DaemonSet's container scripts are run for real, with a fake
`sdcstudy` (exits with a chosen code after writing a chosen JSON report) and fake `scontrol`,
`logger` and `kubectl` that record their arguments; the README's exit-code table is parsed and
each row is run. The manifests are loaded and the fields Kubernetes requires are checked one by
one. Nothing here needs JAX, Slurm or a cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SLURM_SCRIPT = DEPLOY / "slurm" / "sdc-healthcheck.sh"
README = DEPLOY / "README.md"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
NODE = "node017"
SEP = "\x1f"  # the fakes write one line per call, arguments separated by this

FAIL_REPORT = {
    "schema": "sdcstudy-golden-devices/1", "verdict": "FAIL", "exit_code": 1,
    "devices": [
        {"device": 0, "verdict": "PASS", "first_difference": None, "seconds": 12.3,
         "reason": None},
        {"device": 3, "verdict": "FAIL", "seconds": 12.9,
         "first_difference": {"step": 3, "microstep": 0, "layer": 2, "site": "fwd/attn_out",
                              "kind": "activation"},
         "reason": "step 3, microstep 0, layer 2, fwd/attn_out (fwd/attn): ..."},
        {"device": 5, "verdict": "FAIL", "seconds": 13.1,
         "first_difference": {"step": 1, "layer": 0, "site": "bwd/ffn_in"}, "reason": "..."},
    ]}
FAIL_REASON = ("sdcstudy golden FAIL: device 3: step 3, microstep 0, layer 2, site fwd/attn_out"
               " (+1 more)")
INCONCLUSIVE_REPORT = {
    "verdict": "INCONCLUSIVE", "exit_code": 2,
    "devices": [{"device": 0, "verdict": "INCONCLUSIVE", "first_difference": None,
                 "seconds": 1.0, "reason": "the environment differs: packages.jax"}]}
PASS_REPORT = {"verdict": "PASS", "exit_code": 0,
               "devices": [{"device": 0, "verdict": "PASS", "first_difference": None,
                            "seconds": 12.0, "reason": None}]}
REPORTS = {0: PASS_REPORT, 1: FAIL_REPORT, 2: INCONCLUSIVE_REPORT}

FAKE_SDCSTUDY = f"""#!/bin/bash
# Records its arguments, prints the verdict line $FAKE_VERDICT as `golden check|quorum` prints
# it (before any report), copies $FAKE_REPORT to the --json path, says $FAKE_STDERR on stderr,
# exits $FAKE_RC.
{{ printf '%s{SEP}' "$@"; echo; }} >> "$FAKE_LOG/sdcstudy.calls"
if [ -n "${{FAKE_VERDICT:-}}" ]; then
    echo "golden $2 $FAKE_VERDICT: 3 device(s), 2 not PASS, 13.1 s wall time"
fi
if [ -n "${{FAKE_STDERR:-}}" ]; then echo "$FAKE_STDERR" >&2; fi
json=""
while [ $# -gt 0 ]; do
    if [ "$1" = --json ]; then json=$2; shift; fi
    shift
done
if [ -n "$json" ] && [ -n "${{FAKE_REPORT:-}}" ]; then cp "$FAKE_REPORT" "$json"; fi
if [ -n "${{FAKE_SLEEP:-}}" ]; then exec sleep "$FAKE_SLEEP"; fi
exit "${{FAKE_RC:-0}}"
"""
FAKE_RECORDER = f"""#!/bin/bash
# Records its arguments; exits $FAKE_<NAME>_RC (default 0).
name=$(basename "$0")
{{ printf '%s{SEP}' "$@"; echo; }} >> "$FAKE_LOG/$name.calls"
if [ "$name" = kubectl ] && [ "$1" = get ]; then printf '%s' "${{FAKE_TAINT_KEYS:-}}"; fi
if [ "$name" = scontrol ]; then exit "${{FAKE_SCONTROL_RC:-0}}"; fi
exit 0
"""
FAILING = "#!/bin/sh\nexit 1\n"


class Fakes:
    """A bin folder of fake commands (first on PATH) and the calls they recorded."""

    def __init__(self, root: Path):
        self.root, self.bin, self.log = root, root / "bin", root / "calls"
        self.bin.mkdir()
        self.log.mkdir()
        self.write("sdcstudy", FAKE_SDCSTUDY)
        for name in ("scontrol", "logger", "kubectl"):
            self.write(name, FAKE_RECORDER)

    def write(self, name: str, text: str) -> None:
        path = self.bin / name
        path.write_text(text)
        path.chmod(0o755)

    def calls(self, name: str) -> list[list[str]]:
        path = self.log / f"{name}.calls"
        if not path.exists():
            return []
        return [line.split(SEP)[:-1] for line in path.read_text().splitlines()]

    def env(self, rc: int = 0, report: dict | None = None, **extra: str) -> dict[str, str]:
        env = {"PATH": f"{self.bin}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               "HOME": str(self.root), "FAKE_LOG": str(self.log), "FAKE_RC": str(rc)}
        if report is not None:
            path = self.root / "fixture.json"
            path.write_text(json.dumps(report))
            env["FAKE_REPORT"] = str(path)
            if report.get("devices"):  # a refused record prints no verdict line, only stderr
                env["FAKE_VERDICT"] = report["verdict"]
        return {**env, **extra}


@pytest.fixture
def fakes(tmp_path) -> Fakes:
    return Fakes(tmp_path)


def run_slurm(fakes: Fakes, rc: int = 0, report: dict | None | str = "default",
              **settings: str):
    """The Slurm script with the fake sdcstudy exiting `rc` after writing `report` (by default
    the one of REPORTS for rc; None: none at all); settings are SDC_* variables."""
    env = fakes.env(rc, REPORTS.get(rc) if report == "default" else report,
                    SDC_CONFIG=str(fakes.root / "no-such-file.env"),
                    SDC_CMD=str(fakes.bin / "sdcstudy"), SDC_GOLDEN=str(fakes.root / "golden"),
                    SDC_REPORT_DIR=str(fakes.root / "reports"), SDC_NODE=NODE, SDC_TIMEOUT="60")
    env.update(settings)
    return subprocess.run(["bash", str(SLURM_SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=30)


def drain_call(reason: str) -> list[str]:
    return ["update", f"NodeName={NODE}", "State=DRAIN", f"Reason={reason}"]


# --- syntax -----------------------------------------------------------------------------------


def test_every_shell_script_parses():
    """bash -n on every .sh under deploy/: a syntax error would stop the prolog on every node."""
    scripts = sorted(DEPLOY.rglob("*.sh"))
    assert SLURM_SCRIPT in scripts
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def container_scripts() -> list[tuple[str, str]]:
    """(manifest/container, script) for every container that runs `/bin/sh -c SCRIPT`."""
    found = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            for container in pod_containers(doc):
                if container.get("command") == ["/bin/sh", "-c"]:
                    found.append((f"{path.name}/{container['name']}", container["args"][0]))
    return found


def test_every_manifest_script_parses_in_posix_sh():
    """The manifests' scripts run under the image's /bin/sh, which need not be bash."""
    scripts = container_scripts()
    assert {name for name, _ in scripts} >= {"daemonset.yaml/golden-check",
                                             "daemonset.yaml/label-node",
                                             "job.yaml/golden-check"}
    shell = shutil.which("dash") or "sh"
    for name, script in scripts:
        result = subprocess.run([shell, "-n", "-c", script], capture_output=True, text=True)
        assert result.returncode == 0, f"{name}: {result.stderr}"


# --- the Slurm decision table, run for real ---------------------------------------------------


def test_pass_logs_and_leaves_the_node(fakes):
    """PASS: logged, no scontrol call, exit 0 (a prolog lets the job start)."""
    result = run_slurm(fakes, 0)
    assert result.returncode == 0, result.stderr
    assert fakes.calls("scontrol") == []
    assert any("PASS" in call[-1] for call in fakes.calls("logger"))


def test_check_is_called_as_the_docs_say(fakes):
    """golden check GOLDEN --device all --json F --junit F, with F in SDC_REPORT_DIR."""
    run_slurm(fakes, 0)
    (call,) = fakes.calls("sdcstudy")
    assert call[:5] == ["golden", "check", str(fakes.root / "golden"), "--device", "all"]
    report = Path(call[call.index("--json") + 1])
    assert report.parent == fakes.root / "reports" and report.suffix == ".json"
    assert json.loads(report.read_text())["verdict"] == "PASS"  # the fake wrote it there
    assert call[call.index("--junit") + 1].endswith(".xml")


def test_fail_drains_once_naming_the_first_difference(fakes):
    """A FAIL must drain the node with the device, step, layer and site in the reason, and
    exit non-zero so that a prolog keeps the job off the node."""
    result = run_slurm(fakes, 1)
    assert result.returncode == 1
    assert fakes.calls("scontrol") == [drain_call(FAIL_REASON)]


@pytest.mark.parametrize("reader", ["python3", "generic"])
def test_fail_reason_without_jq(fakes, reader):
    """Without jq the reason comes from python3, word for word the same; without either it
    still drains, with a generic reason naming the report."""
    fakes.write("jq", FAILING)
    if reader == "generic":
        fakes.write("python3", FAILING)
    result = run_slurm(fakes, 1)
    assert result.returncode == 1
    (call,) = fakes.calls("scontrol")
    if reader == "python3":
        assert call == drain_call(FAIL_REASON)
    else:
        assert call[:3] == drain_call("")[:3]
        assert re.fullmatch(r"Reason=sdcstudy golden FAIL: exit 1, no readable report \(see "
                            r".*/reports/golden-.*\.log\)", call[3]), call[3]


def test_fail_without_a_report_still_drains(fakes):
    """A FAIL whose JSON was never written (the verdict is printed before the report, and an
    unwritable report keeps the verdict's code) still drains."""
    result = run_slurm(fakes, 1, report=None, FAKE_VERDICT="FAIL")
    assert result.returncode == 1
    (call,) = fakes.calls("scontrol")
    assert call[3].startswith("Reason=sdcstudy golden FAIL: exit 1, no readable report")


def test_fail_still_exits_non_zero_when_scontrol_fails(fakes):
    """A drain that did not happen must not turn into a pass: the prolog still fails."""
    result = run_slurm(fakes, 1, FAKE_SCONTROL_RC="1")
    assert result.returncode == 1
    assert any("could not drain" in call[-1] for call in fakes.calls("logger"))


def test_inconclusive_only_logs(fakes):
    """INCONCLUSIVE (another stack, a damaged golden) says nothing about the hardware: log the
    reason from the report, leave the node, exit 0."""
    result = run_slurm(fakes, 2)
    assert result.returncode == 0, result.stderr
    assert fakes.calls("scontrol") == []
    (message,) = [c[-1] for c in fakes.calls("logger") if "INCONCLUSIVE" in c[-1]]
    assert "packages.jax" in message and "node left as it is" in message


def test_inconclusive_drains_when_asked(fakes):
    """SDC_DRAIN_ON_INCONCLUSIVE=1: drain with the report's reason and fail the prolog."""
    result = run_slurm(fakes, 2, SDC_DRAIN_ON_INCONCLUSIVE="1")
    assert result.returncode == 2
    assert fakes.calls("scontrol") == [drain_call(
        "sdcstudy golden INCONCLUSIVE: device 0: the environment differs: packages.jax")]


REFUSED = {"verdict": "INCONCLUSIVE", "devices": [], "failed_stage": "golden",
           "reason": "no golden record in golden: run sdcstudy golden record first."}


@pytest.mark.parametrize("reader", ["jq", "python3"])
def test_refused_record_drains_with_its_sentence(fakes, reader):
    """A record refused before any device ran (a node report with no device rows) must drain
    with the record's sentence, not with "no readable report"."""
    if reader == "python3":
        fakes.write("jq", FAILING)
    result = run_slurm(fakes, 2, report=REFUSED, SDC_DRAIN_ON_INCONCLUSIVE="1")
    assert result.returncode == 2
    assert fakes.calls("scontrol") == [drain_call(
        "sdcstudy golden INCONCLUSIVE: golden record: " + REFUSED["reason"])]


def alerts(fakes: Fakes) -> list[str]:
    """The messages logged at syslog priority alert (the script's ERROR)."""
    return [c[-1] for c in fakes.calls("logger") if c[2:4] == ["-p", "user.alert"]]


def test_timeout_is_an_error_and_never_drains(fakes):
    """A check that hangs is stopped by SDC_TIMEOUT (exit 124): it could not run, which says
    nothing about the hardware, so it alerts and never drains, even with the drain switch."""
    for drain in ("0", "1"):
        result = run_slurm(fakes, 0, FAKE_SLEEP="20", SDC_TIMEOUT="0.3",
                           SDC_DRAIN_ON_INCONCLUSIVE=drain)
        assert result.returncode == 0
        assert fakes.calls("scontrol") == []
        assert "the check did not finish within 0.3 s" in alerts(fakes)[-1]
        assert "ERROR (exit 124" in alerts(fakes)[-1]


def test_missing_command_is_an_error_and_never_drains(fakes):
    """A broken install (exit 127) is ERROR, not FAIL: an alert, never a drain."""
    result = run_slurm(fakes, 0, SDC_CMD=str(fakes.root / "not-installed"),
                       SDC_DRAIN_ON_INCONCLUSIVE="1")
    assert result.returncode == 0
    assert fakes.calls("scontrol") == []
    assert any("ERROR (exit 127" in message for message in alerts(fakes))


TRACEBACK = ("Traceback (most recent call last):\n  File \"/opt/sdcstudy/bin/sdcstudy\", line 5"
             "\nModuleNotFoundError: No module named 'yaml'")
CRASH = ("sdcstudy: error: could not run: RuntimeError: Unable to initialize backend 'cuda' (a "
         "bug or a broken environment, not a verdict on the hardware; set SDCSTUDY_TRACEBACK=1 "
         "for the traceback)")


@pytest.mark.parametrize("rc", [3, 130, 137, 143, 42])
def test_a_check_that_could_not_run_never_drains(fakes, rc):
    """Exit 3 (could not run or could not report: a backend that does not start, a report that
    cannot be written, a crash), a signal or any other code is ERROR: one alert naming the
    check's own sentence and sent to SDC_ALERT_CMD, the node left as it is, exit 0 (a prolog's
    non-zero exit would make slurmd drain it), even with SDC_DRAIN_ON_INCONCLUSIVE=1."""
    fakes.write("page", f"#!/bin/sh\nprintf '%s' \"$1\" > {fakes.root}/paged\n")
    result = run_slurm(fakes, rc, report=None, FAKE_STDERR=CRASH, SDC_DRAIN_ON_INCONCLUSIVE="1",
                       SDC_ALERT_CMD=str(fakes.bin / "page"))
    assert result.returncode == 0, result.stderr
    assert fakes.calls("scontrol") == []
    [message] = alerts(fakes)
    assert f"{NODE} golden check ERROR (exit {rc}, could not run or report)" in message
    if rc in (130, 143):
        assert "the check was interrupted" in message
    elif rc == 137:
        assert "the check was killed" in message
    else:
        assert CRASH[len("sdcstudy: error: "):][:200] in message
    assert (fakes.root / "paged").read_text() == message


def test_expect_sha_is_passed_from_the_setting_or_the_file(fakes):
    """SDC_EXPECT_SHA, else the file SDC_EXPECT_SHA_FILE, becomes --expect-sha; with neither the
    check runs without it and a warning is logged; quorum has no record and takes none."""
    sha = "ab" * 32
    run_slurm(fakes, 0, SDC_EXPECT_SHA=sha)
    sha_file = fakes.root / "golden-sha256"
    sha_file.write_text(("cd" * 32) + "\n")
    run_slurm(fakes, 0, SDC_EXPECT_SHA_FILE=str(sha_file))
    run_slurm(fakes, 0, SDC_EXPECT_SHA_FILE=str(fakes.root / "none"))
    run_slurm(fakes, 0, SDC_MODE="quorum", SDC_EXPECT_SHA=sha)
    calls = fakes.calls("sdcstudy")
    assert calls[0][:5] == ["golden", "check", str(fakes.root / "golden"), "--expect-sha", sha]
    assert calls[1][3:5] == ["--expect-sha", "cd" * 32]
    assert "--expect-sha" not in calls[2] and "--expect-sha" not in calls[3]
    warnings = [c[-1] for c in fakes.calls("logger") if c[2:4] == ["-p", "user.warning"]]
    assert len(warnings) == 1 and "no SDC_EXPECT_SHA" in warnings[0]


def test_golden_folder_from_the_stack_id(fakes):
    """Unset SDC_GOLDEN: the folder is SDC_GOLDEN_ROOT/<stack id>; no stack id: INCONCLUSIVE
    without running the check."""
    stack_id = fakes.root / "stack-id"
    stack_id.write_text("h100-cuda12-jax0.10.2\n")
    run_slurm(fakes, 0, SDC_GOLDEN="", SDC_GOLDEN_ROOT="/shared/goldens",
              SDC_STACK_ID_FILE=str(stack_id))
    assert fakes.calls("sdcstudy")[0][2] == "/shared/goldens/h100-cuda12-jax0.10.2"
    # No stack id: the check could not run (ERROR), which never drains.
    result = run_slurm(fakes, 0, SDC_GOLDEN="", SDC_STACK_ID_FILE=str(fakes.root / "none"),
                       SDC_DRAIN_ON_INCONCLUSIVE="1")
    assert result.returncode == 0 and len(fakes.calls("sdcstudy")) == 1
    assert fakes.calls("scontrol") == []
    assert "ERROR (exit 3, could not run or report): no golden record" in alerts(fakes)[0]


def test_quorum_mode_and_config_file(fakes):
    """SDC_MODE=quorum (set in the settings file) runs golden quorum with no golden folder."""
    config = fakes.root / "healthcheck.env"
    config.write_text("SDC_MODE=quorum\nSDC_EXTRA_ARGS='--workers 2'\n")
    result = run_slurm(fakes, 1, SDC_CONFIG=str(config))
    assert result.returncode == 1
    (call,) = fakes.calls("sdcstudy")
    assert call[:4] == ["golden", "quorum", "--device", "all"]
    assert call[-2:] == ["--workers", "2"]
    assert fakes.calls("scontrol") == [drain_call(FAIL_REASON)]


# --- the DaemonSet's scripts, run for real ----------------------------------------------------


def manifest_container(file: str, name: str) -> dict:
    for doc in yaml.safe_load_all((DEPLOY / "k8s" / file).read_text()):
        for container in pod_containers(doc):
            if container["name"] == name:
                return container
    raise AssertionError(f"no container {name} in {file}")


def container_env(container: dict) -> dict[str, str]:
    """The container's env: values as written, the downward-API node name as NODE."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", var
            env[var["name"]] = NODE
    return env


def run_daemonset(fakes: Fakes, rc: int, **extra: str) -> None:
    """golden-check then label-node, as the kubelet runs them; both must exit 0."""
    status = fakes.root / "status"
    for name in ("golden-check", "label-node"):
        container = manifest_container("daemonset.yaml", name)
        env = {**container_env(container), "STATUS_DIR": str(status),
               **fakes.env(rc, REPORTS.get(rc), FAKE_TAINT_KEYS="sdcstudy.io/admission"),
               **extra}
        result = subprocess.run(["sh", "-c", container["args"][0]], env=env,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"


def kubernetes_actions(fakes: Fakes) -> set[str]:
    """The node changes the fake kubectl saw, written as README's table writes them."""
    actions = set()
    for call in fakes.calls("kubectl"):
        if call[:2] == ["label", "nodes"]:
            assert call[2] == NODE
            actions |= {a for a in call[3:] if a.startswith("sdcstudy.io/golden=")}
        elif call[:2] == ["taint", "nodes"]:
            assert call[2] == NODE
            actions.add(call[3])
    return actions


def test_daemonset_fail_taints_then_labels(fakes):
    """On FAIL the taint comes before the label: the label ends the pod, so a label first
    could leave a failed node without its taint."""
    run_daemonset(fakes, 1)
    calls = fakes.calls("kubectl")
    assert calls[0] == ["taint", "nodes", NODE, "sdcstudy.io/sdc=fail:NoSchedule", "--overwrite"]
    assert calls[-1] == ["label", "nodes", NODE, "--overwrite", "sdcstudy.io/golden=fail"]
    (annotate,) = [c for c in calls if c[0] == "annotate"]
    assert "sdcstudy.io/golden-exit-code=1" in annotate
    assert ("sdcstudy.io/golden-reason=FAIL device 3: step 3, microstep 0, layer 2, "
            "site fwd/attn_out") in annotate


def test_daemonset_pass_keeps_other_taints(fakes):
    """PASS removes only the admission taint, and only when the node has it."""
    run_daemonset(fakes, 0, FAKE_TAINT_KEYS="nvidia.com/gpu")
    assert kubernetes_actions(fakes) == {"sdcstudy.io/golden=pass"}


def test_daemonset_could_not_run_labels_error_and_never_taints(fakes):
    """Exit 3 (could not run or report) is no verdict on the hardware: the node is labelled
    error (something to alert on) with the check's sentence as the reason, never tainted."""
    run_daemonset(fakes, 3, FAKE_STDERR=CRASH)
    calls = fakes.calls("kubectl")
    assert kubernetes_actions(fakes) == {"sdcstudy.io/golden=error"}
    (annotate,) = [c for c in calls if c[0] == "annotate"]
    assert "sdcstudy.io/golden-exit-code=3" in annotate
    assert f"sdcstudy.io/golden-reason={CRASH[len('sdcstudy: error: '):][:200]}" in annotate


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "job.yaml"])
def test_manifests_pass_the_expected_sha(fakes, manifest):
    """SDC_EXPECT_SHA in the check container's env becomes --expect-sha; empty, none."""
    container = manifest_container(manifest, "golden-check")
    assert container_env(container)["SDC_EXPECT_SHA"] == ""  # a placeholder to fill in
    sha = "ef" * 32
    for value in (sha, ""):
        env = {**container_env(container), "STATUS_DIR": str(fakes.root / "status"),
               "REPORT_DIR": str(fakes.root), **fakes.env(0, PASS_REPORT),
               "SDC_EXPECT_SHA": value}
        subprocess.run(["sh", "-c", container["args"][0]], env=env, capture_output=True,
                       text=True, timeout=30)
    with_sha, without = fakes.calls("sdcstudy")
    assert with_sha[:5] == ["golden", "check", container_env(container)["GOLDEN_DIR"],
                            "--expect-sha", sha]
    assert "--expect-sha" not in without


def test_daemonset_check_arguments(fakes):
    """The DaemonSet runs golden check on every device against GOLDEN_DIR, report in STATUS_DIR."""
    run_daemonset(fakes, 0)
    (call,) = fakes.calls("sdcstudy")
    golden = container_env(manifest_container("daemonset.yaml", "golden-check"))["GOLDEN_DIR"]
    assert call[:5] == ["golden", "check", golden, "--device", "all"]
    assert call[call.index("--json") + 1] == str(fakes.root / "status" / "report.json")


def test_job_exit_code_is_the_checks(fakes):
    """The Job's container exits with the check's code, so the Job fails on FAIL, INCONCLUSIVE
    and ERROR (3: could not run or report), each told apart by its exit code."""
    container = manifest_container("job.yaml", "golden-check")
    for rc in (0, 1, 2, 3):
        env = {**container_env(container), **fakes.env(rc, REPORTS.get(rc)),
               "REPORT_DIR": str(fakes.root)}
        result = subprocess.run(["sh", "-c", container["args"][0]], env=env,
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == rc, result.stderr
        assert f"golden check on {NODE}: exit {rc}" in result.stdout


# --- README's table is what the scripts do ----------------------------------------------------


def readme_table() -> list[dict[str, str]]:
    """The rows of the table whose first header cell is 'check exit'."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| check exit |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def scenario(row: dict[str, str]) -> tuple[int, dict[str, str]]:
    """The fake's exit code and the settings a README row describes."""
    rc = int(re.match(r"\d+", row["check exit"]).group())
    settings = {}
    if "without a FAIL verdict" in row["check exit"]:  # a Python stopped before sdcstudy ran
        settings.update(FAKE_REPORT="", FAKE_VERDICT="", FAKE_STDERR=TRACEBACK)
    if "SDC_DRAIN_ON_INCONCLUSIVE=1" in row["check exit"]:
        settings["SDC_DRAIN_ON_INCONCLUSIVE"] = "1"
    if rc == 124:  # a real timeout, not a fake exit code
        settings.update(FAKE_SLEEP="20", SDC_TIMEOUT="0.3")
    return rc, settings


def test_readme_table_covers_every_case():
    """The table has a row for PASS, FAIL, INCONCLUSIVE and could-not-run (3, with and without
    the drain switch), a timeout, a missing command, a signal and an exit 1 that is a crash, so
    the two tests below run every case."""
    assert any(scenario(row)[1].get("FAKE_STDERR") == TRACEBACK for row in readme_table())
    cases = {scenario(row)[0] for row in readme_table()}
    drain_switch = {scenario(row)[0] for row in readme_table()
                    if "SDC_DRAIN_ON_INCONCLUSIVE=1" in row["check exit"]}
    assert cases >= {0, 1, 2, 3, 124, 127, 143} and drain_switch >= {2, 3}


@pytest.mark.parametrize("row", readme_table(), ids=lambda row: row["check exit"])
def test_readme_row_is_what_the_slurm_script_does(tmp_path, row):
    """Each README row, run: the Slurm action, the exit code and the verdict it names."""
    fakes = Fakes(tmp_path)
    rc, settings = scenario(row)
    if rc == 127:
        settings["SDC_CMD"] = str(tmp_path / "not-installed")
    result = run_slurm(fakes, rc, **settings)
    drained = fakes.calls("scontrol")
    action = "drain" if drained else "alert" if alerts(fakes) else "log"
    assert action == row["Slurm script"], (row, drained)
    assert str(result.returncode) == row["script exit"]
    said = drained[0][3] if drained else " ".join(c[-1] for c in fakes.calls("logger"))
    assert row["verdict"] in said


@pytest.mark.parametrize("row", readme_table(), ids=lambda row: row["check exit"])
def test_readme_row_is_what_the_daemonset_does(tmp_path, row):
    """Each README row, run: exactly the node changes the Kubernetes column names."""
    fakes = Fakes(tmp_path)
    rc, settings = scenario(row)
    settings.pop("SDC_DRAIN_ON_INCONCLUSIVE", None)
    run_daemonset(fakes, rc, **settings)
    said = set(re.findall(r"`(sdcstudy\.io/[^`]+)`", row["Kubernetes (DaemonSet)"]))
    assert kubernetes_actions(fakes) == said
    assert f"sdcstudy.io/golden={row['verdict'].lower()}" in said


# --- manifests: the fields Kubernetes requires -------------------------------------------------


def documents() -> list[tuple[str, dict]]:
    docs = [(path.name, doc) for path in MANIFESTS
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def pod_containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def test_every_document_has_api_version_kind_and_name():
    """apiVersion, kind and a DNS-style metadata.name in every document of every manifest."""
    names = {name for name, _ in documents()}
    assert names == {"daemonset.yaml", "job.yaml", "rbac.yaml"}
    for name, doc in documents():
        for key in ("apiVersion", "kind"):
            assert isinstance(doc.get(key), str) and doc[key], f"{name}: no {key}"
        assert isinstance(doc.get("metadata", {}).get("name"), str), f"{name}: no metadata.name"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", doc["metadata"]["name"])


@pytest.mark.parametrize("kind,api_version", [("Job", "batch/v1"), ("DaemonSet", "apps/v1")])
def test_workloads_have_containers_with_name_and_image(kind, api_version):
    """A pod template needs containers, each with a unique DNS-label name and an image."""
    (doc,) = of_kind(kind)
    assert doc["apiVersion"] == api_version
    spec = doc["spec"]["template"]["spec"]
    assert spec["containers"], "a pod needs at least one container"
    names = [c["name"] for c in pod_containers(doc)]
    assert len(names) == len(set(names)), "container names must be unique in a pod"
    for container in pod_containers(doc):
        assert isinstance(container.get("image"), str) and container["image"], container["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", container["name"])


def test_job_restart_policy():
    """A Job's pod must not restart forever: Never or OnFailure (the API refuses Always)."""
    (job,) = of_kind("Job")
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")


def test_daemonset_selector_matches_its_template():
    """The API refuses a DaemonSet whose selector does not select its own template."""
    (ds,) = of_kind("DaemonSet")
    match = ds["spec"]["selector"]["matchLabels"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert match and all(labels.get(k) == v for k, v in match.items())
    assert ds["spec"]["template"]["spec"].get("restartPolicy", "Always") == "Always"


@pytest.mark.parametrize("kind", ["Job", "DaemonSet"])
def test_gpus_node_name_and_golden_volume(kind):
    """The check container asks for GPUs (extended resources go in limits), knows its node
    through the downward API, and mounts the golden records read-only from a PVC."""
    (doc,) = of_kind(kind)
    spec = doc["spec"]["template"]["spec"]
    check = next(c for c in pod_containers(doc) if c["name"] == "golden-check")
    gpus = check["resources"]["limits"]["nvidia.com/gpu"]
    assert isinstance(gpus, int) and gpus > 0
    assert container_env(check)["NODE_NAME"] == NODE
    (mount,) = [m for m in check["volumeMounts"] if m["name"] == "goldens"]
    assert mount["readOnly"] is True
    assert container_env(check)["GOLDEN_DIR"].startswith(mount["mountPath"] + "/")
    (volume,) = [v for v in spec["volumes"] if v["name"] == "goldens"]
    assert volume["persistentVolumeClaim"]["readOnly"] is True


def test_daemonset_runs_once_per_node():
    """The pod only matches nodes without the verdict label that label-node sets, so the
    label ends the pod and frees the GPUs."""
    (ds,) = of_kind("DaemonSet")
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    for term in terms:
        assert {"key": "sdcstudy.io/golden", "operator": "DoesNotExist"} in \
            term["matchExpressions"]
    label_node = manifest_container("daemonset.yaml", "label-node")
    assert container_env(label_node)["NODE_NAME"] == NODE


def test_daemonset_service_account_may_get_and_patch_nodes():
    """The DaemonSet's ServiceAccount exists in its namespace and is bound to a ClusterRole
    with get and patch on nodes; only label-node gets the token."""
    (ds,) = of_kind("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    namespace, account = ds["metadata"]["namespace"], spec["serviceAccountName"]
    assert namespace in [ns["metadata"]["name"] for ns in of_kind("Namespace")]
    assert any(sa["metadata"] == {"name": account, "namespace": namespace}
               for sa in of_kind("ServiceAccount"))
    roles = {role["metadata"]["name"]: role for role in of_kind("ClusterRole")}
    bound = [b for b in of_kind("ClusterRoleBinding")
             if {"kind": "ServiceAccount", "name": account, "namespace": namespace}
             in b["subjects"]]
    assert bound, "no ClusterRoleBinding for the DaemonSet's ServiceAccount"
    for binding in bound:
        assert binding["roleRef"]["kind"] == "ClusterRole"
        assert binding["roleRef"]["apiGroup"] == "rbac.authorization.k8s.io"
        rules = roles[binding["roleRef"]["name"]]["rules"]
        assert any("" in r["apiGroups"] and "nodes" in r["resources"]
                   and {"get", "patch"} <= set(r["verbs"]) for r in rules)
    assert spec["automountServiceAccountToken"] is False
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    mounts = {c["name"]: {m["mountPath"] for m in c.get("volumeMounts", [])}
              for c in pod_containers(ds)}
    assert [name for name, paths in mounts.items() if token in paths] == ["label-node"]
    job = of_kind("Job")[0]
    assert job["metadata"]["namespace"] == namespace


# --- the reproduce job array, run for real ----------------------------------------------------

REPRODUCE_SCRIPT = DEPLOY / "slurm" / "reproduce-array.sh"


def run_reproduce(fakes: Fakes, *args: str, **settings: str):
    """reproduce-array.sh with the fake sdcstudy; settings are SDC_* and SLURM_* variables."""
    env = fakes.env(0, None, SDC_CONFIG=str(fakes.root / "no-such-file.env"),
                    SDC_CMD=str(fakes.bin / "sdcstudy"), SDC_OUT=str(fakes.root / "out"))
    env.update(settings)
    return subprocess.run(["bash", str(REPRODUCE_SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=30)


def test_reproduce_array_task_runs_its_shard(fakes):
    """Task 7 of an array 5-8 (four tasks) runs shard 2/4 into its own folder, with the
    settings; a second run of the same task (requeued) adds --resume."""
    array = dict(SLURM_ARRAY_TASK_ID="7", SLURM_ARRAY_TASK_MIN="5", SLURM_ARRAY_TASK_COUNT="4",
                 SDC_NODES="1,11", SDC_MODES="paramsync,free", SDC_STEPS="50",
                 SDC_EXTRA_ARGS="--set experiment.seed=1")
    result = run_reproduce(fakes, **array)
    assert result.returncode == 0, result.stderr
    out = str(fakes.root / "out" / "shard-2-of-4")
    (call,) = fakes.calls("sdcstudy")
    assert (fakes.root / "out").is_dir()
    assert call == ["reproduce", "--preset", "small", "--nodes", "1,11", "--shard", "2/4",
                    "--out", out, "--no-progress", "--modes", "paramsync,free", "--steps", "50",
                    "--set",
                    "experiment.seed=1"]
    Path(out).mkdir(parents=True)
    (Path(out) / "reproduce.json").write_text("{}")
    run_reproduce(fakes, **array)
    assert "--resume" in fakes.calls("sdcstudy")[1]


def test_reproduce_array_merge_joins_every_shard(fakes):
    """`merge` passes every shard folder to --merge and writes the scorecard beside them;
    without shard folders, or outside an array, the script says so and exits 2."""
    assert run_reproduce(fakes, "merge").returncode == 2
    for index in range(3):
        (fakes.root / "out" / f"shard-{index}-of-3").mkdir(parents=True)
    result = run_reproduce(fakes, "merge")
    assert result.returncode == 0, result.stderr
    (call,) = fakes.calls("sdcstudy")
    shards = [str(fakes.root / "out" / f"shard-{i}-of-3") for i in range(3)]
    assert call == ["reproduce", "--merge", *shards, "--out",
                    str(fakes.root / "out" / "scorecard"), "--no-progress"]
    result = run_reproduce(fakes)
    assert result.returncode == 2 and "not a Slurm array task" in result.stderr
    assert len(fakes.calls("sdcstudy")) == 1


def test_reproduce_array_runs_float32_matmuls_at_full_precision(fakes):
    """JAX_DEFAULT_MATMUL_PRECISION is highest unless set: TF32 products would make the float32
    ABFT run flag healthy nodes."""
    fakes.write("sdcstudy", "#!/bin/bash\necho \"$JAX_DEFAULT_MATMUL_PRECISION\" "
                            "> \"$FAKE_LOG/precision\"\n")
    array = dict(SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_TASK_COUNT="1")
    assert run_reproduce(fakes, **array).returncode == 0
    assert (fakes.log / "precision").read_text().strip() == "highest"
    run_reproduce(fakes, JAX_DEFAULT_MATMUL_PRECISION="high", **array)
    assert (fakes.log / "precision").read_text().strip() == "high"


def test_reproduce_array_passes_on_the_exit_code(fakes):
    """The task fails when sdcstudy fails, so Slurm marks it failed."""
    result = run_reproduce(fakes, SLURM_ARRAY_TASK_ID="0", SLURM_ARRAY_TASK_COUNT="1",
                           FAKE_RC="2")
    assert result.returncode == 2
