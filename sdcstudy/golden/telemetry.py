"""What a golden record or check exercised, measured from what the device did: the device's
clocks, power, temperature and error counters before and after (nvidia-smi), seconds at full
clocks (sampled while the workload runs), and the SMs its tensor-core kernels reached (the
thread-block grids of the kernels in a profiler trace of one step). Where a figure cannot be
measured it says so and why; nothing here is an estimate presented as a measurement.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time

# nvidia-smi --query-gpu fields, by the name a report gives them.
SMI_FIELDS = {
    "sm_clock_mhz": "clocks.sm", "max_sm_clock_mhz": "clocks.max.sm",
    "memory_clock_mhz": "clocks.mem", "power_w": "power.draw", "temperature_c": "temperature.gpu",
    "ecc_corrected_volatile": "ecc.errors.corrected.volatile.total",
    "ecc_uncorrected_volatile": "ecc.errors.uncorrected.volatile.total",
    "remapped_rows_pending": "remapped_rows.pending",
    "remapped_rows_failure": "remapped_rows.failure",
}
XID = ("not counted: nvidia-smi has no XID counter (the kernel log's 'NVRM: Xid' lines or "
       "DCGM's XID field hold them)")
FULL_CLOCK_SHARE = 0.9  # a sample is "at full clocks" at >= 90% of the maximum SM clock
SAMPLE_S = 1.0
# Kernel names of tensor-core products: cuBLAS/cuBLASLt, CUTLASS and XLA's Triton GEMMs.
TENSOR_CORE = re.compile(r"gemm|xmma|hmma|wgmma|cutlass|cublas|_mma|triton_.*dot", re.I)


def not_available(platform: str) -> str:
    return f"not available on {platform}"


def _smi_id(index: int) -> str:
    """nvidia-smi's id of local device `index` (CUDA_VISIBLE_DEVICES renumbers them)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def parse_smi_csv(line: str) -> dict:
    """One `--format=csv,noheader,nounits` line of SMI_FIELDS; '[N/A]' and the like are None."""
    values = {}
    for name, text in zip(SMI_FIELDS, line.split(",")):
        try:
            values[name] = float(text.strip())
        except ValueError:
            values[name] = None
    return values


def smi_sample(index: int) -> dict | None:
    """SMI_FIELDS of one GPU now, or None where nvidia-smi is absent or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "-i", _smi_id(index), f"--query-gpu={','.join(SMI_FIELDS.values())}",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return parse_smi_csv(lines[0]) if done.returncode == 0 and lines else None


def smi_memory_bytes(index: int) -> int | None:
    """The GPU's memory in bytes as nvidia-smi reports it, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "-i", _smi_id(index), "--query-gpu=memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=10)
        return int(float(done.stdout.split()[0]) * 2**20) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def seconds_at_full_clocks(samples: list[dict], period_s: float) -> float:
    """Seconds whose sampled SM clock is at least FULL_CLOCK_SHARE of the maximum."""
    full = [s for s in samples if s.get("sm_clock_mhz") and s.get("max_sm_clock_mhz")
            and s["sm_clock_mhz"] >= FULL_CLOCK_SHARE * s["max_sm_clock_mhz"]]
    return len(full) * period_s


