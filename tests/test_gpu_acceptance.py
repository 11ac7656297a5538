"""`sdcstudy accept-gpu` (sdcstudy/gpu/, run by experiments/gpu_acceptance.sh) on a machine
without a GPU: its refusals, the MFU peaks, and how it judges what its checks measure.

The acceptance itself needs an NVIDIA GPU (RESULTS.md, "On one GPU"); here we check what a
user meets first: `--help`, bad or missing arguments and the refusal without a GPU each end
with the documented exit code, before anything is run or written. The fake `nvidia-smi` test
reaches the second refusal, a JAX without its CUDA backend. Then the published peak that
`bench train` takes its MFU against, per device kind and dtype. Last, the judging a GPU run
depends on, fed with fake results for each verdict, pass and fail per floor: the MFU floors, the
determinism cost with pinned kernel choices, the pinned choices honoured, cuDNN's fused
attention, the kernel census, the torch ratio, ABFT's false alarms over 100,000 checks and
recall per error size, the golden full workload and the stack fingerprint, `nvidia-smi -q` read
from an H100's text, the short table, and a check that breaks failing alone. And every
command the checks start, at the GPU's sizes, through what its subcommand refuses before
it compiles (config, fault profile, bench's files, golden's --inject), none writing
another's file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sdcstudy.bench import roofline
from sdcstudy.core.config import ModelDims
from sdcstudy.core.determinism import AUTOTUNE_FLAG

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu_acceptance.sh"
SYSTEM_PATH = "/usr/bin:/bin"
H100 = "NVIDIA H100 80GB HBM3"


def acceptance(*args: str, path: str = SYSTEM_PATH, timeout: int = 120):
    env = {**os.environ, "PATH": path, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def one_sentence(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {stderr!r}"
    assert lines[0].startswith("sdcstudy: error: ") and lines[0].endswith(".")
    return lines[0]


def test_refuses_without_a_gpu(tmp_path):
    """Where no nvidia-smi is on the PATH the script must stop at once with exit 2 and one
    sentence, and write nothing: otherwise a CPU machine would spend minutes and report a
    half-empty acceptance as if a GPU had been tested."""
    if shutil.which("nvidia-smi", path=SYSTEM_PATH):
        pytest.skip("this machine has nvidia-smi")
    out = tmp_path / "acc"
    proc = acceptance("--out", str(out))
    assert proc.returncode == 2
    assert one_sentence(proc.stderr) == ("sdcstudy: error: no NVIDIA GPU here (nvidia-smi is "
                                         "not on the PATH); run it on a machine with one.")
    assert proc.stdout == "" and not out.exists()


def test_refuses_a_jax_without_cuda(tmp_path):
    """An NVIDIA driver but a CPU-only JAX (the usual mistake: the cuda extra not installed)
    must also be refused with exit 2, naming the backend JAX fell back to and the fix."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: fake'\n")
    smi.chmod(0o755)
    proc = acceptance("--out", str(tmp_path / "acc"), path=f"{fake_bin}:{SYSTEM_PATH}")
    assert proc.returncode == 2
    line = one_sentence(proc.stderr)
    assert "JAX has no CUDA backend here (its default backend is cpu)" in line
    assert "pip install -e '.[cuda]'" in line
    assert not (tmp_path / "acc").exists()


