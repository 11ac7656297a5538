"""How close a training step runs to this machine's matmul peak, and what that allows.

`sdcstudy bench train` compares our step with transformers + torch. Both spend nearly all
their time in float32 matrix products, so neither can run faster than the machine multiplies
matrices. This module counts a step's model FLOPs and measures that peak in the same process:
the highest ratio to torch that *any* implementation of the step could reach is

    ceiling = peak FLOP/s / torch's step FLOP/s

and a goal above the ceiling is out of this machine's reach, whatever the code does.

Model FLOPs count the matmuls of one forward and backward pass (backward = 2x forward):

- projections and the output head: 6 * tokens * matmul parameters, the matmul parameters
  being q, k, v, o and the three FFN matrices of every layer, and the head (d x V, tied or
  not); embedding lookups and norms are not matmuls;
- attention: standard (not flash) attention forms the whole L x L score matrix and masks it,
  so per layer 2 products of B * H * L * L * E multiply-adds forward, 12 * B * L^2 * H * E
  FLOPs forward and backward.

Softmax, norms, the loss and the optimizer are left out: they only lower what a step can
reach, so the ceiling is an upper bound.

On a GPU whose kind is in `DEVICE_PEAKS` the summary also gives the model FLOPs utilisation,
MFU = step FLOPs / step time / the device's published dense peak for the step's compute dtype
(`device_peak` names the peak it used). A float32 step counts against the plain float32 peak
unless the float32 matmul timed beside it ran faster than that peak, which only tensor cores
(TF32) can do; then against the TF32 peak.
"""

from __future__ import annotations

import time

from sdcstudy.core.config import ModelDims

# Published dense (no sparsity) peak FLOP/s per device kind, as JAX spells the kind
# (`jax.devices()[0].device_kind`): tensor cores in bfloat16 and in TF32, and the plain
# float32 units. The H200 has the H100 SXM's chip and clocks.
_HOPPER_SXM = {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12}
_A100_SXM = {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12}
DEVICE_PEAKS = {
    "NVIDIA H100 80GB HBM3": ("H100 SXM", _HOPPER_SXM),
    "NVIDIA H200": ("H200", _HOPPER_SXM),
    "NVIDIA A100-SXM4-80GB": ("A100 SXM", _A100_SXM),
    "NVIDIA A100-SXM4-40GB": ("A100 SXM", _A100_SXM),
}

PEAK_SIZE = 2048  # square float32 matmul timed for the peak; larger ones gain nothing here
PEAK_SECONDS = 0.5  # per library and repetition


def matmul_params(dims: ModelDims) -> int:
    d, e = dims.d_model, dims.head_dim
    attention = d * e * (2 * dims.n_heads + 2 * dims.n_kv_heads)  # q and o; k and v
    per_layer = attention + 3 * d * dims.ffn_dim
    return dims.n_layers * per_layer + d * dims.vocab_size


def step_flops(dims: ModelDims, sequences: int, seq_len: int) -> float:
    """Model FLOPs of one training step over `sequences` rows of `seq_len` tokens."""
    tokens = sequences * seq_len
    attention = 12 * sequences * seq_len ** 2 * dims.n_heads * dims.head_dim * dims.n_layers
    return 6.0 * tokens * matmul_params(dims) + attention


def best_rate(run, flops: float, repeats: int) -> float:
    """The best FLOP/s of `repeats` repetitions of calling `run` (which does `flops`) for
    `PEAK_SECONDS` each, after one call that compiles and warms up."""
    run()  # compile, allocate, spin the threads up
    best = 0.0
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < PEAK_SECONDS or calls == 0:
            run()
            calls += 1
        best = max(best, flops * calls / elapsed)
    return best


def matmul_peak(repeats: int = 3, with_torch: bool = True) -> dict[str, float]:
    """FLOP/s of a square float32 matmul: the best repetition, per library."""
    import jax
    import numpy as np

    n = PEAK_SIZE
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    flops = 2.0 * n ** 3
    x = jax.device_put(a)
    product = jax.jit(lambda u, v: u @ v)
    peaks = {"jax": best_rate(lambda: product(x, x).block_until_ready(), flops, repeats)}
    if with_torch:
        import torch

        t = torch.from_numpy(a)
        peaks["torch"] = best_rate(lambda: torch.matmul(t, t), flops, repeats)
    return peaks


def device_peak(device_kind: str, dtype: str, measured_float32: float | None = None
                ) -> dict | None:
    """The published peak an MFU is taken against, or None for a kind not in `DEVICE_PEAKS`
    (a CPU among them): {"device_kind", "device", "unit", "flops", "label"}. `unit` is
    bfloat16 for a bfloat16 step; for a float32 one, tf32 when `measured_float32` (FLOP/s of a
    float32 matmul on this device) beats the plain float32 peak, else float32."""
    if device_kind not in DEVICE_PEAKS:
        return None
    device, peaks = DEVICE_PEAKS[device_kind]
    unit = "bfloat16" if dtype == "bfloat16" else "float32"
    if unit == "float32" and measured_float32 is not None and measured_float32 > peaks["float32"]:
        unit = "tf32"
    what = {"bfloat16": "dense bfloat16 tensor-core", "tf32": "dense TF32 tensor-core",
            "float32": "float32 (no tensor cores)"}[unit]
    return {"device_kind": device_kind, "device": device, "unit": unit, "flops": peaks[unit],
            "label": f"{device} {what} peak, {peaks[unit] / 1e12:g} TFLOP/s"}


def summary(dims: ModelDims, sequences: int, seq_len: int, steps_per_s: dict[str, float],
            peaks: dict[str, float], baseline: str | None, mfu_peak: dict | None = None) -> dict:
    """Achieved FLOP/s per contender, the peak, and the ceiling over `baseline`; with
    `mfu_peak` (`device_peak`), each contender's MFU against it."""
    flops = step_flops(dims, sequences, seq_len)
    achieved = {name: flops * rate for name, rate in steps_per_s.items()}
    peak = max(peaks.values())
    out = {"step_gflop": flops / 1e9, "gflops": {k: v / 1e9 for k, v in achieved.items()},
           "peak_gflops": {k: v / 1e9 for k, v in peaks.items()},
           "fraction_of_peak": {k: v / peak for k, v in achieved.items()}, "ceiling": None,
           "mfu": None, "mfu_peak": mfu_peak}
    if baseline is not None:
        out["ceiling"] = peak / achieved[baseline]
    if mfu_peak is not None:
        out["mfu"] = {k: v / mfu_peak["flops"] for k, v in achieved.items()}
    return out
