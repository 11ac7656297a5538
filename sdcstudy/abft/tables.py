"""ABFT's tables on the host, without JAX: abft.parquet's columns, per-step counters,
flags under any threshold rule from the recorded residuals, and detection against the ground
truth. `abft/checksum.py` computes the records these read; `report` and notebooks can use this module
alone.
"""

from __future__ import annotations

import numpy as np

# Model site of each protected matmul's output -> matmul name (abft.parquet's `matmul`).
MATMUL_OF_SITE = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_out": "o",
                  "ffn_gate": "gate", "ffn_up": "up", "ffn_out": "down", "logits": "head"}
DIRECTIONS = ("fwd", "bwd_input", "bwd_weight")
HOST_THRESHOLDS = ("paper", "paper-dtype", "rounding")
EPS32 = 2.0 ** -23  # float32 machine epsilon (torch.finfo(float32).eps)
EPS = {32: EPS32, 16: 2.0 ** -7}  # machine epsilon by bit width (float32, bfloat16)

# abft.parquet: the first columns (`residual`, `threshold`: the row check under the
# configured rule), then the column check, the location, the node, what any rule needs, and
# the arithmetic the rounding bound assumed (operand rounding, -log2 u_acc, output partials).
COLUMNS = ("step", "microstep", "layer", "matmul", "direction", "tp_rank", "residual",
           "threshold", "flagged", "col_residual", "col_threshold", "row", "col", "recomputed",
           "node", "dp_rank", "k", "m", "n", "out_bits", "in_bits", "max_residual",
           "max_col_residual", "norm_inf", "norm_one", "row_ratio", "col_ratio",
           "operand_rounding", "acc_bits", "output_partials")


def tau(rule: str, k, in_bits, xp=np):
    """The paper's factor of the norm product: k times float32's (or the input's) epsilon."""
    if rule == "paper":
        return k * EPS32
    if rule == "paper-dtype":
        return k * xp.where(in_bits == 16, EPS[16], EPS32)
    raise ValueError(f"{rule!r} is not a norm rule; use paper or paper-dtype.")


def counters(rows: list[dict]) -> dict:
    """Per-step counters for metrics.jsonl and summary.json: checks and flags per matmul."""
    out = {"abft/checks": len(rows), "abft/flags": sum(r["flagged"] for r in rows)}
    for name in MATMUL_OF_SITE.values():
        out[f"abft/flags/{name}"] = sum(r["flagged"] for r in rows if r["matmul"] == name)
    for direction in DIRECTIONS:
        out[f"abft/flags/{direction}"] = sum(r["flagged"] for r in rows
                                             if r["direction"] == direction)
    return out


def host_ratios(frame, rule: str):
    """(row, column) largest residual over its threshold for abft.parquet rows under any rule
    of `HOST_THRESHOLDS`, from the recorded residuals, norms and ratios; > 1 is a flag (NaN,
    from non-finite inputs, is not: the product is consistent with what it was given)."""
    if rule == "rounding":
        if len(frame) and frame["row_ratio"].isna().all():
            raise ValueError("these checks ran under abft.threshold=paper, which records no "
                             "rounding-bound ratios; run with abft.threshold=rounding.")
        return frame["row_ratio"].to_numpy(np.float64), frame["col_ratio"].to_numpy(np.float64)
    factor = tau(rule, frame["k"].to_numpy(np.float64), frame["in_bits"].to_numpy())
    with np.errstate(divide="ignore", invalid="ignore"):
        return (frame["max_residual"].to_numpy(np.float64) /
                (factor * frame["norm_inf"].to_numpy(np.float64)),
                frame["max_col_residual"].to_numpy(np.float64) /
                (factor * frame["norm_one"].to_numpy(np.float64)))


def host_flags(frame, rule: str):
    """Flags of abft.parquet rows under any rule, as the device would have raised them."""
    row, col = host_ratios(frame, rule)
    return (row > 1) | (col > 1)


def detection_summary(abft_rows: list[dict], fault_rows: list[dict]) -> dict:
    """Flags against the ground truth of one run (`experiment.mode: abft`).

    A corrupted product (a matmul's output at one step, microstep, layer, tp rank and
    data-parallel rank with at least one fault) is detected when its forward check flagged;
    precision is the detected products over the flagged products (a check's matmul, direction,
    step, microstep, layer, tp rank and data-parallel rank), `flags` the flagged checks. Fault
    rows of runs written before faults.parquet had `dp_rank` read as rank 0. Faults at other
    sites (outside the matmuls) are counted apart: ABFT cannot see them except through what
    they do to later matmuls."""
    site_matmul = {f"fwd/{site}": name for site, name in MATMUL_OF_SITE.items()}
    site_matmul.update({"fwd/attn": "o", "fwd/ffn": "down"})

    def where(r, matmul):
        return (r["step"], r["microstep"], r["layer"], matmul, r["tp_rank"], r.get("dp_rank", 0))

    flags = {where(r, r["matmul"]) for r in abft_rows if r["flagged"] and r["direction"] == "fwd"}
    inside = {where(r, site_matmul[r["site"]]) for r in fault_rows if r["site"] in site_matmul}
    outside = [r for r in fault_rows if r["site"] not in site_matmul]
    all_flags = sum(r["flagged"] for r in abft_rows)
    flagged = {(*where(r, r["matmul"]), r["direction"]) for r in abft_rows if r["flagged"]}
    true_flags = len(flags & inside)
    return {"corrupted_products": len(inside), "faults_outside": len(outside),
            "detected_products": true_flags,
            "recall": true_flags / len(inside) if inside else None,
            "flags": all_flags,
            "precision": true_flags / len(flagged) if flagged else None}