def in_process(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """`sdcstudy accept-gpu ARGS` through the CLI's main in this process (exit code, stdout,
    stderr): the refusals below come before any child or GPU probe, and a subprocess each
    would cost seconds of imports."""
    from sdcstudy import cli

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() adds flags
    try:
        code = cli.main(["accept-gpu", *args])
    except SystemExit as e:  # argparse: --help, or a bad option
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_names_every_option(capsys, monkeypatch):
    """`--help` must exit 0 and name the options docs/gpu.md documents."""
    code, out, _ = in_process(capsys, monkeypatch, "--help")
    assert code == 0
    assert out.startswith("usage: sdcstudy accept-gpu")
    for option in ("--out DIR", "--stage {full,quick}", "--budget SECONDS", "--work DIR",
                   "--only LIST"):
        assert option in out


@pytest.mark.parametrize("args, says", [
    (["--out", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["--out", "x", "--budget", "soon"], "argument --budget: invalid int value: 'soon'"),
    (["--out", "x", "--stage", "slow"], "argument --stage: invalid choice: 'slow'"),
    ([], "the following arguments are required: --out"),
])
def test_bad_arguments(capsys, monkeypatch, args, says):
    """A wrong option or value must give exit 2 naming it in one line (never start the
    checks)."""
    code, _, err = in_process(capsys, monkeypatch, *args)
    assert code == 2 and says in err and err.count("\n") == 1


@pytest.mark.parametrize("args, says", [
    (["--budget", "5"], "--budget must be at least 60 seconds, not 5."),
    (["--only", "doctor,warp_drive"], "--only names no check warp_drive; choose from doctor"),
])
def test_refusals_before_the_gpu_probe(tmp_path, capsys, monkeypatch, args, says):
    """Our own refusals come as one sentence with exit 2, before the GPU is looked for."""
    code, out, err = in_process(capsys, monkeypatch, "--out", str(tmp_path / "acc"), *args)
    assert code == 2 and out == ""
    assert says in one_sentence(err)
    assert not (tmp_path / "acc").exists()


def test_the_outputs_refused_in_out_are_every_file_a_run_writes_there():
    assert set(GA.OUTPUTS) == {GS.RESULT, GS.TABLE, GS.LOG, GS.HLO, GGC.KEPT}


@pytest.mark.parametrize("name", ["gpu_acceptance.json", "gpu_acceptance.log",
                                  "gpu_acceptance_hlo.tar.gz", "golden-record-tiny.tar.gz"])
def test_an_out_holding_an_earlier_runs_file_is_refused_and_left_as_it_is(
        tmp_path, capsys, monkeypatch, name):
    """A run cut short (a window's end) leaves its log, or its packed record, before its JSON:
    a second run into the same --out must not append to that log or replace the record."""
    out = tmp_path / "acc"
    out.mkdir()
    (out / name).write_text("earlier")
    code, stdout, err = in_process(capsys, monkeypatch, "--out", str(out))
    assert code == 2 and stdout == ""
    assert one_sentence(err) == (f"sdcstudy: error: {out / name} already exists; choose "
                                 f"another --out.")
    assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == "earlier"


def test_a_work_folder_in_use_or_an_out_that_is_a_file_is_refused(tmp_path, capsys,
                                                                  monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "doctor.json").write_text("mine")
    code, _, err = in_process(capsys, monkeypatch, "--out", str(tmp_path / "acc"), "--work",
                              str(work))
    assert code == 2 and one_sentence(err).endswith(f"--work {work} is not empty; choose a "
                                                    f"new folder.")
    assert (work / "doctor.json").read_text() == "mine" and not (tmp_path / "acc").exists()
    (tmp_path / "file").write_text("mine")
    code, _, err = in_process(capsys, monkeypatch, "--out", str(tmp_path / "file"))
    assert code == 2 and "is a file, not a folder." in one_sentence(err)


def test_device_peak_follows_the_kind_and_dtype():
    """MFU is only as right as the peak under it: bfloat16 against the tensor cores' dense
    bfloat16 peak, float32 against the plain float32 units unless a float32 matmul measured
    faster than those (then XLA used TF32 tensor cores), and no MFU for a kind we have no
    published figure for (a CPU)."""
    bf16 = roofline.device_peak(H100, "bfloat16")
    assert bf16["flops"] == 989e12 and bf16["unit"] == "bfloat16" and bf16["device"] == "H100 SXM"
    assert "989 TFLOP/s" in bf16["label"]
    assert roofline.device_peak(H100, "float32", measured_float32=50e12)["flops"] == 67e12
    tf32 = roofline.device_peak(H100, "float32", measured_float32=120e12)
    assert tf32["unit"] == "tf32" and tf32["flops"] == 494e12
    assert roofline.device_peak("cpu", "float32", 1e11) is None


def test_summary_mfu_is_step_flops_over_time_over_peak():
    """MFU = model FLOPs per step x steps per second / peak; absent without a peak."""
    dims = ModelDims(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, ffn_dim=128, dtype="bfloat16")
    peak = roofline.device_peak(H100, "bfloat16")
    out = roofline.summary(dims, 8, 64, {"ours": 100.0}, {"jax": 1e12}, None, peak)
    assert out["mfu"]["ours"] == pytest.approx(roofline.step_flops(dims, 8, 64) * 100 / 989e12)
    assert out["mfu_peak"] is peak
    assert roofline.summary(dims, 8, 64, {"ours": 100.0}, {"jax": 1e12}, None)["mfu"] is None


# The floors, the census and the device's state, judged without a GPU: the functions the
# acceptance applies to each check's files, fed with what its children write.

from sdcstudy.gpu import acceptance as GA  # noqa: E402
from sdcstudy.gpu import checks as GC  # noqa: E402
from sdcstudy.gpu import floors as GF  # noqa: E402
from sdcstudy.gpu import golden_checks as GGC  # noqa: E402
from sdcstudy.gpu import nvidia_smi as SMI  # noqa: E402
from sdcstudy.gpu import session as GS  # noqa: E402

SMI_SAMPLE = (ROOT / "tests" / "data" / "nvidia_smi_q_h100.txt").read_text()


def bench_report(preset: str, dtype: str, tflops: float, unit: str = "bfloat16") -> dict:
    """`sdcstudy bench train --json`'s report as measure_train writes it, for one preset
    whose step reached `tflops` on an H100; bench train's own MFU taken against `unit`."""
    peak = roofline.device_peak(H100, dtype, measured_float32=1e15 if unit == "tf32" else 1e12)
    step_gflop = 11_150.0
    rate = tflops * 1e3 / step_gflop  # steps per second
    return {"suite": "train", "environment": {"xla_flags": "--xla_gpu_deterministic_ops=true"},
            "results": [{
                "preset": preset, "dtype": dtype, "n_params": 104_000_000, "batch": 32,
                "seq_len": 512, "tokens_per_step": 16384,
                "ours": {"tokens_per_s": {"median": 16384 * rate},
                         "seconds_per_step": {"median": 1 / rate}, "compile_s": 9.5},
                "census": None,
                "roofline": {"step_gflop": step_gflop, "gflops": {"ours": tflops * 1e3},
                             "peak_gflops": {"jax": 120_000.0},
                             "mfu": {"ours": tflops * 1e12 / peak["flops"]},
                             "mfu_peak": peak}}]}


@pytest.mark.parametrize("preset, dtype, tflops, passes", [
    ("medium", "bfloat16", 0.36 * 989, True),
    ("medium", "bfloat16", 0.34 * 989, False),
    ("llama3.2-1b", "bfloat16", 0.41 * 989, True),
    ("llama3.2-1b", "bfloat16", 0.39 * 989, False),
    ("llama3.2-1b", "float32", 0.36 * 494, True),
    ("llama3.2-1b", "float32", 0.34 * 494, False),
])
def test_bench_floors_are_the_targets(preset, dtype, tflops, passes):
    """A bench result just above its floor (medium bfloat16 35%, the 1B preset 40% in
    bfloat16 and 35% of TF32 in float32) passes and one just below fails: a floor that let
    1% through, as "MFU present" did, would accept the slow step the targets exist to stop."""
    figures = GF.bench_figures(bench_report(preset, dtype, tflops))
    judged = GF.judge_bench(figures, GF.BENCH_FLOORS[preset, dtype], H100)
    assert judged["pass"] is passes
    assert judged["mfu_against_floor_peak"] == pytest.approx(
        tflops / (494 if dtype == "float32" else 989))


def test_float32_floor_takes_the_tf32_peak_whatever_bench_train_chose():
    """The 1B float32 floor is a share of the TF32 peak: had bench train's float32 matmul run
    slower than the plain float32 units (so its MFU is against 67 TFLOP/s and reads 4x
    higher), the floor must still be judged against TF32's 494 TFLOP/s."""
    figures = GF.bench_figures(bench_report("llama3.2-1b", "float32", 100.0, unit="float32"))
    assert figures["mfu"] == pytest.approx(100 / 67)  # bench train's own, against 67
    judged = GF.judge_bench(figures, GF.BENCH_FLOORS["llama3.2-1b", "float32"], H100)
    assert judged["mfu_against_floor_peak"] == pytest.approx(100 / 494)
    assert judged["pass"] is False and judged["floor"] == {"mfu": 0.35, "unit": "tf32"}


def test_no_floor_and_unknown_devices():
    """medium float32 has no target: MFU measured passes. A device kind without a published
    peak fails with the reason, since no floor can be judged there."""
    figures = GF.bench_figures(bench_report("medium", "float32", 92.0, unit="tf32"))
    assert GF.judge_bench(figures, None, H100)["pass"] is True
    judged = GF.judge_bench(figures, GF.Floor(0.35, "tf32"), "NVIDIA GeForce RTX 4090")
    assert judged["pass"] is False and "no published peak" in judged["note"]


def test_determinism_cost_limit():
    """The flags may cost 10%: without them 1.09x the tokens/s passes, 1.12x fails."""
    with_flags = {"tokens_per_s": 100_000.0, "census_line": "A"}
    assert GF.judge_determinism(with_flags, {"tokens_per_s": 109_000.0})["pass"] is True
    judged = GF.judge_determinism(with_flags, {"tokens_per_s": 112_000.0, "census_line": "B"})
    assert judged["pass"] is False and judged["cost"] == pytest.approx(0.12)
    assert (judged["census_with_flags"], judged["census_without_flags"]) == ("A", "B")


def test_the_b_side_really_runs_without_the_determinism_flags(monkeypatch):
    """The A/B's B side must end with both determinism flags false after the CLI's
    determinism.configure() has run, other XLA flags kept: otherwise the A/B compares the
    flags with themselves and reports a cost of zero."""
    from sdcstudy.core import determinism

    env = GS.without_determinism({"XLA_FLAGS": "--xla_gpu_deterministic_ops=true "
                                               "--xla_dump_to=/tmp/x"})
    monkeypatch.setenv("XLA_FLAGS", env["XLA_FLAGS"])
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)  # configure() sets it
    determinism.configure()
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_dump_to=/tmp/x" in flags
    for name in ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops"):
        assert [f for f in flags if f.startswith(name + "=")] == [f"{name}=false"]


def test_census_check_wants_no_serialized_scatter():
    """The census check passes a step whose scatters stayed scatters and fails one with a
    scatter expanded into a serial `while` loop (tens of ms a step over 16k tokens)."""
    from sdcstudy.bench import census

    text = (ROOT / "tests" / "data" / "census_gpu_step.hlo").read_text()
    looped = {"census": census.census(text)}
    looped["census_line"] = census.describe(looped["census"])
    judged = GF.judge_census(looped)
    assert judged["pass"] is False and judged["scatters"]["while_loops"] == 1
    assert judged["triton_gemms_with_32x32x32_tiles"] == 1
    kept = {**looped, "census": {**looped["census"],
                                 "scatters": {"native": 2, "while_loops": 0, "sort_based": 0}}}
    assert GF.judge_census(kept)["pass"] is True
    assert GF.judge_census({"census": None})["pass"] is False


@pytest.mark.slow
def test_census_reaches_the_acceptance_from_a_real_bench_train(tmp_path):
    """The wiring end to end on this CPU: `sdcstudy bench train --no-torch --hlo` writes a
    census and the HLO it came from, and the acceptance's reader turns the JSON into figures
    with the census line; the CPU has no published peak, so the floor cannot pass here."""
    path, hlo = tmp_path / "bench.json", tmp_path / "hlo"
    proc = subprocess.run(
        [sys.executable, "-m", "sdcstudy", "bench", "train", "--no-torch", "--presets", "tiny",
         "--batch", "2", "--seq-len", "16", "--steps", "1", "--repeats", "1", "--json",
         str(path), "--hlo", str(hlo)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    figures = GF.bench_figures(json.loads(path.read_text()))
    assert figures["census"]["gemms"]["xla"] > 0 and figures["census"]["gemms"]["cublas"] == 0
    assert figures["census_line"].startswith(f"GEMMs {figures['census']['gemms']['xla']}: XLA")
    assert (hlo / "tiny-float32.hlo").read_text().startswith("HloModule")
    assert GF.judge_census(figures)["pass"] is True
    judged = GF.judge_bench(figures, GF.Floor(0.35, "bfloat16"), figures["mfu_peak"] or "cpu")
    assert judged["pass"] is False


def test_an_overhead_check_runs_its_suite_on_the_workload(tmp_path, monkeypatch):
    """Each overhead check runs its own suite on `small` at 16 x 512 and reads its JSON; a
    child that wrote nothing is an ERROR. On one GPU the paired bench cannot form a pair:
    SKIPPED with the reason, nothing started."""
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="quick", budget=240)
    one = GC.Acceptance(args, sys.executable, {"device_kind": H100, "device_count": 1},
                        tmp_path)
    monkeypatch.setattr(one, "sdcstudy", lambda *a, **k: pytest.fail("started a child"))
    assert one.overhead("paired_cost", "paired")["skipped"] == GC.PAIR_NEEDS_TWO
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100, "device_count": 2},
                        tmp_path)
    seen = []
    envs = []

    def crashed(label, argv, cap, env=None):
        seen.append(argv)
        envs.append(env)
        return {"exit_code": 3, "seconds": 2.0, "timed_out": False, "command": []}

    monkeypatch.setattr(acc, "sdcstudy", crashed)
    for name, suite in GC.OVERHEADS.items():
        assert GS.state(acc.overhead(name, suite)) == "ERROR"
        argv = [str(a) for a in seen[-1]]
        assert argv[:2] == ["bench", suite]
        assert argv[argv.index("--presets") + 1] == "small"
        assert (argv[argv.index("--batch") + 1], argv[argv.index("--seq-len") + 1]) == (
            "16", "512")
    assert set(GC.OVERHEADS.values()) == {"faults", "paired", "abft"}
    assert envs == [None] * len(GC.OVERHEADS)  # the children's own environment
    # the A/B of the fault engine's conditionals: the same bench, the flag added to XLA_FLAGS
    acc.overhead("fault_engine_cost_graphs", "faults", (GC.CONDITIONALS_IN_GRAPHS,))
    assert seen[-1][:2] == ["bench", "faults"]
    assert GC.CONDITIONALS_IN_GRAPHS in envs[-1]["XLA_FLAGS"].split()
    assert GC.CONDITIONALS_IN_GRAPHS.endswith(",CONDITIONAL")


