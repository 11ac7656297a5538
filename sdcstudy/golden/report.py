"""A golden check report as one sentence, as JUnit XML and as strict JSON."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np

from sdcstudy.golden.compare import FAIL, INCONCLUSIVE


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
