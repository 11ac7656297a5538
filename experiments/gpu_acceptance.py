"""bash experiments/gpu_acceptance.sh --out DIR [--quick] [--budget SECONDS] [--work DIR]

Is this GPU ready for sdcstudy, and does sdcstudy meet its targets on it? On one NVIDIA GPU,
in at most 10 minutes, it runs in turn (the seconds planned for an H100 in brackets):

1. `sdcstudy doctor`: the tiny training twice in separate processes, every bit compared [30];
2. `sdcstudy golden record` then `golden check` of the built-in tiny workload [35];
3. `sdcstudy bench train --no-torch` on medium (32 x 512 tokens) in bfloat16: MFU at least
   35% of the dense bfloat16 peak, and the kernel census of the compiled step [30];
4. the determinism A/B: the same bench train with `--xla_gpu_deterministic_ops=false
   --xla_gpu_exclude_nondeterministic_ops=false` in XLA_FLAGS (keys already set win over
   sdcstudy/core/determinism.py's); the flags may cost at most 10% of the tokens/s [30];
5. bench train on medium in float32: MFU measured (no floor) [25];
6. the census of step 3's program: no scatter serialized into a `while` loop;
7. bench train on `llama3.2-1b` (8 x 512 tokens): MFU at least 40% in bfloat16 [75] and 35%
   of the TF32 peak in float32 [85]; skipped, saying so, where the preset is not defined;
8. ABFT on a healthy node (`configs/abft.yaml`, `abft.threshold=rounding`) in float32 and
   bfloat16: no flag in any check [2 x 30];
9. ABFT against single exponent-bit flips (`suspect.profile=exponent-flip`) in both dtypes:
   recall at least 90%, and recall per error size [2 x 25];
10. the device's clocks, power, temperatures and ECC counters (`nvidia-smi -q`) before and
    after, clocks, power and temperature sampled during every bench train, and no ECC error
    or counter rise, no pending row remap.

Planned: about 430 s of the 570 s budget. experiments/gpu_floors.py holds the floors and reads
each check's files; experiments/nvidia_smi.py reads the device's state. Results:
DIR/gpu_acceptance.json (each check's verdict and figures, the device kind and state, driver
and package versions, wall time; rewritten after every check, so a run cut short still leaves
what it measured), DIR/gpu_acceptance.log (every command's output and both `nvidia-smi -q`
texts) and DIR/gpu_acceptance_hlo.tar.gz (each bench train step's optimized HLO). A check
with too little of --budget left, or whose preset is missing, is skipped with the reason.
Verdict PASS: every check passed (exit 0); FAIL: one failed; INCOMPLETE: none failed but one
was skipped (exit 1 for both). `--quick` times the small preset instead (16 x 256 tokens), skips
the 1B preset and applies no MFU floor or cost limit: a first look, not an acceptance.

Where there is no GPU it refuses with one sentence and exit 2 before running anything: no
`nvidia-smi` on the PATH means no NVIDIA GPU; then a JAX whose default backend is not `gpu`
means JAX has no CUDA backend here (install the `cuda` extra). JAX is only ever imported in
child processes, so this process holds no GPU memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_checks as GC  # noqa: E402
import gpu_floors as GF  # noqa: E402

PROG = "experiments/gpu_acceptance.sh"
BUDGET_S = 570  # the whole acceptance, under the 10 minutes it promises
PROBE = ("import json, jax; d = jax.devices()[0]; print(json.dumps({'backend': "
         "jax.default_backend(), 'device_kind': d.device_kind, 'device_count': "
         "jax.device_count()}))")


class UsageError(Exception):
    """A bad command line: one sentence, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog=PROG, description="Acceptance of one NVIDIA GPU for sdcstudy against its "
                "targets: doctor, golden, bench train MFU floors with the kernel census and "
                "the determinism A/B, ABFT false alarms and recall, and the device's clocks, "
                "power, temperatures and ECC counters, in at most 10 minutes; results in "
                "DIR/gpu_acceptance.json. Exit 0 all checks pass, 1 one fails or is skipped, "
                "2 bad arguments or no GPU.")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help=f"folder for {GC.RESULT}, {GC.LOG} and {GC.HLO} (created if missing)")
    p.add_argument("--quick", action="store_true",
                   help="smaller workloads, no 1B preset and no floors: the small preset for "
                        f"bench train, {GC.ABFT_STEPS[True]} ABFT steps")
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
    if (args.out / GC.RESULT).exists():
        raise UsageError(f"{args.out / GC.RESULT} already exists; choose another --out")
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
                              timeout=180, env=GC.child_env())
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






def run_all(acc: GC.Acceptance) -> int:
    """The checks in the docstring's order; exit 0 when every one passed, else 1."""
    quick = acc.args.quick
    before = acc.device_state("before")
    acc.check("doctor", acc.doctor)
    acc.check("golden", acc.golden)
    deterministic = acc.check("bench_train_bfloat16", acc.bench, "bench_train_bfloat16",
                              GC.BENCH[quick], "bfloat16", cap=200)
    acc.check("determinism_ab", acc.determinism_ab, deterministic)
    acc.check("bench_train_float32", acc.bench, "bench_train_float32", GC.BENCH[quick],
              "float32", cap=200)
    if "census" in deterministic:
        acc.check("kernel_census", GF.judge_census, deterministic)
    else:
        acc.record("kernel_census", GC.skipped("the bfloat16 bench train wrote no census"))
    reason = "--quick" if quick else GC.preset_problem(GF.ONE_B)
    for dtype in ("bfloat16", "float32"):
        name = f"bench_train_1b_{dtype}"
        if reason:
            acc.record(name, GC.skipped(reason))
        else:
            acc.check(name, acc.bench, name, GC.BENCH_1B, dtype, cap=240)
    for dtype in GC.DTYPES:
        acc.check(f"abft_healthy_{dtype}", acc.abft_healthy, dtype)
    for dtype in GC.DTYPES:
        acc.check(f"abft_recall_{dtype}", acc.abft_recall, dtype)
    acc.check("device_health", acc.device_health, before, acc.device_state("after"))
    return acc.finish()


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
        return run_all(GC.Acceptance(args, python, probe, work))


if __name__ == "__main__":
    sys.exit(main())