def _xla_starts_with(flags: str) -> bool:
    env = dict(os.environ, XLA_FLAGS=flags)
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, timeout=120).returncode == 0


def test_xla_parses_every_flag_the_gpu_checks_hand_their_children(tmp_path):
    """The flags reach XLA's own parser before any GPU does: the CPU build parses every
    platform's flags at start-up and exits on a name or value it does not know, so a misspelt
    flag would cost a GPU window its check. The conditionals A/B's command-buffer types, the
    free step's dump, load and completeness flags and the determinism flags, as the checks
    write them, must start JAX; the A/B's flag with a type XLA lacks must not."""
    from sdcstudy.core import determinism as DT
    from sdcstudy.gpu import free_step as FS

    pinned = tmp_path / "autotune.txt"
    assert _xla_starts_with(" ".join((
        GC.CONDITIONALS_IN_GRAPHS, FS.REQUIRE_PINNED, f"{DT.AUTOTUNE_DUMP_FLAG}={pinned}",
        f"{DT.AUTOTUNE_FLAG}={pinned}", *DT.DETERMINISM_XLA_FLAGS)))
    assert not _xla_starts_with(GC.CONDITIONALS_IN_GRAPHS.replace("CONDITIONAL",
                                                                  "CONDITIONALS"))


def test_healthy_abft_needs_100000_checks_and_no_flag():
    """0 false alarms in at least 100,000 healthy checks is the target: exactly 100,000 with
    no flag passes; one flag, or one check fewer, fails (270 checks, all the GPU has shown so
    far, proves no rate anyone can rely on). The planned run makes enough: `small` has 171
    checked products a step."""
    summary = {"steps_done": 600, "abft/checks": 100_000, "abft/flags": 0}
    assert GF.judge_healthy_abft(summary)["pass"] is True
    assert GF.judge_healthy_abft({**summary, "abft/flags": 1})["pass"] is False
    assert GF.judge_healthy_abft({**summary, "abft/checks": 99_999})["pass"] is False
    assert GF.judge_healthy_abft({**summary, "abft/checks": 0})["pass"] is False
    preset, steps = GC.ABFT_HEALTHY
    assert preset == "small" and steps * (8 * 7 * 3 + 3) >= GF.ABFT_MIN_CHECKS


def test_recall_floor_and_recall_per_error_size():
    """Recall below 90% fails; each fault lands in the decade of its error, detected when the
    forward check of its product (step, microstep, layer, the site's matmul, tp rank)
    flagged; a flag on another matmul or a backward check does not count."""
    def fault(step, site, original, corrupted, layer=0):
        return {"step": step, "microstep": 0, "layer": layer, "site": site, "tp_rank": 0,
                "original": original, "corrupted": corrupted}

    def check(step, matmul, direction="fwd", flagged=True):
        return {"step": step, "microstep": 0, "layer": 0, "matmul": matmul,
                "direction": direction, "tp_rank": 0, "flagged": flagged}

    faults = [fault(1, "fwd/attn", 0.5, 3.0e5), fault(1, "fwd/attn", 0.2, 7.1e5),
              fault(2, "fwd/ffn", 0.75, 0.75 * 2 ** -64), fault(3, "fwd/ffn", 1.0, float("inf")),
              fault(4, "fwd/attn", 0.5, 0.5 + 5e-3), fault(5, "bwd/attn", 1.0, 9.0)]
    checks = [check(1, "o"), check(2, "down"), check(3, "down", "bwd_input"), check(4, "q")]
    by_size = GF.recall_by_size(faults, checks)
    # a flag on another data-parallel rank's product does not detect the fault
    other_rank = [{**c, "dp_rank": 1} for c in checks]
    assert GF.recall_by_size(faults, other_rank)["1e5"]["detected"] == 0
    assert by_size == {"1e-3": {"faults": 1, "detected": 0, "recall": 0.0},
                       "1e-1": {"faults": 1, "detected": 1, "recall": 1.0},
                       "1e5": {"faults": 2, "detected": 2, "recall": 1.0},
                       "non-finite": {"faults": 1, "detected": 0, "recall": 0.0}}
    summary = {"steps_done": 20, "abft/checks": 900, "abft/flags": 27,
               "abft/detection": {"recall": 27 / 28}}
    assert GF.judge_recall(summary, faults, checks)["pass"] is True
    low = {**summary, "abft/detection": {"recall": 0.85}}
    assert GF.judge_recall(low, faults, checks)["pass"] is False
    none = GF.judge_recall({**summary, "abft/detection": {"recall": None}}, [], [])
    assert none["pass"] is False and "no fault landed" in none["note"]


