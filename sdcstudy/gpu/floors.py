"""What `sdcstudy accept-gpu` requires of each check, and how it reads a check's output files
into figures and a verdict (pure functions on what sdcstudy writes; no JAX). Issue 53's
targets for one H100 or H200:

| check | target |
|---|---|
| bench train medium, 32 x 512, bfloat16 | MFU >= 35% of the dense bfloat16 peak |
| the same, `model.attention=pallas` | MFU >= 35%; the Pallas kernels forward and backward |
| bench train llama3.2-1b, 8 x 512, bfloat16 | MFU >= 40% of the dense bfloat16 peak |
| bench train llama3.2-1b, 8 x 512, float32 | MFU >= 35% of the TF32 peak |
| determinism | the flags, with pinned tuned kernels, cost <= 10% of tokens/s |
| pinned autotuning | a loaded file is honoured with the determinism flags on |
| fused attention | cuDNN's fused attention forward and backward in the bfloat16 step |
| kernel census | no scatter serialized into a `while` loop |
| torch | ours >= 1.0x transformers + torch (bfloat16, SDPA, torch.compile), tokens/s |
| ABFT healthy | 0 flags in >= 100,000 checks, float32 and bfloat16 |
| ABFT recall | >= 90% of products hit by single exponent-bit flips |
| golden full | every SM, >= 70% of memory, <= 180 s, the check PASSes (bitwise) |
| stack fingerprint | driver, CUDA runtime, cuBLAS, cuDNN and NCCL in env.json |
| golden, another GPU | its committed record PASSes here; with one flipped bit FAILs, localized |
| fault engine, paired modes, ABFT | each step's cost over the plain step's, stated (no floor) |
| attention, repeated | tiny, bfloat16, cuDNN's attention (else Pallas): two processes, same bits |
| the step without the flags | medium, bfloat16, kernel choices pinned: two processes, same bits |

Each `judge_*` returns a dict with `pass` (True, False) and the figures it read.
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
ABFT_MIN_CHECKS = 100_000  # healthy checks a false-alarm claim needs, per dtype
TORCH_RATIO_FLOOR = 1.0  # our tokens/s over transformers + torch's, at least
GOLDEN_MEMORY_FLOOR = 0.70  # share of device memory written and verified, at least
GOLDEN_SECONDS_LIMIT = 180.0  # golden record --workload full, at most
# Where env.json's gpu_stack holds each part of the stack fingerprint (core/determinism.py).
STACK_FIELDS = ("driver", "cuda_runtime", "cublas", "cudnn", "nccl")
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


def judge_healthy_abft(summary: dict, min_checks: int = ABFT_MIN_CHECKS) -> dict:
    """ABFT on a healthy node: at least `min_checks` checks made, none flagged (a run that made
    fewer proves a false-alarm rate no one can rely on)."""
    checks, flags = summary["abft/checks"], summary["abft/flags"]
    return {"steps": summary["steps_done"], "checks": checks, "flags": flags,
            "min_checks": min_checks, "false_alarm_rate": flags / checks if checks else None,
            "pass": checks >= max(min_checks, 1) and flags == 0}


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
    flagged = {(r["step"], r["microstep"], r["layer"], r["matmul"], r["tp_rank"],
                r.get("dp_rank", 0)) for r in abft_rows if r["flagged"] and r["direction"] == "fwd"}
    buckets: dict[str, list[int]] = {}
    for f in fault_rows:
        matmul = SITE_MATMUL.get(f["site"])
        if matmul is None:
            continue
        key = (f["step"], f["microstep"], f["layer"], matmul, f["tp_rank"], f.get("dp_rank", 0))
        counts = buckets.setdefault(size_bucket(f["original"], f["corrupted"]), [0, 0])
        counts[0] += 1
        counts[1] += key in flagged
    finite = sorted((b for b in buckets if b != "non-finite"), key=float)
    order = finite + [b for b in buckets if b == "non-finite"]
    return {b: {"faults": buckets[b][0], "detected": buckets[b][1],
                "recall": buckets[b][1] / buckets[b][0]} for b in order}


def judge_fused_attention(figures: dict) -> dict:
    """cuDNN's fused attention in the compiled step, forward and backward (census counts)."""
    census = figures.get("census")
    if census is None:
        return {"pass": False, "note": "bench train wrote no census"}
    attention = census.get("attention") or {}
    forward, backward = attention.get("cudnn_fmha_forward", 0), attention.get(
        "cudnn_fmha_backward", 0)
    return {"cudnn_fmha_forward": forward, "cudnn_fmha_backward": backward,
            "pass": forward > 0 and backward > 0}