class Watch:
    """Samples one GPU's clocks and power while the workload runs (a thread calling
    nvidia-smi every SAMPLE_S); on another platform it records nothing and says so."""

    def __init__(self, platform: str, index: int):
        self.platform, self.index = platform, index
        self.on_gpu = platform in ("gpu", "cuda") and shutil.which("nvidia-smi") is not None
        self.samples: list[dict] = []
        self.before = self.after = None
        self._stop = threading.Event()
        self._thread = None
        self.started = self.seconds = 0.0

    def __enter__(self):
        self.started = time.perf_counter()
        if self.on_gpu:
            self.before = smi_sample(self.index)
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(SAMPLE_S):
            sample = smi_sample(self.index)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.started
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.after = smi_sample(self.index)
        return False

    def device_figures(self) -> dict:
        """Clocks, power, temperature and error counters before and after, and the seconds
        at full clocks; on CPU, or without nvidia-smi, each says why it is missing."""
        if not self.on_gpu:
            why = (not_available(self.platform) if self.platform not in ("gpu", "cuda")
                   else "not available: nvidia-smi is not on PATH")
            return {"before": why, "after": why, "seconds_at_full_clocks": why,
                    "samples": 0, "xid": why}
        powers = [s["power_w"] for s in self.samples if s.get("power_w") is not None]
        return {"before": self.before, "after": self.after,
                "seconds_at_full_clocks": seconds_at_full_clocks(self.samples, SAMPLE_S),
                "samples": len(self.samples), "max_power_w": max(powers, default=None),
                "xid": XID}


# --- SMs reached: kernel grids of a profiler trace ----------------------------------------------

_GRID = re.compile(r"grid[:=\s]*\(?\s*(\d+)\s*[,x ]\s*(\d+)\s*[,x ]\s*(\d+)", re.I)
_GRID_AXES = re.compile(r"grid_([xyz])\s*[:=]\s*(\d+)", re.I)


def grid_blocks(details: str) -> int | None:
    """Thread blocks (CTAs) of one kernel launch from its trace details (`grid:X,Y,Z` or
    `grid_x:X grid_y:Y grid_z:Z`), or None when the details name no grid."""
    match = _GRID.search(details)
    if match:
        x, y, z = (int(v) for v in match.groups())
        return x * y * z
    axes = dict((a.lower(), int(v)) for a, v in _GRID_AXES.findall(details))
    if "x" in axes:
        return axes["x"] * axes.get("y", 1) * axes.get("z", 1)
    return None


def sm_reach(launches: list[tuple[str, int | None, float]], sms: int) -> dict:
    """What the launches (kernel name, CTAs or None, seconds) show of the SMs reached by
    tensor-core kernels: a grid of at least `sms` CTAs gives every SM a block."""
    tensor = [(name, ctas, s) for name, ctas, s in launches if TENSOR_CORE.search(name)]
    gridded = [(name, ctas, s) for name, ctas, s in tensor if ctas is not None]
    if not gridded:
        return {"measured": False, "sms": sms, "reached": None,
                "why": ("the trace has no tensor-core kernel with a launch grid" if launches
                        else "the trace has no kernel launches")}
    widest = max(ctas for _, ctas, _ in gridded)
    total = sum(s for _, _, s in gridded)
    filling = sum(s for _, ctas, s in gridded if ctas >= sms)
    return {"measured": True, "sms": sms, "reached": min(sms, widest),
            "method": "profiler trace: thread blocks in each tensor-core kernel's grid",
            "tensor_core_kernels": len(gridded), "widest_grid_ctas": widest,
            "time_share_of_grids_filling_every_sm": filling / total if total else None}


def trace_launches(trace_dir: str, device_id: int) -> list[tuple[str, int | None, float]]:
    """(kernel name, CTAs, seconds) of every kernel that device `device_id` ran in the trace."""
    import glob

    from jax.profiler import ProfileData

    launches = []
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        data = ProfileData.from_file(path)
        for plane in data.planes:
            if not re.search(rf"/device:GPU:{device_id}(\D|$)", plane.name):
                continue
            for line in plane.lines:
                for event in line.events:
                    details = " ".join(f"{k}:{v}" for k, v in event.stats)
                    launches.append((event.name, grid_blocks(details),
                                     event.duration_ns * 1e-9))
    return launches


_TRACE_LOCK = threading.Lock()  # one profiler trace at a time in a process