def test_nvidia_smi_summary_of_an_h100():
    """What the JSON keeps beside the figures, read from `nvidia-smi -q` on an H100 (driver
    580): clocks, power, temperatures, the clock event reasons and every ECC counter."""
    (gpu,) = SMI.summary(SMI_SAMPLE)["gpus"].values()
    assert SMI.summary(SMI_SAMPLE)["driver_version"] == "580.159.04"
    assert gpu["performance_state"] == "P0"
    assert gpu["clocks_mhz"]["SM"] == 1980 and gpu["max_clocks_mhz"]["Memory"] == 2619
    assert gpu["power_w"] == {"draw": 312.47, "limit": 700.0}
    assert gpu["temperature_c"] == {"gpu": 41.0, "memory": 48.0, "limit_margin": 45.0,
                                    "slowdown": None}
    assert gpu["clock_event_reasons_active"] == ["SW Power Cap"]
    assert gpu["clock_event_reason_counters_us"]["SW Power Capping"] == 1210337
    assert gpu["ecc_mode"] == "Enabled" and set(gpu["ecc_volatile"].values()) == {0}
    assert gpu["ecc_aggregate"]["DRAM Correctable"] == 2
    assert gpu["remapped_rows"]["Pending"] == "No"


def test_ecc_problems_catch_errors_rises_and_remaps():
    """A healthy card shows no problem; an uncorrectable error, a counter that rose during the
    acceptance (an old aggregate count alone is not one) and a pending row remap each do."""
    before = SMI.summary(SMI_SAMPLE)
    assert SMI.ecc_problems(before, before) == []
    bad = SMI_SAMPLE.replace("            DRAM Uncorrectable            : 0",
                             "            DRAM Uncorrectable            : 1", 1)
    bad = bad.replace("        Pending                           : No",
                      "        Pending                           : Yes")
    problems = SMI.ecc_problems(before, SMI.summary(bad))
    assert "GPU 00000000:18:00.0: 1 volatile DRAM Uncorrectable ECC errors." in problems
    assert ("GPU 00000000:18:00.0: volatile DRAM Uncorrectable rose from 0 to 1 during the "
            "acceptance.") in problems
    assert "GPU 00000000:18:00.0: remapped rows pending." in problems
    later = SMI_SAMPLE.replace("SW Power Capping                  : 1210337 us",
                               "SW Power Capping                  : 1710337 us")
    assert SMI.counters_during(before, SMI.summary(later)) == {
        "00000000:18:00.0": {"SW Power Capping": 500000}}


def test_ecc_not_reported_is_no_problem():
    """Inside some virtual machines every ECC field reads N/A: recorded as unknown (None),
    never as an error and never as zero."""
    hidden = re.sub(r"(ECC|Correctable|Uncorrectable[\w -]*?|Parity|SEC-DED)(\s+): \d+",
                    r"\1\2: N/A", SMI_SAMPLE)
    gpu = next(iter(SMI.summary(hidden)["gpus"].values()))
    assert set(gpu["ecc_volatile"].values()) == {None}
    assert SMI.ecc_problems(SMI.summary(hidden), SMI.summary(hidden)) == []


def test_sampled_clocks_and_power():
    """The clocks, power and temperature sampled during a bench train: N/A skipped."""
    text = "1980, 2619, 650.50, 55\n1755, 2619, 699.90, 61\n[N/A], 2619, [N/A], 60\n"
    s = SMI.samples_summary(text)
    assert s["samples"] == 3 and s["clocks.sm"] == {"min": 1755, "median": 1867.5, "max": 1980}
    assert s["power.draw"]["max"] == 699.9 and s["temperature.gpu"]["max"] == 61


def test_missing_preset_is_skipped_with_a_reason():
    """The 1B preset's floors are skipped, naming the preset, until the preset exists."""
    assert GC.preset_problem("medium") is None
    reason = GC.preset_problem("no-such-preset")
    assert reason.startswith("the model preset no-such-preset is not defined")


def test_verdict_tells_failed_from_broken_from_skipped():
    """FAIL beats COULD NOT RUN beats INCOMPLETE: a skipped floor is not a met one, and a check
    that broke (its child crashed) is not a missed one; each verdict has its exit code."""
    ok, skip, crash = {"pass": True}, GS.skipped("no time"), GS.broke({"exit_code": 3})
    assert GS.verdict({"a": ok, "b": ok}) == "PASS"
    assert GS.verdict({"a": ok, "b": skip}) == "INCOMPLETE"
    assert GS.verdict({"a": ok, "b": skip, "c": crash}) == "COULD NOT RUN"
    assert GS.verdict({"a": {"pass": False}, "b": skip, "c": crash}) == "FAIL"
    assert crash["error"] == "the child exited 3"
    assert GS.broke({"exit_code": None, "timed_out": True})["error"] == "timed out"
    assert GS.VERDICT_EXIT == {"FAIL": 1, "COULD NOT RUN": 3, "INCOMPLETE": 2, "PASS": 0}
    table = GS.table({"verdict": "COULD NOT RUN", "checks": {"c": crash, "b": skip}})
    assert "c                                  ERROR" in table and "the child exited 3" in table
    assert "b                                  SKIPPED" in table


def test_a_check_that_breaks_is_an_error_alone(tmp_path, monkeypatch):
    """An exception while one check reads its child's files marks that check ERROR (not a
    FAIL: nothing was judged), with the error, and the JSON is written: the one GPU run must
    still report every other check."""
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="full", budget=540)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)

    def broken():
        raise KeyError("abft/detection")

    result = acc.check("abft_recall_float32", broken)
    assert result == {"pass": None, "error": "KeyError: 'abft/detection'"}
    saved = json.loads((tmp_path / GS.RESULT).read_text())
    assert saved["checks"]["abft_recall_float32"]["pass"] is None
    assert GS.state(saved["checks"]["abft_recall_float32"]) == "ERROR"


# The figures issue 53 added: fake results for each verdict, pass and fail per floor.

def census_figures(gemms, tiles=(), fmha=(24, 24), tokens_per_s=100_000.0) -> dict:
    return {"tokens_per_s": tokens_per_s,
            "census": {"gemms": dict(gemms), "triton_tiles": list(tiles),
                       "attention": {"cudnn_fmha_forward": fmha[0],
                                     "cudnn_fmha_backward": fmha[1]}}}


def test_fused_attention_needs_cudnn_forward_and_backward():
    """The bfloat16 step must run cuDNN's fused attention both ways; a step that kept the
    einsum + softmax (no fmha call) or lost the backward fails."""
    assert GF.judge_fused_attention(census_figures({}, fmha=(12, 12)))["pass"] is True
    assert GF.judge_fused_attention(census_figures({}, fmha=(0, 0)))["pass"] is False
    assert GF.judge_fused_attention(census_figures({}, fmha=(12, 0)))["pass"] is False
    assert GF.judge_fused_attention({"census": None})["pass"] is False


TUNED = {"cublas": 10, "triton": 131, "cublaslt": 0}
UNTUNED = {"cublas": 0, "triton": 0, "cublaslt": 171}
TILES = [{"block_m": 128, "block_n": 256, "block_k": 64, "count": 40}]


@pytest.mark.parametrize("pinned, passes", [
    (census_figures(TUNED, TILES, tokens_per_s=95_000.0), True),  # honoured, costs 5%
    (census_figures(UNTUNED, tokens_per_s=71_000.0), False),  # ignored: first candidates
    (census_figures(TUNED, [{**TILES[0], "block_m": 32}], tokens_per_s=99_000.0), False),
    (census_figures(TUNED, TILES, tokens_per_s=88_000.0), False),  # honoured, costs 13.6%
])
def test_pinned_autotune_honoured_with_the_flags_on(pinned, passes):
    """Choices dumped without the flags and loaded with them are honoured when the pinned
    step runs the tuned step's GEMM libraries and Triton tiles, and then costs at most 10%;
    the untuned step's GEMMs (the flags' first candidates) or other tiles fail."""
    tuned = census_figures(TUNED, TILES, tokens_per_s=100_000.0)
    untuned = census_figures(UNTUNED, tokens_per_s=71_000.0)
    judged = GF.judge_pinned_autotune(tuned, pinned, untuned)
    assert judged["pass"] is passes
    assert judged["gemms_untuned"] == UNTUNED


