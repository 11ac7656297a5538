"""A golden record's files and manifest: their names, writing the manifest, and reading the
files back once each, bounded and checked against the manifest (and against the SHA-256 the
fleet keeps, `--expect-sha`). Imports no JAX, so a command refuses a wrong path in a fraction of
a second, before any device is touched.

The manifest's own checksum only shows damage: whoever can write the folder can write a new
manifest for changed files. `--expect-sha` authenticates the record: the SHA-256 of the
manifest's body (which names every file's SHA-256 and size), kept where the folder's writers
cannot change it, is compared before anything is read. Each file is read once, its size
checked against the manifest before it is read and its SHA-256 computed over the bytes that are
then parsed, so a file changed after the check is never the one used.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.core import yamlsafe
from sdcstudy.core.config import UserError

FORMAT = "sdcstudy-golden/1"
MANIFEST, META, ARRAYS, CONFIG, ENV = ("MANIFEST.json", "golden.json", "golden.npz",
                                       "config.yaml", "env.json")
FILES = (CONFIG, ENV, META, ARRAYS)
# How `golden record` names its folder when it refuses one at once (golden/cli.py, before JAX;
# golden/record.py's lock, core/runlock.py, says the same).
RECORD_FOLDER = "golden folder"
RECORD_HINT = "a golden record is never overwritten: choose another --out"
MiB = 1 << 20
# The most of each file that is read. golden.npz is bounded again, tighter, by what its config
# and golden.json imply (golden/contents.py) before it is read.
MAX_BYTES = {MANIFEST: MiB, CONFIG: yamlsafe.MAX_BYTES, ENV: MiB, META: 16 * MiB,
             ARRAYS: 1 << 30}
_SHA256 = re.compile(r"[0-9a-f]{64}")


class GoldenError(Exception):
    """The check cannot be completed (INCONCLUSIVE): damaged golden, other environment, ..."""


def expect_sha_arg(text: str) -> str:
    """`--expect-sha`: the 64 hexadecimal digits `golden record` prints (any case)."""
    sha = text.strip().lower()
    if not _SHA256.fullmatch(sha):
        raise UserError(f"--expect-sha must be the 64 hexadecimal digits of the manifest SHA-256 "
                        f"that golden record prints, not {text!r}.")
    return sha


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(folder: Path) -> dict:
    body = {"format": FORMAT,
            "files": {name: {"sha256": sha256_file(folder / name),
                             "bytes": (folder / name).stat().st_size} for name in FILES}}
    manifest = {"body": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
    RF.atomic_write_json(folder / MANIFEST, manifest)
    return manifest


def body_sha256(body) -> str:
    """SHA-256 of a manifest's body: what `golden record` prints and `--expect-sha` takes."""
    return hashlib.sha256(_canonical(body)).hexdigest()


def read_manifest(golden_dir: Path, expect_sha: str | None = None) -> dict:
    """The manifest, after checking it against `expect_sha` (when given) and its own checksum;
    every file it must list, each with a size within bounds. GoldenError otherwise."""
    golden_dir = Path(golden_dir)
    where = repr(str(golden_dir))
    if not golden_dir.is_dir():
        what = "is a file, not a folder" if golden_dir.exists() else "does not exist"
        raise GoldenError(f"golden folder {where} {what}.")
    try:
        manifest = json.loads(_read_bounded(golden_dir / MANIFEST, MAX_BYTES[MANIFEST]))
        body, claimed = manifest["body"], manifest["sha256"]
        files = body["files"]
        sizes = {name: files[name]["bytes"] for name in FILES if name in files}
        found = body_sha256(body)
    except FileNotFoundError:
        raise GoldenError(f"{MANIFEST} is missing from {where}.") from None
    except (ValueError, KeyError, TypeError):
        raise GoldenError(f"{MANIFEST} in {where} is damaged (not a golden manifest).") from None
    except OSError as e:
        raise GoldenError(f"{MANIFEST} in {where} cannot be read ({e.strerror}).") from None
    if expect_sha is not None and found != expect_sha:
        raise GoldenError(f"the golden record in {where} has manifest SHA-256 {found}, not the "
                          f"expected {expect_sha}: it was changed or swapped; use the record "
                          f"whose SHA-256 the fleet keeps.")
    if found != claimed:
        raise GoldenError(f"{MANIFEST} in {where} is damaged (its checksum does not match its "
                          f"contents).")
    if body.get("format") != FORMAT:
        raise GoldenError(f"golden record format {body.get('format')!r} is not {FORMAT!r}; "
                          f"record it again with this version.")
    for name in FILES:
        if name not in sizes:
            raise GoldenError(f"{MANIFEST} does not list {name}.")
        size = sizes[name]
        if type(size) is not int or not 0 <= size <= MAX_BYTES[name]:
            raise GoldenError(f"{MANIFEST} in {where} gives {name} a size of {size!r} bytes; "
                              f"at most {MAX_BYTES[name]} are read.")
        if not isinstance(files[name].get("sha256"), str):
            raise GoldenError(f"{MANIFEST} in {where} gives {name} no SHA-256.")
    return manifest


