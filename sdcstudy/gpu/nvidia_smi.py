"""The GPU's state beside the acceptance's figures, read from `nvidia-smi` (used by
`sdcstudy accept-gpu`; no JAX, nothing changed on the device).

- `snapshot()` runs `nvidia-smi -q -d CLOCK,POWER,TEMPERATURE,ECC,PERFORMANCE,ROW_REMAPPER`
  and `summary()` reads from its text, per GPU: the performance state, clocks (current and
  maximum), power draw and limit, temperatures, the clock event reasons active and their
  counters (how long power or heat held the clocks down since the driver loaded), and the ECC
  counters with the row remapper's state.
- `ecc_problems(before, after)` names what a healthy acceptance must not show: an
  uncorrectable ECC error, any ECC counter that rose while the acceptance ran, a pending or
  failed row remap.
- `identity()` names the GPU (UUID, name, serial): which machine made a golden record;
- `Sampler` polls clocks, power and temperature every half second while a check runs (an MFU
  means little without the clock it ran at); `samples_summary` gives their range.

Fields the driver reports as N/A (ECC inside some virtual machines) are None, never guessed.
"""

from __future__ import annotations

import re
import statistics
import subprocess
from pathlib import Path

QUERY = ["nvidia-smi", "-q", "-d", "CLOCK,POWER,TEMPERATURE,ECC,PERFORMANCE,ROW_REMAPPER"]
SAMPLE_FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
SAMPLE_PERIOD_MS = 500
_LINE = re.compile(r"^(\s*)(\S.*?)\s+:\s?(.*)$")


def parse(text: str) -> dict:
    """`nvidia-smi -q` text as nested dicts: a section header (a line without `key : value`)
    opens a dict holding the more indented lines below it."""
    root: dict = {}
    stack: list[tuple[int, dict]] = [(-1, root)]
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("="):
            continue
        indent = len(line) - len(line.lstrip(" "))
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        m = _LINE.match(line)
        if m:
            parent[m.group(2).strip()] = m.group(3).strip()
        else:
            section: dict = {}
            parent[line.strip()] = section
            stack.append((indent, section))
    return root


def _number(value) -> float | None:
    """`1980 MHz`, `71.05 W`, `33 C`, `0` -> the number; N/A and the like -> None."""
    m = re.match(r"^\s*(-?\d+(?:\.\d+)?)", value) if isinstance(value, str) else None
    return float(m.group(1)) if m else None


def _numbers(section: dict | None) -> dict:
    return {k: _number(v) for k, v in (section or {}).items() if isinstance(v, str)}


def _first(section: dict, *keys):
    """The first of `keys` the section has (field names change between drivers)."""
    for key in keys:
        if key in section:
            return section[key]
    return None


def gpu_summary(gpu: dict) -> dict:
    """What the acceptance records of one GPU's section."""
    reasons = _first(gpu, "Clocks Event Reasons", "Clocks Throttle Reasons") or {}
    power = _first(gpu, "GPU Power Readings", "Power Readings") or {}
    temps = gpu.get("Temperature", {})
    ecc = gpu.get("ECC Errors", {})
    return {
        "performance_state": gpu.get("Performance State"),
        "clocks_mhz": _numbers(gpu.get("Clocks")),
        "max_clocks_mhz": _numbers(gpu.get("Max Clocks")),
        "clock_event_reasons_active": sorted(_active(reasons)),
        "clock_event_reason_counters_us": _numbers(
            _first(gpu, "Clocks Event Reasons Counters", "Clocks Throttle Reasons Counters")),
        "power_w": {"draw": _number(_first(power, "Power Draw", "Average Power Draw",
                                           "Instantaneous Power Draw")),
                    "limit": _number(_first(power, "Current Power Limit", "Power Limit"))},
        # Newer drivers state the margin below the slowdown limit (T.Limit), older ones the
        # slowdown temperature itself.
        "temperature_c": {"gpu": _number(temps.get("GPU Current Temp")),
                          "memory": _number(temps.get("Memory Current Temp")),
                          "limit_margin": _number(temps.get("GPU T.Limit Temp")),
                          "slowdown": _number(temps.get("GPU Slowdown Temp"))},
        "ecc_mode": (gpu.get("ECC Mode") or {}).get("Current"),
        "ecc_volatile": _numbers(ecc.get("Volatile")),
        "ecc_aggregate": _numbers(ecc.get("Aggregate")),
        "remapped_rows": {k: v for k, v in (gpu.get("Remapped Rows") or {}).items()
                          if isinstance(v, str)},
    }


