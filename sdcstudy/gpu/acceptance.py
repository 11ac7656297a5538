"""sdcstudy accept-gpu --out DIR [--stage full|quick] [--budget SECONDS] [--work DIR] [--only LIST]

Is this GPU ready for sdcstudy, and does sdcstudy meet issue 53's targets on it (`floors`)?
On one NVIDIA GPU, in two runs that fit a 15-minute window (the seconds planned for an H200 in
brackets):

`--stage full` (budget 540 s, about 9 minutes):
1. `doctor`: the tiny training twice in separate processes, every bit compared [30];
2. `bench_medium_bfloat16_tuned`: bench train medium (32 x 512) bfloat16 without the
   determinism flags, XLA's autotuner free, its choices dumped to a file [35];
3. `bench_medium_bfloat16_pinned`: the same with the flags on and that file loaded: MFU at
   least 35% [35]; 4. `bench_medium_bfloat16_untuned`: flags on, nothing loaded (today) [35];
   `bench_medium_bfloat16_pallas`: flags on, the file loaded, `model.attention=pallas` (JAX's
   Pallas flash attention, no cuDNN): MFU at least 35%, its kernels in the census [45; 0
   where cuDNN's cannot launch under the flags: `auto` runs Pallas, the pinned step is it];
5. `pinned_autotune`: the pinned step runs the tuned step's GEMMs (census), not the untuned;
6. `determinism_cost`: the flags with pinned choices cost at most 10% of tokens/s;
7. `kernel_census`: no scatter serialized into a `while` loop; `fused_attention`: cuDNN's
   fused attention forward and backward in the step;
8. `torch_ratio`: transformers + torch (bfloat16 autocast, SDPA, torch.compile, AdamW) on the
   same GPU and shapes: ours at least 1.0x its tokens/s [60];
9. `bench_1b_bfloat16`, `bench_1b_float32`: llama3.2-1b (8 x 512), flags on: MFU at least 40%
   of the bfloat16 peak and 35% of the TF32 peak [75, 85];
10. `abft_healthy_float32`, `abft_healthy_bfloat16`: ABFT on a healthy `small` node, 600 steps
    (102,600 checks): no flag [2 x 40]; `abft_recall_*`: single exponent-bit flips on `tiny`,
    recall at least 90% and recall per error size [2 x 25];
11. `device_health`: clocks, power, temperatures and ECC counters (`nvidia-smi -q`) before and
    after, no ECC error or counter rise, no pending row remap.

`--stage quick` (budget 240 s, the short second run): `golden_full`: `golden record --workload
full` then one `golden check` of it: every SM reached, at least 70% of device memory written
and verified, at most 180 s to record, the check PASSes (bitwise); `fingerprint`: driver, CUDA
runtime, cuBLAS, cuDNN and NCCL in the record's env.json; `golden_other_machine`: the tiny
workload recorded into DIR (commit it for the next machine), and each record another GPU made,
committed under experiments/golden-records/, checked here: PASS, and FAIL at one injected
flip's step, layer and site [60]; `attention_repeat`: the tiny training
in bfloat16 with cuDNN's fused attention (the Pallas kernels where cuDNN's cannot launch under
the flags) in two processes, the same bits [40]; `fault_draws`: the fault engine's dense rest
on a weight gradient of `small` at nodes 1 and 14's rate, one pass and two timed, the two the
same bits [20]; `free_step`: medium in bfloat16 without the determinism flags (Pallas
attention, `model.embedding_grad=sorted`), its kernel choices pinned by a first run, in two
more processes: the same bits, and its tokens/s over the flags' (gpu/free_step.py) [100];
`fault_engine_cost`, `paired_cost`, `abft_overhead`: `bench faults`, `bench
paired` and `bench abft` on `small` (16 x 512), each contender's step over the plain step's
(idle and firing fault engine; lock-step and parameter synchronization against free running,
SKIPPED on one GPU: a pair is two devices; ABFT on, and with recomputation): stated [3 x 60];
`bench_8b16l_bfloat16`: llama3-8b-16l (4 x 512) in bfloat16, flags on: MFU stated [150];
`fault_engine_cost_graphs`: `bench faults` again with conditionals inside CUDA graphs
(`checks.CONDITIONALS_IN_GRAPHS`), beside `fault_engine_cost` [120]; `device_health`.

`--only LIST` runs the named checks of either stage (a rerun of what a budget skipped).
Results: DIR/gpu_acceptance.json (each check's verdict and figures, the device's state,
versions, wall time; rewritten after every check), DIR/gpu_acceptance.txt (the short table),
DIR/gpu_acceptance.log (every command's output) and DIR/gpu_acceptance_hlo.tar.gz (each bench
train step's optimized HLO); an --out holding any of these, or the record `golden_other_machine`
packs, is refused before anything runs, as is a --work that is not empty. Exit 0 every check
passed; 1 one failed (FAIL); 3 none failed and one could not measure, its child crashed or
wrote nothing (COULD NOT RUN: ERROR is never a FAIL); 2 one was skipped (INCOMPLETE), bad
arguments or no usable GPU. JAX is only ever imported in child processes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from sdcstudy.core.errors import UserError

STAGES = {"full": 540, "quick": 240}  # stage -> default budget, seconds
FULL_CHECKS = ("doctor", "bench_medium_bfloat16_tuned", "bench_medium_bfloat16_pinned",
               "bench_medium_bfloat16_untuned", "bench_medium_bfloat16_pallas",
               "pinned_autotune", "determinism_cost", "kernel_census", "fused_attention",
               "torch_ratio", "bench_1b_bfloat16", "bench_1b_float32", "abft_healthy_float32",
               "abft_healthy_bfloat16", "abft_recall_float32", "abft_recall_bfloat16",
               "device_health")
QUICK_CHECKS = ("golden_full", "fingerprint", "golden_other_machine", "attention_repeat",
                "fault_draws", "free_step", "fault_engine_cost", "paired_cost", "abft_overhead",
                "bench_8b16l_bfloat16", "fault_engine_cost_graphs", "device_health")
# What a run writes into --out (session.py's files, golden_checks.py's KEPT): none may be there.
OUTPUTS = ("gpu_acceptance.json", "gpu_acceptance.txt", "gpu_acceptance.log",
           "gpu_acceptance_hlo.tar.gz", "golden-record-tiny.tar.gz")
PROBE = ("import json, jax; d = jax.devices()[0]; print(json.dumps({'backend': "
         "jax.default_backend(), 'device_kind': d.device_kind, 'device_count': "
         "jax.device_count()}))")


def add_arguments(p) -> None:
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="folder for gpu_acceptance.json, .txt, .log and the HLO archive "
                        "(created if missing)")
    p.add_argument("--stage", choices=tuple(STAGES), default="full",
                   help="full: speed, determinism, torch, ABFT (about 9 minutes); quick: the "
                        "golden checks, repeated bits, the step without the flags, the "
                        "step costs and the 8B step (about 4 minutes; docs/gpu.md)")
    p.add_argument("--budget", type=int, default=None, metavar="SECONDS",
                   help="wall-clock limit (default: full 540, quick 240)")
    p.add_argument("--work", type=Path, default=None, metavar="DIR",
                   help="keep the run folders and records here (default: a temporary folder)")
    p.add_argument("--only", default=None, metavar="LIST",
                   help="comma-separated checks to run, of either stage")


def checks_to_run(args) -> tuple[str, ...]:
    """The stage's checks, or `--only`'s in the stages' order."""
    if args.only is None:
        return FULL_CHECKS if args.stage == "full" else QUICK_CHECKS
    known = FULL_CHECKS + QUICK_CHECKS
    wanted = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in known]
    if unknown or not wanted:
        raise UserError(f"--only names no check {', '.join(unknown) or '(empty)'}; choose from "
                        f"{', '.join(dict.fromkeys(known))}.")
    return tuple(c for c in dict.fromkeys(known) if c in wanted)