def test_torch_ratio_floor():
    """Ours must reach 1.0x transformers + torch's tokens/s on the same GPU: 1.02x passes,
    0.97x fails."""
    torch = {"tokens_per_s": 100_000.0, "attention": "sdpa", "compiled": True}
    assert GF.judge_torch_ratio({"tokens_per_s": 102_000.0}, torch)["pass"] is True
    judged = GF.judge_torch_ratio({"tokens_per_s": 97_000.0}, torch)
    assert judged["pass"] is False and judged["ratio"] == pytest.approx(0.97)
    assert judged["torch"]["compiled"] is True


def golden_meta(reached=132, sms=132, measured=True, share=0.75) -> dict:
    return {"coverage": {"workload": "full",
                         "sms": {"measured": measured, "sms": sms, "reached": reached,
                                 "why": None if measured else "no profiler trace"},
                         "memory": {"bytes": int(share * 141e9), "device_bytes": int(141e9),
                                    "share": share}}}


@pytest.mark.parametrize("meta, seconds, verdict, failing", [
    (golden_meta(), 150.0, "PASS", None),
    (golden_meta(reached=131), 150.0, "PASS", "every_sm"),
    (golden_meta(measured=False, reached=None), 150.0, "PASS", "every_sm"),
    (golden_meta(share=0.69), 150.0, "PASS", "memory_ok"),
    (golden_meta(), 181.0, "PASS", "time_ok"),
    (golden_meta(), 150.0, "FAIL", "reproducible"),
    (golden_meta(), 150.0, None, "reproducible"),
])
def test_golden_full_targets(meta, seconds, verdict, failing):
    """golden record --workload full passes with every SM reached (measured: unmeasured is
    not reached), at least 70% of memory, at most 180 s, and its check PASS; each shortfall
    alone fails it, named."""
    judged = GF.judge_golden_full(meta, seconds, verdict)
    assert judged["pass"] is (failing is None)
    if failing:
        assert judged[failing] is False


def test_fault_draws_pass_only_with_the_one_pass_draws_bits():
    """The two-pass dense rest must give the one-pass draw's bits on the device; its speed is
    stated (one pass over two), whatever it is."""
    report = {"dense_rest_us": {"one_pass": 90.0, "two_passes": 30.0},
              "dense_rest_same_bits": True}
    judged = GF.judge_fault_draws(report)
    assert judged["pass"] is True and judged["ratio"] == pytest.approx(3.0)
    assert GF.judge_fault_draws({**report, "dense_rest_same_bits": False})["pass"] is False
    # no dense rest drawn (a rate too low to pass the cap): nothing measured, so no verdict
    # (ERROR, with the reason), neither PASS nor FAIL
    nothing = GF.judge_fault_draws({"dense_rest_us": {}, "dense_rest_same_bits": None})
    assert nothing["pass"] is None and nothing["ratio"] is None
    assert GS.state(nothing) == "ERROR" and "no dense rest" in nothing["error"]


@pytest.mark.slow
def test_the_fault_draws_check_runs_the_experiment_and_reads_its_file(tmp_path, monkeypatch):
    """`fault_draws` for real on the CPU, at a tensor the size of a tiny model's 2,048 x 64
    activation: the study runs in a child, writes its JSON, and the judge reads both ways."""
    monkeypatch.setattr(GC, "FAULT_DRAWS", ("tiny", 2048, 0.0152, 1))
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="quick", budget=240)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)
    out = acc.fault_draws()
    assert out["pass"] is True and out["same_bits"] is True, out
    assert out["dense_rest_one_pass_us"] > 0 and out["dense_rest_two_passes_us"] > 0


def test_repeat_needs_every_digest_equal():
    """Two processes' runs must end on the same parameters; a differing or missing digest
    (a run that failed) fails."""
    assert GF.judge_repeat(["ab", "ab"])["pass"] is True
    assert GF.judge_repeat(["ab", "ac"])["pass"] is False
    assert GF.judge_repeat(["ab", None])["pass"] is False


def _golden_report(verdict, step=3, layer=1, site="fwd/attn"):
    first = {"step": step, "layer": layer, "paper_site": site} if verdict == "FAIL" else None
    return {"verdict": verdict, "reason": "r", "first_difference": first}


@pytest.mark.parametrize("plain, flipped, passes", [
    (_golden_report("PASS"), _golden_report("FAIL"), True),
    (_golden_report("FAIL"), _golden_report("FAIL"), False),  # the bits differ unflipped
    (_golden_report("PASS"), _golden_report("PASS"), False),  # the flip went unseen
    (_golden_report("PASS"), _golden_report("FAIL", step=4), False),  # seen, misplaced
    (_golden_report("PASS"), _golden_report("FAIL", site="fwd/ffn"), False),
])
def test_a_record_from_another_gpu_passes_and_its_flip_fails_where_it_was(plain, flipped,
                                                                           passes):
    assert GF.judge_golden_cross(plain, flipped, GGC.CROSS_FLIP_AT)["pass"] is passes


def test_golden_other_machine_keeps_its_record_and_checks_the_others(tmp_path, monkeypatch):
    """The tiny record lands in --out as one archive with the GPU that made it; without a
    committed archive from another GPU (none, or only this GPU's) the check is SKIPPED with
    what to commit; with one, it unpacks it and runs `golden check` on it plainly and with
    `CROSS_FLIP`, and judges both."""
    import shutil
    import tarfile

    monkeypatch.setattr(GS, "versions", lambda: {})
    monkeypatch.setattr(SMI, "identity", lambda: {"uuid": "GPU-here", "name": "NVIDIA H200"})
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setattr(GGC, "RECORDS", records)
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    args = SimpleNamespace(out=out, stage="quick", budget=240)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": "NVIDIA H200"}, work)
    calls = []

    def fake(label, argv, cap):
        argv = [str(a) for a in argv]
        calls.append(argv)
        if argv[:2] == ["golden", "record"]:
            target = Path(argv[argv.index("--out") + 1])
            target.mkdir(parents=True)
            (target / "golden.json").write_text("{}")
        else:
            flipped = "--inject" in argv
            Path(argv[argv.index("--json") + 1]).write_text(json.dumps(
                _golden_report("FAIL" if flipped else "PASS")))
        return {"exit_code": 0, "seconds": 1.0, "timed_out": False, "command": argv}

    monkeypatch.setattr(acc, "sdcstudy", fake)
    result = acc.golden_other_machine()
    assert "no record made by another GPU is committed" in result["skipped"]
    with tarfile.open(out / GGC.KEPT) as tar:
        assert set(tar.getnames()) >= {"record", "record/golden.json", GGC.GPU_FILE}
    (records / "h200-mine.tar.gz").write_bytes((out / GGC.KEPT).read_bytes())
    shutil.rmtree(work)  # each acceptance works in a new folder
    assert "no record made by another GPU" in acc.golden_other_machine()["skipped"]
    monkeypatch.setattr(SMI, "identity", lambda: {"uuid": "GPU-there", "name": "NVIDIA H200"})
    calls.clear()
    shutil.rmtree(work)
    result = acc.golden_other_machine()
    assert result["pass"] is True and list(result["records"]) == ["h200-mine"]
    assert result["records"]["h200-mine"]["made_by"]["uuid"] == "GPU-here"
    checks = [c for c in calls if c[:2] == ["golden", "check"]]
    assert [c[2] for c in checks] == [str(work / "golden-cross" / "h200-mine" / "record")] * 2
    assert "--inject" not in checks[0] and GGC.CROSS_FLIP in checks[1]
    # a record of another stack is INCONCLUSIVE there: an ERROR with the reason, never a FAIL
    def another_stack(label, argv, cap):
        if argv[:2] == ["golden", "record"]:
            return fake(label, argv, cap)
        Path(str(argv[argv.index("--json") + 1])).write_text(json.dumps(
            {"verdict": "INCONCLUSIVE", "reason": "the environment differs"}))
        return {"exit_code": 3, "seconds": 1.0, "timed_out": False, "command": []}

    monkeypatch.setattr(acc, "sdcstudy", another_stack)
    shutil.rmtree(work)
    result = acc.golden_other_machine()
    assert GS.state(result) == "ERROR" and "the environment differs" in result["error"]
    # nvidia-smi cannot say which GPU this is: no committed record can be told from one made
    # here, so none is checked (an ERROR with the reason), and the record is still kept
    monkeypatch.setattr(SMI, "identity", lambda: {"error": "NVIDIA-SMI has failed"})
    monkeypatch.setattr(acc, "sdcstudy", fake)
    calls.clear()
    shutil.rmtree(work)
    (out / GGC.KEPT).unlink()
    result = acc.golden_other_machine()
    assert GS.state(result) == "ERROR" and "NVIDIA-SMI has failed" in result["error"]
    assert not [c for c in calls if c[:2] == ["golden", "check"]] and (out / GGC.KEPT).exists()


