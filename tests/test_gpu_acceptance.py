"""experiments/gpu_acceptance.sh on a machine without a GPU, and the MFU peaks it reports.

The acceptance itself needs an NVIDIA GPU (RESULTS.md, "On one GPU"); here we check what a
user meets first: `--help`, bad or missing arguments and the refusal without a GPU each end
with one sentence and the documented exit code, before anything is run or written. The fake
`nvidia-smi` test reaches the second refusal, a JAX without its CUDA backend. Last, the
published peak that `bench train` takes its MFU against, per device kind and dtype.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
