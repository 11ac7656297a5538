"""bash experiments/gpu_acceptance.sh --out DIR [--quick] [--budget SECONDS] [--work DIR]

Is this GPU ready for sdcstudy? On one NVIDIA GPU, in at most 10 minutes, it runs

1. `sdcstudy doctor`: the tiny training twice in separate processes, every bit compared;
2. `sdcstudy golden record` then `golden check` of the built-in tiny workload on device 0;
3. ABFT on a healthy node (`configs/abft.yaml`, `suspect.profile=healthy`,
   `abft.threshold=rounding`) in float32 and in bfloat16: flagged checks over all checks, under
   the device's rule and, from abft.parquet, under the paper's rules;
4. `sdcstudy bench train --no-torch` in float32 and bfloat16: tokens/s and MFU against the
   device kind's published peak (sdcstudy/bench/roofline.py names the peak it used);

and writes DIR/gpu_acceptance.json (each check's pass or fail and figures, the device kind,
driver and package versions, wall time; rewritten after every check, so a run cut short still
leaves what it measured) and DIR/gpu_acceptance.log (every command's output). It should show
every check PASS on a healthy GPU; exit 0 when all pass, 1 when one does not.

Where there is no GPU it refuses with one sentence and exit 2 before running anything: no
`nvidia-smi` on the PATH means no NVIDIA GPU; then a JAX whose default backend is not `gpu`
means JAX has no CUDA backend here (install the `cuda` extra). JAX is only ever imported in
child processes, so this process holds no GPU memory. The whole acceptance took 154 s on an
H100 (RESULTS.md, "On one GPU"); `--quick` shrinks the workloads for a first look.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROG = "experiments/gpu_acceptance.sh"
RESULT, LOG = "gpu_acceptance.json", "gpu_acceptance.log"
BUDGET_S = 570  # the whole acceptance, under the 10 minutes it promises
MIN_CHECK_S = 20  # a check with less time left than this is skipped, not started
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
            "jax-cuda13-pjrt", "flax", "optax", "orbax-checkpoint", "numpy")
DTYPES = ("float32", "bfloat16")
# bench train's workload: (preset, sequences per step, tokens per sequence, timed steps,
# repetitions), full and --quick.
BENCH = {False: ("medium", 32, 512, 10, 3), True: ("small", 16, 256, 5, 2)}
ABFT_STEPS = {False: 20, True: 6}
ABFT_RULES = ("rounding", "paper", "paper-dtype")  # abft/tables.py HOST_THRESHOLDS
PROBE = ("import json, jax; d = jax.devices()[0]; print(json.dumps({'backend': "
         "jax.default_backend(), 'device_kind': d.device_kind, 'device_count': "
         "jax.device_count()}))")


class UsageError(Exception):
    """A bad command line: one sentence, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog=PROG, description="Acceptance of one NVIDIA GPU for sdcstudy: doctor, "
                "golden record + check, ABFT false alarms in float32 and bfloat16, and bench "
                "train with MFU, in at most 10 minutes; results in DIR/gpu_acceptance.json. "
                "Exit 0 all checks pass, 1 one fails, 2 bad arguments or no GPU.")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help=f"folder for {RESULT} and {LOG} (created if missing)")
    p.add_argument("--quick", action="store_true",
                   help="smaller workloads: the small preset for bench train, "
                        f"{ABFT_STEPS[True]} ABFT steps")
    p.add_argument("--budget", type=int, default=BUDGET_S, metavar="SECONDS",
                   help=f"wall-clock limit of the whole acceptance (default {BUDGET_S})")
    p.add_argument("--work", type=Path, default=None, metavar="DIR",
                   help="keep the run folders and the golden record here (default: a "
                        "temporary folder, removed at the end)")
    args = p.parse_args(argv)
    if args.budget < 60:
        raise UsageError(f"--budget must be at least 60 seconds, not {args.budget}")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is a file, not a folder")
    if (args.out / RESULT).exists():
        raise UsageError(f"{args.out / RESULT} already exists; choose another --out")
    if args.work is not None and args.work.exists() and any(args.work.iterdir()):
        raise UsageError(f"--work {args.work} is not empty; choose a new folder")
    return args


