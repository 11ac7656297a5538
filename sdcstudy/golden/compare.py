"""Comparing one re-run with its golden record, step by step, and saying where it first
went wrong.

A step is compared in program order: per microstep the forward sites in the order the model
computes them, then the backward sites in reverse; then the loss, the gradient norm, the
parameters. What the first difference reports:
- loss and gradient norm: exactly, expected and observed bits;
- a parameter tensor: exactly (flat index, expected and observed bits) at steps whose full
  values the golden record holds, otherwise the first differing block of 1/64 of the tensor;
- a site value or gradient: the first differing block (1/64 of the tensor) and how many
  blocks differ; expected values of activations are not stored (that would take 12 MB per
  step for tiny).
A repetition whose digests all agree also compares SHA-256 of its final parameters with the
record's, a cryptographic end-to-end check at the cost of one copy to the host, and SHA-256 of
the rest of its final state (the optimizer's state and the step count, `final_state_sha256`),
which no step digest covers: a bit of Adam's moments can leave every parameter's bits as they
were. A record made before it held these is compared without them, and its PASS says so.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from sdcstudy.core.determinism import AUTOTUNE_FLAG, flags_deciding_bits
from sdcstudy.faults import specs as FS
from sdcstudy.core.digest import tensor_digests
from sdcstudy.golden.digest import block_range, n_blocks
from sdcstudy.golden.sizing import CHUNK_WORDS
from sdcstudy.golden.record import ARRAYS, GoldenError, _bar, final_state_sha256
from sdcstudy.golden.report import EXIT_CODES, FAIL, INCONCLUSIVE, PASS  # noqa: F401
from sdcstudy.golden.workload import Workload, _bits, _param_leaves


# Environment fields a golden record's bits depend on, by platform: on CPU the host CPU (XLA's
# code generation and threads), on a GPU the GPU stack (driver, CUDA libraries, pinned kernel
# choices) and not the host CPU, which computes none of the GPU's bits. "os" (the kernel
# version) is reported, not compared.
COMMON_FIELDS = ("packages", "xla_flags", "platform", "device_kinds", "device_count",
                 "local_device_count", "process_count", "compiled_step_sha256")
PLATFORM_FIELDS = {"cpu": ("cpu",), "gpu": ("gpu_stack", "backend_version")}
ENV_FIELDS = COMMON_FIELDS + ("cpu", "gpu_stack", "backend_version")
# Fields env.json gained after records were first made: a record without one is not compared on
# it (what it decides still shows in `compiled_step_sha256`, compared after compiling).
ADDED_FIELDS = ("cpu.schedulable_cores",)
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def compared_fields(platform: str | None) -> tuple[str, ...]:
    """What a check compares on `platform` (the golden record's)."""
    key = "gpu" if platform in GPU_PLATFORMS else platform
    return COMMON_FIELDS + PLATFORM_FIELDS.get(key, ("cpu", "gpu_stack", "backend_version"))


def _xla_flags(value) -> str:
    """The flags that decide bits (`flags_deciding_bits`), without the autotuning results' path
    (their SHA-256 is compared in gpu_stack, so a copy of the same file elsewhere is the same
    stack)."""
    return " ".join(f for f in flags_deciding_bits(value).split()
                    if f.partition("=")[0] != AUTOTUNE_FLAG)


def _flatten_env(env: dict, fields: tuple[str, ...]) -> dict:
    flat = {}

    def put(prefix: str, value):
        if isinstance(value, dict):
            for key in sorted(value):
                put(f"{prefix}.{key}", value[key])
        else:
            flat[prefix] = value

    for name in fields:
        value = env.get(name)
        put(name, _xla_flags(value) if name == "xla_flags" else value)
    return flat


def env_differences(golden: dict, observed: dict, skip: tuple[str, ...] = ()) -> list[dict]:
    """The fields that differ among those compared on the golden record's platform."""
    fields = compared_fields(golden.get("platform"))
    a, b = _flatten_env(golden, fields), _flatten_env(observed, fields)
    return [{"field": k, "golden": a.get(k), "observed": b.get(k)}
            for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and k.split(".")[0] not in skip
            and (k in a or k not in ADDED_FIELDS)]


def env_sentence(differences: list[dict]) -> str:
    """One sentence: what differs (the first three with their values) and to re-record."""
    shown = "; ".join(f"{d['field']} {d['golden']} -> {d['observed']}"
                      for d in differences[:3])
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    return (f"the environment differs from the golden record's in {shown}{more}; record a "
            f"golden run for this stack, or pass --allow-env-drift.")


def _blocks(diff: dict, shape: tuple) -> dict:
    """Where a tensor's digests first differ: the block and how many blocks differ."""
    block, blocks = _first_block(diff["expected"], diff["observed"])
    size = int(np.prod(shape))
    start, stop = block_range(block, size)
    return {"block": {"index": block, "of": n_blocks(size), "flat_start": start,
                      "flat_stop": stop, "start": [int(i) for i in np.unravel_index(start, shape)]},
            "differing_blocks": blocks}


def _first_block(expected: np.ndarray, observed: np.ndarray) -> tuple[int, int]:
    """(first differing block, number of differing blocks) of two (blocks, 2) digests."""
    differ = np.any(expected != observed, axis=-1)
    return int(np.argmax(differ)), int(np.sum(differ))


def _scalar(name: str, expected: int, observed: int) -> dict:
    xor = int(expected) ^ int(observed)
    value = lambda b: float(np.uint32(b).view(np.float32))  # noqa: E731
    return {"kind": name, "exact": True, "expected_bits": f"0x{int(expected):08x}",
            "observed_bits": f"0x{int(observed):08x}", "expected": value(expected),
            "observed": value(observed), "differing_bits": [b for b in range(32) if xor >> b & 1]}


def step_differences(step: int, out: dict, arrays: dict, meta: dict) -> list[dict]:
    """Every differing digest of one step, in program order (the first is where it began)."""
    found = []
    if step > 0:
        order = meta["site_order"]
        for m in range(meta["microsteps"]):
            for direction, keys in (("fwd", order), ("bwd", order[::-1])):
                for key in keys:
                    expected = arrays[f"{direction}/{key}"][step - 1, m]
                    observed = out[direction][key][m]
                    if not np.array_equal(expected, observed):
                        found.append({"kind": "site", "direction": direction, "key": key,
                                      "microstep": m, "expected": expected, "observed": observed})
        for name in meta.get("coverage_digests", []):
            expected, observed = arrays[f"coverage/{name}"][step - 1], out["coverage"][name]
            if not np.array_equal(expected, observed):
                found.append({"kind": "coverage", "name": name, "expected": expected,
                              "observed": observed})
        for name in ("loss", "grad_norm"):
            if arrays[name][step - 1] != out[name]:
                found.append({"kind": name, "expected": arrays[name][step - 1],
                              "observed": out[name]})
    for path in meta["params"]:
        expected, observed = arrays[f"params/{path}"][step], out["params"][path]
        if not np.array_equal(expected, observed):
            found.append({"kind": "parameter", "path": path, "expected": expected,
                          "observed": observed})
    return found


def _differing(observed: dict, golden: dict) -> list[str]:
    """The tensors whose SHA-256 differ (or that only one side has), sorted."""
    return sorted(p for p in observed.keys() | golden.keys() if observed.get(p) != golden.get(p))


def _site_name(direction: str, site: str) -> str:
    for alias, (d, s) in FS.SITE_ALIASES.items():
        if (d, s) == (direction, site):
            return alias
    return f"{direction}/{site}"


def describe(diff: dict, step: int, meta: dict, arrays: dict, state) -> dict:
    """The report entry of one difference, with the element or block where it lies."""
    where = {"step": step}
    if diff["kind"] in ("loss", "grad_norm"):
        return {**where, **_scalar(diff["kind"], diff["expected"], diff["observed"])}
    if diff["kind"] == "site":
        site, layer = diff["key"].rsplit("/", 1)
        info = meta["sites"][diff["key"]]
        shape = tuple(info["shape"])
        return {**where, "kind": "activation" if diff["direction"] == "fwd" else "gradient",
                "microstep": diff["microstep"], "layer": int(layer),
                "site": f"{diff['direction']}/{site}",
                "paper_site": _site_name(diff["direction"], site),
                "shape": list(shape), "dtype": info["dtype"], "exact": False,
                **_blocks(diff, shape)}
    if diff["kind"] == "coverage":
        return {**where, **_coverage_entry(diff, meta)}
    path = diff["path"]
    info = meta["params"][path]
    shape = tuple(info["shape"])
    entry = {**where, "kind": "parameter", "tensor": path, "shape": list(shape),
             "dtype": info["dtype"]}
    full = arrays.get(f"full/{step}/{path}")
    if full is not None and state is not None:
        observed = _bits(jax.device_get(_param_leaves(state["params"])[path])).reshape(-1)
        expected = full.reshape(-1)
        differ = expected != observed
        if np.any(differ):
            index = int(np.argmax(differ))
            e, o = int(expected[index]), int(observed[index])
            width = 8 * expected.dtype.itemsize
            value = lambda b: float(np.array([b], expected.dtype).view(  # noqa: E731
                np.float32 if width == 32 else jnp.bfloat16)[0])
            return {**entry, "exact": True, "index": index,
                    "multi_index": [int(i) for i in np.unravel_index(index, shape)],
                    "expected_bits": f"0x{e:0{width // 4}x}",
                    "observed_bits": f"0x{o:0{width // 4}x}",
                    "expected": value(e), "observed": value(o),
                    "differing_bits": [b for b in range(width) if (e ^ o) >> b & 1],
                    "differing_elements": int(np.sum(differ))}
    return {**entry, "exact": False, **_blocks(diff, shape)}


def _coverage_entry(diff: dict, meta: dict) -> dict:
    """A full workload's memory buffer (the 4 MiB chunk read back wrong) or float32 product
    (the first differing block of its output)."""
    if diff["name"] == "memory":
        chunk, chunks = _first_block(diff["expected"], diff["observed"])
        chunk_bytes = 4 * CHUNK_WORDS
        return {"kind": "memory", "exact": False, "chunk": chunk, "of": len(diff["expected"]),
                "byte_start": chunk * chunk_bytes, "byte_stop": (chunk + 1) * chunk_bytes,
                "differing_chunks": chunks}
    n = meta["sizing"]["gemm_size"]
    return {"kind": "product", "unit": diff["name"], "shape": [n, n], "exact": False,
            **_blocks(diff, (n, n))}


def _short(diff: dict) -> str:
    if diff["kind"] == "site":
        return f"m{diff['microstep']} {diff['direction']}/{diff['key']}"
    if diff["kind"] == "coverage":
        return f"coverage/{diff['name']}"
    return diff.get("path", diff["kind"])


def _check_layout(work: Workload, meta: dict, arrays: dict) -> None:
    """The golden record must describe exactly the program that runs here."""
    if (meta.get("steps"), meta.get("microsteps")) != (work.steps, work.microsteps):
        raise GoldenError("golden.json disagrees with the recorded tokens (steps, microsteps).")
    if meta.get("site_order") != work.site_order or meta.get("sites") != work.sites:
        raise GoldenError("the golden record's sites differ from this program's (another "
                          "model version?).")
    leaves = _param_leaves(work.initial["params"])
    if set(meta.get("params", {})) != set(leaves):
        raise GoldenError("the golden record's parameter tensors differ from this program's.")
    wanted = {f"{d}/{k}" for d in ("fwd", "bwd") for k in work.site_order}
    wanted |= {f"params/{p}" for p in leaves} | {"loss", "grad_norm"}
    wanted |= {f"coverage/{name}" for name in meta.get("coverage_digests", [])}
    missing = sorted(wanted - set(arrays))
    if missing:
        raise GoldenError(f"{ARRAYS} lacks {len(missing)} arrays (first: {missing[0]}).")


def run_once(work: Workload, meta: dict, arrays: dict, progress: bool = False) -> dict:
    """One repetition of the workload against the golden digests."""
    started = time.perf_counter()
    result = {"verdict": INCONCLUSIVE, "steps_compared": 0, "first_difference": None,
              "injected": []}
    bar = _bar(progress, work.steps, "golden check")
    try:
        for step, out, state in work.run():
            if step > 0:
                result["injected"] += work.fault_rows(out.get("faults"), step)
            found = step_differences(step, out, arrays, meta)
            if found:
                result.update(verdict=FAIL, steps_compared=step,
                              first_difference=describe(found[0], step, meta, arrays, state),
                              differences_at_step=len(found),
                              differing=[_short(d) for d in found[:20]])
                if step > 0:
                    result["first_difference"]["observed_loss"] = float(
                        np.uint32(out["loss"]).view(np.float32))
                break
            result["steps_compared"] = step
            bar.update(int(step > 0))
        else:
            final = tensor_digests(jax.device_get(state["params"]))
            golden_state = meta.get("final_state_sha256")
            result["state_compared"] = golden_state is not None
            wrong_state = [] if golden_state is None else _differing(
                final_state_sha256(state), golden_state)
            if result["steps_compared"] != work.steps:
                result["reason"] = (f"only {result['steps_compared']} of {work.steps} steps "
                                    f"were compared.")
            elif final != meta["final_param_sha256"]:
                wrong = _differing(final, meta["final_param_sha256"])
                result.update(verdict=FAIL, first_difference={
                    "step": work.steps, "kind": "parameter", "tensor": wrong[0], "exact": False,
                    "sha256_only": True, "differing_tensors": wrong})
            elif wrong_state:
                result.update(verdict=FAIL, first_difference={
                    "step": work.steps, "kind": "optimizer state", "tensor": wrong_state[0],
                    "exact": False, "sha256_only": True, "differing_tensors": wrong_state})
            else:
                result["verdict"] = PASS
    finally:
        bar.close()
    result["wall_s"] = time.perf_counter() - started
    return result
