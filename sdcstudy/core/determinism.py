"""The one place that sets what bitwise determinism needs, and the environment fingerprint.

`configure()` must run before JAX initialises a backend (the CLI calls it first thing).
On CPU, XLA is run-to-run deterministic with no flags; the flags below make GPU runs
deterministic too (`xla_gpu_deterministic_ops` picks deterministic kernels and scatter
implementations; `xla_gpu_exclude_nondeterministic_ops` refuses the rest). XLA parses every
backend's flags on every platform, so they are harmless on CPU.

The fingerprint records what the bits of a run depend on: package versions, XLA flags, device
kind and count, process count, CPU model and instruction set (XLA's CPU code generation and
its thread partitioning differ between them), the hash of the compiled step, and the GPU stack
wherever its parts exist (`gpu_stack`: NVIDIA driver, CUDA runtime, cuBLAS, cuDNN, NCCL, the
nvidia-* wheels, SHA-256 of the pinned autotuning results). Each part is looked up without
requiring a GPU: a part that cannot be found is left out, never guessed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

from sdcstudy.core.errors import UserError

DETERMINISM_XLA_FLAGS = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_exclude_nondeterministic_ops=true",
)

# Flags that say how long a waiting thread or process waits, never what anything computes: the
# comparisons of two environments (golden checks, `reproduce --reuse`) leave them out, so a run
# made before one of them was set is still the same run.
WAIT_XLA_FLAGS = (
    "--xla_cpu_collective_timeout_seconds",
    "--xla_cpu_collective_call_terminate_timeout_seconds",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds",
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
            "isa": sorted(flags.intersection(ISA_FLAGS)), "cores": os.cpu_count(),
            "schedulable_cores": schedulable_cores()}


def schedulable_cores() -> int | None:
    """The cores this process may run on (its CPU affinity: `taskset`, a container's cpuset).
    XLA:CPU splits its loops over threads by it and by the device count, so its programs differ
    with it (a step compiled under `taskset -c 0` on a 2-core machine hashes differently;
    docs/golden.md)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict:
    """Python's version and each installed package's of `names` (absent ones left out)."""
    versions = {"python": sys.version.split()[0]}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


AUTOTUNE_FLAG = "--xla_gpu_load_autotune_results_from"
AUTOTUNE_DUMP_FLAG = "--xla_gpu_dump_autotune_results_to"
# A run's pinned kernel choices, in its folder; XLA writes text where the name ends in .txt.
AUTOTUNE_FILE = "autotune_results.txt"
ENV_FILE = "env.json"  # core/runfolder.py's ENV: where a run folder keeps its fingerprint


class AutotuneMismatch(UserError):
    """The run folder names pinned kernel choices that are missing or changed (exit 2)."""

# jaxlib's CUDA plugin reports these (functions of `jax._src.lib.cuda_versions`).
CUDA_LIBRARIES = {"cuda_runtime": "cuda_runtime_get_version", "cublas": "cublas_get_version",
                  "cudnn": "cudnn_get_version", "cufft": "cufft_get_version",
                  "cusolver": "cusolver_get_version", "cusparse": "cusparse_get_version"}
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")


def flag_value(flags: str, name: str) -> str | None:
    """The value of `--name=value` in an XLA_FLAGS string (the last one wins), or None."""
    value = None
    for flag in flags.split():
        key, _, text = flag.partition("=")
        if key == name:
            value = text
    return value


# XLA cannot launch cuDNN's fused attention under either determinism flag in our models (every
# one has layers of one shape): the step compiles, and its first launch fails with "IndexError:
# raw_hash_map<>::at" (as we read XLA's source, not measured: it writes the backward's
# determinism into the backend config of only the first of two identical calls, so the
# second's compiled graph is looked up under a key never stored). Measured: the failure, with
# jaxlib 0.11.2 on an H200, only with cuDNN's attention and a flag on (docs/results/gpu.md,
# 2026-11-30); a later jaxlib is not measured, so there cuDNN is tried.
CUDNN_ATTENTION_FAILS_THROUGH = (0, 11, 2)


def flags_deciding_bits(flags) -> str:
    """An XLA_FLAGS string (or None) as two environments compare it: sorted, the wait flags
    (`WAIT_XLA_FLAGS`) left out."""
    return " ".join(sorted(f for f in str(flags or "").split()
                           if f.partition("=")[0] not in WAIT_XLA_FLAGS))


def bool_flag(flags: str, name: str) -> bool:
    """Whether an XLA_FLAGS string sets the boolean flag `name` true, as XLA reads it: the
    last one of that name wins, and a bare `--name` (no value) is true (measured with jaxlib
    0.10.2: the debug options XLA dumps say so; tests/test_gpu_promises.py)."""
    on = False
    for flag in flags.split():
        key, equals, text = flag.partition("=")
        if key == name:
            on = not equals or text.lower() in ("true", "1")
    return on


def determinism_on(flags: str) -> bool:
    """Whether an XLA_FLAGS string turns on either determinism flag (`configure` adds both
    unless the environment names them)."""
    return any(bool_flag(flags, flag.partition("=")[0]) for flag in DETERMINISM_XLA_FLAGS)


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "0.11.2" and "0.11.2.dev1" are (0, 11, 2)."""
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(numbers)


def cudnn_attention_fails(flags: str | None = None, jaxlib_version: str | None = None) -> bool:
    """Whether cuDNN's fused attention would fail to launch here (`CUDNN_ATTENTION_FAILS_THROUGH`):
    a determinism flag on (`flags`: XLA_FLAGS, by default this process's) and a jaxlib that
    is not later than the last one measured to fail (by default the installed one)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    if not determinism_on(flags):
        return False
    jaxlib_version = jaxlib_version or _installed_jaxlib()
    if jaxlib_version is None:
        return True  # no jaxlib to tell: assume the measured one
    return version_tuple(jaxlib_version) <= CUDNN_ATTENTION_FAILS_THROUGH


@functools.cache
def _installed_jaxlib() -> str | None:
    """jaxlib's installed version, read once (every layer's attention asks when traced)."""
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None


def autotune_results(flags: str, run_dir: Path | None = None) -> dict:
    """The pinned kernel choices: the SHA-256 of the file XLA_FLAGS loads (or that it is
    unreadable), else of the run folder's own `AUTOTUNE_FILE` with its name; {} when neither."""
    path = flag_value(flags, AUTOTUNE_FLAG)
    if not path:
        pinned = None if run_dir is None else Path(run_dir) / AUTOTUNE_FILE
        if pinned is None or not pinned.is_file():
            return {}
        return {"autotune_results_sha256": _sha256(pinned), "autotune_results_file": AUTOTUNE_FILE}
    try:
        return {"autotune_results_sha256": _sha256(Path(path))}
    except OSError as e:
        return {"autotune_results_sha256": f"unreadable: {e.strerror}"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def autotune_options(run_dir: Path, platform: str, dump: bool = True) -> dict | None:
    """XLA options for compiling a run's step so that its tuned kernel choices are pinned in
    the run folder (`AUTOTUNE_FILE`, text): the first compile on a GPU dumps them (where
    `dump`: the process that writes the folder), every later one (a resume, another process
    or node given the folder) loads them. Where the folder's env.json names pinned results the
    file must be there with the same SHA-256, else `AutotuneMismatch`: the run would silently
    pick other kernels. XLA_FLAGS naming a file to load wins (None: nothing to add); off a GPU
    None, as no other compiler reads these options. Called before anything compiles."""
    pinned = Path(run_dir) / AUTOTUNE_FILE
    named = _recorded_pin(Path(run_dir) / ENV_FILE)
    if named is not None:
        if not pinned.is_file():
            raise AutotuneMismatch(
                f"the run folder's env.json pins kernel choices in {str(pinned)!r}, which is "
                f"missing; copy it back from where the run started, or start a new run.")
        if _sha256(pinned) != named:
            raise AutotuneMismatch(
                f"{str(pinned)!r} is not the file the run folder's env.json pinned (another "
                f"SHA-256); copy back the original, or start a new run.")
    if platform != "gpu" or flag_value(os.environ.get("XLA_FLAGS", ""), AUTOTUNE_FLAG):
        return None
    if pinned.is_file():
        return {AUTOTUNE_FLAG.lstrip("-"): str(pinned)}
    return {AUTOTUNE_DUMP_FLAG.lstrip("-"): str(pinned)} if dump else None


def _recorded_pin(env_file: Path) -> str | None:
    """The SHA-256 of the run folder's own pinned results that its env.json records, or None."""
    try:
        stack = json.loads(env_file.read_text()).get("gpu_stack") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return stack.get("autotune_results_sha256") if stack.get("autotune_results_file") else None


def nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version (e.g. 570.124.06), or None without one."""
    try:
        text = NVIDIA_DRIVER_FILE.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    return match.group(1) if match else None


def _cuda_library_versions() -> dict:
    """Versions the CUDA plugin of jaxlib loaded, where it is installed and answers."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return {}
    found = {}
    for name, function in CUDA_LIBRARIES.items():
        try:
            found[name] = int(getattr(cuda_versions, function)())
        except Exception:  # no plugin, no GPU, another jaxlib: leave it out
            continue
    return found


def _nccl_version() -> int | None:
    """ncclGetVersion() of the NCCL library this process can load, or None."""
    names = ["libnccl.so.2"]
    try:
        import nvidia.nccl

        names.append(str(Path(next(iter(nvidia.nccl.__path__))) / "lib" / "libnccl.so.2"))
    except (ImportError, StopIteration):
        pass
    for name in names:
        try:
            version = ctypes.c_int()
            if ctypes.CDLL(name).ncclGetVersion(ctypes.byref(version)) == 0:
                return version.value
        except (OSError, AttributeError):
            continue
    return None


def nvidia_wheels() -> dict:
    """Versions of the installed nvidia-* wheels (cuBLAS, cuDNN, NCCL, ptxas ...)."""
    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-"):
            found[name] = dist.version
    return dict(sorted(found.items()))


def gpu_stack(flags: str, run_dir: Path | None = None) -> dict:
    """What a GPU's bits depend on beyond the Python packages, where each part exists."""
    stack = {}
    driver = nvidia_driver()
    if driver is not None:
        stack["driver"] = driver
    stack.update(_cuda_library_versions())
    nccl = _nccl_version()
    if nccl is not None:
        stack["nccl"] = nccl
    wheels = nvidia_wheels()
    if wheels:
        stack["wheels"] = wheels
    stack.update(autotune_results(flags, run_dir))
    return stack


def fingerprint(compiled_text: str | None = None, run_dir: Path | None = None) -> dict:
    """Environment fingerprint for `env.json`; pass the compiled step's `program_text` to hash it
    (without op metadata, so a program loaded from JAX's compilation cache hashes the same),
    and the run folder to record the kernel choices pinned there (`autotune_options`)."""
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
        "gpu_stack": gpu_stack(os.environ.get("XLA_FLAGS", ""), run_dir),
        "backend_version": _backend_version(),
        "os": platform.platform(),
        "compiled_step_sha256": (hashlib.sha256(compiled_text.encode()).hexdigest()
                                 if compiled_text is not None else None),
    }


def _backend_version() -> str | None:
    """The backend's own version string (on GPU it names the CUDA version it runs)."""
    try:
        from jax.extend import backend

        return str(backend.get_backend().platform_version)
    except Exception:
        return None
