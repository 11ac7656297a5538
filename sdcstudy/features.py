"""The step features, one line each, in the order a step installs them.

A step feature (`core.step.DeviceHalf` inside the jitted step, `core.step.HostHalf` after
it) lives in a folder of its own; this registry is the one module that names them all, so
`core/` imports none of them and a trainer gets its features here instead of importing each.

Order matters: faults come first, so that every later hook (a lock-step tap, an ABFT check)
sees the corrupted value; then the lock-step taps; then ABFT, which wraps each checked matmul
and places the faults and taps installed before it around its check.

An entry is `name: class`. The class has
- `name`, the same string: the key of its records in `StepOut.records` and of its sinks;
- `from_config(cfg, dims) -> feature | None`: the feature this config asks for, None when
  the config leaves it off (dims: `core.config.ModelDims`).
Adding a step feature is one folder holding its class and one line here
(docs/architecture.md, "Where to add things").
"""

from __future__ import annotations

from sdcstudy.abft.checker import Checker
from sdcstudy.collectives.feature import Collectives
from sdcstudy.faults.feature import Faults
from sdcstudy.paired.lockstep import LockstepTaps

FEATURES = {
    "faults": Faults,
    "collectives": Collectives,  # before the taps: it sees what a tap overwrites
    "taps": LockstepTaps,
    "abft": Checker,
}

_UNSET = object()


def from_config(cfg, dims, names=None, **given) -> list:
    """The features `cfg` turns on, in install order. `names`: only these (default all);
    `given`: a feature (or None) a topology built itself, in place of the config's, e.g.
    `abft=None` where ABFT is a detector's choice rather than `abft.enabled`."""
    unknown = set(given) - set(FEATURES) | set(names or ()) - set(FEATURES)
    if unknown:
        raise ValueError(f"no step feature {sorted(unknown)[0]!r}; registered: "
                         f"{', '.join(FEATURES)}.")
    active = []
    for name, cls in FEATURES.items():
        if names is not None and name not in names:
            continue
        feature = given.get(name, _UNSET)
        if feature is _UNSET:
            feature = cls.from_config(cfg, dims)
        if feature is not None:
            active.append(feature)
    return active


def by_name(features: list) -> dict:
    """{name: feature} of a list of active features."""
    return {f.name: f for f in features}


def active(topology) -> list:
    """The features a topology (a trainer) carries, in install order: for each registered
    name, its attribute of that name (None: off), else its entry in `topology.more` (the
    features registered after the ones it names)."""
    more = getattr(topology, "more", None) or {}
    found = []
    for name in FEATURES:
        feature = getattr(topology, name, None)
        feature = more.get(name) if feature is None else feature
        if feature is not None:
            found.append(feature)
    return found


def tables(features: list, reported=()) -> tuple[str, ...]:
    """The run-folder tables of these features, and of the registered ones named in
    `reported` (a topology that always reports them, on or off), in registry order."""
    on = by_name(features)
    names = [n for n in FEATURES if n in on or n in reported]
    return tuple(dict.fromkeys(t for n in names for t in FEATURES[n].tables))


def host(features: list, step: int, records: dict, places, microsteps: int, reported=()
         ) -> tuple[dict, dict]:
    """Host side, one step: ({table: rows}, counters) of every feature whose records the step
    returned, each from its blocks at `places`; a feature named in `reported` that is off
    gives its idle rows and counters (`idle`)."""
    out_tables, counters = {}, {}
    on = by_name(features)
    for name in reported:
        if name not in on:
            t, c = FEATURES[name].idle()
            out_tables.update(t)
            counters.update(c)
    for feature in features:
        if feature.name in records:
            t, c = feature.host(step, records[feature.name], places, microsteps)
            out_tables.update(t)
            counters.update(c)
    return out_tables, counters


__all__ = ["FEATURES", "active", "by_name", "from_config", "host", "tables"]
