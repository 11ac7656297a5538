"""The one way sdcstudy reads YAML: bounded before any Python object is built.

Configs, fault profiles, model preset files, a golden record's config.yaml and the fleet config
all come through here, and some arrive from other machines and are read as root. So the text
is screened event by event before it is loaded: a file over `MAX_BYTES` is not read, and an
anchor or alias (the "billion laughs": 617 bytes that expand past 4 GB), a tag other than
YAML's plain ones (`!!python/object`, `!!binary`), nesting deeper than `MAX_DEPTH`, more
than `MAX_NODES` values or a key given twice in one mapping end in one `ConfigError` sentence. Only then does the safe loader
build the value, which the screen has bounded to `MAX_NODES` plain values. No config needs an
anchor: write the value out in full. Imports no JAX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sdcstudy.core.errors import ConfigError, first_line

MAX_BYTES = 1 << 20  # 1 MiB: a config is a few KiB, the largest profile a few tens
MAX_NODES = 10_000  # values (scalars, lists, mappings) in one file
MAX_DEPTH = 16  # lists and mappings nested inside each other (a config uses 3, a profile 5)
# The C parser when PyYAML has it (a 1 MiB list: 0.1 s to screen, against seconds in Python).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{name}" for name in
                        ("str", "int", "float", "bool", "null", "seq", "map"))
_NODE_EVENTS = (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent)
_OPEN_EVENTS = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE_EVENTS = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


class InvalidYaml(ConfigError):
    """Text that is not YAML at all (a syntax error), as opposed to YAML that is refused."""


def load_file(path: str | Path, what: str = "YAML file") -> Any:
    """The value of the YAML file at `path`, or a `ConfigError` that names it as `what`."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            data = _read_at_most(f, MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what} {name!r} cannot be read ({first_line(e)}).") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{what} {name!r} is larger than {MAX_BYTES >> 20} MiB, the most "
                          f"sdcstudy reads of a YAML file; give a smaller file.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidYaml(f"{what} {name!r} is not valid YAML (it is not UTF-8 text).") from None
    return load_text(text, f"{what} {name!r}")


def _read_at_most(f, limit: int) -> bytes:
    """At most `limit` bytes of `f`, in chunks (`f.read(limit)` would allocate all of it)."""
    chunks, size = [], 0
    while size < limit and (chunk := f.read(min(1 << 16, limit - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def load_text(text: str, what: str = "YAML text") -> Any:
    """The value of the YAML `text`, screened (`screen`) before it is built."""
    if len(text.encode("utf-8")) > MAX_BYTES:
        raise ConfigError(f"{what} is larger than {MAX_BYTES >> 20} MiB, the most sdcstudy "
                          f"reads of YAML.")
    screen(text, what)
    try:
        return yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as e:
        raise InvalidYaml(f"{what} is not valid YAML ({first_line(e)}).") from None


def screen(text: str, what: str = "YAML text") -> None:
    """Refuse anchors, aliases, tags beyond YAML's plain ones, nesting or value counts past
    the bounds, and a key given twice in one mapping (YAML's loader keeps the last one
    silently: `{rate: 0.1, rate: 0.2}` read as 0.2), reading the parser's events one at a time
    (no value is built)."""
    depth = nodes = 0
    mappings: list[tuple[set, list] | None] = []  # per open collection: keys seen, key next?
    try:
        for event in yaml.parse(text, Loader=_LOADER):
            where = f"line {event.start_mark.line + 1}" if event.start_mark else "somewhere"
            if isinstance(event, yaml.AliasEvent):
                raise ConfigError(f"{what} uses the YAML alias *{event.anchor} ({where}); "
                                  f"sdcstudy reads no anchors or aliases, so write the value out.")
            if not isinstance(event, _NODE_EVENTS):
                if isinstance(event, _CLOSE_EVENTS):
                    depth -= 1
                    mappings.pop()
                continue
            _check_key(mappings[-1] if mappings else None, event, what, where)
            if event.anchor is not None:
                raise ConfigError(f"{what} defines the YAML anchor &{event.anchor} ({where}); "
                                  f"sdcstudy reads no anchors or aliases, so write the value out.")
            if event.tag not in (None, "!") and event.tag not in _PLAIN_TAGS:
                raise ConfigError(f"{what} holds the tag {_short(event.tag)} ({where}); "
                                  f"sdcstudy reads only plain YAML values (strings, numbers, "
                                  f"booleans, null, lists and mappings).")
            nodes += 1
            if nodes > MAX_NODES:
                raise ConfigError(f"{what} holds more than {MAX_NODES} values, the most "
                                  f"sdcstudy reads of a YAML file.")
            if isinstance(event, _OPEN_EVENTS):
                mappings.append((set(), [True]) if isinstance(event, yaml.MappingStartEvent)
                                else None)
                depth += 1
                if depth > MAX_DEPTH:
                    raise ConfigError(f"{what} nests lists or mappings more than {MAX_DEPTH} "
                                      f"deep ({where}), deeper than sdcstudy reads.")
    except yaml.YAMLError as e:
        raise InvalidYaml(f"{what} is not valid YAML ({first_line(e)}).") from None


def _check_key(mapping: tuple[set, list] | None, event, what: str, where: str) -> None:
    """In a mapping, events alternate key and value: refuse a scalar key seen before."""
    if mapping is None:
        return
    seen, key_next = mapping
    if key_next[0] and isinstance(event, yaml.ScalarEvent):
        if event.value in seen:
            raise ConfigError(f"{what} gives the key {event.value!r} twice in one mapping "
                              f"({where}); YAML would keep the last silently: keep one.")
        seen.add(event.value)
    key_next[0] = not key_next[0]


def _short(tag: str) -> str:
    """`!!python/object:os.system` for `tag:yaml.org,2002:python/object:os.system`."""
    prefix = "tag:yaml.org,2002:"
    return "!!" + tag[len(prefix):] if tag.startswith(prefix) else tag


class _PlainDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, less anchors and aliases: a value used twice is written twice, so
    what sdcstudy writes, `load_text` reads back."""

    def ignore_aliases(self, data) -> bool:
        return True


def dump(data: Any, **options) -> str:
    """YAML text of plain data with no anchors or aliases (`yaml.safe_dump` writes `&id001`
    for a list used twice, which `screen` refuses)."""
    return yaml.dump(data, Dumper=_PlainDumper, **options)
