"""`sdcstudy doctor`: run the same tiny training twice in separate processes, compare bitwise.

Exit 0 only when both runs agree in every metric (except wall-clock times), in the digest of
every final parameter, and in the compiled program; 1 when they differ; 3 when a run failed
(the check could not run: no verdict). The verdict is printed before `--json` is written; a
JSON file that cannot be written is one warning and leaves the verdict's exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.core import errors
from sdcstudy.core import reports
from sdcstudy.core import runfolder as RF
from sdcstudy.core.ticker import ticking

DOCTOR = {
    "experiment": {"mode": "train", "steps": 20, "batch_size": 8, "microsteps": 2,
                   "checkpoint_every": 0, "name": "doctor"},
    "model": {"preset": "tiny"},
    "data": {"source": "synthetic", "seq_len": 64},
}


def _uncached_env() -> dict:
    """This environment with JAX's compilation cache off: each run compiles its own program, so
    a compiler that is not deterministic shows (a user's cache would hand the second run the
    first one's executable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def _run(config_path: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sdcstudy", "run", str(config_path), "--out",
                           str(out), "--no-progress"], capture_output=True, text=True,
                          env=_uncached_env())


def deterministic_view(run_dir: Path) -> dict:
    """What must be bitwise equal between two runs of one config: no wall-clock times."""
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in RF.read_jsonl(run_dir / RF.METRICS)]
    summary = RF.json_load(run_dir / RF.SUMMARY)
    env = RF.json_load(run_dir / RF.ENV)
    return {"metrics": rows, "param_digest": summary["param_digest"],
            "compiled_step_sha256": env["compiled_step_sha256"]}


def compare(a: dict, b: dict) -> list[str]:
    problems = []
    for key in ("compiled_step_sha256", "param_digest"):
        if a[key] != b[key]:
            problems.append(f"{key} differs")
    if len(a["metrics"]) != len(b["metrics"]):
        problems.append("the runs logged different numbers of steps")
    for ra, rb in zip(a["metrics"], b["metrics"]):
        diff = sorted(k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k))
        if diff:
            problems.append(f"step {ra['step']}: {', '.join(diff)} differ")
            break
    return problems


def main(json_path: Path | None = None, keep: Path | None = None, progress: bool = True) -> int:
    with tempfile.TemporaryDirectory(prefix="sdcstudy-doctor-") as tmp:
        root = Path(keep) if keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        config_path = root / "doctor.yaml"
        RF.atomic_write_text(config_path, C.dump(C.from_dict(DOCTOR)))
        print("sdcstudy doctor: two tiny trainings in separate processes ...", flush=True)
        views, failed = [], None
        with ticking("sdcstudy doctor", enabled=progress, total=2, unit="runs") as line:
            for name in ("a", "b"):
                proc = _run(config_path, root / name)
                if proc.returncode != 0:
                    failed = name, proc
                    break
                views.append(deterministic_view(root / name))
                line.advance()
        if failed:  # said once the line is closed
            name, proc = failed
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            print(f"sdcstudy doctor: run {name} failed (exit {proc.returncode}): {tail[0]}",
                  file=sys.stderr)
            return errors.EXIT_COULD_NOT_RUN
        env = RF.json_load(root / "a" / RF.ENV)
    problems = compare(*views)
    verdict = "PASS" if not problems else "FAIL"
    report = {"verdict": verdict, "problems": problems, "steps": len(views[0]["metrics"]),
              "param_digest": views[0]["param_digest"], "env": env}
    cpu = env["cpu"]
    print(f"  jax {env['packages'].get('jax')} on {env['platform']} "
          f"({', '.join(f'{n} x {k}' for k, n in env['device_kinds'].items())}); "
          f"CPU {cpu['model']} [{' '.join(cpu['isa'])}]")
    print(f"  compiled step sha256 {env['compiled_step_sha256'][:16]}...")
    if problems:
        print(f"FAIL: the two runs differ: {'; '.join(problems)}", flush=True)
    else:
        print(f"PASS: {report['steps']} steps, every metric and parameter bitwise identical "
              f"(params sha256 {report['param_digest'][:16]}...)", flush=True)
    if json_path:  # after the verdict: a file that cannot be written does not change it
        reports.write_report_json(json_path, report)
    return errors.EXIT_FAIL if problems else errors.EXIT_PASS
