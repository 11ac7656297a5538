"""The one place that sets what bitwise determinism needs, and the environment fingerprint.

`configure()` must run before JAX initialises a backend (the CLI calls it first thing).
On CPU, XLA is run-to-run deterministic with no flags; the flags below make GPU runs
deterministic too (`xla_gpu_deterministic_ops` picks deterministic kernels and scatter
implementations; `xla_gpu_exclude_nondeterministic_ops` refuses the rest). XLA parses every
backend's flags on every platform, so they are harmless on CPU.

The fingerprint records what the bits of a run depend on: package versions, XLA flags, device
kind and count, process count, CPU model and instruction set (XLA's CPU code generation and
its thread partitioning differ between them), and the hash of the compiled step.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
from importlib import metadata

DETERMINISM_XLA_FLAGS = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_exclude_nondeterministic_ops=true",
)

PACKAGES = ("sdcstudy", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy",
            "datasets", "jax-cuda12-plugin", "jax-cuda13-plugin")

# Instruction-set extensions that change XLA:CPU code generation.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve", "sve2")


_SOURCE_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_METADATA = re.compile(r',?\s*metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def program_text(hlo: str) -> str:
    """Compiled HLO text without source locations and op metadata: what the program computes,
    not where it was traced from (file paths and caller line numbers would otherwise make a
    golden record depend on the install path and on which command compiled it, and two
    benchmark contenders traced from different lines look like different programs)."""
    lines, skipping = [], False
    for line in hlo.splitlines():
        if line in _SOURCE_SECTIONS:
            skipping = True
        elif skipping and not line:
            skipping = False
        elif not skipping:
            lines.append(_METADATA.sub("", line))
    return "\n".join(lines)


def configure(device_count: int | None = None) -> None:
    """Set determinism flags (and optionally the simulated CPU device count) before JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    for flag in DETERMINISM_XLA_FLAGS:
        if flag.split("=")[0] not in {f.split("=")[0] for f in flags}:
            flags.append(flag)
    if device_count is not None and not any(
            f.startswith("--xla_force_host_platform_device_count") for f in flags):
        flags.append(f"--xla_force_host_platform_device_count={device_count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and model in ("", platform.machine(),
                                                                           platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "machine": platform.machine(),
            "isa": sorted(flags.intersection(ISA_FLAGS)), "cores": os.cpu_count()}


def package_versions() -> dict:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def fingerprint(compiled_text: str | None = None) -> dict:
    """Environment fingerprint for `env.json`; pass the compiled step's `program_text` to hash it
    (without op metadata, so a program loaded from JAX's compilation cache hashes the same)."""
    import jax

    devices = jax.devices()
    kinds: dict[str, int] = {}
    for d in devices:
        kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
    return {
        "packages": package_versions(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "platform": devices[0].platform,
        "device_kinds": kinds,
        "device_count": len(devices),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "cpu": cpu_info(),
        "os": platform.platform(),
        "compiled_step_sha256": (hashlib.sha256(compiled_text.encode()).hexdigest()
                                 if compiled_text is not None else None),
    }
