"""Devices: how many the mode's mesh needs, and the named ones a plan is held against (their
memory, their peak, and the MFU measured on one).

A plan says whether a step's per-device bytes fit a named device and how long the step would
take there at a model FLOPs utilisation (MFU): step time = FLOPs per device / (MFU x peak).
The peaks are `bench/roofline.py`'s published dense figures; the default MFU is the one
`sdcstudy bench train` measured (RESULTS.md, "On one GPU"), for the step's compute dtype.
No JAX here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sdcstudy import modes
from sdcstudy.bench import roofline
from sdcstudy.core.config import Config
from sdcstudy.core.errors import UserError, did_you_mean

MiB = 2 ** 20

# XLA's allocator takes this share of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise; a plan that needs more names the fraction it needs. Above the largest share a plan
# calls a fit, the CUDA context and the libraries' workspaces have no room left.
DEFAULT_MEM_FRACTION = 0.75
LARGEST_MEM_FRACTION = 0.95

# The modes a plan compiles, and their nodes. The others build programs of their own shape
# (detectors' executions, PAFT's workers, a fine-tuning's pretrained start).
NODES = {"train": 1, "abft": 1, "lockstep": 2, "paramsync": 2, "free": 2}


def devices_needed(cfg: Config) -> int:
    """Devices of the mode's mesh (node x dp x tp); a `UserError` for a mode a plan lacks."""
    mode = cfg.experiment.mode
    if mode not in NODES:
        # A typo gets the nearest mode a plan compiles; a real mode it does not (finetune)
        # gets none, or the sentence would offer `free` for `finetune`.
        hint = "" if mode in modes.REGISTRY else did_you_mean(mode, NODES)
        raise UserError(f"sdcstudy plan compiles the modes {', '.join(NODES)}, not "
                        f"experiment.mode {mode!r}{hint}.")
    return NODES[mode] * cfg.mesh.dp * cfg.mesh.tp


@dataclass(frozen=True)
class Device:
    name: str  # as `--device` spells it
    kind: str  # as JAX spells it (`device_kind`), the key of roofline.DEVICE_PEAKS
    memory: int  # bytes the driver reports (nvidia-smi's memory.total)


DEVICES = {d.name: d for d in (
    Device("h100", "NVIDIA H100 80GB HBM3", 81559 * MiB),
    Device("h200", "NVIDIA H200", 143771 * MiB),
)}

# `sdcstudy bench train` on one H100 (RESULTS.md, "On one GPU"): the `medium` preset (104M),
# 32 x 512 tokens a step, against the dense TF32 peak in float32 and the bfloat16 peak.
MEASURED_MFU = {"float32": 0.186, "bfloat16": 0.126}
MFU_SOURCE = ("measured by `sdcstudy bench train` for medium (104M) on one H100, RESULTS.md "
              "\"On one GPU\"")


def device(name: str) -> Device:
    """The named device, or a `UserError` that names the ones a plan knows."""
    if name not in DEVICES:
        raise UserError(f"unknown device {name!r}{did_you_mean(name, DEVICES)}; "
                        f"sdcstudy plan knows {', '.join(DEVICES)}.")
    return DEVICES[name]


def check_mfu(mfu: float | None) -> None:
    if mfu is not None and not 0 < mfu <= 1:
        raise UserError(f"--mfu must be a fraction above 0 and at most 1 (0.4 for 40%), "
                        f"not {mfu:g}.")


def peak(dev: Device, dtype: str) -> dict:
    """`roofline.device_peak` for the step's dtype. XLA's default precision multiplies float32
    matrices on the TF32 tensor cores (RESULTS.md, "On one GPU"), so a float32 step counts
    against the TF32 peak, as its measured MFU does."""
    return roofline.device_peak(dev.kind, dtype, measured_float32=math.inf)


def step_estimate(dev: Device, dtype: str, flops_per_device: float,
                  mfu: float | None = None) -> dict:
    """Seconds a step would take on `dev` at `mfu` (default: the measured one for `dtype`)."""
    used = MEASURED_MFU[dtype] if mfu is None else mfu
    p = peak(dev, dtype)
    source = MFU_SOURCE if mfu is None else "given with --mfu"
    return {"mfu": used, "mfu_source": f"{dtype} MFU {used:.1%}, {source}",
            "peak": p["label"], "seconds": flops_per_device / (used * p["flops"])}


def fit(dev: Device, need: int) -> dict:
    """Whether `need` bytes per device fit `dev`: within the largest share of its memory XLA
    should take, and the XLA_PYTHON_CLIENT_MEM_FRACTION that takes enough."""
    share = need / dev.memory
    return {"device": dev.name, "memory": dev.memory, "need": need, "share": share,
            "fits": share <= LARGEST_MEM_FRACTION,
            "mem_fraction": (None if share <= DEFAULT_MEM_FRACTION or
                             share > LARGEST_MEM_FRACTION else math.ceil(share * 100) / 100)}