def measure_sm_reach(work, sms: int | None) -> dict:
    """Run one more step of `work` under the JAX profiler and read its kernels' grids (GPU);
    elsewhere, say that SM reach is not measured."""
    platform = work.device.platform
    if platform not in ("gpu", "cuda"):
        return {"measured": False, "sms": None, "reached": None,
                "why": f"{not_available(platform)}: a CPU has no SMs"}
    if not sms:
        return {"measured": False, "sms": None, "reached": None,
                "why": "the device does not report its SM count"}
    import tempfile

    import jax

    with _TRACE_LOCK, tempfile.TemporaryDirectory() as trace_dir:
        state = work.initial_state()
        try:
            with jax.profiler.trace(trace_dir):
                jax.block_until_ready(work.compiled(state, work._batch(1)))
            launches = trace_launches(trace_dir, work.device.id)
        except Exception as e:  # a profiler that fails leaves SM reach unmeasured, not the check
            return {"measured": False, "sms": sms, "reached": None,
                    "why": f"the profiler trace failed: {type(e).__name__}: {e}"}
    return sm_reach(launches, sms)


def units(work) -> list[str]:
    """The number formats and units a workload's step exercises."""
    gpu = work.device.platform in ("gpu", "cuda")
    dtype = work.cfg.model.dtype
    model = f"{dtype} model products" + (
        " (bfloat16 tensor cores)" if gpu and dtype == "bfloat16" else
        " at default precision (TF32 tensor cores)" if gpu else "")
    found = [model, "uint32 digests"]
    if work.sizing is not None:
        found += ["float32 products at default precision" + (" (TF32)" if gpu else ""),
                  "float32 products at HIGHEST precision" + (" (FP32 units)" if gpu else ""),
                  "bfloat16 products", "uint32 memory buffer"]
    return found


def coverage(work, device_index: int, watch: Watch, trace: bool = True) -> dict:
    """The coverage section of a record or check report (docs/golden.md, "Coverage")."""
    from sdcstudy.golden import coverage as C

    try:
        description = C.describe(work.device, smi_memory_bytes(device_index))
    except ValueError:
        description = None
    sms = description.sms if description is not None and not description.simulated else None
    buffer = 0 if work.sizing is None else work.sizing.buffer_bytes
    device_bytes = None if description is None else description.memory_bytes
    memory = {"bytes": buffer, "device_bytes": device_bytes,
              "share": buffer / device_bytes if device_bytes else None,
              "device_bytes_from": ("a simulated description (cpu)" if description is not None
                                    and description.simulated else "the device")}
    return {"workload": "tiny" if work.sizing is None else "full",
            "sms": measure_sm_reach(work, sms) if trace else {
                "measured": False, "sms": sms, "reached": None, "why": "not traced"},
            "memory": memory, "units": units(work), "seconds": watch.seconds,
            "device": watch.device_figures()}


# --- the report -----------------------------------------------------------------------------------


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.0f} MiB"


def coverage_line(coverage: dict) -> str:
    """The coverage section of a record or check report as one line of text."""
    if coverage is None:
        return "coverage: not measured"
    sm = coverage["sms"]
    sms = (f"{sm['reached']}/{sm['sms']} SMs reached by tensor-core kernels" if sm["measured"]
           else f"SMs reached unmeasured ({sm['why']})")
    memory = coverage["memory"]
    if not memory["bytes"]:
        written = "no memory buffer"
    elif memory["share"] is None:
        written = f"{_size(memory['bytes'])} of memory written and verified (device memory unknown)"
    else:
        written = (f"{memory['share']:.0%} of {_size(memory['device_bytes'])} memory written and "
                   f"verified")
    clocks = coverage["device"]["seconds_at_full_clocks"]
    clocks = f"{clocks:.0f} s at full clocks" if isinstance(clocks, float) else (
        f"seconds at full clocks {clocks}")
    return (f"coverage ({coverage['workload']}): {sms}; {written}; "
            f"{', '.join(coverage['units'])}; {coverage['seconds']:.1f} s run, {clocks}")
