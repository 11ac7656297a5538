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
record's, a cryptographic end-to-end check at the cost of one copy to the host.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from sdcstudy.faults import specs as FS
from sdcstudy.core.digest import tensor_digests
from sdcstudy.golden.digest import block_range, n_blocks
from sdcstudy.golden.record import ARRAYS, GoldenError, _bar
from sdcstudy.golden.workload import Workload, _bits, _param_leaves

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}

# Environment fields a golden record depends on; "os" (kernel version) is reported, not compared.
ENV_FIELDS = ("packages", "xla_flags", "platform", "device_kinds", "device_count",
              "local_device_count", "process_count", "cpu", "compiled_step_sha256")


def _flatten_env(env: dict) -> dict:
    flat = {}
    for name in ENV_FIELDS:
        value = env.get(name)
        if name == "xla_flags":
            value = " ".join(sorted(str(value or "").split()))
        if isinstance(value, dict):
            for key in sorted(value):
                flat[f"{name}.{key}"] = value[key]
        else:
            flat[name] = value
    return flat


def env_differences(golden: dict, observed: dict, skip: tuple[str, ...] = ()) -> list[dict]:
    a, b = _flatten_env(golden), _flatten_env(observed)
    return [{"field": k, "golden": a.get(k), "observed": b.get(k)}
            for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and k.split(".")[0] not in skip]


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
        block, blocks = _first_block(diff["expected"], diff["observed"])
        start, stop = block_range(block, int(np.prod(shape)))
        return {**where, "kind": "activation" if diff["direction"] == "fwd" else "gradient",
                "microstep": diff["microstep"], "layer": int(layer),
                "site": f"{diff['direction']}/{site}",
                "paper_site": _site_name(diff["direction"], site),
                "shape": list(shape), "dtype": info["dtype"], "exact": False,
                "block": {"index": block, "of": n_blocks(int(np.prod(shape))),
                          "flat_start": start, "flat_stop": stop,
                          "start": [int(i) for i in np.unravel_index(start, shape)]},
                "differing_blocks": blocks}
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
    block, blocks = _first_block(diff["expected"], diff["observed"])
    start, stop = block_range(block, int(np.prod(shape)))
    return {**entry, "exact": False,
            "block": {"index": block, "of": n_blocks(int(np.prod(shape))), "flat_start": start,
                      "flat_stop": stop, "start": [int(i) for i in np.unravel_index(start, shape)]},
            "differing_blocks": blocks}


def _short(diff: dict) -> str:
    if diff["kind"] == "site":
        return f"m{diff['microstep']} {diff['direction']}/{diff['key']}"
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
            if result["steps_compared"] != work.steps:
                result["reason"] = (f"only {result['steps_compared']} of {work.steps} steps "
                                    f"were compared.")
            elif final != meta["final_param_sha256"]:
                golden = meta["final_param_sha256"]
                wrong = sorted(p for p in final.keys() | golden.keys()
                               if final.get(p) != golden.get(p))
                result.update(verdict=FAIL, first_difference={
                    "step": work.steps, "kind": "parameter", "tensor": wrong[0], "exact": False,
                    "sha256_only": True, "differing_tensors": wrong})
            else:
                result["verdict"] = PASS
    finally:
        bar.close()
    result["wall_s"] = time.perf_counter() - started
    return result