def read_file(golden_dir: Path, manifest: dict, name: str, limit: int | None = None) -> bytes:
    """The bytes of one file of the record, read once: its size as the manifest says (and at
    most `limit`) before it is read, its SHA-256 the manifest's over the bytes returned."""
    path, where = Path(golden_dir) / name, repr(str(golden_dir))
    entry = manifest["body"]["files"][name]
    if limit is not None and entry["bytes"] > limit:
        raise GoldenError(f"golden file {name} in {where} is {entry['bytes']} bytes, more than "
                          f"the {limit} its config and golden.json allow.")
    try:
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise GoldenError(f"golden file {name} in {where} is damaged ({size} bytes, the "
                              f"manifest says {entry['bytes']}).")
        data = _read_bounded(path, entry["bytes"])
    except FileNotFoundError:
        raise GoldenError(f"golden file {name} is missing from {where}.") from None
    except OSError as e:
        raise GoldenError(f"golden file {name} in {where} cannot be read ({e.strerror}).") from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise GoldenError(f"golden file {name} in {where} is damaged (SHA-256 differs from the "
                          f"manifest).")
    return data


def _read_bounded(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of the file (one more shows that it is longer)."""
    with open(path, "rb") as f:
        return f.read(limit + 1)


def verify(golden_dir: Path, expect_sha: str | None = None) -> dict:
    """The manifest, after checking it (`read_manifest`) and every file's size and SHA-256."""
    manifest = read_manifest(golden_dir, expect_sha)
    for name in FILES:
        read_file(golden_dir, manifest, name)
    return manifest


def load_config(golden_dir: Path) -> C.Config:
    """The record's config.yaml as a Config (GoldenError, one sentence, when it is not one)."""
    path = Path(golden_dir) / CONFIG
    try:
        return C.from_dict(yamlsafe.load_file(path, "golden config"))
    except UserError as e:
        raise GoldenError(f"the golden config is not valid here: {e}") from None


def config_from_bytes(data: bytes, golden_dir: Path) -> C.Config:
    """The record's config.yaml, already read, as a Config (GoldenError when it is not one)."""
    what = f"golden config {str(Path(golden_dir) / CONFIG)!r}"
    try:
        return C.from_dict(yamlsafe.load_text(data.decode("utf-8"), what))
    except UnicodeDecodeError:
        raise GoldenError(f"the golden config is not valid here: {what} is not UTF-8 "
                          f"text.") from None
    except UserError as e:
        raise GoldenError(f"the golden config is not valid here: {e}") from None


def json_object(data: bytes, name: str, golden_dir: Path) -> dict:
    """A JSON file of the record that must hold an object (GoldenError when it does not)."""
    where = repr(str(golden_dir))
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise GoldenError(f"golden file {name} in {where} is not valid JSON; record the golden "
                          f"run again.") from None
    if not isinstance(value, dict):
        raise GoldenError(f"golden file {name} in {where} holds a {type(value).__name__}, not "
                          f"the JSON object a golden record writes; record the golden run "
                          f"again.")
    return value
