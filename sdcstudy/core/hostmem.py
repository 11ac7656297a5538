"""The host allocator: freed memory stays in the process instead of going back to the OS.

XLA's CPU runtime allocates each step's temporary buffers with `malloc` and frees them when
the step ends. With glibc's defaults, buffers above a (moving) threshold are `mmap`ed and
unmapped every step, and freed memory at the top of a heap is handed back to the kernel; the
next step touches it again and takes a page fault per 4 KiB page. On the simulated devices
every worker pays that, one after the other on a few cores: a tiny PAFT step with 8 workers
spent about a tenth of its CPU time in the kernel, and the faults fell unevenly on the
contenders of one benchmark, which made their ratios drift by several percent from one run to
the next (docs/paft.md, section 7).

`tune()` fixes glibc's thresholds (which also turns off their adjustment at run time): blocks
up to `MMAP_THRESHOLD` come from the heaps, which keep up to `TRIM_THRESHOLD` of free memory
at their top. Freed memory is reused by the next step instead of being faulted in again; the
process keeps its peak footprint. Results do not change: where a buffer lies does not change
what XLA computes.

It runs when `sdcstudy` is imported. It does nothing on a C library other than glibc, nor when
the user set any of glibc's `MALLOC_*_` tunables in the environment (theirs win), nor when
`LD_PRELOAD` puts another allocator in glibc's place (jemalloc, tcmalloc, mimalloc: glibc's
settings would not reach it), nor with `SDCSTUDY_MALLOC=system`.

Blocks above 64 MiB that XLA's worker threads allocate are mapped afresh on every step
whatever the thresholds say (a thread's own arena cannot hold them); docs/paft.md, section 7,
measures that, and an allocator to preload that keeps them.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import re
import warnings

# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
USER_TUNABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_",
                 "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "GLIBC_TUNABLES")
OPT_OUT = "SDCSTUDY_MALLOC"
JEMALLOC_PURGE_ALL = b"arena.4096.purge"  # 4096: MALLCTL_ARENAS_ALL

_state: dict = {"tuned": False, "why": "not tried"}


def tune() -> bool:
    """Set the thresholds once per process; True when they are set (now or before)."""
    if _state["tuned"]:
        return True
    why = _skip_reason()
    if why is None:
        ok = all(_process_symbols().mallopt(param, value) == 1 for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD)))
        why = None if ok else "mallopt refused a value"
    _state.update(tuned=why is None, why=why or "tuned")
    return _state["tuned"]


def _skip_reason() -> str | None:
    choice = os.environ.get(OPT_OUT, "").lower()
    if choice == "system":
        return f"{OPT_OUT}=system"
    if choice:  # a misspelt opt-out should not pass unnoticed
        warnings.warn(f"{OPT_OUT}={os.environ[OPT_OUT]!r} is not understood; only 'system' "
                      f"keeps the C library's allocator defaults.", stacklevel=3)
    user = [name for name in USER_TUNABLES if name in os.environ]
    if user:
        return f"{user[0]} is set"
    preloaded = preloaded_allocator()
    if preloaded:
        conf = os.environ.get("MALLOC_CONF")
        return f"LD_PRELOAD allocator {preloaded}" + (f", MALLOC_CONF={conf}" if conf else "")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    return None


def preloaded_allocator() -> str | None:
    """The file name of an allocator `LD_PRELOAD` loads in glibc's place, if any."""
    for entry in re.split(r"[:\s]+", os.environ.get("LD_PRELOAD", "")):
        name = os.path.basename(entry)
        if "malloc" in name:
            return name
    return None


def release() -> str | None:
    """Hand the memory freed so far back to the kernel; the allocator that did it, or None.

    For the boundaries between a benchmark's stages (presets, worker counts), whose buffers
    differ in size: an allocator that keeps freed memory for the next step (glibc with the
    thresholds above, or jemalloc preloaded with decay off) would otherwise hold each stage's
    peak beside the next one's. jemalloc purges every arena (`mallctl`); glibc trims its heaps
    (`malloc_trim`). Buffers still in use are untouched."""
    gc.collect()  # arrays held only by reference cycles free their buffers first
    process = _process_symbols()
    mallctl = getattr(process, "mallctl", None)
    if mallctl is not None:
        return "jemalloc" if mallctl(JEMALLOC_PURGE_ALL, None, None, None, 0) == 0 else None
    trim = getattr(process, "malloc_trim", None)
    if trim is not None and platform.libc_ver()[0] == "glibc":
        trim(0)
        return "glibc"
    return None


def _process_symbols() -> ctypes.CDLL:
    """The process's global symbols (the C library's, and a preloaded allocator's first)."""
    return ctypes.CDLL(None)


def describe() -> str:
    """One line for a benchmark's environment record."""
    if _state["tuned"]:
        return (f"glibc mallopt: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
                f"{TRIM_THRESHOLD >> 20} MiB, top pad {TOP_PAD >> 20} MiB")
    return f"allocator defaults ({_state['why']})"


__all__ = ["tune", "describe", "release"]
