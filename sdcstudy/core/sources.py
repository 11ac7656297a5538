"""Where the documents of `data.source` come from: a local .txt/.jsonl/.json/.parquet file or
folder (text and JSON also gzipped, as C4 ships), a folder of `datasets`' save_to_disk, a
Hugging Face Hub dataset, or the built-in synthetic corpus.

`resolve_source` names the kind of source and the local files it reads, in order (a mistyped
path is a UserError, not a hub name); `load_documents` gives a `datasets.Dataset` with one
document per row and the column that holds its text: a line of a .txt file (the `datasets`
"text" builder), a record of a .jsonl/.json file or a row of a Parquet file, a row of a
saved dataset (a DatasetDict's `data.split`), an example of a hub dataset, or a document of the
synthetic corpus. Hub downloads stay inside the cache folder. Anything unreadable ends
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

_LOCAL_KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_COMPRESSED = ".gz"  # gzip-compressed text or JSON lines (C4's own files: c4-train.*.json.gz)
_READS_AS = {"text": "UTF-8 text", "json": "JSON", "parquet": "Parquet"}
# The files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write at a folder's top level.
_SAVED_MARKS = (("state.json", "dataset_info.json"), ("dataset_dict.json",))
_LOCAL_NAMES = ".txt, .jsonl, .json or .parquet (.txt, .jsonl and .json also gzipped, .gz)"


def _local_kind(path: Path) -> str | None:
    """"text", "json" or "parquet" by the file's name, or None for any other file."""
    name = path.name.lower()
    if name.endswith(_COMPRESSED):
        kind = _LOCAL_KINDS.get(Path(name[:-len(_COMPRESSED)]).suffix)
        return kind if kind != "parquet" else None  # Parquet compresses inside the file
    return _LOCAL_KINDS.get(path.suffix.lower())


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return any(all((path / name).is_file() for name in names) for names in _SAVED_MARKS)


def resolve_source(source: str) -> tuple[str, list[Path]]:
    """("synthetic" | "text" | "json" | "parquet" | "saved" | "hub", local files in the order
    they are read; for "saved", every file of the save_to_disk folder)."""
    if source == "synthetic":
        return "synthetic", []
    path = Path(source).expanduser()
    if path.is_dir() and is_saved_dataset(path):
        return "saved", sorted(p for p in path.rglob("*") if p.is_file())
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _local_kind(p)
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        kinds = {_local_kind(p) for p in files}
        if not files:
            raise UserError(f"folder {source!r} holds no {_LOCAL_NAMES} files and is no "
                            f"folder of datasets' save_to_disk; put the corpus there or point "
                            f"data.source at a file.")
        if len(kinds) > 1:
            raise UserError(f"folder {source!r} mixes {' and '.join(sorted(kinds))} files; "
                            f"keep one kind per folder.")
        return kinds.pop(), files
    if path.is_file():
        if not _local_kind(path):
            raise UserError(f"data.source {source!r} is not a {_LOCAL_NAMES} file; convert it "
                            f"to one of those.")
        return _local_kind(path), [path]
    if source.startswith(("/", ".", "~")) or _local_kind(path):
        raise UserError(f"data.source {source!r} does not exist; give an existing "
                        f"{_LOCAL_NAMES} file or folder, a folder of datasets' save_to_disk, "
                        f"\"synthetic\", or a Hugging Face Hub dataset name.")
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
    elif kind == "saved":
        what = f"{data_cfg.source!r}"
        docs = _load_saved(data_cfg)
    else:
        what = f"{data_cfg.source!r}"
        try:
            docs = datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train",
                                         cache_dir=str(work / "hf"))
        except Exception as e:  # undecodable text, malformed JSON or Parquet, a bad gzip
            raise UserError(f"could not read {what} as {_READS_AS[kind]} ({first_line(e)}); "
                            f"fix or remove the offending file.") from None
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


def _load_saved(data_cfg: DataConfig):
    """The documents of a save_to_disk folder: its Dataset, or a DatasetDict's `data.split`."""
    import datasets

    source = data_cfg.source
    try:
        docs = datasets.load_from_disk(str(Path(source).expanduser()))
    except Exception as e:  # a damaged or partial folder
        raise UserError(f"could not read {source!r} as a folder of datasets' save_to_disk "
                        f"({first_line(e)}); write it again with save_to_disk.") from None
    if isinstance(docs, datasets.DatasetDict):
        if data_cfg.split not in docs:
            raise UserError(f"{source!r} has no split {data_cfg.split!r} (its splits: "
                            f"{', '.join(docs)}); set data.split to one of them.")
        docs = docs[data_cfg.split]
    return docs

