"""What experiments/gpu_acceptance.py requires of each check, and how it reads a check's
output files into figures and a verdict (pure functions on what sdcstudy writes; no JAX).

The floors are the project's targets for one H100 or H200, each a lower bound on the model
FLOPs utilization (MFU) of `sdcstudy bench train`:

| workload | dtype | floor | against the device's dense peak of |
|---|---|---|---|
| medium, 32 x 512 tokens | bfloat16 | 35% | bfloat16 tensor cores |
| llama3.2-1b, 8 x 512 tokens | bfloat16 | 40% | bfloat16 tensor cores |
| llama3.2-1b, 8 x 512 tokens | float32 | 35% | TF32 tensor cores |

and beside them: the determinism flags cost at most 10% (the same bench train with the flags
off runs at most 1.10x as many tokens per second); the compiled step serializes no scatter
into a `while` loop (the kernel census, sdcstudy/bench/census.py); ABFT raises no flag on a
healthy node; and ABFT catches at least 90% of the products hit by single exponent-bit flips
(the `exponent-flip` profile; the 2-core CPU caught all 25 in float32 and 27 of 28 in
bfloat16 on the same run, configs/abft.yaml at 20 steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Floor:
    mfu: float  # the least MFU that passes
    unit: str  # the peak it is taken against: a key of roofline.DEVICE_PEAKS' tables


ONE_B = "llama3.2-1b"
BENCH_FLOORS = {("medium", "bfloat16"): Floor(0.35, "bfloat16"),
                (ONE_B, "bfloat16"): Floor(0.40, "bfloat16"),
                (ONE_B, "float32"): Floor(0.35, "tf32")}
DETERMINISM_COST_LIMIT = 0.10  # tokens/s without the flags / with them - 1, at most
ABFT_RECALL_FLOOR = 0.90
# The exponent-flip profile's sites and the matmul whose output each is (abft.parquet's
# `matmul`): the attention block's output is the o projection's, the FFN's the down one's.
SITE_MATMUL = {"fwd/attn": "o", "fwd/ffn": "down"}


def bench_figures(report: dict) -> dict:
    """The figures of `sdcstudy bench train --json` (one preset) the acceptance records."""
    r = report["results"][0]
    roof = r["roofline"]
    figures = {"preset": r["preset"], "dtype": r["dtype"], "n_params": r["n_params"],
               "batch": r["batch"], "seq_len": r["seq_len"],
               "tokens_per_s": r["ours"]["tokens_per_s"]["median"],
               "step_ms": r["ours"]["seconds_per_step"]["median"] * 1e3,
               "compile_s": r["ours"]["compile_s"], "step_tflop": roof["step_gflop"] / 1e3,
               "achieved_tflops": roof["gflops"]["ours"] / 1e3,
               "float32_matmul_tflops": roof["peak_gflops"]["jax"] / 1e3,
               "mfu": (roof.get("mfu") or {}).get("ours"), "mfu_peak": roof.get("mfu_peak"),
               "census": r.get("census")}
    if figures["census"] is not None:
        from sdcstudy.bench.census import describe

        figures["census_line"] = describe(figures["census"])
    return figures


def judge_bench(figures: dict, floor: Floor | None, device_kind: str) -> dict:
    """`pass` and why: MFU at least the floor, taken against the floor's own peak (a float32
    step against TF32's, whatever peak bench train chose); without a floor, MFU measured."""
    from sdcstudy.bench.roofline import DEVICE_PEAKS

    out = {"floor": None if floor is None else {"mfu": floor.mfu, "unit": floor.unit}}
    if device_kind not in DEVICE_PEAKS:
        return {**out, "pass": False, "note": f"no published peak for {device_kind!r} in "
                                              f"roofline.DEVICE_PEAKS, so no MFU"}
    if floor is None:
        return {**out, "pass": figures["mfu"] is not None}
    peak = DEVICE_PEAKS[device_kind][1][floor.unit]
    mfu = figures["achieved_tflops"] * 1e12 / peak
    return {**out, "mfu_against_floor_peak": mfu, "floor_peak_tflops": peak / 1e12,
            "pass": mfu >= floor.mfu}


