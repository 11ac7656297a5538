"""How `sdcstudy accept-gpu` runs its checks: each in a child process of its own (JAX never
starts in the acceptance's process, so it holds no GPU memory) against the one deadline of
--budget; each check's figures and verdict recorded in DIR/gpu_acceptance.json, rewritten after
every check (a run cut short still leaves what it measured), and a short table at the end
(DIR/gpu_acceptance.txt). A check with less than MIN_CHECK_S seconds left is skipped, not
started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from contextlib import nullcontext
from importlib import metadata
from pathlib import Path

from sdcstudy.gpu import nvidia_smi as SMI

ROOT = Path(__file__).resolve().parents[2]
RESULT, TABLE, LOG, HLO = ("gpu_acceptance.json", "gpu_acceptance.txt", "gpu_acceptance.log",
                           "gpu_acceptance_hlo.tar.gz")
MIN_CHECK_S = 20  # a check with less time left than this is skipped, not started
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
            "jax-cuda13-pjrt", "flax", "optax", "orbax-checkpoint", "numpy", "torch",
            "transformers")
# The figure each check's table row shows, where it has one.
HEADLINE = ("mfu_against_floor_peak", "mfu", "cost", "ratio", "worst_ratio", "false_alarm_rate",
            "recall", "memory_share")


def child_env() -> dict:
    """The environment of every child: sdcstudy importable from this checkout, no
    compilation cache (each process compiles for itself, as the doctor means it to)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def with_flags(env: dict, *flags: str) -> dict:
    """`env` with `flags` (`--name=value`) in XLA_FLAGS, replacing any of the same name: keys
    already there win over the ones determinism.configure() adds."""
    keys = {flag.split("=")[0] for flag in flags}
    kept = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] not in keys]
    return {**env, "XLA_FLAGS": " ".join(kept + list(flags))}


def without_determinism(env: dict) -> dict:
    """`env` with every boolean determinism flag of core/determinism.py set false."""
    from sdcstudy.core.determinism import DETERMINISM_XLA_FLAGS

    return with_flags(env, *(f"{flag.split('=')[0]}=false" for flag in DETERMINISM_XLA_FLAGS
                             if flag.endswith("=true")))


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=60)
    out["nvidia_smi"] = smi.stdout.strip().splitlines()
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    out["sdcstudy_commit"] = git.stdout.strip() if git.returncode == 0 else None
    return out


def skipped(reason: str, **fields) -> dict:
    return {"pass": None, "skipped": reason, "seconds": 0.0, **fields}


def failure(run: dict) -> str:
    """Why a child gave no results: it timed out, exited non-zero, or wrote nothing."""
    return ("timed out" if run.get("timed_out") else
            f"the child exited {run.get('exit_code')}" if run.get("exit_code") else
            "the child wrote no results")


def broke(run: dict, why: str = "") -> dict:
    """A check that could not measure: its child crashed, timed out or wrote nothing
    (`failure`), or reading its files raised (`why`). Neither PASS nor FAIL: no target was
    judged (a crash is not a verdict on the GPU)."""
    return {**run, "pass": None, "error": why or failure(run)}


# The acceptance's verdicts, strongest first, and their exit codes (core/errors.py's contract).
VERDICT_EXIT = {"FAIL": 1, "COULD NOT RUN": 3, "INCOMPLETE": 2, "PASS": 0}


def state(check: dict) -> str:
    """One check's verdict: PASS, FAIL, ERROR (could not measure) or SKIPPED."""
    if check["pass"] is None:
        return "ERROR" if "error" in check else "SKIPPED"
    return "PASS" if check["pass"] else "FAIL"


def verdict(checks: dict) -> str:
    """FAIL: a target was missed; else COULD NOT RUN: a check broke; else INCOMPLETE: one was
    skipped; else PASS."""
    states = {state(c) for c in checks.values()}
    for name, needs in (("FAIL", "FAIL"), ("COULD NOT RUN", "ERROR"),
                        ("INCOMPLETE", "SKIPPED")):
        if needs in states:
            return name
    return "PASS"


def table(report: dict) -> str:
    """The short table: one line per check, its verdict, seconds and headline figure."""
    lines = [f"gpu acceptance {report['verdict']} on {report.get('device_kind')} "
             f"(stage {report.get('stage')}, {report.get('wall_s')} s)",
             f"{'check':34} {'verdict':10} {'s':>6}  figure"]
    for name, c in report["checks"].items():
        shown = state(c)
        figure = next((f"{k} {c[k]:.4g}" for k in HEADLINE
                       if isinstance(c.get(k), (int, float))), "")
        note = c.get("skipped") or c.get("error") or c.get("note") or ""
        lines.append(f"{name:34} {shown:10} {c.get('seconds') or 0:6.0f}  "
                     f"{figure}{'; ' if figure and note else ''}{note}".rstrip())
    return "\n".join(lines) + "\n"


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


