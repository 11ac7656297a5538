"""A golden check report as one sentence, as JUnit XML and as strict JSON; the verdicts; a
node's table of devices. Imports no JAX (a refused record is reported before JAX starts)."""

from __future__ import annotations

import json
import socket
import time
import xml.etree.ElementTree as ET

import numpy as np

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
CHECK_SCHEMA = "sdcstudy-golden-check/1"
NODE_SCHEMA = "sdcstudy-golden-devices/1"


def check_report(golden_dir, device_index, inject: str | None, allow_env_drift: bool) -> dict:
    """A one-device check report before anything is known (INCONCLUSIVE until decided)."""
    return {"schema": CHECK_SCHEMA, "verdict": INCONCLUSIVE, "exit_code": 2, "reason": None,
            "golden": {"dir": str(golden_dir)}, "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": {"index": device_index},
            "inject": inject, "env": {"compared": False, "differences": [],
                                      "allowed_drift": allow_env_drift},
            "failed_stage": None, "repetitions": [], "first_difference": None,
            "injected": None, "coverage": None, "timing": {}}


def refused_report(golden_dir, reason: str, device_index, inject: str | None,
                   allow_env_drift: bool, command: str = "check") -> dict:
    """The report of a command refused before any device ran (a record, or an injection that
    cannot land): one device's (`golden check`) or a node's, with no device rows (`--device
    all`, `golden quorum`)."""
    if device_index == "all":
        extra = ({"golden": {"dir": str(golden_dir)}} if command == "check"
                 else {"groups": None, "reference": None})
        report = node_report(command, [], time.time(), **extra)
        report.update(verdict=INCONCLUSIVE, exit_code=EXIT_CODES[INCONCLUSIVE], reason=reason,
                      failed_stage="golden" if command == "check" else "devices")
        return report
    report = check_report(golden_dir, device_index, inject, allow_env_drift)
    report.update(reason=reason, failed_stage="golden", timing={"total_s": 0.0})
    return report


def _sentence(d: dict) -> str:
    where = f"step {d['step']}"
    if "microstep" in d:
        where += f", microstep {d['microstep']}"
    if d["kind"] in ("activation", "gradient"):
        b = d["block"]
        alias = f" ({d['paper_site']})" if d["paper_site"] != d["site"] else ""
        return (f"{where}, layer {d['layer']}, {d['site']}{alias}: the {d['kind']} differs first "
                f"in block {b['index']} of {b['of']} (elements {b['flat_start']}-"
                f"{b['flat_stop'] - 1} of shape {tuple(d['shape'])}), {d['differing_blocks']} "
                f"block(s) differ")
    if d["kind"] == "memory":
        return (f"{where}: the memory buffer read back differs in chunk {d['chunk']} of "
                f"{d['of']} (bytes {d['byte_start']}-{d['byte_stop'] - 1} of the buffer), "
                f"{d['differing_chunks']} chunk(s) differ")
    if d["kind"] == "product":
        b = d["block"]
        return (f"{where}: the {d['unit']} float32 product differs first in block {b['index']} "
                f"of {b['of']} (elements {b['flat_start']}-{b['flat_stop'] - 1} of shape "
                f"{tuple(d['shape'])}), {d['differing_blocks']} block(s) differ")
    if d["kind"] == "optimizer state":
        return (f"{where}: SHA-256 of the final optimizer state "
                f"{', '.join(d['differing_tensors'])} differs from the record's although the "
                f"parameters agreed")
    if d["kind"] == "parameter":
        if d.get("sha256_only"):
            return (f"{where}: SHA-256 of the final parameters {', '.join(d['differing_tensors'])} "
                    f"differs from the record's although every digest agreed")
        if d["exact"]:
            return (f"{where}: parameter {d['tensor']} element {tuple(d['multi_index'])} is "
                    f"{d['observed_bits']} ({d['observed']:.9g}), expected {d['expected_bits']} "
                    f"({d['expected']:.9g}); {d['differing_elements']} element(s) differ")
        b = d["block"]
        return (f"{where}: parameter {d['tensor']} differs first in block {b['index']} of "
                f"{b['of']} (elements {b['flat_start']}-{b['flat_stop'] - 1})")
    return (f"{where}: {d['kind']} is {d['observed_bits']} ({d['observed']:.9g}), expected "
            f"{d['expected_bits']} ({d['expected']:.9g})")