def judge_determinism(with_flags: dict, without_flags: dict) -> dict:
    """The determinism flags' cost: tokens/s without them over tokens/s with them, minus 1."""
    cost = without_flags["tokens_per_s"] / with_flags["tokens_per_s"] - 1
    return {"cost": cost, "limit": DETERMINISM_COST_LIMIT,
            "tokens_per_s_with_flags": with_flags["tokens_per_s"],
            "tokens_per_s_without_flags": without_flags["tokens_per_s"],
            "census_with_flags": with_flags.get("census_line"),
            "census_without_flags": without_flags.get("census_line"),
            "pass": cost <= DETERMINISM_COST_LIMIT}


def judge_census(figures: dict) -> dict:
    """The compiled step's census read, and no scatter serialized into a `while` loop."""
    census = figures.get("census")
    if census is None:
        return {"pass": False, "note": "bench train wrote no census"}
    default_tile = sum(t["count"] for t in census["triton_tiles"]
                       if (t.get("block_m"), t.get("block_n"), t.get("block_k")) == (32, 32, 32))
    return {"pass": census["scatters"]["while_loops"] == 0, "census_line": figures["census_line"],
            "gemms": census["gemms"], "gemm_gflop": census["gemm_gflop"],
            "triton_gemms_with_32x32x32_tiles": default_tile, "scatters": census["scatters"],
            "while_loops": census["while_loops"]}


def judge_healthy_abft(summary: dict) -> dict:
    """ABFT on a healthy node: every check made, none flagged."""
    checks, flags = summary["abft/checks"], summary["abft/flags"]
    return {"steps": summary["steps_done"], "checks": checks, "flags": flags,
            "false_alarm_rate": flags / checks if checks else None,
            "pass": checks > 0 and flags == 0}


def judge_recall(summary: dict, fault_rows: list[dict], abft_rows: list[dict]) -> dict:
    """ABFT against injected faults: the run's detection summary, recall per error size, and
    `pass` when recall reaches the floor."""
    detection = summary["abft/detection"]
    recall = detection.get("recall")
    out = {"steps": summary["steps_done"], "checks": summary["abft/checks"],
           "flags": summary["abft/flags"], "detection": detection, "recall": recall,
           "recall_floor": ABFT_RECALL_FLOOR,
           "recall_by_error_size": recall_by_size(fault_rows, abft_rows)}
    out["pass"] = recall is not None and recall >= ABFT_RECALL_FLOOR
    if recall is None:
        out["note"] = "no fault landed inside a checked matmul"
    return out


def size_bucket(original: float, corrupted: float) -> str:
    """The decade of a fault's absolute error |corrupted - original|: "1e-3" holds errors in
    [1e-3, 1e-2); infinities and NaNs are "non-finite"."""
    error = abs(corrupted - original)
    if not math.isfinite(error):
        return "non-finite"
    if error == 0:
        return "0"
    return f"1e{math.floor(math.log10(error))}"


def recall_by_size(fault_rows: list[dict], abft_rows: list[dict]) -> dict:
    """Per error-size decade: faults inside a checked matmul's output, and how many sat in a
    product whose forward check flagged (a product with several faults counts for each)."""
    flagged = {(r["step"], r["microstep"], r["layer"], r["matmul"], r["tp_rank"])
               for r in abft_rows if r["flagged"] and r["direction"] == "fwd"}
    buckets: dict[str, list[int]] = {}
    for f in fault_rows:
        matmul = SITE_MATMUL.get(f["site"])
        if matmul is None:
            continue
        key = (f["step"], f["microstep"], f["layer"], matmul, f["tp_rank"])
        counts = buckets.setdefault(size_bucket(f["original"], f["corrupted"]), [0, 0])
        counts[0] += 1
        counts[1] += key in flagged
    finite = sorted((b for b in buckets if b != "non-finite"), key=float)
    order = finite + [b for b in buckets if b == "non-finite"]
    return {b: {"faults": buckets[b][0], "detected": buckets[b][1],
                "recall": buckets[b][1] / buckets[b][0]} for b in order}