def gpu_problem(python: str) -> tuple[str | None, dict]:
    """(None, what JAX reports) on a usable GPU, else (one sentence saying why not, {})."""
    if shutil.which("nvidia-smi") is None:
        return ("no NVIDIA GPU here (nvidia-smi is not on the PATH); run it on a machine with "
                "one."), {}
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True,
                              timeout=180, env=child_env())
    except subprocess.TimeoutExpired:
        return "JAX took over 3 minutes to list its devices; check the GPU and its driver.", {}
    try:
        probe = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"JAX did not start ({tail}); install sdcstudy with its cuda extra.", {}
    if probe["backend"] != "gpu":
        return (f"JAX has no CUDA backend here (its default backend is {probe['backend']}); "
                f"install it with pip install -e '.[cuda]'."), {}
    return None, probe


def child_env() -> dict:
    """The environment of every child: sdcstudy importable from this checkout, no
    compilation cache (each process compiles for itself, as the doctor means it to)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


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
    return out


class Acceptance:
    """Runs the checks in turn against one deadline and rewrites the JSON after each."""

    def __init__(self, args, python: str, probe: dict, work: Path):
        self.args, self.python, self.work = args, python, work
        self.start = time.monotonic()
        self.deadline = self.start + args.budget
        self.log = open(args.out / LOG, "a")
        self.report = {"schema": "sdcstudy-gpu-acceptance/1", "verdict": None,
                       "quick": args.quick, "budget_s": args.budget, **probe,
                       "versions": versions(), "checks": {}, "wall_s": None}

    def sdcstudy(self, label: str, argv: list, cap: float) -> dict:
        """One `python -m sdcstudy ...` in its own process group, killed at its time limit;
        {"exit_code", "seconds", "timed_out", "command"} (exit_code None: not started)."""
        command = ["sdcstudy", *map(str, argv)]
        limit = min(cap, self.deadline - time.monotonic())
        if limit < MIN_CHECK_S:
            return {"exit_code": None, "seconds": 0.0, "timed_out": False, "command": command,
                    "skipped": "no time left in --budget"}
        self.log.write(f"\n===== {label}: {' '.join(command)}\n")
        self.log.flush()
        begin = time.monotonic()
        proc = subprocess.Popen([self.python, "-m", "sdcstudy", *map(str, argv)], cwd=ROOT,
                                env=child_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:  # timed out or interrupted: its children (the doctor's) too
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        seconds = time.monotonic() - begin
        self.log.write(f"===== {label}: exit {proc.returncode} after {seconds:.1f} s\n")
        self.log.flush()
        return {"exit_code": proc.returncode, "seconds": round(seconds, 1),
                "timed_out": timed_out, "command": command}

    def record(self, name: str, result: dict) -> None:
        self.report["checks"][name] = result
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        write_json(self.args.out / RESULT, self.report)
        figures = {k: round(v, 4) for k, v in result.items()
                   if k in ("false_alarm_rate", "mfu") and v is not None}
        print(f"[{name}] {'PASS' if result['pass'] else 'FAIL'} "
              f"({result.get('seconds', 0):.0f} s) {figures or ''}".rstrip(),
              file=sys.stderr, flush=True)

    def doctor(self) -> dict:
        path = self.work / "doctor.json"
        run = self.sdcstudy("doctor", ["doctor", "--json", path], cap=240)
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
        out = {"pass": False, "record": rec}
        if rec["exit_code"] != 0:
            return {**out, "seconds": rec["seconds"]}
        chk = self.sdcstudy("golden check", ["golden", "check", folder, "--json", path,
                                             "--no-progress"], cap=150)
        out.update(check=chk, seconds=round(rec["seconds"] + chk["seconds"], 1))
        if path.exists():
            d = json.loads(path.read_text())
            out.update(verdict=d["verdict"], reason=d["reason"], timing=d.get("timing"))
        out["pass"] = chk["exit_code"] == 0 and out.get("verdict") == "PASS"
        return out

    def abft(self, dtype: str) -> dict:
        folder = self.work / f"abft-{dtype}"
        run = self.sdcstudy(f"abft {dtype}", [
            "run", "configs/abft.yaml", "--out", folder, "--no-progress",
            "--set", "suspect.profile=healthy", "--set", f"model.dtype={dtype}",
            "--set", "abft.threshold=rounding",
            "--set", f"experiment.steps={ABFT_STEPS[self.args.quick]}"], cap=150)
        out = {"pass": False, **run, "dtype": dtype, "device_rule": "rounding"}
        if run["exit_code"] != 0 or not (folder / "summary.json").exists():
            return out
        summary = json.loads((folder / "summary.json").read_text())
        checks, flags = summary["abft/checks"], summary["abft/flags"]
        out.update(steps=summary["steps_done"], checks=checks, flags=flags,
                   false_alarm_rate=flags / checks if checks else None,
                   rules=host_rule_rates(folder / "abft.parquet"))
        out["pass"] = checks > 0 and flags == 0  # the rounding bound: a healthy run never flags
        return out

    def bench(self, dtype: str) -> dict:
        preset, batch, seq_len, steps, repeats = BENCH[self.args.quick]
        path = self.work / f"bench_train_{dtype}.json"
        run = self.sdcstudy(f"bench train {dtype}", [
            "bench", "train", "--no-torch", "--presets", preset, "--batch", batch,
            "--seq-len", seq_len, "--steps", steps, "--repeats", repeats,
            "--set", f"model.dtype={dtype}", "--json", path], cap=200)
        out = {"pass": False, **run, "dtype": dtype}
        if run["exit_code"] != 0 or not path.exists():
            return out
        r = json.loads(path.read_text())["results"][0]
        roof = r["roofline"]
        out.update(preset=preset, n_params=r["n_params"], batch=batch, seq_len=seq_len,
                   tokens_per_s=r["ours"]["tokens_per_s"]["median"],
                   step_ms=r["ours"]["seconds_per_step"]["median"] * 1e3,
                   compile_s=r["ours"]["compile_s"], step_tflop=roof["step_gflop"] / 1e3,
                   achieved_tflops=roof["gflops"]["ours"] / 1e3,
                   float32_matmul_tflops=roof["peak_gflops"]["jax"] / 1e3,
                   mfu=(roof.get("mfu") or {}).get("ours"), mfu_peak=roof.get("mfu_peak"))
        out["pass"] = out["mfu"] is not None
        if out["mfu"] is None:
            out["note"] = "no published peak for this device kind in roofline.DEVICE_PEAKS"
        return out

    def run_all(self) -> int:
        self.record("doctor", self.doctor())
        self.record("golden", self.golden())
        for dtype in DTYPES:
            self.record(f"abft_{dtype}", self.abft(dtype))
        for dtype in DTYPES:
            self.record(f"bench_train_{dtype}", self.bench(dtype))
        passed = all(c["pass"] for c in self.report["checks"].values())
        self.report["verdict"] = "PASS" if passed else "FAIL"
        self.record_final()
        return 0 if passed else 1

    def record_final(self) -> None:
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        write_json(self.args.out / RESULT, self.report)
        self.log.close()
        failed = [k for k, c in self.report["checks"].items() if not c["pass"]]
        print(f"gpu acceptance {self.report['verdict']} on {self.report['device_kind']} in "
              f"{self.report['wall_s']:.0f} s" + (f"; not passed: {', '.join(failed)}"
                                                  if failed else "") +
              f"; {self.args.out / RESULT}", flush=True)


def host_rule_rates(parquet: Path) -> dict:
    """Flagged checks over all checks under each rule, from the recorded residuals."""
    from sdcstudy.abft.tables import host_flags
    from sdcstudy.core.runfolder import read_table

    frame = read_table(parquet)
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


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"gpu_acceptance: {e} (see --help).", file=sys.stderr)
        return 2
    python = sys.executable
    problem, probe = gpu_problem(python)
    if problem is not None:
        print(f"gpu_acceptance: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(f"gpu acceptance on {probe['device_kind']}: budget {args.budget} s, "
              f"work in {work}", file=sys.stderr, flush=True)
        return Acceptance(args, python, probe, work).run_all()


if __name__ == "__main__":
    sys.exit(main())
