"""The checks of experiments/gpu_acceptance.py, one method each: every check runs sdcstudy in a
child process of its own (JAX never starts in the acceptance's process) against the one
deadline of --budget, and reads what the child wrote into figures and a verdict
(experiments/gpu_floors.py judges them; experiments/nvidia_smi.py reads the device's state).
A check with less than MIN_CHECK_S seconds left is skipped, not started.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_floors as GF  # noqa: E402
import nvidia_smi as SMI  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULT, LOG, HLO = "gpu_acceptance.json", "gpu_acceptance.log", "gpu_acceptance_hlo.tar.gz"
MIN_CHECK_S = 20  # a check with less time left than this is skipped, not started
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
            "jax-cuda13-pjrt", "flax", "optax", "orbax-checkpoint", "numpy")
DTYPES = ("float32", "bfloat16")
# bench train's workloads: (preset, sequences per step, tokens per sequence, timed steps,
# repetitions), full and --quick; the 1B model at 8 x 512 fits an 80 GB card in float32.
BENCH = {False: ("medium", 32, 512, 10, 3), True: ("small", 16, 256, 5, 2)}
BENCH_1B = (GF.ONE_B, 8, 512, 5, 3)
ABFT_STEPS = {False: 40, True: 6}
RECALL_PROFILE = "exponent-flip"
RECALL_STEPS = {False: 20, True: 6}
ABFT_RULES = ("rounding", "paper", "paper-dtype")  # abft/tables.py HOST_THRESHOLDS


def child_env() -> dict:
    """The environment of every child: sdcstudy importable from this checkout, no
    compilation cache (each process compiles for itself, as the doctor means it to)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def without_determinism(env: dict) -> dict:
    """`env` with every boolean determinism flag of core/determinism.py set false in
    XLA_FLAGS: keys already there win over the ones determinism.configure() adds."""
    from sdcstudy.core.determinism import DETERMINISM_XLA_FLAGS

    off = [f"{flag.split('=')[0]}=false" for flag in DETERMINISM_XLA_FLAGS
           if flag.endswith("=true")]
    keys = {flag.split("=")[0] for flag in off}
    kept = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] not in keys]
    return {**env, "XLA_FLAGS": " ".join(kept + off)}


def preset_problem(name: str) -> str | None:
    """None when the model preset exists (built in or configs/models/NAME.yaml), else why
    its check is skipped."""
    from sdcstudy.core.presets import PRESETS

    if name in PRESETS or (ROOT / "configs" / "models" / f"{name}.yaml").is_file():
        return None
    return (f"the model preset {name} is not defined (sdcstudy/core/presets.py, "
            f"configs/models/), so its floor was not measured")


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


def verdict(checks: dict) -> str:
    """PASS: every check passed; FAIL: one failed; INCOMPLETE: none failed, one skipped."""
    states = [c["pass"] for c in checks.values()]
    if any(s is False for s in states):
        return "FAIL"
    return "INCOMPLETE" if any(s is None for s in states) else "PASS"