def test_gpu_identity_reads_the_first_gpus_line(monkeypatch):
    """`nvidia-smi --query-gpu=uuid,name,serial,pci.bus_id`: the first GPU's fields by name;
    a missing nvidia-smi or a failing one is an error, never a guess."""
    line = "GPU-4b7c, NVIDIA H200, 1652824011224, 00000000:18:00.0\nGPU-99, NVIDIA H200, 2, x\n"
    monkeypatch.setattr(SMI.subprocess, "run", lambda *a, **k: SimpleNamespace(
        returncode=0, stdout=line, stderr=""))
    assert SMI.identity() == {"uuid": "GPU-4b7c", "name": "NVIDIA H200",
                              "serial": "1652824011224", "bus_id": "00000000:18:00.0"}
    monkeypatch.setattr(SMI.subprocess, "run", lambda *a, **k: SimpleNamespace(
        returncode=9, stdout="", stderr="NVIDIA-SMI has failed"))
    assert SMI.identity() == {"error": "NVIDIA-SMI has failed"}

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(SMI.subprocess, "run", missing)
    assert "FileNotFoundError" in SMI.identity()["error"]


def test_stack_fingerprint_fields():
    """env.json on a GPU must name the driver, CUDA runtime, cuBLAS, cuDNN and NCCL; one
    missing fails, naming it."""
    env = {"platform": "gpu", "gpu_stack": {"driver": "580.159.04", "cuda_runtime": 13000,
                                            "cublas": 130100, "cudnn": 91400, "nccl": 22803}}
    assert GF.judge_fingerprint(env)["pass"] is True
    del env["gpu_stack"]["cudnn"]
    judged = GF.judge_fingerprint(env)
    assert judged["pass"] is False and judged["missing"] == ["cudnn"]


def test_only_and_stages():
    """Each stage runs its own checks; --only picks from both, in the stages' order."""
    def args(**kw):
        return SimpleNamespace(**{"stage": "full", "only": None, **kw})

    assert GA.checks_to_run(args()) == GA.FULL_CHECKS
    assert GA.checks_to_run(args(stage="quick")) == GA.QUICK_CHECKS
    assert GA.checks_to_run(args(only="fingerprint, doctor")) == ("doctor", "fingerprint")


def test_the_short_table(tmp_path):
    """The table names every check with its verdict, seconds and headline figure or reason."""
    report = {"verdict": "FAIL", "device_kind": H100, "stage": "full", "wall_s": 512.0,
              "checks": {"bench_1b_bfloat16": {"pass": False, "seconds": 80.2,
                                               "mfu_against_floor_peak": 0.31},
                         "torch_ratio": {"pass": None, "skipped": "no time left in --budget",
                                         "seconds": 0.0}}}
    text = GS.table(report)
    assert text.splitlines()[0] == f"gpu acceptance FAIL on {H100} (stage full, 512.0 s)"
    assert "bench_1b_bfloat16" in text and "FAIL" in text and "mfu_against_floor_peak 0.31" in text
    assert "SKIPPED" in text and "no time left in --budget" in text


def test_the_runs_plan_fits_the_window():
    """The full stage's planned seconds (docs/gpu.md, H200 estimates) fit its 540 s budget and
    the quick stage's its 240 s: the two runs and a machine start fit 15 minutes."""
    assert GA.STAGES == {"full": 540, "quick": 240}
    assert sum(GA.STAGES.values()) <= 15 * 60 - 120


@pytest.mark.parametrize("cudnn_fails", [False, True])
@pytest.mark.parametrize("stage", ["full", "quick"])
def test_every_check_of_a_stage_is_wired(tmp_path, monkeypatch, stage, cudnn_fails):
    """The checks' order and wiring, with each child replaced by a fake result: every check
    of the stage lands in the JSON and the table, the judges get the medium step's census
    (pinned over untuned), and one fake miss makes the verdict FAIL. A typo here would only
    show on the GPU, whose minutes are scarce. Where cuDNN's attention cannot launch under
    the flags, `fused_attention` is skipped with the reason."""
    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: cudnn_fails)
    monkeypatch.setattr(GS, "versions", lambda: {})
    monkeypatch.setattr(SMI, "snapshot", lambda: ("", SMI.summary(SMI_SAMPLE)))
    args = SimpleNamespace(out=tmp_path, stage=stage, budget=540)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)
    step = census_figures(TUNED, TILES, tokens_per_s=100_000.0)
    scatters = {"native": 2, "while_loops": 0, "sort_based": 0}
    step["census"].update(scatters=scatters, gemm_gflop=1.0, while_loops=0)
    step["census_line"] = "GEMMs"
    ok = {"pass": True, "seconds": 1.0}
    for name in ("doctor", "bench_untuned", "bench_pallas", "abft_healthy", "abft_recall",
                 "golden_full", "fingerprint", "golden_other_machine", "attention_repeat",
                 "fault_draws", "free_step", "overhead"):
        monkeypatch.setattr(acc, name, lambda *a, **k: dict(ok))
    monkeypatch.setattr(acc, "bench_tuned", lambda: {**ok, **step})
    monkeypatch.setattr(acc, "bench_pinned", lambda: {**ok, **step, "tokens_per_s": 95_000.0})
    # the 1B floors missed; the 8B step, without a floor, measured
    monkeypatch.setattr(acc, "bench", lambda name, *a, **k: {**ok, "mfu": 0.3,
                                                             "pass": k.get("floor") is None})
    monkeypatch.setattr(acc, "torch_ratio", lambda ours: GF.judge_torch_ratio(
        ours, {"tokens_per_s": 90_000.0}))
    monkeypatch.setattr(GC, "preset_problem", lambda name: None)
    checks = GA.FULL_CHECKS if stage == "full" else GA.QUICK_CHECKS
    code = GA.run_checks(acc, checks)
    saved = json.loads((tmp_path / GS.RESULT).read_text())
    assert list(saved["checks"]) == list(checks)
    assert (tmp_path / GS.TABLE).read_text() == GS.table(saved)
    if stage == "full":
        assert code == 1 and saved["verdict"] == "FAIL"  # the fake 1B benches miss
        for name in ("pinned_autotune", "determinism_cost", "kernel_census", "torch_ratio"):
            assert saved["checks"][name]["pass"] is True, name
        fused = saved["checks"]["fused_attention"]
        assert fused["pass"] is (None if cudnn_fails else True)
        assert ("skipped" in fused) is cudnn_fails
        assert saved["checks"]["bench_1b_float32"]["pass"] is False
    else:
        assert code == 0 and saved["verdict"] == "PASS"


