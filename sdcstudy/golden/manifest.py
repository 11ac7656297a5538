"""A golden record's files and manifest: their names, writing the manifest, verifying it, and
refusing a folder that is no usable golden record. Imports no JAX, so a command refuses a wrong
path in a fraction of a second, before any device is touched.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy.core import yamlsafe
from sdcstudy.core.config import UserError

FORMAT = "sdcstudy-golden/1"
MANIFEST, META, ARRAYS, CONFIG, ENV = ("MANIFEST.json", "golden.json", "golden.npz",
                                       "config.yaml", "env.json")
FILES = (CONFIG, ENV, META, ARRAYS)


class GoldenError(Exception):
    """The check cannot be completed (INCONCLUSIVE): damaged golden, other environment, ..."""


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


def verify(golden_dir: Path) -> dict:
    """The manifest, after checking its own checksum and every file's; GoldenError otherwise."""
    golden_dir = Path(golden_dir)
    if not golden_dir.is_dir():
        raise GoldenError(f"golden folder {str(golden_dir)!r} does not exist.")
    try:
        manifest = json.loads((golden_dir / MANIFEST).read_text())
        body, claimed = manifest["body"], manifest["sha256"]
        files = body["files"]
    except FileNotFoundError:
        raise GoldenError(f"{MANIFEST} is missing from {str(golden_dir)!r}.") from None
    except (ValueError, KeyError, TypeError):
        raise GoldenError(f"{MANIFEST} in {str(golden_dir)!r} is damaged (not a golden "
                          f"manifest).") from None
    if hashlib.sha256(_canonical(body)).hexdigest() != claimed:
        raise GoldenError(f"{MANIFEST} in {str(golden_dir)!r} is damaged (its checksum does "
                          f"not match its contents).")
    if body.get("format") != FORMAT:
        raise GoldenError(f"golden record format {body.get('format')!r} is not {FORMAT!r}; "
                          f"record it again with this version.")
    for name in FILES:
        path = golden_dir / name
        if name not in files:
            raise GoldenError(f"{MANIFEST} does not list {name}.")
        if not path.is_file():
            raise GoldenError(f"golden file {name} is missing from {str(golden_dir)!r}.")
        if sha256_file(path) != files[name]["sha256"]:
            raise GoldenError(f"golden file {name} in {str(golden_dir)!r} is damaged (SHA-256 "
                              f"differs from the manifest).")
    return manifest


def load_config(golden_dir: Path) -> C.Config:
    try:
        return C.from_dict(yamlsafe.load_file(Path(golden_dir) / CONFIG, "golden config"))
    except UserError as e:
        raise GoldenError(f"the golden config is not valid here: {e}") from None


def load_meta(golden_dir: Path) -> dict:
    return RF.json_load(Path(golden_dir) / META)


def unusable(golden_dir: Path) -> str | None:
    """Why `golden_dir` cannot be checked against (one sentence), or None when it can: the
    manifest and every file verify, and the config, environment and layout read."""
    try:
        verify(golden_dir)
        load_config(golden_dir)
        RF.json_load(Path(golden_dir) / ENV)
        load_meta(golden_dir)
    except GoldenError as e:
        return str(e)
    except (OSError, ValueError) as e:
        return f"the golden record in {str(golden_dir)!r} cannot be read ({e})."
    return None
