"""experiments/gpu_acceptance.sh on a machine without a GPU: its refusals, the MFU peaks, and
how it judges what its checks measure.

The acceptance itself needs an NVIDIA GPU (RESULTS.md, "On one GPU"); here we check what a
user meets first: `--help`, bad or missing arguments and the refusal without a GPU each end
with one sentence and the documented exit code, before anything is run or written. The fake
`nvidia-smi` test reaches the second refusal, a JAX without its CUDA backend. Then the
published peak that `bench train` takes its MFU against, per device kind and dtype. Last, the
judging a GPU run depends on, fed with what the checks' children write: the MFU floors (a
result just below a target fails, just above passes), the determinism A/B's cost limit and
its flags, the kernel census check (wired from a real `bench train` on this CPU), ABFT's false
alarms and recall per error size, `nvidia-smi -q` read from an H100's text, and a check that
breaks failing alone.
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
    assert lines[0].startswith("gpu_acceptance: ") and lines[0].endswith(".")
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
    assert one_sentence(proc.stderr) == ("gpu_acceptance: no NVIDIA GPU here (nvidia-smi is not "
                                         "on the PATH); run it on a machine with one.")
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


def test_help_names_every_option():
    """`--help` must exit 0 and name the options the README documents."""
    proc = acceptance("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: experiments/gpu_acceptance.sh")
    for option in ("--out DIR", "--quick", "--budget SECONDS", "--work DIR"):
        assert option in proc.stdout


@pytest.mark.parametrize("args, says", [
    (["--out", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["--out", "x", "--budget", "soon"], "argument --budget: invalid int value: 'soon'"),
    (["--out", "x", "--budget", "5"], "--budget must be at least 60 seconds, not 5"),
])
def test_bad_arguments(args, says):
    """A wrong option or value must give exit 2 and one sentence naming it, not a usage
    screen or a traceback (and never start the checks)."""
    proc = acceptance(*args)
    assert proc.returncode == 2
    assert says in one_sentence(proc.stderr)


def test_missing_out():
    """--out is required: without it there is nowhere to write the JSON, so exit 2 at once."""
    proc = acceptance("--quick")
    assert proc.returncode == 2
    assert "the following arguments are required: --out" in one_sentence(proc.stderr)


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

EXPERIMENTS = ROOT / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import gpu_checks as GC  # noqa: E402
import gpu_floors as GF  # noqa: E402
import nvidia_smi as SMI  # noqa: E402

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

    env = GC.without_determinism({"XLA_FLAGS": "--xla_gpu_deterministic_ops=true "
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


def test_healthy_abft_needs_checks_and_no_flag():
    """0 false alarms is the requirement; a run that made no check proves nothing."""
    summary = {"steps_done": 40, "abft/checks": 1800, "abft/flags": 0}
    assert GF.judge_healthy_abft(summary)["pass"] is True
    assert GF.judge_healthy_abft({**summary, "abft/flags": 1})["pass"] is False
    assert GF.judge_healthy_abft({**summary, "abft/checks": 0})["pass"] is False


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


def test_verdict_tells_failed_from_skipped():
    """FAIL beats INCOMPLETE: a skipped floor is not a met one, and not a missed one."""
    assert GC.verdict({"a": {"pass": True}, "b": {"pass": True}}) == "PASS"
    assert GC.verdict({"a": {"pass": True}, "b": {"pass": None}}) == "INCOMPLETE"
    assert GC.verdict({"a": {"pass": False}, "b": {"pass": None}}) == "FAIL"


def test_a_check_that_breaks_fails_alone(tmp_path, monkeypatch):
    """An exception while one check reads its child's files fails that check, with the
    error, and the JSON is written: the one GPU run must still report every other check."""
    monkeypatch.setattr(GC, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, quick=False, budget=570)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": H100}, tmp_path)

    def broken():
        raise KeyError("abft/detection")

    result = acc.check("abft_recall_float32", broken)
    assert result == {"pass": False, "error": "KeyError: 'abft/detection'"}
    saved = json.loads((tmp_path / GC.RESULT).read_text())
    assert saved["checks"]["abft_recall_float32"]["pass"] is False