def judge_pallas_attention(figures: dict, pinned: dict) -> dict:
    """The step under `model.attention=pallas`: its MFU floor (`judge_bench`'s `pass`, kept)
    and the Pallas kernels in the compiled step both ways (census); its tokens/s over the
    pinned step's (the same flags and loaded choices, unfused attention) where that ran."""
    attention = (figures.get("census") or {}).get("attention") or {}
    forward, backward = attention.get("pallas_forward", 0), attention.get("pallas_backward", 0)
    speedup = (figures["tokens_per_s"] / pinned["tokens_per_s"]
               if "tokens_per_s" in pinned else None)
    return {"pallas_forward": forward, "pallas_backward": backward,
            "speedup_over_pinned": speedup,
            "pass": bool(figures.get("pass")) and forward > 0 and backward > 0}


def judge_pinned_autotune(tuned: dict, pinned: dict, untuned: dict | None = None) -> dict:
    """Whether tuned kernel choices, dumped by a compile without the determinism flags and
    loaded by one with them, are honoured: the pinned step runs the tuned step's GEMMs
    (library per GEMM, Triton tiles) and not the untuned ones, and the flags then cost at most
    DETERMINISM_COST_LIMIT of the tuned step's tokens/s."""
    def census(figures: dict | None, key: str):
        return ((figures or {}).get("census") or {}).get(key)

    same = census(tuned, "gemms") is not None and census(tuned, "gemms") == census(pinned, "gemms")
    tiles_same = census(tuned, "triton_tiles") == census(pinned, "triton_tiles")
    cost = judge_determinism(pinned, tuned)
    out = {"gemms_tuned": census(tuned, "gemms"), "gemms_pinned": census(pinned, "gemms"),
           "gemms_untuned": census(untuned, "gemms"),
           "same_gemms_as_tuned": same, "same_triton_tiles_as_tuned": tiles_same,
           "cost": cost["cost"], "limit": cost["limit"],
           "tokens_per_s_tuned": tuned["tokens_per_s"],
           "tokens_per_s_pinned": pinned["tokens_per_s"]}
    out["pass"] = same and tiles_same and cost["pass"]
    return out


def judge_torch_ratio(ours: dict, torch: dict) -> dict:
    """Our tokens/s over transformers + torch's on the same GPU, shapes and optimizer."""
    ratio = ours["tokens_per_s"] / torch["tokens_per_s"]
    return {"ours_tokens_per_s": ours["tokens_per_s"], "torch_tokens_per_s": torch["tokens_per_s"],
            "ratio": ratio, "floor": TORCH_RATIO_FLOOR, "torch": {
                k: torch.get(k) for k in ("attention", "compiled", "dtype", "torch_version")},
            "pass": ratio >= TORCH_RATIO_FLOOR}


def overhead_figures(report: dict) -> dict:
    """The figures of `sdcstudy bench faults|paired|abft --json` (one preset): each
    contender's median step time and its median ratio to the suite's plain step, the largest
    of those ratios, and the suite's goals; `pass` where every contender measured."""
    r = report["results"][0]
    contenders = r.get("variants") or r.get("modes") or {}
    figures = {name: {"ratio": c["ratio"]["median"],
                      "step_ms": c["seconds_per_step"]["median"] * 1e3,
                      **({"conditionals": c["conditionals"]} if "conditionals" in c else {})}
               for name, c in contenders.items()}
    ratios = [f["ratio"] for f in figures.values() if f["ratio"] is not None]
    return {"preset": r["preset"], "batch": r["batch"], "seq_len": r["seq_len"],
            "contenders": figures, "worst_ratio": max(ratios) if ratios else None,
            "goals": report.get("goals", []), "pass": bool(ratios) and len(ratios) == len(figures)}


