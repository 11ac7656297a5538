"""Golden-run pre-admission tests: record a short training on a trusted node, re-run it on a
candidate node, compare every bit, and say where the candidate first went wrong.

This module holds the check (cli.py its command line); the parts, each in its own module:
- `golden_digest`: the on-device digest of a tensor and of the gradient arriving at a site;
- `golden_workload`: the training that is recorded and re-run, and the faults of `--inject`;
- `golden_record`: what `golden record` keeps, writing, verifying and loading it;
- `golden_compare`: one re-run against the record, and where it first differs;
- `golden_report`: a check report as a sentence, as JUnit XML and as JSON.

`golden check` verifies the manifest, compares the environment (a difference is INCONCLUSIVE
unless allowed), re-runs on one device and compares step by step in program order: per
microstep the forward sites in the order the model computes them, then the backward sites in
reverse; then the loss, the gradient norm, the parameters (`golden_compare` says what the
first difference reports).

Verdicts: PASS (exit 0) only when every step of every repetition was compared and equal;
FAIL (exit 1) when a bit differs; INCONCLUSIVE (exit 2) when the check could not be completed:
a damaged or missing golden file, another environment, a crash.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from sdcstudy.core import determinism
from sdcstudy.faults import specs as FS
from sdcstudy.core.config import UserError
from sdcstudy.golden.compare import (
    EXIT_CODES, FAIL, INCONCLUSIVE, PASS, _check_layout, env_differences, run_once)
from sdcstudy.golden.digest import block_digest, site_key
from sdcstudy.golden.record import GoldenError, load, record, verify
from sdcstudy.golden.report import _sentence, junit_xml, report_json
from sdcstudy.golden.workload import Workload, device_info, parse_injection, pick_device, workload

REPORT_SCHEMA = "sdcstudy-golden-check/1"

# The default workload: tiny Llama, 6 steps of 2 microsteps of 4 sequences of 64 tokens.
DEFAULT = {
    "experiment": {"mode": "train", "steps": 6, "microsteps": 2, "batch_size": 4, "seed": 0,
                   "checkpoint_every": 0, "name": "golden"},
    "model": {"preset": "tiny", "dtype": "float32"},
    "optim": {"warmup_steps": 2},
    "data": {"source": "synthetic", "seq_len": 64},
}


def check(golden_dir: Path, *, inject: str | None = None, allow_env_drift: bool = False,
          repeat: int = 1, duration_min: float | None = None, device_index: int = 0,
          progress: bool = False) -> dict:
    """Verify, re-run and compare; the report (see docs/golden.md). Never raises for a
    problem with the golden record, the environment or the run: those are INCONCLUSIVE."""
    started = time.perf_counter()
    report = {"schema": REPORT_SCHEMA, "verdict": INCONCLUSIVE, "exit_code": 2, "reason": None,
              "golden": {"dir": str(golden_dir)}, "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": {"index": device_index},
              "inject": inject, "env": {"compared": False, "differences": [],
                                        "allowed_drift": allow_env_drift},
              "failed_stage": None, "repetitions": [], "first_difference": None, "injected": None,
              "timing": {}}

    def finish(verdict: str, reason: str | None = None, stage: str | None = None) -> dict:
        report.update(verdict=verdict, exit_code=EXIT_CODES[verdict], reason=reason,
                      failed_stage=stage)
        report["timing"]["total_s"] = time.perf_counter() - started
        return report

    try:
        manifest = verify(golden_dir)
        report["golden"]["manifest_sha256"] = manifest["sha256"]
        cfg, golden_env, meta, arrays = load(golden_dir)
        report["golden"].update(steps=meta.get("steps"), microsteps=meta.get("microsteps"),
                                preset=cfg.model.preset, created=meta.get("created"),
                                recorded_on=meta.get("host"))
        injection = parse_injection(inject) if inject else None
        device = pick_device(device_index)
        report["device"] = device_info(device, device_index)
        if injection is not None and injection.flip is not None:
            _check_flip(injection.flip, meta)
    except (GoldenError, UserError) as e:
        return finish(INCONCLUSIVE, str(e), "golden")
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
            fields = ", ".join(d["field"] for d in differences)
            return finish(INCONCLUSIVE, f"the environment differs from the golden record's in "
                                        f"{fields}; record a golden run for this stack, or "
                                        f"pass --allow-env-drift.", "environment")
        return None

    observed_env = determinism.fingerprint(None)
    env.update(compared=True, skipped=[],
               os={"golden": golden_env.get("os"), "observed": observed_env.get("os")})
    if env_verdict(env_differences(golden_env, observed_env, skip=("compiled_step_sha256",))):
        return report
    try:
        work, cached = workload(cfg, arrays["tokens"], device, injection)
        report["timing"].update(compile_s=0.0 if cached else work.compile_s,
                                compiled_earlier_in_process=cached)
        _check_layout(work, meta, arrays)
    except (GoldenError, UserError) as e:
        return finish(INCONCLUSIVE, str(e), "workload")
    except Exception as e:
        return finish(INCONCLUSIVE, f"could not build the golden workload: "
                                    f"{type(e).__name__}: {e}", "workload")
    if work.injector is not None:
        env["skipped"] = ["compiled_step_sha256"]
    else:
        observed = determinism.fingerprint(
            determinism.program_text(work.hlo))["compiled_step_sha256"]
        expected = golden_env.get("compiled_step_sha256")
        if env_verdict([] if observed == expected else [
                {"field": "compiled_step_sha256", "golden": expected, "observed": observed}]):
            return report

    deadline = None if duration_min is None else started + 60.0 * duration_min
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
            break
        if deadline is None and index >= repeat:
            break
        if deadline is not None and time.perf_counter() >= deadline:
            break
    if work.injector is not None:
        report["injected"] = {"label": injection.label, "landed": len(landed),
                              "first": landed[:20]}
    report["timing"]["run_s"] = sum(r.get("wall_s", 0.0) for r in report["repetitions"])
    last = report["repetitions"][-1]
    if last["verdict"] == FAIL:
        report["first_difference"] = dict(last["first_difference"], repetition=index)
        return finish(FAIL, _sentence(report["first_difference"]), "run")
    if last["verdict"] == INCONCLUSIVE:
        return finish(INCONCLUSIVE, last.get("reason"), "run")
    return finish(PASS, f"{len(report['repetitions'])} repetition(s) of {meta['steps']} steps "
                        f"bitwise equal to the golden record.")


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
