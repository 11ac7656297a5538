"""`sdcstudy doctor`: run the same tiny training twice in separate processes, compare bitwise.

Exit 0 only when both runs agree in every metric (except wall-clock times), in every bit of the
whole final training state (each parameter and optimizer-state array and the step counter, read
back from the last checkpoint) and in the compiled program; 1 when they differ, naming the first
difference; 3 when a run failed, was killed or left no readable result (the check could not
run: no verdict); 130 / 143 when a run was interrupted. The verdict is printed before `--json` is
written; a JSON file that cannot be written is one warning and leaves the exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

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
INTERRUPTED = {signal.SIGINT: errors.EXIT_SIGINT, signal.SIGTERM: errors.EXIT_SIGTERM}


def _uncached_env() -> dict:
    """This environment with JAX's compilation cache off: each run compiles its own program, so
    a compiler that is not deterministic shows (a user's cache would hand the second run the
    first one's executable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def _run(config_path: Path, out: Path) -> subprocess.CompletedProcess:
    # errors="replace": bytes that are not UTF-8 on its stdout or stderr are no crash here
    return subprocess.run([sys.executable, "-m", "sdcstudy", "run", str(config_path), "--out",
                           str(out), "--no-progress"], capture_output=True, text=True,
                          errors="replace", env=_uncached_env())


def deterministic_view(run_dir: Path) -> dict:
    """What must be bitwise equal between two runs of one config: no wall-clock times."""
    import jax

    from sdcstudy.core.checkpoint import final_state  # imports jax and orbax: only here

    # Reading a checkpoint starts a JAX backend in this process: the CPU's, never the
    # accelerator the runs used (its client would hold most of the device's memory).
    jax.config.update("jax_platforms", "cpu")

    rows = [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in RF.read_jsonl(run_dir / RF.METRICS)]
    summary = RF.json_load(run_dir / RF.SUMMARY)
    env = RF.json_load(run_dir / RF.ENV)
    return {"metrics": rows, "param_digest": summary["param_digest"],
            "compiled_step_sha256": env["compiled_step_sha256"],
            "state": final_state(run_dir)}


def _metric(row: dict, key: str) -> str:
    # repr tells every float's bits apart (-0.0 from 0.0) and 0 from 0.0; NaN and Inf are
    # stored as the strings "nan", "inf".
    return repr(row[key]) if key in row else "absent"


def _metric_difference(rows_a: list[dict], rows_b: list[dict]) -> str | None:
    """The first metrics row that differs: its step, and each differing value in run a, b."""
    for ra, rb in zip(rows_a, rows_b):
        diff = sorted(k for k in ra.keys() | rb.keys() if _metric(ra, k) != _metric(rb, k))
        if diff:
            values = ", ".join(f"{k} {_metric(ra, k)} vs {_metric(rb, k)}" for k in diff)
            return f"step {ra.get('step')}: {values} (run a vs run b)"
    return None


def _bits(array):
    """The array's elements as unsigned integers of their width: equal only if every bit is."""
    array = np.ascontiguousarray(array)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def _state_difference(a: dict, b: dict) -> str | None:
    """The first array of the final state that differs in any bit (parameters first): which
    array, which element, its values and bits in run a and b, and how many differ."""
    if a.keys() != b.keys():
        return f"final state: arrays in one run only: {', '.join(sorted(a.keys() ^ b.keys()))}"
    names = sorted(a, key=lambda name: not name.startswith("params/"))  # stable: stored order
    differing = [n for n in names if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
                 or _bits(a[n]).tobytes() != _bits(b[n]).tobytes()]
    if not differing:
        return None
    name = differing[0]
    x, y = a[name], b[name]
    where = f"final state: {len(differing)} of {len(names)} arrays differ; first {name}"
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"{where}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
    bits_x, bits_y = _bits(x), _bits(y)
    unequal = bits_x != bits_y
    index = tuple(int(i) for i in np.argwhere(unequal)[0]) if x.ndim else ()
    width = 2 * bits_x.dtype.itemsize
    return (f"{where}{list(index) if index else ''}: {x[index].item()!r} vs {y[index].item()!r} "
            f"(bits {int(bits_x[index]):#0{width + 2}x} vs {int(bits_y[index]):#0{width + 2}x}), "
            f"{int(np.count_nonzero(unequal))} of {x.size} elements differ")


def compare(a: dict, b: dict) -> list[str]:
    problems = []
    for key in ("compiled_step_sha256", "param_digest"):
        if a[key] != b[key]:
            problems.append(f"{key} differs ({a[key][:16]}... vs {b[key][:16]}...)")
    if len(a["metrics"]) != len(b["metrics"]):
        problems.append("the runs logged different numbers of steps")
    for difference in (_metric_difference(a["metrics"], b["metrics"]),
                       _state_difference(a["state"], b["state"])):
        if difference is not None:
            problems.append(difference)
    return problems


def _stopped(name: str, proc: subprocess.CompletedProcess) -> tuple[int, str]:
    """The exit code and sentence for run `name`, which did not exit 0: interrupted (130, 143:
    by its own handler or killed by the signal), else could not run (3). Never a FAIL."""
    code = proc.returncode
    sig = -code if code < 0 else next((s for s, c in INTERRUPTED.items() if c == code), None)
    if sig in INTERRUPTED:
        return (INTERRUPTED[sig], f"run {name} was interrupted by {signal.Signals(sig).name}; "
                                  f"no verdict: run sdcstudy doctor again")
    if sig is not None:
        try:
            how = f"was killed by {signal.Signals(sig).name}"
        except ValueError:
            how = f"was killed by signal {sig}"
    else:
        how = f"failed (exit {code})"
    tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
    return errors.EXIT_COULD_NOT_RUN, f"run {name} {how}: {tail[0][:300]}; no verdict"


def fingerprint_lines(env: dict) -> list[str]:
    """The environment fingerprint on screen; env.json's every field is in the JSON report."""
    cpu = env["cpu"]
    lines = [f"  jax {env['packages'].get('jax')} (jaxlib {env['packages'].get('jaxlib')}) on "
             f"{env['platform']} ({', '.join(f'{n} x {k}' for k, n in env['device_kinds'].items())}"
             f"); CPU {cpu['model']} [{' '.join(cpu['isa'])}]"]
    gpu = {k: v for k, v in (env.get("gpu_stack") or {}).items() if not isinstance(v, dict)}
    if gpu:
        lines.append(f"  GPU stack: {', '.join(f'{k} {v}' for k, v in gpu.items())}")
    lines.append(f"  XLA_FLAGS: {env.get('xla_flags') or '(none)'}")
    lines.append(f"  compiled step sha256 {env['compiled_step_sha256'][:16]}...")
    return lines


def _runs(root: Path, progress: bool) -> tuple[list[dict], tuple[int, str] | None]:
    """Both runs' deterministic views, or the exit code and sentence of the first that failed."""
    config_path = root / "doctor.yaml"
    RF.atomic_write_text(config_path, C.dump(C.from_dict(DOCTOR)))
    with ticking("sdcstudy doctor", enabled=progress, total=2, unit="runs") as line:
        for name in ("a", "b"):
            proc = _run(config_path, root / name)
            if proc.returncode != 0:
                return [], _stopped(name, proc)
            line.advance()
    views = []  # read once both runs have ended: run b never shares its device with this one
    for name in ("a", "b"):
        try:
            views.append(deterministic_view(root / name))
        except Exception as e:  # exit 0 but no readable folder: no verdict, never a FAIL
            return views, (errors.EXIT_COULD_NOT_RUN,
                           f"run {name} left no readable result ({type(e).__name__}: "
                           f"{errors.first_line(e, 300)}); no verdict")
    return views, None


def main(json_path: Path | None = None, keep: Path | None = None, progress: bool = True) -> int:
    with tempfile.TemporaryDirectory(prefix="sdcstudy-doctor-") as tmp:
        root = Path(keep) if keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        print("sdcstudy doctor: two tiny trainings in separate processes ...", flush=True)
        views, stopped = _runs(root, progress)
        if stopped:  # said once the line is closed
            code, sentence = stopped
            print(f"sdcstudy doctor: {sentence}", file=sys.stderr, flush=True)
            if json_path:  # never leave an earlier report standing for this one
                reports.write_report_json(json_path, {"verdict": None, "exit_code": code,
                                                      "error": sentence})
            return code
        env = RF.json_load(root / "a" / RF.ENV)
    problems = compare(*views)
    code = errors.EXIT_FAIL if problems else errors.EXIT_PASS
    report = {"verdict": "FAIL" if problems else "PASS", "exit_code": code,
              "problems": problems, "steps": len(views[0]["metrics"]),
              "state_arrays": len(views[0]["state"]), "param_digest": views[0]["param_digest"],
              "env": env}
    print("\n".join(fingerprint_lines(env)))
    if problems:
        print(f"FAIL: the two runs differ: {'; '.join(problems)}", flush=True)
    else:
        print(f"PASS: {report['steps']} steps, every metric and every bit of the final state "
              f"({report['state_arrays']} arrays: parameters, optimizer state, step) identical "
              f"(params sha256 {report['param_digest'][:16]}...)", flush=True)
    if json_path:  # after the verdict: a file that cannot be written does not change it
        reports.write_report_json(json_path, report)
    return code
