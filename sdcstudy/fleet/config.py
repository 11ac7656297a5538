"""The fleet model's configuration: defaults, YAML files, `--set key=value`, and its checks.

`DEFAULTS` holds the same values as configs/fleet.yaml (a test keeps the two equal); the YAML
file cites where each comes from and docs/fleet.md shows the arithmetic. A config file gives
only the keys it changes. Every bad key or value ends in a one-sentence `UserError`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

from sdcstudy.core import yamlsafe
from sdcstudy.core.errors import UserError, did_you_mean

MAX_NODES = 100_000
MAX_STEPS = 10_000_000  # 13 times the default job; model.py sums arrays of this length
DETECTORS = ("monitor", "abft", "shadow", "reexec", "lockstep")
NONE = "none"

ROLLBACK = ("clean", "latest")

DEFAULTS: dict = {
    "fleet": {"nodes": 2048},
    "job": {"step_seconds": 6.22, "hours": 1296.0, "checkpoint_every": 100,
            "checkpoint_seconds": 10.0, "restart_seconds": 600.0, "rollback": "clean"},
    "sdc": {"transient_per_node_hour": 1.1303e-6, "persistent_per_node_hour": 1.1303e-6},
    "golden": {"enabled": True, "interval_hours": 168.0, "duration_hours": 0.25,
               "recall": 0.8},
    "detectors": {
        "monitor": {"recall_transient": 0.2, "recall_persistent": 0.2, "latency_steps": 1,
                    "overhead": 0.01},
        "abft": {"recall_transient": 0.45, "recall_persistent": 0.083, "latency_steps": 0,
                 "overhead": 0.36},
        "shadow": {"recall_transient": 1.0, "recall_persistent": 1.0, "latency_steps": 0,
                   "overhead": 1.0, "spares": 1},
        "reexec": {"recall_transient": 1.0, "recall_persistent": 0.0, "latency_steps": 0,
                   "overhead": 1.0},
        "lockstep": {"recall_transient": 1.0, "recall_persistent": 1.0, "latency_steps": 0,
                     "overhead": 1.0},
    },
    "strategies": ["none", "monitor", "abft", "shadow", "reexec", "lockstep", "monitor+abft",
                   "monitor+reexec", "abft+shadow", "monitor+abft+reexec"],
    "max_corrupted_steps": None,
    "montecarlo": {"trials": 20000, "seed": 0},
}

# Keys whose default does not show their type.
_NULLABLE_FLOAT = {"max_corrupted_steps"}


@dataclass(frozen=True)
class FleetConfig:
    """The checked configuration; `data` is the nested dict it was built from."""

    data: dict

    def __getitem__(self, dotted: str):
        value = self.data
        for part in dotted.split("."):
            value = value[part]
        return value

    def replace(self, **dotted) -> "FleetConfig":
        """A copy with `key=value` changes (dots written as `__`), checked again."""
        data = copy.deepcopy(self.data)
        for key, value in dotted.items():
            _set(data, key.replace("__", "."), value)
        return build(data)


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


KEYS = tuple(_flatten(DEFAULTS))


def _set(data: dict, dotted: str, value) -> None:
    if dotted not in KEYS:
        raise UserError(f"unknown fleet config key {dotted!r}{did_you_mean(dotted, KEYS)}.")
    *parents, last = dotted.split(".")
    for part in parents:
        data = data[part]
    data[last] = value


def _merge(base: dict, extra: dict, prefix: str = "") -> None:
    for key, value in extra.items():
        dotted = f"{prefix}{key}"
        if isinstance(base.get(key), dict):
            if not isinstance(value, dict):
                raise UserError(f"fleet config key {dotted!r} must be a mapping of "
                                f"{', '.join(base[key])}.")
            _merge(base[key], value, dotted + ".")
        elif dotted not in KEYS:
            raise UserError(f"unknown fleet config key {dotted!r}{did_you_mean(dotted, KEYS)}.")
        else:
            base[key] = value


def _coerce(dotted: str, value):
    """The value with the type of its default, or a UserError naming the key."""
    default = _flatten(DEFAULTS)[dotted]
    if dotted in _NULLABLE_FLOAT:
        if value is None:
            return None
        default = 0.0
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UserError(f"fleet config key {dotted!r} must be true or false, not {value!r}.")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"fleet config key {dotted!r} must be a whole number, not {value!r}.")
        return value
    if isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"fleet config key {dotted!r} must be a number, not {value!r}.")
        if not math.isfinite(value):  # inf and nan pass every range check below
            raise UserError(f"fleet config key {dotted!r} must be a finite number, not "
                            f"{value!r}.")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise UserError(f"fleet config key {dotted!r} must be a word, not {value!r}.")
        return value
    if isinstance(default, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"fleet config key {dotted!r} must be a list of strategy names.")
        return value
    return value


def _check(data: dict) -> None:
    """Ranges; strategy names are checked where they are parsed (strategies.py)."""
    def need(ok: bool, sentence: str) -> None:
        if not ok:
            raise UserError(sentence)

    nodes = data["fleet"]["nodes"]
    need(1 <= nodes <= MAX_NODES,
         f"fleet.nodes must be between 1 and {MAX_NODES:,}, not {nodes}.")
    job = data["job"]
    need(job["step_seconds"] > 0, f"job.step_seconds must be positive, not {job['step_seconds']}.")
    need(job["hours"] > 0, f"job.hours must be positive, not {job['hours']}.")
    need(job["checkpoint_every"] >= 1,
         f"job.checkpoint_every must be at least 1 step, not {job['checkpoint_every']}.")
    need(job["rollback"] in ROLLBACK, f"job.rollback must be one of {', '.join(ROLLBACK)}, "
                                      f"not {job['rollback']!r}.")
    for key in ("checkpoint_seconds", "restart_seconds"):
        need(job[key] >= 0, f"job.{key} must not be negative, not {job[key]}.")
    need(job["hours"] * 3600 >= job["step_seconds"],
         "job.hours must hold at least one step of job.step_seconds.")
    steps = job["hours"] * 3600 // job["step_seconds"]
    shown = f"{steps:,.0f}" if steps < 1e15 else f"{steps:.3g}"
    need(steps <= MAX_STEPS, f"job.hours / job.step_seconds gives {shown} steps; the model "
                             f"sums over every step, so at most {MAX_STEPS:,}.")
    for key, rate in data["sdc"].items():
        need(rate >= 0, f"sdc.{key} must not be negative, not {rate}.")
    golden = data["golden"]
    need(golden["interval_hours"] > 0,
         f"golden.interval_hours must be positive, not {golden['interval_hours']} "
         "(set golden.enabled=false to leave the checks out).")
    need(golden["duration_hours"] >= 0,
         f"golden.duration_hours must not be negative, not {golden['duration_hours']}.")
    need(0 <= golden["recall"] <= 1, f"golden.recall must be between 0 and 1, not "
                                     f"{golden['recall']}.")
    for name, det in data["detectors"].items():
        for kind in ("recall_transient", "recall_persistent"):
            need(0 <= det[kind] <= 1,
                 f"detectors.{name}.{kind} must be between 0 and 1, not {det[kind]}.")
        need(det["latency_steps"] >= 0,
             f"detectors.{name}.latency_steps must not be negative, not {det['latency_steps']}.")
        need(det["overhead"] >= 0,
             f"detectors.{name}.overhead must not be negative, not {det['overhead']}.")
    need(data["detectors"]["shadow"]["spares"] >= 1,
         "detectors.shadow.spares must be at least 1 spare node.")
    need(len(data["strategies"]) >= 1, "strategies is empty; name at least one, e.g. none.")
    limit = data["max_corrupted_steps"]
    need(limit is None or limit >= 0,
         f"max_corrupted_steps must not be negative, not {limit}.")
    need(data["montecarlo"]["trials"] >= 1,
         f"montecarlo.trials must be at least 1, not {data['montecarlo']['trials']}.")
    need(data["montecarlo"]["seed"] >= 0,
         f"montecarlo.seed must not be negative, not {data['montecarlo']['seed']}.")


def build(data: dict) -> FleetConfig:
    """Check types and ranges of a complete nested dict."""
    flat = _flatten(data)
    for dotted in KEYS:
        _set(data, dotted, _coerce(dotted, flat[dotted]))
    _check(data)
    return FleetConfig(data)


def parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise UserError(f"--set expects key=value, got {text!r}.")
    key, raw = (part.strip() for part in text.split("=", 1))
    if key not in KEYS:
        raise UserError(f"unknown fleet config key {key!r}{did_you_mean(key, KEYS)}.")
    try:
        value = yamlsafe.load_text(raw, f"--set {key}") if raw else ""
    except yamlsafe.InvalidYaml:
        value = raw
    return key, value


def load(path: str | Path | None = None, overrides=()) -> FleetConfig:
    """DEFAULTS, then the keys of the YAML file at `path`, then `--set` overrides."""
    data = copy.deepcopy(DEFAULTS)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"fleet config {str(path)!r} does not exist; give a YAML file such "
                            "as configs/fleet.yaml.")
        given = yamlsafe.load_file(path, "fleet config")
        if given is not None and not isinstance(given, dict):
            raise UserError(f"fleet config {str(path)!r} must be a YAML mapping of keys.")
        _merge(data, given or {})
    for text in overrides:
        _set(data, *parse_override(text))
    return build(data)