class Session:
    """Runs children against one deadline and rewrites the JSON after each check."""

    def __init__(self, args, python: str, probe: dict, work: Path):
        self.args, self.python, self.work = args, python, work
        self.start = time.monotonic()
        self.deadline = self.start + args.budget
        self.log = open(args.out / LOG, "a")
        self.report = {"schema": "sdcstudy-gpu-acceptance/3", "verdict": None,
                       "stage": args.stage, "budget_s": args.budget, **probe,
                       "versions": versions(), "device": {}, "checks": {}, "wall_s": None}

    def child(self, label: str, argv: list, cap: float, env: dict | None = None,
              sample: Path | None = None) -> dict:
        """One `python ARGV...` in its own process group, killed at its time limit (with
        `sample`, nvidia-smi samples the device beside it into that file);
        {"exit_code", "seconds", "timed_out", "command"}, or a skipped check's fields."""
        command = [str(a) for a in argv]
        limit = min(cap, self.deadline - time.monotonic())
        if limit < MIN_CHECK_S:
            return skipped("no time left in --budget", exit_code=None, command=command)
        self.log.write(f"\n===== {label}: {' '.join(command)}\n")
        self.log.flush()
        begin = time.monotonic()
        with SMI.Sampler(sample) if sample is not None else nullcontext():
            proc = subprocess.Popen([self.python, *command], cwd=ROOT, env=env or child_env(),
                                    stdout=self.log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if proc.poll() is None:  # timed out or interrupted: its children too
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        seconds = time.monotonic() - begin
        self.log.write(f"===== {label}: exit {proc.returncode} after {seconds:.1f} s\n")
        self.log.flush()
        return {"exit_code": proc.returncode, "seconds": round(seconds, 1),
                "timed_out": timed_out, "command": command}

    def sdcstudy(self, label: str, argv: list, cap: float, env: dict | None = None,
                 sample: Path | None = None) -> dict:
        """`python -m sdcstudy ARGV...` as `child` runs it."""
        return self.child(label, ["-m", "sdcstudy", *argv], cap, env, sample)

    @staticmethod
    def ran(run: dict, *paths: Path) -> bool:
        return run.get("exit_code") == 0 and all(p.exists() for p in paths)

    def check(self, name: str, measure, *args, **kwargs) -> dict:
        """Run one check and record it; an exception while it reads its child's output marks
        that check ERROR, with the error, instead of ending the acceptance."""
        try:
            result = measure(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any surprise in one check's files
            result = broke({}, f"{type(e).__name__}: {e}")
        return self.record(name, result)

    def record(self, name: str, result: dict) -> dict:
        self.report["checks"][name] = result
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        write_json(self.args.out / RESULT, self.report)
        if result["pass"] is None:
            print(f"[{name}] {state(result)}: {result.get('skipped') or result.get('error')}",
                  file=sys.stderr, flush=True)
            return result
        figures = {k: round(v, 4) for k, v in result.items()
                   if k in HEADLINE and isinstance(v, (int, float))}
        print(f"[{name}] {'PASS' if result['pass'] else 'FAIL'} "
              f"({result.get('seconds') or 0:.0f} s) {figures or ''}".rstrip(),
              file=sys.stderr, flush=True)
        return result

    def device_state(self, when: str) -> dict:
        text, state = SMI.snapshot()
        self.log.write(f"\n===== nvidia-smi -q, {when}\n{text}")
        self.log.flush()
        self.report["device"][when] = state
        return state

    def pack_hlo(self) -> None:
        """Every optimized HLO bench train kept so far, in one archive beside the JSON."""
        folder = self.work / "hlo"
        tmp = self.args.out / (HLO + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(folder.rglob("*.hlo")):
                tar.add(path, arcname=str(path.relative_to(folder)))
        tmp.replace(self.args.out / HLO)

    def finish(self) -> int:
        """The verdict, the JSON's last rewrite, the table and one line on stdout; the exit
        code (`VERDICT_EXIT`: 0 PASS, 1 FAIL, 2 INCOMPLETE, 3 COULD NOT RUN)."""
        checks = self.report["checks"]
        self.report["verdict"] = verdict(checks)
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        write_json(self.args.out / RESULT, self.report)
        (self.args.out / TABLE).write_text(table(self.report))
        self.log.close()
        failed = [k for k, c in checks.items() if state(c) == "FAIL"]
        broken = [k for k, c in checks.items() if state(c) == "ERROR"]
        missing = [k for k, c in checks.items() if state(c) == "SKIPPED"]
        print(table(self.report), end="")
        print(f"gpu acceptance {self.report['verdict']} on {self.report['device_kind']} in "
              f"{self.report['wall_s']:.0f} s" +
              (f"; failed: {', '.join(failed)}" if failed else "") +
              (f"; could not measure: {', '.join(broken)}" if broken else "") +
              (f"; skipped: {', '.join(missing)}" if missing else "") +
              f"; {self.args.out / RESULT}", flush=True)
        return VERDICT_EXIT[self.report["verdict"]]