@pytest.mark.parametrize("cudnn_fails, attention", [(True, "pallas"), (False, "auto")])
def test_the_tuned_step_runs_the_attention_the_flags_leave(tmp_path, monkeypatch, cudnn_fails,
                                                           attention):
    """The tuned step (flags off) must be the pinned step's program: where cuDNN's attention
    cannot launch under the flags, `auto` runs the Pallas kernels there, so the tuned step
    names pallas; and the repeat check trains with the Pallas kernels there, cuDNN's
    elsewhere."""
    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: cudnn_fails)
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="full", budget=540)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)
    seen = {}
    monkeypatch.setattr(acc, "bench", lambda name, *a, **k: seen.setdefault(name, k) and {})
    acc.bench_tuned()
    assert seen["bench_medium_bfloat16_tuned"]["sets"] == (f"model.attention={attention}",)
    started = []
    monkeypatch.setattr(acc, "sdcstudy", lambda *a, **k: started.append(a) or {"skipped": "x"})
    acc.attention_repeat()
    repeat_attention = "pallas" if cudnn_fails else "fused"
    assert f"model.attention={repeat_attention}" in started[0][1]


def test_the_pallas_bench_loads_the_tuned_choices_and_needs_its_kernels(tmp_path, monkeypatch):
    """The Pallas step runs with the flags (not the free step's environment), names
    `model.attention=pallas`, loads the tuned choices once they exist, is judged by the
    medium floor, and passes only where the census shows the Pallas kernels both ways."""
    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: False)
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="full", budget=540)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)
    seen = {}

    def bench(name, workload, dtype, cap, env=None, floor=None, sets=()):
        seen.update(name=name, env=env, floor=floor, sets=sets)
        return {"pass": True, "tokens_per_s": 150_000.0,
                "census": {"attention": {"pallas_forward": 12, "pallas_backward": 12}}}

    monkeypatch.setattr(acc, "bench", bench)
    pinned = {"tokens_per_s": 100_000.0}
    out = acc.bench_pallas(pinned)
    assert seen["sets"] == ("model.attention=pallas",)
    assert seen["floor"] == GF.BENCH_FLOORS["medium", "bfloat16"]
    flags = seen["env"].get("XLA_FLAGS", "")
    assert "=false" not in flags  # the child sets the determinism flags, none turned off
    assert AUTOTUNE_FLAG not in flags and out["autotune_loaded"] is False
    assert out["pass"] is True and out["speedup_over_pinned"] == pytest.approx(1.5)
    acc.autotune_path().write_text("tuned")
    out = acc.bench_pallas({})
    assert f"{AUTOTUNE_FLAG}={acc.autotune_path()}" in seen["env"]["XLA_FLAGS"]
    assert out["autotune_loaded"] is True and out["speedup_over_pinned"] is None
    missing = {"pass": True, "tokens_per_s": 1.0,
               "census": {"attention": {"pallas_forward": 12, "pallas_backward": 0}}}
    assert GF.judge_pallas_attention(missing, pinned)["pass"] is False
    assert GF.judge_pallas_attention({**missing, "pass": False, "census": {"attention": {
        "pallas_forward": 1, "pallas_backward": 1}}}, pinned)["pass"] is False


def test_where_auto_runs_pallas_the_pinned_step_is_the_pallas_step(tmp_path, monkeypatch):
    """Where cuDNN's attention cannot launch under the flags, `auto` runs the Pallas kernels,
    so the pinned step is the Pallas step: the Pallas check is judged from the pinned step's
    figures (its floor and its census) without a second bench, and skipped where the pinned
    step measured nothing."""
    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: True)
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="full", budget=540)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)
    monkeypatch.setattr(acc, "bench", lambda *a, **k: pytest.fail("benched twice"))
    kernels = {"attention": {"pallas_forward": 12, "pallas_backward": 12}}
    pinned = {"pass": True, "tokens_per_s": 400_000.0, "mfu": 0.36, "census": kernels}
    out = acc.bench_pallas(pinned)
    assert out["pass"] is True and out["mfu"] == 0.36 and out["speedup_over_pinned"] == 1.0
    assert out["pallas_forward"] == 12 and out["seconds"] == 0.0
    assert acc.bench_pallas({**pinned, "pass": False})["pass"] is False  # under the floor
    assert acc.bench_pallas({**pinned, "census": {"attention": {}}})["pass"] is False
    assert acc.bench_pallas({})["pass"] is None and "skipped" in acc.bench_pallas({})


def test_a_crashed_child_is_an_error_never_a_fail(tmp_path, monkeypatch):
    """Every check whose child crashes (exit 3, a timeout, no results) reports ERROR with the
    reason, never FAIL, and the acceptance ends COULD NOT RUN with exit 3; only the doctor's
    own FAIL (exit 1 with its report) is a FAIL."""
    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: False)  # the repeat check's child runs
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="full", budget=540)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)
    crashed = {"exit_code": 3, "seconds": 1.0, "timed_out": False, "command": []}
    monkeypatch.setattr(acc, "sdcstudy", lambda *a, **k: dict(crashed))
    monkeypatch.setattr(acc, "child", lambda *a, **k: dict(crashed))
    results = {"doctor": acc.doctor(), "abft_healthy": acc.abft_healthy("float32"),
               "abft_recall": acc.abft_recall("float32"), "golden_full": acc.golden_full(),
               "attention_repeat": acc.attention_repeat(), "fault_draws": acc.fault_draws(),
               "bench": acc.bench("b", ("tiny", 1, 16, 1, 1), "float32", cap=60),
               "torch_ratio": acc.torch_ratio({"tokens_per_s": 1.0})}
    for name, result in results.items():
        assert GS.state(result) == "ERROR" and "exited 3" in result["error"], name
        assert result["seconds"] == 1.0, name  # the crashed child's time, for the table
    for name, result in results.items():
        acc.record(name, result)
    assert acc.finish() == 3 and acc.report["verdict"] == "COULD NOT RUN"
    # The doctor's own verdict: exit 1 with its report is a FAIL of the check.
    (tmp_path / "doctor.json").write_text(json.dumps({
        "verdict": "FAIL", "problems": ["bits differ"], "steps": 2, "param_digest": "x",
        "env": {"compiled_step_sha256": "y", "xla_flags": ""}}))
    monkeypatch.setattr(acc, "sdcstudy", lambda *a, **k: {**crashed, "exit_code": 1})
    assert GS.state(acc.doctor()) == "FAIL"


def test_the_fingerprint_of_a_doctor_that_could_not_run_is_skipped(tmp_path, monkeypatch):
    """A doctor that could not run writes its report with no "env" (verdict null): the
    fingerprint check is SKIPPED, naming what is missing (was: ERROR, a KeyError)."""
    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: False)
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="full", budget=540)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)
    (tmp_path / "doctor.json").write_text(json.dumps({"verdict": None, "exit_code": 3,
                                                      "error": "run a failed (exit 3)"}))
    result = acc.fingerprint()
    assert GS.state(result) == "SKIPPED" and "env.json" in result["skipped"], result