def _active(section: dict, prefix: str = ""):
    for key, value in section.items():
        if isinstance(value, dict):
            yield from _active(value, f"{prefix}{key}/")
        elif value == "Active":
            yield f"{prefix}{key}"


def summary(text: str) -> dict:
    """{"driver_version", "cuda_version", "gpus": {bus id: gpu_summary}} of `nvidia-smi -q`."""
    tree = parse(text)
    gpus = {key.split(" ", 1)[1]: gpu_summary(value) for key, value in tree.items()
            if key.startswith("GPU ") and isinstance(value, dict)}
    return {"driver_version": tree.get("Driver Version"),
            "cuda_version": tree.get("CUDA Version"), "gpus": gpus}


IDENTITY = ["nvidia-smi", "--query-gpu=uuid,name,serial,pci.bus_id", "--format=csv,noheader"]


def identity(timeout: float = 60) -> dict:
    """Which GPU this is (the first one): {"uuid", "name", "serial", "bus_id"}, or {"error"}."""
    try:
        out = subprocess.run(IDENTITY, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip() or "no output")[:200]}
    fields = [f.strip() for f in lines[0].split(",")]
    return dict(zip(("uuid", "name", "serial", "bus_id"), fields))


def snapshot(timeout: float = 60) -> tuple[str, dict]:
    """(the raw text, its summary) of `nvidia-smi -q -d ...` now; an error sentence on failure."""
    try:
        proc = subprocess.run(QUERY, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", {"error": f"{' '.join(QUERY)} did not answer ({e})."}
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        return proc.stdout, {"error": f"{' '.join(QUERY)} exited {proc.returncode} ({tail})."}
    return proc.stdout, summary(proc.stdout)


UNCORRECTABLE = ("SRAM Uncorrectable", "SRAM Uncorrectable Parity", "SRAM Uncorrectable SEC-DED",
                 "DRAM Uncorrectable", "Double Bit ECC")


def ecc_problems(before: dict, after: dict) -> list[str]:
    """One sentence per sign of unhealthy memory between two summaries (none: healthy, or
    the counters are not reported)."""
    problems = []
    for bus, gpu in after.get("gpus", {}).items():
        old = before.get("gpus", {}).get(bus, {})
        for name, count in gpu["ecc_volatile"].items():
            if name in UNCORRECTABLE and count:
                problems.append(f"GPU {bus}: {count:g} volatile {name} ECC errors.")
        for scope in ("ecc_volatile", "ecc_aggregate"):
            for name, count in gpu[scope].items():
                was = old.get(scope, {}).get(name)
                if count is not None and was is not None and count > was:
                    problems.append(f"GPU {bus}: {scope.split('_')[1]} {name} rose from "
                                    f"{was:g} to {count:g} during the acceptance.")
        rows = gpu["remapped_rows"]
        for flag in ("Pending", "Remapping Failure Occurred"):
            if rows.get(flag) == "Yes":
                problems.append(f"GPU {bus}: remapped rows {flag.lower()}.")
    return problems


def counters_during(before: dict, after: dict) -> dict:
    """Per GPU, microseconds each clock event reason held the clocks down between the two."""
    out = {}
    for bus, gpu in after.get("gpus", {}).items():
        old = before.get("gpus", {}).get(bus, {}).get("clock_event_reason_counters_us", {})
        out[bus] = {k: v - old[k] for k, v in gpu["clock_event_reason_counters_us"].items()
                    if v is not None and old.get(k) is not None and v > old[k]}
    return out


class Sampler:
    """`nvidia-smi --query-gpu=... -lms 500` in the background while a check runs."""

    def __init__(self, path: Path):
        self.path, self.proc = path, None

    def __enter__(self):
        try:
            self.file = open(self.path, "w")
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--id=0", f"--query-gpu={','.join(SAMPLE_FIELDS)}",
                 "--format=csv,noheader,nounits", f"-lms={SAMPLE_PERIOD_MS}"],
                stdout=self.file, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.file.close()

    def summary(self) -> dict:
        return samples_summary(self.path.read_text() if self.path.exists() else "")


def samples_summary(text: str) -> dict:
    """min / median / max of each sampled field (N/A values skipped)."""
    columns: dict[str, list[float]] = {field: [] for field in SAMPLE_FIELDS}
    for line in text.splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(SAMPLE_FIELDS):
            continue
        for field, value in zip(SAMPLE_FIELDS, values):
            number = _number(value)
            if number is not None:
                columns[field].append(number)
    out = {"samples": max((len(v) for v in columns.values()), default=0),
           "period_ms": SAMPLE_PERIOD_MS}
    for field, values in columns.items():
        if values:
            out[field] = {"min": min(values), "median": statistics.median(values),
                          "max": max(values)}
    return out
