"""Detector strategies: one detector, a combination ("monitor+abft"), or none.

Each detector is described, per kind of SDC event, by
- its recall: for a transient event (one corrupted step), the chance that a check of that
  step flags it; for a persistent defect (a node that corrupts every step it computes until it
  is removed), the chance that the detector can see this defect at all (a defect it can see
  is flagged at the first step it checks). Re-execution recomputes on the same device, so it
  catches transient faults and never a repeatable one (recall_persistent 0);
- its coverage: the share of the fleet's work it checks each step. 1 for every detector but
  `shadow`, which recomputes the work of `spares` randomly chosen nodes per step on spare
  nodes: spares / nodes;
- its latency: steps from the corrupted step to the flag. 0 means the check runs before the
  update is applied (the step is simply recomputed, as detect/rollback.py does); the monitor
  reads the loss and gradient norm after the step, so its latency is at least 1;
- its overhead: extra node-time per step as a fraction of the job's (shadow: `overhead` per
  spare node, relative to one of the job's nodes, so spares * overhead / nodes).
Detectors in a combination check independently; their overheads add.

`bench_overheads` reads the overheads that `sdcstudy bench detect --json F` measured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from sdcstudy.core.errors import UserError, did_you_mean
from sdcstudy.fleet.config import DETECTORS, NONE, FleetConfig


@dataclass(frozen=True)
class Detector:
    name: str
    recall_transient: float
    recall_persistent: float
    latency_steps: int
    coverage: float
    overhead: float


@dataclass(frozen=True)
class Strategy:
    name: str
    detectors: tuple[Detector, ...]

    @property
    def overhead(self) -> float:
        return sum(d.overhead for d in self.detectors)

    @property
    def recall_transient(self) -> float:
        """The chance that some detector flags a transient event (the job's end aside)."""
        return 1 - math.prod(1 - d.recall_transient * d.coverage for d in self.detectors)

    @property
    def recall_persistent(self) -> float:
        """The chance that some detector can see a persistent defect (golden checks aside)."""
        return 1 - math.prod(1 - d.recall_persistent for d in self.detectors)


def detector(name: str, cfg: FleetConfig, nodes: int) -> Detector:
    params = cfg["detectors"][name]
    coverage, overhead = 1.0, params["overhead"]
    if name == "shadow":
        spares = params["spares"]
        coverage = min(1.0, spares / nodes)
        overhead = spares * params["overhead"] / nodes
    return Detector(name, params["recall_transient"], params["recall_persistent"],
                    params["latency_steps"], coverage, overhead)


def parse(name: str, cfg: FleetConfig, nodes: int | None = None) -> Strategy:
    """'none', one detector, or detectors joined by '+'; a one-sentence UserError otherwise."""
    nodes = cfg["fleet.nodes"] if nodes is None else nodes
    text = name.strip()
    if text == NONE:
        return Strategy(NONE, ())
    parts = [p.strip() for p in text.split("+")]
    choices = (NONE,) + DETECTORS
    for part in parts:
        if part not in DETECTORS:
            hint = ("; 'none' stands alone" if part == NONE else
                    did_you_mean(part, choices) if part else "")
            raise UserError(f"strategy {name!r} names {part!r}, which is not one of "
                            f"{', '.join(choices)}{hint}.")
    if len(set(parts)) != len(parts):
        raise UserError(f"strategy {name!r} names a detector twice.")
    return Strategy("+".join(parts), tuple(detector(p, cfg, nodes) for p in parts))


def strategies(cfg: FleetConfig, nodes: int | None = None) -> list[Strategy]:
    parsed = [parse(name, cfg, nodes) for name in cfg["strategies"]]
    names = [s.name for s in parsed]
    if len(set(names)) != len(names):
        raise UserError("strategies names one strategy twice.")
    return parsed


def _detect_results(report) -> list:
    """The results of a `bench detect` report, or of the detect suite inside `bench all`."""
    if not isinstance(report, dict):
        return []
    if report.get("suite") == "detect":
        results = report.get("results")
    else:
        suites = report.get("suites")
        detect = suites.get("detect") if isinstance(suites, dict) else None
        results = detect.get("results") if isinstance(detect, dict) else None
    return [r for r in results or [] if isinstance(r, dict) and isinstance(r.get("variants"), dict)
            and any(name in r["variants"] for name in DETECTORS)]


def _median_ratio(variant) -> float | None:
    ratio = variant.get("ratio") if isinstance(variant, dict) else None
    if isinstance(ratio, dict):
        ratio = ratio.get("median")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
        return None
    return float(ratio)


def bench_overheads(path: str | Path) -> tuple[dict, dict]:
    """({detector: overhead}, where they came from) from a `bench detect --json` file.

    The result of the largest preset is used. A ratio is the step time with the detector over
    the step time without it, measured side by side (bench/detect.py); the overhead is the
    median ratio minus 1 (at least 0). The shadow recomputes one of the benchmark's `ranks`
    ranks, so its overhead per spare node is (ratio - 1) * ranks.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--bench-detect file {str(path)!r} does not exist.")
    try:
        report = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"--bench-detect file {str(path)!r} is not JSON; write one with "
                        "`sdcstudy bench detect --json FILE`.") from None
    results = _detect_results(report)
    if not results:
        raise UserError(f"--bench-detect file {str(path)!r} holds no detect results; write one "
                        "with `sdcstudy bench detect --json FILE`.")
    result = max(results, key=lambda r: r.get("n_params") or 0)
    ranks = result.get("ranks") if isinstance(result.get("ranks"), int) else 2
    overheads = {}
    for name in DETECTORS:
        ratio = _median_ratio(result["variants"].get(name))
        if ratio is not None:
            overheads[name] = max(0.0, ratio - 1) * (ranks if name == "shadow" else 1)
    if not overheads:
        raise UserError(f"--bench-detect file {str(path)!r} holds no detector step-time ratio; "
                        "write one with `sdcstudy bench detect --json FILE`.")
    source = {"file": str(path), "preset": result.get("preset"),
              "n_params": result.get("n_params"), "ranks": ranks}
    return overheads, source


def with_bench_overheads(cfg: FleetConfig, path: str | Path) -> tuple[FleetConfig, dict]:
    """`cfg` with the detectors' overheads measured by `sdcstudy bench detect`."""
    overheads, source = bench_overheads(path)
    changes = {f"detectors__{name}__overhead": value for name, value in overheads.items()}
    return cfg.replace(**changes), {**source, "overheads": overheads}
