"""Golden-run pre-admission tests: record a short training on a trusted node, re-run it on a
candidate node, compare every bit, and say where the candidate first went wrong.

This module holds the check (cli.py its command line); the parts, each in its own module:
- `golden_digest`: the on-device digest of a tensor and of the gradient arriving at a site;
- `golden_workload`: the training that is recorded and re-run, and the faults of `--inject`;
- `golden_record`: what `golden record` keeps, writing and loading it;
- `golden_contents`: a record read once and checked against itself before anything runs;
- `golden_compare`: one re-run against the record, and where it first differs;
- `golden_report`: a check report as a sentence, as JUnit XML and as JSON.

`golden check` reads the record once and checks it before anything runs (`golden.contents`:
the manifest, against `--expect-sha` when given, every file's size and SHA-256, the files'
consistency with the config, golden.npz's arrays against what they imply), compares the
environment (a difference is INCONCLUSIVE unless allowed), re-runs on one device and compares
step by step in program order: per
microstep the forward sites in the order the model computes them, then the backward sites in
reverse; then the loss, the gradient norm, the parameters (`golden_compare` says what the
first difference reports).

Verdicts: PASS (exit 0) only when every step of every repetition was compared and equal;
FAIL (exit 1) when a bit differs; INCONCLUSIVE (exit 2) when the check could not be completed:
a damaged or missing golden file, another environment, a crash. A backend that does not
start raises CouldNotRun (exit 3): no verdict.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from sdcstudy.core import determinism
from sdcstudy.core.ticker import ticking
from sdcstudy.core.errors import CouldNotRun
from sdcstudy.faults import specs as FS
from sdcstudy.core.config import UserError
from sdcstudy.golden.contents import Golden, open_record
from sdcstudy.golden.compare import (
    EXIT_CODES, FAIL, INCONCLUSIVE, PASS, _check_layout, compared_fields, env_differences,
    env_sentence, run_once)
from sdcstudy.golden.digest import block_digest, site_key
from sdcstudy.golden.record import GoldenError, load, record, verify
from sdcstudy.golden.report import _sentence, check_report, junit_xml, report_json
from sdcstudy.golden import telemetry
from sdcstudy.golden.sizing import TINY as DEFAULT
from sdcstudy.golden.sizing import FullSizing, sizing_from_dict
from sdcstudy.golden.workload import Workload, device_info, parse_injection, pick_device, workload


def check(golden: Path | Golden, *, inject: str | None = None, allow_env_drift: bool = False,
          repeat: int | None = None, duration_min: float | None = None, device_index: int = 0,
          progress: bool = False, expect_sha: str | None = None) -> dict:
    """Verify, re-run and compare; the report (see docs/golden.md). `golden`: a folder (read
    and checked here, against `expect_sha` when given) or a record already read
    (`contents.open_record`). Never raises for a problem with the golden record, the
    environment or the run: those are INCONCLUSIVE; a backend that does not start is
    CouldNotRun."""
    started = time.perf_counter()
    golden_dir = golden.dir if isinstance(golden, Golden) else Path(golden)
    report = check_report(golden_dir, device_index, inject, allow_env_drift)

    def finish(verdict: str, reason: str | None = None, stage: str | None = None) -> dict:
        report.update(verdict=verdict, exit_code=EXIT_CODES[verdict], reason=reason,
                      failed_stage=stage)
        report["timing"]["total_s"] = time.perf_counter() - started
        return report

    try:
        if not isinstance(golden, Golden):
            golden = open_record(golden_dir, expect_sha)
        report["golden"]["manifest_sha256"] = golden.manifest_sha256
        cfg, golden_env, meta, arrays = golden.cfg, golden.env, golden.meta, golden.arrays
        report["golden"].update(steps=meta.get("steps"), microsteps=meta.get("microsteps"),
                                preset=cfg.model.preset, created=meta.get("created"),
                                recorded_on=meta.get("host"),
                                workload=meta.get("workload", "tiny"))
        sizing = sizing_from_dict(meta["sizing"]) if meta.get("sizing") else None
        injection = parse_injection(inject) if inject else None
        device = pick_device(device_index)
        report["device"] = device_info(device, device_index)
        if injection is not None and injection.flip is not None:
            _check_flip(injection.flip, meta)
    except (GoldenError, UserError) as e:
        return finish(INCONCLUSIVE, str(e), "golden")
    except CouldNotRun:
        raise
    except Exception as e:  # a crash while loading is no verdict on the node
        return finish(INCONCLUSIVE, f"could not read the golden record: {type(e).__name__}: {e}",
                      "golden")

    # The environment first (before compiling: a node on another stack fails fast), then the
    # compiled program. An injected program differs from the golden one by construction, so
    # its hash is not compared; everything else about the environment still is.
    env = report["env"]

    def env_verdict(differences):
        env["differences"] += differences
        if differences and not allow_env_drift:
            return finish(INCONCLUSIVE, env_sentence(differences), "environment")
        return None

    observed_env = determinism.fingerprint(None)
    env.update(compared=True, skipped=[],
               fields=list(compared_fields(golden_env.get("platform"))),
               os={"golden": golden_env.get("os"), "observed": observed_env.get("os")})
    if env_verdict(env_differences(golden_env, observed_env, skip=("compiled_step_sha256",))):
        return report
    try:
        with ticking("golden check: preparing and compiling the workload", enabled=progress):
            work, cached = workload(cfg, arrays["tokens"], device, injection, sizing)
        report["timing"].update(compile_s=0.0 if cached else work.compile_s,
                                compiled_earlier_in_process=cached)
        _check_layout(work, meta, arrays)
    except (GoldenError, UserError) as e:
        return finish(INCONCLUSIVE, str(e), "workload")
    except Exception as e:
        return finish(INCONCLUSIVE, f"could not build the golden workload: "
                                    f"{type(e).__name__}: {e}", "workload")
    if work.faults is not None:
        env["skipped"] = ["compiled_step_sha256"]
    else:
        observed = determinism.fingerprint(
            determinism.program_text(work.hlo))["compiled_step_sha256"]
        expected = golden_env.get("compiled_step_sha256")
        if env_verdict([] if observed == expected else [
                {"field": "compiled_step_sha256", "golden": expected, "observed": observed}]):
            return report

    with telemetry.Watch(device.platform, device_index) as watch:
        landed = _repetitions(report, work, meta, arrays, progress,
                              _deadline(started, duration_min, repeat, sizing), repeat)
    index = len(report["repetitions"])
    if report["repetitions"][-1]["verdict"] != INCONCLUSIVE:
        report["coverage"] = telemetry.coverage(work, device_index, watch)
    if work.faults is not None:
        report["injected"] = {"label": injection.label, "landed": len(landed),
                              "first": landed[:20]}
    report["timing"]["run_s"] = sum(r.get("wall_s", 0.0) for r in report["repetitions"])
    last = report["repetitions"][-1]
    if last["verdict"] == FAIL:
        report["first_difference"] = dict(last["first_difference"], repetition=index)
        return finish(FAIL, _sentence(report["first_difference"]), "run")
    if last["verdict"] == INCONCLUSIVE:
        return finish(INCONCLUSIVE, last.get("reason"), "run")
    if all(r.get("state_compared") for r in report["repetitions"]):
        return finish(PASS, f"{len(report['repetitions'])} repetition(s) of {meta['steps']} "
                            f"steps bitwise equal to the golden record.")
    return finish(PASS, f"{len(report['repetitions'])} repetition(s) of {meta['steps']} steps "
                        f"bitwise equal to the golden record in every digest and the final "
                        f"parameters; the record holds no SHA-256 of the optimizer state (an "
                        f"older record): record it again to compare that too.")


def _deadline(started: float, duration_min: float | None, repeat: int | None,
              sizing: FullSizing | None) -> float | None:
    """When repetitions stop starting: `--duration` from the check's start; for the full
    workload without --repeat or --duration, its `min_seconds` from now; else None (an
    explicit `--repeat 1` is one repetition)."""
    if duration_min is not None:
        return started + 60.0 * duration_min
    if sizing is not None and sizing.min_seconds and repeat is None:
        return time.perf_counter() + sizing.min_seconds
    return None


def _repetitions(report: dict, work: Workload, meta: dict, arrays: dict, progress: bool,
                 deadline: float | None, repeat: int | None) -> list[dict]:
    """Run and compare repetitions into the report until one is not PASS, `repeat` (by
    default 1) ran, or the deadline passed; what the injection landed, over all of them."""
    landed = []
    while True:
        index = len(report["repetitions"]) + 1
        try:
            result = run_once(work, meta, arrays, progress)
        except Exception as e:
            result = {"verdict": INCONCLUSIVE, "steps_compared": None, "first_difference": None,
                      "injected": [], "reason": f"the run failed: {type(e).__name__}: {e}"}
        result["repetition"] = index
        landed += [dict(r, repetition=index) for r in result.pop("injected")]
        report["repetitions"].append(result)
        if result["verdict"] != PASS:
            return landed
        if deadline is None and index >= (repeat or 1):
            return landed
        if deadline is not None and time.perf_counter() >= deadline:
            return landed


def _check_flip(flip: dict, meta: dict) -> None:
    """A flip that can never land would let the check pass without proving anything."""
    steps, micro = meta["steps"], meta["microsteps"]
    if not 1 <= flip["step"] <= steps:
        raise UserError(f"--inject flip: step must be 1 to {steps}, not {flip['step']}.")
    if not 0 <= flip["microstep"] < micro:
        raise UserError(f"--inject flip: microstep must be 0 to {micro - 1}.")
    site = FS.FaultSpec(flip["site"]).resolve()[1]
    keys = [k for k in meta["site_order"] if k.rsplit("/", 1)[0] == site]
    if "layer" in flip and site_key(site, flip["layer"]) not in keys:
        layers = sorted(int(k.rsplit("/", 1)[1]) for k in keys)
        raise UserError(f"--inject flip: site {flip['site']!r} has layers {layers}, not "
                        f"{flip['layer']}.")
    dtype = meta["sites"][keys[0]]["dtype"]
    width = 16 if dtype == "bfloat16" else 32
    if not 0 <= flip["bit"] < width:
        raise UserError(f"--inject flip: bit must be 0 to {width - 1} for {dtype}.")


# The public calls of the golden checks, importable from here whichever module holds them.
__all__ = ["record", "check", "verify", "load", "parse_injection", "block_digest", "Workload",
           "junit_xml", "DEFAULT", "PASS", "FAIL", "INCONCLUSIVE", "EXIT_CODES"]