def check_arguments(args) -> None:
    """Refuse what cannot work before anything runs (one sentence, exit 2)."""
    args.budget = STAGES[args.stage] if args.budget is None else args.budget
    # Children run in the checkout (configs/ is read from there): hand them absolute paths.
    args.out = args.out.absolute()
    args.work = None if args.work is None else args.work.absolute()
    if args.budget < 60:
        raise UserError(f"--budget must be at least 60 seconds, not {args.budget}.")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file, not a folder.")
    taken = [args.out / name for name in OUTPUTS if (args.out / name).exists()]
    if taken:  # an earlier acceptance's results (a run cut short leaves its log): keep them
        raise UserError(f"{taken[0]} already exists; choose another --out.")
    if args.work is not None and args.work.exists() and any(args.work.iterdir()):
        raise UserError(f"--work {args.work} is not empty; choose a new folder.")
    args.checks = checks_to_run(args)


def gpu_problem(python: str) -> tuple[str | None, dict]:
    """(None, what JAX reports) on a usable GPU, else (one sentence saying why not, {})."""
    from sdcstudy.gpu.session import child_env

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


def run_checks(acc, checks: tuple[str, ...]) -> int:
    """The named checks in their order; the exit code of `Session.finish`."""
    from sdcstudy.gpu import checks as GC
    from sdcstudy.gpu import floors as GF

    before = acc.device_state("before") if "device_health" in checks else None
    got: dict[str, dict] = {}

    def do(name, measure, *args, **kwargs):
        if name in checks:
            got[name] = acc.check(name, measure, *args, **kwargs)
        return got.get(name, {})

    def do_unless(reason, name, measure, *args, **kwargs):
        """`do`, or the check SKIPPED with `reason` where there is one."""
        if reason and name in checks:
            got[name] = acc.record(name, GC.skipped(reason))
            return got[name]
        return do(name, measure, *args, **kwargs)

    do("doctor", acc.doctor)
    tuned = do("bench_medium_bfloat16_tuned", acc.bench_tuned)
    pinned = do("bench_medium_bfloat16_pinned", acc.bench_pinned)
    untuned = do("bench_medium_bfloat16_untuned", acc.bench_untuned)
    do("bench_medium_bfloat16_pallas", acc.bench_pallas, pinned)
    do("pinned_autotune", acc.pinned_autotune, tuned, pinned, untuned)
    do("determinism_cost", acc.determinism_cost, tuned, pinned, untuned)
    shipped = pinned if "census" in pinned else untuned
    do("kernel_census", _with_census, GF.judge_census, shipped)
    do_unless(GC.CUDNN_FAILS if GC.cudnn_fails_here() else None, "fused_attention",
              _with_census, GF.judge_fused_attention, shipped)
    do("torch_ratio", acc.torch_ratio, shipped)
    for dtype in ("bfloat16", "float32"):
        name = f"bench_1b_{dtype}"
        do_unless(GC.preset_problem(GF.ONE_B), name, acc.bench, name, GC.ONE_B, dtype, cap=240,
                  floor=GF.BENCH_FLOORS[GF.ONE_B, dtype])
    for dtype in GC.DTYPES:
        do(f"abft_healthy_{dtype}", acc.abft_healthy, dtype)
    for dtype in GC.DTYPES:
        do(f"abft_recall_{dtype}", acc.abft_recall, dtype)
    do("golden_full", acc.golden_full)
    do("fingerprint", acc.fingerprint)
    do("golden_other_machine", acc.golden_other_machine)
    do("attention_repeat", acc.attention_repeat)
    do("fault_draws", acc.fault_draws)
    do("free_step", acc.free_step)
    for name, suite in GC.OVERHEADS.items():
        do(name, acc.overhead, name, suite)
    do_unless(GC.preset_problem(GC.EIGHT_B_16L[0]), "bench_8b16l_bfloat16", acc.bench,
              "bench_8b16l_bfloat16", GC.EIGHT_B_16L, "bfloat16", cap=300)
    do("fault_engine_cost_graphs", acc.overhead, "fault_engine_cost_graphs", "faults",
       (GC.CONDITIONALS_IN_GRAPHS,))
    if before is not None:
        do("device_health", acc.device_health, before, acc.device_state("after"))
    return acc.finish()


def _with_census(judge, figures: dict) -> dict:
    from sdcstudy.gpu.session import skipped

    if "census" not in figures:
        return skipped("no medium bfloat16 bench train wrote a census")
    return judge(figures)


def run(args) -> int:
    """`sdcstudy accept-gpu`: refuse without a GPU (exit 2), else run the checks."""
    import sys

    from sdcstudy.gpu.checks import Acceptance

    check_arguments(args)
    python = sys.executable
    problem, probe = gpu_problem(python)
    if problem is not None:
        raise UserError(problem)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(f"gpu acceptance ({args.stage}: {', '.join(args.checks)}) on "
              f"{probe['device_kind']}: budget {args.budget} s, work in {work}",
              file=sys.stderr, flush=True)
        return run_checks(Acceptance(args, python, probe, work), args.checks)