class Acceptance:
    """Runs the checks in turn against one deadline and rewrites the JSON after each."""

    def __init__(self, args, python: str, probe: dict, work: Path):
        self.args, self.python, self.work = args, python, work
        self.start = time.monotonic()
        self.deadline = self.start + args.budget
        self.log = open(args.out / LOG, "a")
        self.report = {"schema": "sdcstudy-gpu-acceptance/2", "verdict": None,
                       "quick": args.quick, "budget_s": args.budget, **probe,
                       "versions": versions(), "device": {}, "checks": {}, "wall_s": None}

    def sdcstudy(self, label: str, argv: list, cap: float, env: dict | None = None,
                 sample: Path | None = None) -> dict:
        """One `python -m sdcstudy ...` in its own process group, killed at its time limit
        (with `sample`, nvidia-smi samples the device beside it into that file);
        {"exit_code", "seconds", "timed_out", "command"}, or a skipped check's fields."""
        command = ["sdcstudy", *map(str, argv)]
        limit = min(cap, self.deadline - time.monotonic())
        if limit < MIN_CHECK_S:
            return skipped("no time left in --budget", exit_code=None, command=command)
        self.log.write(f"\n===== {label}: {' '.join(command)}\n")
        self.log.flush()
        begin = time.monotonic()
        with SMI.Sampler(sample) if sample is not None else nullcontext():
            proc = subprocess.Popen([self.python, "-m", "sdcstudy", *map(str, argv)],
                                    cwd=ROOT, env=env or child_env(), stdout=self.log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
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

    @staticmethod
    def ran(run: dict, *paths: Path) -> bool:
        return run.get("exit_code") == 0 and all(p.exists() for p in paths)

    def check(self, name: str, measure, *args, **kwargs) -> dict:
        """Run one check and record it; an exception while it reads its child's output fails
        that check, with the error, instead of ending the acceptance."""
        try:
            result = measure(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any surprise in one check's files
            result = {"pass": False, "error": f"{type(e).__name__}: {e}"}
        return self.record(name, result)

    def record(self, name: str, result: dict) -> dict:
        self.report["checks"][name] = result
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        write_json(self.args.out / RESULT, self.report)
        if result["pass"] is None:
            print(f"[{name}] SKIPPED: {result['skipped']}", file=sys.stderr, flush=True)
            return result
        figures = {k: round(v, 4) for k, v in result.items()
                   if k in ("false_alarm_rate", "mfu", "mfu_against_floor_peak", "recall",
                            "cost") and v is not None}
        print(f"[{name}] {'PASS' if result['pass'] else 'FAIL'} "
              f"({result.get('seconds', 0):.0f} s) {figures or ''}".rstrip(),
              file=sys.stderr, flush=True)
        return result

    def device_state(self, when: str) -> dict:
        text, state = SMI.snapshot()
        self.log.write(f"\n===== nvidia-smi -q, {when}\n{text}")
        self.log.flush()
        self.report["device"][when] = state
        return state

    def doctor(self) -> dict:
        path = self.work / "doctor.json"
        run = self.sdcstudy("doctor", ["doctor", "--json", path], cap=240)
        if "skipped" in run:
            return run
        out = {"pass": run["exit_code"] == 0, **run}
        if path.exists():
            d = json.loads(path.read_text())
            out.update(verdict=d["verdict"], problems=d["problems"], steps=d["steps"],
                       compiled_step_sha256=d["env"]["compiled_step_sha256"],
                       param_digest=d["param_digest"], xla_flags=d["env"]["xla_flags"])
        return out

    def golden(self) -> dict:
        folder, path = self.work / "golden", self.work / "golden_check.json"
        rec = self.sdcstudy("golden record", ["golden", "record", "--out", folder,
                                              "--no-progress"], cap=150)
        if "skipped" in rec:
            return rec
        out = {"pass": False, "record": rec}
        if rec["exit_code"] != 0:
            return {**out, "seconds": rec["seconds"]}
        chk = self.sdcstudy("golden check", ["golden", "check", folder, "--json", path,
                                             "--no-progress"], cap=150)
        out.update(check=chk, seconds=round(rec["seconds"] + chk.get("seconds", 0), 1))
        if path.exists():
            d = json.loads(path.read_text())
            out.update(verdict=d["verdict"], reason=d["reason"], timing=d.get("timing"))
        out["pass"] = chk.get("exit_code") == 0 and out.get("verdict") == "PASS"
        return out

    def bench(self, name: str, workload: tuple, dtype: str, cap: float,
              env: dict | None = None) -> dict:
        """bench train of one workload, its figures and census, judged by its floor."""
        preset, batch, seq_len, steps, repeats = workload
        path, hlo = self.work / f"{name}.json", self.work / "hlo" / name
        run = self.sdcstudy(name, [
            "bench", "train", "--no-torch", "--presets", preset, "--batch", batch,
            "--seq-len", seq_len, "--steps", steps, "--repeats", repeats,
            "--set", f"model.dtype={dtype}", "--json", path, "--hlo", hlo], cap=cap, env=env,
            sample=self.work / f"{name}.samples.csv")
        if "skipped" in run:
            return run
        out = {"pass": False, **run, "dtype": dtype,
               "device_during": SMI.samples_summary(_read(self.work / f"{name}.samples.csv"))}
        if not self.ran(run, path):
            return out
        self.pack_hlo()
        report = json.loads(path.read_text())
        out.update(GF.bench_figures(report),
                   xla_flags=report.get("environment", {}).get("xla_flags"))
        floor = None if self.args.quick else GF.BENCH_FLOORS.get((preset, dtype))
        out.update(GF.judge_bench(out, floor, self.report["device_kind"]))
        if self.args.quick:
            out["floor_note"] = "--quick: the floors apply to the full workloads only"
        return out

    def determinism_ab(self, with_flags: dict) -> dict:
        """The bfloat16 medium bench again without the determinism flags: their cost."""
        if "tokens_per_s" not in with_flags:
            return skipped("the bench train it compares with measured nothing")
        out = self.bench("bench_train_without_determinism", BENCH[self.args.quick],
                         "bfloat16", cap=200, env=without_determinism(child_env()))
        if "tokens_per_s" not in out:
            return {**out, "pass": None if "skipped" in out else False}
        judged = GF.judge_determinism(with_flags, out)
        if self.args.quick:
            judged["pass"] = True
            judged["note"] = "--quick: the cost limit applies to the full workload only"
        return {"without_flags": {k: v for k, v in out.items() if k != "census"},
                "seconds": out["seconds"], **judged}

    def abft(self, dtype: str, profile: str, steps: int) -> tuple[dict, Path | None]:
        """One `sdcstudy run configs/abft.yaml` under the rounding bound: (run, its folder)."""
        folder = self.work / f"abft-{profile}-{dtype}"
        run = self.sdcstudy(f"abft {profile} {dtype}", [
            "run", "configs/abft.yaml", "--out", folder, "--no-progress",
            "--set", f"suspect.profile={profile}", "--set", f"model.dtype={dtype}",
            "--set", "abft.threshold=rounding", "--set", f"experiment.steps={steps}"],
            cap=120)
        return run, folder if self.ran(run, folder / "summary.json") else None

    def abft_healthy(self, dtype: str) -> dict:
        run, folder = self.abft(dtype, "healthy", ABFT_STEPS[self.args.quick])
        if "skipped" in run or folder is None:
            return run if "skipped" in run else {"pass": False, **run}
        summary = json.loads((folder / "summary.json").read_text())
        return {**run, "dtype": dtype, "device_rule": "rounding",
                **GF.judge_healthy_abft(summary), "rules": host_rule_rates(folder)}

    def abft_recall(self, dtype: str) -> dict:
        run, folder = self.abft(dtype, RECALL_PROFILE, RECALL_STEPS[self.args.quick])
        if "skipped" in run or folder is None:
            return run if "skipped" in run else {"pass": False, **run}
        summary = json.loads((folder / "summary.json").read_text())
        return {**run, "dtype": dtype, "profile": RECALL_PROFILE,
                **GF.judge_recall(summary, _records(folder / "faults.parquet"),
                                  _records(folder / "abft.parquet"))}

    def device_health(self, before: dict, after: dict) -> dict:
        if "error" in before or "error" in after:
            return {"pass": False, "note": before.get("error") or after.get("error")}
        return {"pass": not SMI.ecc_problems(before, after),
                "problems": SMI.ecc_problems(before, after),
                "clock_event_reasons_during_us": SMI.counters_during(before, after)}

    def pack_hlo(self) -> None:
        """Every optimized HLO bench train kept so far, in one archive beside the JSON."""
        folder = self.work / "hlo"
        tmp = self.args.out / (HLO + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(folder.rglob("*.hlo")):
                tar.add(path, arcname=str(path.relative_to(folder)))
        tmp.replace(self.args.out / HLO)

    def finish(self) -> int:
        """The verdict, the JSON's last rewrite and one line on stdout; the exit code."""
        checks = self.report["checks"]
        self.report["verdict"] = verdict(checks)
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        write_json(self.args.out / RESULT, self.report)
        self.log.close()
        failed = [k for k, c in checks.items() if c["pass"] is False]
        missing = [k for k, c in checks.items() if c["pass"] is None]
        print(f"gpu acceptance {self.report['verdict']} on {self.report['device_kind']} in "
              f"{self.report['wall_s']:.0f} s" +
              (f"; failed: {', '.join(failed)}" if failed else "") +
              (f"; skipped: {', '.join(missing)}" if missing else "") +
              f"; {self.args.out / RESULT}", flush=True)
        return 0 if self.report["verdict"] == "PASS" else 1


def host_rule_rates(folder: Path) -> dict:
    """Flagged checks over all checks under each rule, from the recorded residuals."""
    from sdcstudy.abft.tables import host_flags
    from sdcstudy.core.runfolder import read_table

    frame = read_table(folder / "abft.parquet")
    out = {}
    for rule in ABFT_RULES:
        flags = int(host_flags(frame, rule).sum())
        out[rule] = {"flags": flags, "checks": len(frame),
                     "false_alarm_rate": flags / len(frame) if len(frame) else None}
    return out


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _records(path: Path) -> list[dict]:
    """A run folder's table as rows ([] when the run wrote none)."""
    from sdcstudy.core.runfolder import read_table

    return read_table(path).to_dict("records") if path.exists() else []