def judge_golden_full(meta: dict, record_seconds: float, check_verdict: str | None) -> dict:
    """golden record --workload full: every SM reached (measured), at least
    GOLDEN_MEMORY_FLOOR of device memory written and verified, at most GOLDEN_SECONDS_LIMIT
    to record, and its check PASSes (the same bits a second time)."""
    coverage = meta.get("coverage") or {}
    sms, memory = coverage.get("sms") or {}, coverage.get("memory") or {}
    every_sm = bool(sms.get("measured")) and sms.get("reached") == sms.get("sms")
    share = memory.get("share")
    out = {"sms": sms.get("sms"), "sms_reached": sms.get("reached"),
           "sms_measured": bool(sms.get("measured")), "sms_why": sms.get("why"),
           "memory_share": share, "memory_floor": GOLDEN_MEMORY_FLOOR,
           "record_seconds": record_seconds, "seconds_limit": GOLDEN_SECONDS_LIMIT,
           "check_verdict": check_verdict,
           "every_sm": every_sm, "memory_ok": share is not None and share >= GOLDEN_MEMORY_FLOOR,
           "time_ok": record_seconds <= GOLDEN_SECONDS_LIMIT,
           "reproducible": check_verdict == "PASS"}
    out["pass"] = all(out[k] for k in ("every_sm", "memory_ok", "time_ok", "reproducible"))
    return out


def judge_golden_cross(plain: dict, flipped: dict, flip_at: dict) -> dict:
    """A record another GPU made, checked here (`golden check --json` reports): the same bits
    (PASS), and with one injected flip a FAIL whose first difference is at the flip's step,
    layer and site (`flip_at`)."""
    first = flipped.get("first_difference") or {}
    where = {k: first.get(k) for k in flip_at}
    out = {"verdict": plain.get("verdict"), "reason": plain.get("reason"),
           "flipped_verdict": flipped.get("verdict"), "flipped_first_difference": where,
           "same_bits": plain.get("verdict") == "PASS",
           "flip_localized": flipped.get("verdict") == "FAIL" and where == flip_at}
    out["pass"] = out["same_bits"] and out["flip_localized"]
    return out


def judge_fingerprint(env: dict) -> dict:
    """The stack fingerprint a GPU run's env.json must hold: each of STACK_FIELDS present."""
    stack = env.get("gpu_stack") or {}
    missing = [f for f in STACK_FIELDS if stack.get(f) in (None, "")]
    return {"present": {f: stack[f] for f in STACK_FIELDS if f not in missing},
            "missing": missing, "platform": env.get("platform"), "pass": not missing}


def judge_fault_draws(report: dict) -> dict:
    """The fault engine's dense rest on the device (experiments/fault_draw_cost.py --json): the
    two passes must give the one-pass draw's bits (the CPU's tests show it; a GPU could contract
    an error size's multiply-add apart in the two programs); their speed stated, one pass over
    two as `ratio`. Where the rate drew no dense rest there is nothing to judge: no verdict
    (`pass` None, with the reason as `error`: the check could not measure), never a FAIL."""
    times = report.get("dense_rest_us") or {}
    one, two = times.get("one_pass"), times.get("two_passes")
    same = report.get("dense_rest_same_bits")
    judged = {"dense_rest_one_pass_us": one, "dense_rest_two_passes_us": two,
              "ratio": one / two if one and two else None, "same_bits": same,
              "pass": None if same is None else same is True}
    if same is None:
        judged["error"] = "the rate drew no dense rest: no two passes to compare"
    return judged


def judge_free_step(summaries: dict) -> dict:
    """The step without the determinism flags (gpu/free_step.py): its two runs that load the
    first run's kernel choices must end on the same parameters bit for bit; its tokens/s over
    the flags' (the same model, the same choices loaded) stated as `speedup_over_flags`, and
    whether the first run (which tuned) ended on the same bits too."""
    digests = {name: s.get("param_digest") for name, s in summaries.items()}
    speed = {name: s.get("tokens_per_s") for name, s in summaries.items()}
    free, flags = speed.get("repeat_1"), speed.get("flags")
    return {"param_digests": digests, "tokens_per_s": speed,
            "speedup_over_flags": free / flags if free and flags else None,
            "tuned_run_same_bits": digests.get("tuned") == digests.get("repeat_1"),
            "pass": judge_repeat([digests.get("repeat_1"), digests.get("repeat_2")])["pass"]}


def judge_repeat(digests: list) -> dict:
    """The same run in separate processes: every final parameter digest there and equal."""
    return {"param_digests": digests,
            "pass": len(digests) > 1 and None not in digests and len(set(digests)) == 1}
