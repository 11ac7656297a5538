"""The YAML form of fault specs and profiles: a profile file's mapping (`name`, `description`,
`specs`) read into a `Profile`, each spec's mapping into a `FaultSpec` (`faults/specs.py`),
with one sentence naming the field for every mistake (docs/faults.md, section 8).
`faults/profiles.py` reads the files and passes their values here.
"""

from __future__ import annotations

import dataclasses

from sdcstudy.faults.specs import PATTERN_REALS, FaultSpec, FaultSpecError, Profile
from sdcstudy.faults.time_patterns import TimePattern


REAL_FIELDS = ("rate", "value_std", "scale")  # numbers a YAML file may write as 5e-7


def _real(value, what: str):
    """A number, or a tuple of them, as given; a string that reads as one (YAML 1.1 reads
    `5e-7`, without a dot, as a string) becomes that float; another string is bad input."""
    if isinstance(value, tuple):
        return tuple(_real(v, what) for v in value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise FaultSpecError(f"{what} must be a number, not {value!r}.") from None
    return value


def spec_from_dict(data: dict, where: str) -> FaultSpec:
    if not isinstance(data, dict):
        raise FaultSpecError(f"{where} must be a mapping of fault-spec fields.")
    fields = {f.name: f for f in dataclasses.fields(FaultSpec)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            import difflib

            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise FaultSpecError(f"{where}: unknown field {key!r}{hint}.")
        if key == "pattern":
            pfields = {f.name for f in dataclasses.fields(TimePattern)}
            if not isinstance(value, dict):
                raise FaultSpecError(f"{where}: pattern must be a mapping such as {{kind: "
                                     f"burst, p_active: 0.05}}, not {value!r}.")
            if set(value) - pfields:
                raise FaultSpecError(f"{where}: pattern has unknown fields "
                                     f"{sorted(set(value) - pfields, key=str)}; it takes "
                                     f"{', '.join(sorted(pfields))}.")
            if value.get("kind") == "steps" and "steps" not in value:
                raise FaultSpecError(f"{where}: a steps pattern needs pattern.steps, the "
                                     f"optimizer steps (from 1) at which the spec is on, e.g. "
                                     f"[3, 7] ([] keeps it off at every step).")
            if "steps" in value:
                steps = value["steps"]
                value = {**value, "steps": tuple(steps) if isinstance(steps, list) else (steps,)}
            value = {k: _real(v, f"{where}: pattern.{k}") if k in PATTERN_REALS else v
                     for k, v in value.items()}
            value = TimePattern(**value)
        elif key in ("bits", "layers", "tp_ranks", "scale", "lanes") and value is not None:
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        if key in REAL_FIELDS:
            value = _real(value, f"{where}: {key}")
        kwargs[key] = value
    if "site" not in kwargs:
        raise FaultSpecError(f"{where}: the field 'site' is required.")
    try:
        spec = FaultSpec(**kwargs)
        spec.validate(where)
    except TypeError as e:
        raise FaultSpecError(f"{where}: {e}.") from None
    if "rate" not in kwargs and spec.count is None:
        raise FaultSpecError(f"{where}: give rate (the probability that each element is hit, "
                             f"e.g. 1.0e-5) or count (how many elements of each tensor); "
                             f"without either the spec injects nothing.")
    return spec


PROFILE_FIELDS = ("name", "description", "specs")
SHAPE = ("a mapping with a list 'specs' of fault specs (and, optionally, 'name' and "
         "'description'), as docs/faults.md section 8 shows")


def profile_from_dict(data: dict, source: str) -> Profile:
    """The profile a YAML file's value `data` describes (`source` names the file)."""
    if not isinstance(data, dict):
        what = ("a list (start it with 'specs:' and indent the list under it)"
                if isinstance(data, list) else "empty" if data is None else repr(data))
        raise FaultSpecError(f"{source}: a profile file is {SHAPE}; this one is {what}.")
    unknown = sorted(set(data) - set(PROFILE_FIELDS), key=str)
    if unknown:
        raise FaultSpecError(f"{source}: unknown profile field {unknown[0]!r}; a profile "
                             f"takes {', '.join(PROFILE_FIELDS)}.")
    if "specs" not in data:
        raise FaultSpecError(f"{source}: a profile file is {SHAPE}; this one has no 'specs'.")
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise FaultSpecError(f"{source}: {key} must be text, not {data[key]!r}.")
    specs = data["specs"]
    if specs is not None and not isinstance(specs, list):
        raise FaultSpecError(f"{source}: 'specs' must be a list of fault specs, each "
                             f"starting with '- '.")
    if not specs:
        raise FaultSpecError(f"{source}: the profile has no specs, so it would inject nothing; "
                             f"add a spec, or use suspect.profile=healthy for a healthy node.")
    return Profile(data.get("name", source),
                   tuple(spec_from_dict(s, f"{source}: specs[{i}]") for i, s in enumerate(specs)),
                   data.get("description", ""))
