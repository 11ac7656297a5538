"""Mismatch statistics between a healthy and a suspect tensor, in numpy (no JAX).

The reference for what `paired/mismatch.py` computes on device, and `sdcstudy.mismatch_stats`
(docs/metrics.md, "Mismatches of one tensor"; Ma et al., "Understanding Silent Data
Corruption in LLM Training", section 4.1, eq. (3)):

- a mismatch is an element whose bit pattern differs between suspect and healthy;
- `severity` is the mean, over mismatching elements where both values are finite, of
  |f' - f| / |f|, a zero |f| replaced by the smallest normal number of the dtype, in float64;
- `nonfinite` counts mismatching elements whose suspect value is Inf or NaN (they are left out
  of the mean; so are the rare mismatches whose healthy value is itself non-finite);
- `max_rel_err` is the largest of those relative errors; both are 0.0 when no finite mismatch.

Bit positions count from 0 = least significant mantissa bit up to the sign bit at the top.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# dtype -> (unsigned view, mantissa bits, exponent bits). The sign bit is the top one.
_LAYOUTS = {
    np.dtype(np.float64): (np.uint64, 52, 11),
    np.dtype(np.float32): (np.uint32, 23, 8),
    np.dtype(np.float16): (np.uint16, 10, 5),
    BFLOAT16: (np.uint16, 7, 8),
}

BIT_CLASSES = ("mantissa", "exponent", "sign")


def _layout(dtype) -> tuple[type, int, int]:
    dtype = np.dtype(dtype)
    if dtype not in _LAYOUTS:
        raise TypeError(f"mismatch statistics need a float64, float32, float16 or bfloat16 "
                        f"array, not {dtype}.")
    return _LAYOUTS[dtype]


def bit_width(dtype) -> int:
    """Bits per element: 32 for float32, 16 for bfloat16."""
    return np.dtype(_layout(dtype)[0]).itemsize * 8


def smallest_normal(dtype) -> float:
    """The |f| that replaces a zero healthy value in the relative error."""
    dtype = np.dtype(dtype)
    finfo = ml_dtypes.finfo(dtype) if dtype == BFLOAT16 else np.finfo(dtype)
    return float(finfo.tiny)


def bit_classes(dtype) -> dict[str, range]:
    """{"mantissa": range, "exponent": range, "sign": range} of bit positions for `dtype`."""
    _, mantissa, exponent = _layout(dtype)
    return {"mantissa": range(0, mantissa),
            "exponent": range(mantissa, mantissa + exponent),
            "sign": range(mantissa + exponent, mantissa + exponent + 1)}


def bit_class(bit: int, dtype) -> str:
    """Name of the field ("mantissa", "exponent" or "sign") that bit position `bit` belongs to."""
    for name, positions in bit_classes(dtype).items():
        if bit in positions:
            return name
    raise ValueError(f"bit {bit} does not exist in a {bit_width(dtype)}-bit {np.dtype(dtype)}.")


def class_counts(histogram, dtype) -> dict[str, int]:
    """Sum a per-bit histogram (as from `bit_histogram`) into mantissa / exponent / sign."""
    histogram = np.asarray(histogram)
    return {name: int(histogram[list(positions)].sum())
            for name, positions in bit_classes(dtype).items()}


def _check_pair(healthy, suspect) -> tuple[np.ndarray, np.ndarray]:
    healthy, suspect = np.asarray(healthy), np.asarray(suspect)
    if healthy.shape != suspect.shape or healthy.dtype != suspect.dtype:
        raise ValueError(f"healthy and suspect must have the same shape and dtype, got "
                         f"{healthy.shape} {healthy.dtype} and {suspect.shape} {suspect.dtype}.")
    _layout(healthy.dtype)
    return healthy, suspect


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(_layout(a.dtype)[0])


def mismatch_stats(healthy, suspect) -> dict:
    """dict(mismatches, elements, severity, max_rel_err, nonfinite) of two same-shape arrays."""
    healthy, suspect = _check_pair(healthy, suspect)
    differ = _bits(healthy) != _bits(suspect)
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when it casts a bfloat16 NaN
        f = healthy[differ].astype(np.float64)
        f_bad = suspect[differ].astype(np.float64)
    bad_finite = np.isfinite(f_bad)
    finite = bad_finite & np.isfinite(f)
    f, f_bad = f[finite], f_bad[finite]
    denominator = np.where(f == 0, smallest_normal(healthy.dtype), np.abs(f))
    # eq. (3), Ma et al.: element-wise relative difference |f' - f| / |f| over the mismatches.
    relative = np.abs(f_bad - f) / denominator
    return {
        "mismatches": int(differ.sum()),
        "elements": int(healthy.size),
        "severity": float(relative.mean()) if relative.size else 0.0,
        "max_rel_err": float(relative.max()) if relative.size else 0.0,
        "nonfinite": int((~bad_finite).sum()),
    }


def bit_histogram(healthy, suspect) -> np.ndarray:
    """int64 array of length `bit_width`: how many elements differ in each bit position."""
    healthy, suspect = _check_pair(healthy, suspect)
    width = bit_width(healthy.dtype)
    xor = (_bits(healthy) ^ _bits(suspect)).reshape(-1)
    flips = np.unpackbits(xor.astype(f">u{width // 8}").view(np.uint8).reshape(-1, width // 8),
                          axis=1)  # big-endian, so column 0 is the top bit
    return flips.sum(axis=0, dtype=np.int64)[::-1].copy()
