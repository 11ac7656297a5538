"""Where the documents of `data.source` come from: a local .txt/.jsonl/.json file or folder,
a Hugging Face Hub dataset, or the built-in synthetic corpus.

`resolve_source` names the kind of source and the local files it reads, in order (a mistyped
path is a UserError, not a hub name); `load_documents` gives a `datasets.Dataset` with one
document per row and the column that holds its text: a line of a .txt file (the `datasets`
"text" builder), a record of a .jsonl/.json file, an example of a hub dataset, or a document
of the synthetic corpus. Hub downloads stay inside the cache folder. Anything unreadable ends
in one sentence that names the source and the fix.

This module imports no JAX.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from sdcstudy.core.config import DataConfig, UserError
from sdcstudy.core.corpus import SYNTHETIC_SEED, synthetic_corpus
from sdcstudy.core.errors import first_line

_LOCAL_KINDS = {".txt": "text", ".jsonl": "json", ".json": "json"}


def resolve_source(source: str) -> tuple[str, list[Path]]:
    """("synthetic" | "text" | "json" | "hub", local files in the order they are read)."""
    if source == "synthetic":
        return "synthetic", []
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and p.suffix.lower() in _LOCAL_KINDS
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        kinds = {_LOCAL_KINDS[p.suffix.lower()] for p in files}
        if not files:
            raise UserError(f"folder {source!r} holds no .txt, .jsonl or .json files; put the "
                            f"corpus there or point data.source at a file.")
        if len(kinds) > 1:
            raise UserError(f"folder {source!r} mixes .txt and .jsonl/.json files; keep one kind "
                            f"per folder.")
        return kinds.pop(), files
    if path.is_file():
        if path.suffix.lower() not in _LOCAL_KINDS:
            raise UserError(f"data.source {source!r} is not a .txt, .jsonl or .json file; convert "
                            f"it to one of those.")
        return _LOCAL_KINDS[path.suffix.lower()], [path]
    if source.startswith(("/", ".", "~")) or path.suffix.lower() in _LOCAL_KINDS:
        raise UserError(f"data.source {source!r} does not exist; give an existing .txt/.jsonl "
                        f"file or folder, \"synthetic\", or a Hugging Face Hub dataset name.")
    return "hub", []


@contextlib.contextmanager
def _hub_cache_inside(folder: Path):
    """Send hub downloads to `folder` (not ~/.cache/huggingface) while a hub dataset loads:
    `load_dataset(cache_dir=...)` places the built Arrow files, but the raw files come through
    `hf_hub_download`, which reads these two settings."""
    from huggingface_hub import constants

    saved_hub, saved_xet = constants.HF_HUB_CACHE, os.environ.get("HF_XET_CACHE")
    constants.HF_HUB_CACHE = str(folder / "hub")
    os.environ["HF_XET_CACHE"] = str(folder / "xet")
    try:
        yield
    finally:
        constants.HF_HUB_CACHE = saved_hub
        if saved_xet is None:
            os.environ.pop("HF_XET_CACHE", None)
        else:
            os.environ["HF_XET_CACHE"] = saved_xet


def load_documents(data_cfg: DataConfig, kind: str, files: list[Path], root: Path, work: Path):
    """A `datasets.Dataset` with one document per row; returns it and its text column."""
    import datasets

    if kind == "synthetic":
        corpus = synthetic_corpus(data_cfg.synthetic_tokens, SYNTHETIC_SEED)
        return datasets.Dataset.from_dict({"text": corpus}), "text"
    if kind == "hub":
        what = f"dataset {data_cfg.source!r}"
        try:
            with _hub_cache_inside(root / "hf"):
                docs = datasets.load_dataset(data_cfg.source, data_cfg.hub_config,
                                             split=data_cfg.split, cache_dir=str(root / "hf"))
        except Exception as e:  # offline, unknown name, bad config or split: all the user's fix
            raise UserError(
                f"could not load data.source {data_cfg.source!r} (config {data_cfg.hub_config!r}, "
                f"split {data_cfg.split!r}) from the Hugging Face Hub ({first_line(e)}); check "
                f"the name and the network, or give a local .txt/.jsonl file or folder.") from None
    else:
        what = f"{data_cfg.source!r}"
        try:
            docs = datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train",
                                         cache_dir=str(work / "hf"))
        except Exception as e:  # undecodable text, malformed JSON
            raise UserError(f"could not read {what} as {'UTF-8 text' if kind == 'text' else 'JSON'}"
                            f" ({first_line(e)}); fix or remove the offending file.") from None
        if kind == "text":
            return docs, "text"
    field = data_cfg.text_field
    if field not in docs.column_names:
        raise UserError(f"{what} has no field {field!r} (its fields: "
                        f"{', '.join(docs.column_names)}); set data.text_field to the one that "
                        f"holds the text.")
    feature = docs.features[field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise UserError(f"field {field!r} of {what} holds {feature}, not text; set "
                        f"data.text_field to the field that holds the text.")
    return docs, field
