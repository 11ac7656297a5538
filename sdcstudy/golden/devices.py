"""Every local device in one command: `golden check --device all` and `golden quorum`.

`check_all` runs the golden check (`golden.check.check`) on every local device, `workers`
devices at a time in threads (XLA compiles and runs without holding the GIL); each device
compiles its own program, since XLA binds an executable to its device. A device's result does
not depend on what runs beside it: every device runs the same deterministic program. Each
device's line is printed in device order (`InOrder`), whichever finishes first; its seconds
are its own, counted while other devices ran beside it, so they add up to more than the
command's wall time.

`quorum` is for new hardware with no trusted node: the same workload runs on every local
device (at least 3) and the devices vote. Devices whose digests agree in every step and whose
final state has the same SHA-256 (parameters, optimizer state, step count) form a group; a
group holding a strict majority is the reference, and each device outside it FAILs
with its first differing step, microstep, layer and site, found in program order exactly as
`golden check` finds it against a record. Without a strict majority no device can be trusted:
every device is INCONCLUSIVE.

Both give one report per node: `{"verdict", "devices": [{"device", "verdict", ...}]}`. The
node's verdict is FAIL if any device FAILs, PASS if every device PASSes, else INCONCLUSIVE
(exit 1, 0, 2).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from sdcstudy.core.config import Config, UserError
from sdcstudy.core.digest import tensor_digests
from sdcstudy.core.ticker import ticking
from sdcstudy.golden.check import _check_flip, check
from sdcstudy.golden.contents import Golden, open_record
from sdcstudy.golden.manifest import GoldenError
from sdcstudy.golden.compare import FAIL, INCONCLUSIVE, PASS, describe, step_differences
from sdcstudy.golden.record import final_state_sha256, load_tokens, store_digests
from sdcstudy.golden.report import (  # noqa: F401  (the node's report, importable here)
    _sentence, node_junit_xml as junit_xml, node_report, node_table as table, node_verdict)
from sdcstudy.golden.workload import (
    _param_leaves, backend_devices, check_config, device_info, layout, parse_injection,
    workload)



def _where(first: dict | None) -> dict | None:
    """The step/microstep/layer/site of a first difference (the table's column)."""
    if first is None:
        return None
    keep = ("step", "microstep", "layer", "site", "kind", "tensor")
    return {k: first[k] for k in keep if k in first}


def local_devices(inject: str | None, inject_device: int | None, least: int = 1) -> list:
    devices = backend_devices()
    if len(devices) < least:
        raise UserError(f"golden quorum needs at least {least} local devices to vote and this "
                        f"node has {len(devices)}; record a golden run on a trusted node and "
                        f"use golden check instead.")
    if inject_device is not None:
        if inject is None:
            raise UserError("--inject-device needs --inject PROFILE (what to inject there).")
        if not 0 <= inject_device < len(devices):
            raise UserError(f"--inject-device {inject_device}: this node has {len(devices)} "
                            f"local devices (0 to {len(devices) - 1}).")
    return devices


def _injected(index: int, inject: str | None, inject_device: int | None) -> str | None:
    return inject if inject_device is None or index == inject_device else None


class InOrder:
    """Each device's line, printed in device order on `line` (a `ticker.Line`): a device done
    before a lower-numbered one is counted done at once (the progress line) and its line waits
    until every lower-numbered device's is printed. Safe from several threads."""

    def __init__(self, line):
        self._line, self._lock = line, threading.Lock()
        self._waiting: dict[int, str] = {}
        self._next = 0

    def done(self, index: int, text: str) -> None:
        with self._lock:
            self._waiting[index] = text
            while self._next in self._waiting:
                self._line.write(self._waiting.pop(self._next))
                self._next += 1
        self._line.advance()


# --- golden check --device all ----------------------------------------------------------------


def check_all(golden: Path | Golden, *, inject: str | None = None,
              inject_device: int | None = None, workers: int | None = None,
              progress: bool = False, expect_sha: str | None = None, **options) -> dict:
    """`check` on every local device against one copy of the record, read once here when
    `golden` is a folder; `options` as `check` takes them (repeat, ...). Each device's verdict
    is printed in device order (`InOrder`); with `progress`, below them a line counts the
    devices done and the seconds (the devices compile at once, for a while, before the first
    is done). An `inject` that cannot land is refused here, once, before any device runs."""
    started = time.time()
    if not isinstance(golden, Golden):
        try:
            golden = open_record(golden, expect_sha)
        except GoldenError as e:
            raise UserError(str(e)) from None
    devices = local_devices(inject, inject_device)
    if inject is not None:
        injection = parse_injection(inject)
        if injection.flip is not None:
            _check_flip(injection.flip, golden.meta)

    def one(index: int) -> dict:
        report = check(golden, inject=_injected(index, inject, inject_device),
                       device_index=index, **options)
        printer.done(index, f"  device {index}: {report['verdict']} "
                            f"({report['timing'].get('total_s', 0.0):.1f} s)")
        return {"device": index, "kind": report["device"].get("kind"),
                "verdict": report["verdict"], "reason": report["reason"],
                "first_difference": _where(report["first_difference"]),
                "injected": report["inject"],
                "seconds": report["timing"].get("total_s", 0.0),
                "coverage": report.get("coverage"), "report": report}

    with ticking("golden check", enabled=progress, total=len(devices), unit="devices") as line:
        printer = InOrder(line)
        rows = in_threads(one, len(devices), workers)
    return node_report("check", rows, started, workers=_workers(workers, len(devices)),
                       golden={"dir": str(golden.dir),
                               "manifest_sha256": golden.manifest_sha256})


def _workers(workers: int | None, n: int) -> int:
    return max(1, min(n, workers or os.cpu_count() or 1))


def in_threads(fn, n: int, workers: int | None) -> list:
    """[fn(0), ..., fn(n - 1)], `workers` at a time (default: the CPU cores). An interrupt
    (Ctrl-C, SIGTERM) or an exception in the main thread returns at once, without waiting for
    the devices still compiling or running (minutes on a GPU): the ones not started never
    start, and the command's exit (130, 143) ends the others."""
    pool = ThreadPoolExecutor(max_workers=_workers(workers, n))
    try:
        rows = list(pool.map(fn, range(n)))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return rows


# --- golden quorum ----------------------------------------------------------------------------


def _run(work) -> tuple[list[dict], dict]:
    """Every step's digests (step 0: the initial parameters) and SHA-256 of the final state:
    its parameters ("params/...") and the rest, the optimizer's state and the step count
    (`record.final_state_sha256`)."""
    outs, final = [], None
    for step, out, state in work.run():
        outs.append({k: v for k, v in out.items() if k != "faults"})
        if step == work.steps:
            final = {**{f"params/{k}": v for k, v in
                        tensor_digests(jax.device_get(state["params"])).items()},
                     **final_state_sha256(state)}
    return outs, final


def _fingerprint(outs: list[dict], final: dict) -> str:
    h = hashlib.sha256()

    def feed(tree, prefix=""):
        for key in sorted(tree):
            value = tree[key]
            if isinstance(value, dict):
                feed(value, f"{prefix}{key}/")
            else:
                h.update(f"{prefix}{key}".encode())
                h.update(np.ascontiguousarray(value).tobytes())
    for out in outs:
        feed(out)
    feed({k: np.frombuffer(bytes.fromhex(v), np.uint8) for k, v in final.items()})
    return h.hexdigest()


def first_difference(outs: list[dict], reference: dict, meta: dict) -> dict | None:
    """The first step (in program order within it) where `outs` leave the reference."""
    for step, out in enumerate(outs):
        found = step_differences(step, out, reference, meta)
        if found:
            return describe(found[0], step, meta, reference, None)
    return None


def vote(digests: list[str]) -> tuple[list[int] | None, list[list[int]]]:
    """(the devices of the strict majority or None, every group of agreeing devices)."""
    by_digest: dict[str, list[int]] = {}
    for device, digest in enumerate(digests):
        by_digest.setdefault(digest, []).append(device)
    groups = sorted(by_digest.values())
    largest = max(groups, key=len)
    return (largest if 2 * len(largest) > len(digests) else None), groups


def quorum(cfg: Config, *, inject: str | None = None, inject_device: int | None = None,
           workers: int | None = None, progress: bool = False) -> dict:
    """Run `cfg`'s workload on every local device and let the devices vote (module doc); with
    `progress`, a line counts the devices done, as `check_all`'s does."""
    started = time.time()
    check_config(cfg)
    devices = local_devices(inject, inject_device, least=3)
    injection = parse_injection(inject) if inject else None  # a typo fails before the data
    tokens = load_tokens(cfg)
    if injection is not None and injection.flip is not None:
        _check_flip(injection.flip, layout(cfg, tokens))  # a flip that never lands proves nothing

    def one(index: int) -> dict:
        t0 = time.perf_counter()
        text = _injected(index, inject, inject_device)
        work, _ = workload(cfg, tokens, devices[index], injection if text else None)
        outs, final = _run(work)
        seconds = time.perf_counter() - t0
        printer.done(index, f"  device {index}: ran {work.steps} steps ({seconds:.1f} s)")
        return {"device": index, "kind": device_info(devices[index], index)["kind"],
                "injected": text, "outs": outs, "digest": _fingerprint(outs, final),
                "final": final,
                "seconds": seconds, "work": work}

    with ticking("golden quorum", enabled=progress, total=len(devices), unit="devices") as line:
        printer = InOrder(line)
        runs = in_threads(one, len(devices), workers)
    work = runs[0]["work"]  # every device runs the same layout
    meta = {"site_order": work.site_order, "sites": work.sites, "microsteps": work.microsteps,
            "steps": work.steps,
            "params": {p: {"shape": list(np.shape(v)), "dtype": str(v.dtype)}
                       for p, v in _param_leaves(work.initial["params"]).items()}}
    majority, groups = vote([run["digest"] for run in runs])
    rows = []
    if majority is None:
        sizes = sorted((len(g) for g in groups), reverse=True)
        for run in runs:
            rows.append(_row(run, INCONCLUSIVE, f"no strict majority: the {len(runs)} devices "
                                                f"split into groups of {sizes}"))
        return node_report("quorum", rows, started, groups=groups, reference=None,
                       workers=_workers(workers, len(runs)))
    arrays: dict = {}
    for step, out in enumerate(runs[majority[0]]["outs"]):
        store_digests(arrays, step, out, work.steps)
    for run in runs:
        if run["device"] in majority:
            rows.append(_row(run, PASS, f"agrees with {len(majority)} of {len(runs)} devices "
                                        f"in every digest of {work.steps} steps and in its "
                                        f"final state."))
            continue
        first = first_difference(run["outs"], arrays, meta)
        reason = (_sentence(first) if first is not None else
                  f"SHA-256 of the final {_final_difference(run, runs[majority[0]])} differs "
                  f"from the majority's although every digest agreed")
        rows.append(_row(run, FAIL, reason, first))
    return node_report("quorum", rows, started, groups=groups,
                   reference=majority[0], workers=_workers(workers, len(runs)))


def _final_difference(run: dict, reference: dict) -> str:
    """What of the final state differs from the reference's: "parameters", "optimizer state"
    (the rest of the state), or both."""
    a, b = run["final"], reference["final"]
    wrong = {"parameters" if k.startswith("params/") else "optimizer state"
             for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    return " and ".join(sorted(wrong, reverse=True)) or "state"


def _row(run: dict, verdict: str, reason: str, first: dict | None = None) -> dict:
    return {"device": run["device"], "kind": run["kind"], "verdict": verdict, "reason": reason,
            "first_difference": _where(first), "injected": run["injected"],
            "seconds": run["seconds"]}


# The public calls of every device's check, importable from here whichever module holds them.
__all__ = ["check_all", "quorum", "vote", "first_difference", "local_devices", "in_threads",
           "InOrder", "node_report", "node_verdict", "junit_xml", "table"]