def test_every_sdcstudy_command_a_check_starts_parses(tmp_path, monkeypatch):
    """The first `sdcstudy` command of each check, parsed by the CLI's own parser: a flag a
    subcommand does not take (a `--no-progress` handed to one without it) would otherwise
    show only as a GPU check's ERROR."""
    from sdcstudy import cli

    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: False)
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="full", budget=540)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)
    commands = []

    def child(label, argv, cap, env=None, sample=None):
        commands.append([str(a) for a in argv])
        return {"exit_code": 3, "seconds": 1.0, "timed_out": False, "command": []}

    monkeypatch.setattr(acc, "child", child)
    for check in (acc.doctor, lambda: acc.abft_healthy("float32"),
                  lambda: acc.abft_recall("bfloat16"), acc.golden_full, acc.fingerprint,
                  acc.attention_repeat, acc.free_step, lambda: acc.overhead("o", "faults"),
                  lambda: acc.bench("b", ("tiny", 1, 16, 1, 1), "bfloat16", cap=60),
                  acc.bench_tuned, acc.bench_pinned, acc.bench_untuned):
        check()
    ours = [argv[2:] for argv in commands if argv[:2] == ["-m", "sdcstudy"]]
    assert len(ours) >= 10
    parser = cli.build_parser()
    for argv in ours:
        parser.parse_args(argv)  # exits 2 on a flag it does not know
    assert ["doctor", "--json", str(tmp_path / "doctor.json"), "--no-progress"] in ours


def test_children_get_absolute_folders(tmp_path, monkeypatch):
    """The children run in the checkout, so a relative --out or --work given from elsewhere
    must reach them as the folder the user meant."""
    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(out=Path("acc"), work=Path("work"), stage="quick", budget=None,
                           only=None)
    GA.check_arguments(args)
    assert args.out == tmp_path / "acc" and args.work == tmp_path / "work"
    assert args.budget == GA.STAGES["quick"] and args.checks == GA.QUICK_CHECKS


def test_a_healthy_abft_run_says_where_its_checks_flagged(tmp_path):
    """The result of a healthy ABFT run names where its false alarms were (matmul and
    direction, layer, tenth of the run), each matmul's largest residual over its bound, and
    the worst flagged checks: what a GPU run's 2 and 3,957 flags of 102,600 did not keep."""
    import pandas as pd

    rows = [  # step, layer, matmul, direction, row ratio, column ratio
        (1, 0, "q", "fwd", 0.5, 0.2), (3, 1, "q", "fwd", 1.5, 0.1),
        (9, 1, "down", "bwd_x", 0.3, 2.5), (10, 0, "down", "bwd_x", 0.9, 0.99)]
    pd.DataFrame([{"step": s, "microstep": 0, "layer": layer, "matmul": m, "direction": d,
                   "tp_rank": 0, "row_ratio": r, "col_ratio": c, "max_residual": 1e-3,
                   "k": 64} for s, layer, m, d, r, c in rows]).to_parquet(
        tmp_path / "abft.parquet")
    where = GC.where_flagged(tmp_path, steps=10)
    assert where["flags"] == 2
    assert where["by_matmul"] == {"down/bwd_x": 1, "q/fwd": 1}
    assert where["by_layer"] == {"1": 2}
    assert where["by_tenth_of_steps"] == {"2": 1, "8": 1}
    assert where["largest_ratio"] == {"down/bwd_x": 2.5, "q/fwd": 1.5}
    assert [(w["step"], w["ratio"]) for w in where["worst"]] == [(9, 2.5), (3, 1.5)]
    json.dumps(where)  # the result file takes it


# Where each bench suite's command gives its config the suite's own overrides (bench/*.py).
SUITE_OVERRIDES = {"train": [["experiment.mode=train"]],
                   "abft": [["experiment.mode=train", *o] for o in (
                       [], ["abft.enabled=true"], ["abft.enabled=true", "abft.recompute=true"])],
                   "faults": [["experiment.mode=train"]], "paired": [[]]}


def accepted_at_its_sizes(argv: list[str]) -> list[Path]:
    """One `python -m sdcstudy ...` command a check starts, through what its subcommand
    refuses before it compiles anything, at the command's own sizes: the config with its
    `--set`s and its fault profile (`profiles.load_for`: fields a kind ignores, layers the
    model lacks, patterns past experiment.steps), bench's arguments and output files, golden's
    `--inject`. Raises as the subcommand would; returns the files and folders it writes."""
    from sdcstudy import cli
    from sdcstudy.bench import common as B
    from sdcstudy.core import config as C
    from sdcstudy.faults import profiles
    from sdcstudy.golden import workload as GW

    args = cli.build_parser().parse_args(argv)  # exits 2 on a flag it does not know
    command = argv[0]
    if command == "run":
        cfg = C.load(ROOT / args.config, args.overrides)
        if cfg.suspect.profile:
            profiles.load_for(cfg)
        return [args.out]
    if command == "bench":
        for preset in B.check_args(args):  # --json must not exist yet
            for overrides in SUITE_OVERRIDES[argv[1]]:
                B.preset_config(argv[1], preset, args, overrides)
        return [p for p in (args.json, getattr(args, "hlo", None)) if p is not None]
    if command == "golden":
        if getattr(args, "inject", None):
            GW.parse_injection(args.inject)
        return [p for p in (getattr(args, "out", None), getattr(args, "json", None)) if p]
    return [args.json] if command == "doctor" else []


@pytest.mark.parametrize("cudnn_fails", [False, True])
def test_every_command_a_check_starts_is_accepted_at_its_sizes(tmp_path, monkeypatch,
                                                               cudnn_fails):
    """Every sdcstudy command of both stages, with the presets, sizes, profiles and flip the
    GPU runs them at, passes the checks its subcommand makes before it compiles (config, fault
    profile, bench's arguments, golden's --inject), and no two of them write the same file or
    folder (bench refuses a --json that exists, run an --out it did not make): a refusal that
    would otherwise cost a check of a GPU window. The cross-machine flip strikes a step and a
    layer the tiny golden workload has."""
    from sdcstudy.core.config import model_dims
    from sdcstudy.core.presets import ModelConfig
    from sdcstudy.golden.sizing import TINY

    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: cudnn_fails)
    monkeypatch.setattr(GC, "preset_problem", lambda name: None)
    monkeypatch.setattr(GS, "versions", lambda: {})
    monkeypatch.setattr(SMI, "snapshot", lambda: ("", SMI.summary(SMI_SAMPLE)))
    (tmp_path / "out").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    args = SimpleNamespace(out=tmp_path / "out", stage="full", budget=5400)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100, "device_count": 2}, work)
    acc.autotune_path().write_text("tuned")  # so the pinned and the Pallas benches start
    commands = []

    def child(label, argv, cap, env=None, sample=None):
        commands.append([str(a) for a in argv])
        return {"exit_code": 3, "seconds": 1.0, "timed_out": False, "command": []}

    monkeypatch.setattr(acc, "child", child)
    GA.run_checks(acc, tuple(dict.fromkeys(GA.FULL_CHECKS + GA.QUICK_CHECKS)))
    ours = [argv[2:] for argv in commands if argv[:2] == ["-m", "sdcstudy"]]
    subcommands = {tuple(argv[:2]) for argv in ours}
    assert {("run", "configs/abft.yaml"), ("run", "configs/tiny.yaml"), ("bench", "train"),
            ("bench", "abft"), ("bench", "faults"), ("bench", "paired"),
            ("golden", "record"), ("doctor", "--json")} <= subcommands
    written = []
    for argv in ours:
        written += [Path(p).resolve() for p in accepted_at_its_sizes(argv)]
    assert len(written) == len(set(written)), sorted(str(p) for p in written)
    for inject in ([], ["--inject", GGC.CROSS_FLIP]):
        accepted_at_its_sizes(["golden", "check", str(work / "record"), *inject,
                               "--json", str(tmp_path / "check.json"), "--no-progress"])
    tiny = model_dims(ModelConfig(**TINY["model"]))
    assert 1 <= GGC.CROSS_FLIP_AT["step"] <= TINY["experiment"]["steps"]
    assert 1 <= GGC.CROSS_FLIP_AT["layer"] <= tiny.n_layers