def junit_xml(report: dict) -> str:
    """JUnit XML: one test case per stage (golden record, environment, workload) and per
    repetition; FAIL is a <failure>, INCONCLUSIVE an <error>, stages not reached <skipped>."""
    label = f"device{report['device'].get('index')}"
    failed = report.get("failed_stage")
    cases, reached = [], True
    for stage, name in (("golden", "golden record"), ("environment", "environment"),
                        ("workload", "workload compiles")):
        if not reached:
            cases.append((name, ("skipped", "not reached"), 0.0))
            continue
        cases.append((name, ("error", report["reason"]) if failed == stage else None, 0.0))
        reached = failed != stage
    for rep in report["repetitions"]:
        outcome = None
        if rep["verdict"] == FAIL:
            outcome = ("failure", _sentence(rep["first_difference"]))
        elif rep["verdict"] == INCONCLUSIVE:
            outcome = ("error", rep.get("reason") or "incomplete")
        cases.append((f"repetition {rep['repetition']}", outcome, rep.get("wall_s", 0.0)))
    count = lambda tag: str(sum(1 for c in cases if c[1] and c[1][0] == tag))  # noqa: E731
    suite = ET.Element("testsuite", name=f"sdcstudy.golden.{label}", hostname=report["host"],
                       timestamp=report["started"], tests=str(len(cases)),
                       failures=count("failure"), errors=count("error"), skipped=count("skipped"),
                       time=f"{report['timing'].get('total_s', 0.0):.3f}")
    props = ET.SubElement(suite, "properties")
    for name, value in (("verdict", report["verdict"]), ("golden", report["golden"]["dir"]),
                        ("device", json.dumps(report["device"])),
                        ("inject", report["inject"] or "")):
        ET.SubElement(props, "property", name=name, value=str(value))
    for name, outcome, seconds in cases:
        case = ET.SubElement(suite, "testcase", classname=f"sdcstudy.golden.{label}", name=name,
                             time=f"{seconds:.3f}")
        if outcome:
            tag, message = outcome
            node = ET.SubElement(case, tag, message=message or "")
            if tag != "skipped":
                node.set("type", report["verdict"])
                node.text = message
    root = ET.Element("testsuites", name="sdcstudy golden check")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _strict(value):
    """JSON has no NaN or Inf (a corrupted loss may be either): write them as strings."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, (float, np.floating)) and not np.isfinite(value):
        return str(float(value))
    if isinstance(value, np.generic):
        return value.item()
    return value


def report_json(report: dict) -> str:
    return json.dumps(_strict(report), indent=2, allow_nan=False) + "\n"


# --- a node: every device ---------------------------------------------------------------------


def node_verdict(verdicts: list[str]) -> str:
    if FAIL in verdicts:
        return FAIL
    return PASS if verdicts and all(v == PASS for v in verdicts) else INCONCLUSIVE


def node_report(command: str, rows: list[dict], started: float, **extra) -> dict:
    """`started`: `time.time()` when the command began."""
    verdict = node_verdict([r["verdict"] for r in rows])
    return {"schema": NODE_SCHEMA, "command": command, "verdict": verdict,
            "exit_code": EXIT_CODES[verdict], "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "seconds": time.time() - started, **extra, "devices": rows}


def node_table(report: dict) -> str:
    """One line per device: verdict, where it first differed, seconds."""
    lines = [f"{'device':<8}{'kind':<10}{'verdict':<14}{'first difference':<52}seconds"]
    for row in report["devices"]:
        first = row["first_difference"]
        where = "-" if first is None else ", ".join(
            f"{k} {first[k]}" for k in ("step", "microstep", "layer", "site", "tensor")
            if k in first)
        lines.append(f"{row['device']:<8}{str(row['kind'])[:9]:<10}{row['verdict']:<14}"
                     f"{where[:51]:<52}{row['seconds']:.1f}")
    return "\n".join(lines) + "\n"


def node_junit_xml(report: dict) -> str:
    """JUnit XML with one test case per device: FAIL a <failure>, INCONCLUSIVE an <error>; a
    command refused before any device ran is one case with an <error>: `golden record` for a
    check (the record, or an injection it cannot take), `devices` for a quorum."""
    name = f"sdcstudy.golden.{report['command']}"
    cases = [(f"device {row['device']}", row["verdict"], row["reason"], row["seconds"])
             for row in report["devices"]]
    if not cases:
        stage = "golden record" if report.get("failed_stage") == "golden" else "devices"
        cases.append((stage, report["verdict"], report["reason"], 0.0))
    suite = ET.Element("testsuite", name=name, hostname=report["host"],
                       timestamp=report["started"], tests=str(len(cases)),
                       failures=str(sum(c[1] == FAIL for c in cases)),
                       errors=str(sum(c[1] == INCONCLUSIVE for c in cases)),
                       time=f"{report['seconds']:.3f}")
    for case_name, verdict, reason, seconds in cases:
        case = ET.SubElement(suite, "testcase", classname=name, name=case_name,
                             time=f"{seconds:.3f}")
        tag = {FAIL: "failure", INCONCLUSIVE: "error"}.get(verdict)
        if tag:
            node = ET.SubElement(case, tag, message=reason or "", type=verdict)
            node.text = reason
    root = ET.Element("testsuites", name=f"sdcstudy golden {report['command']}")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
