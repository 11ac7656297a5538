"""Pretraining data, as in Ma et al., appendix B.1: tokenize the corpus, concatenate the entire
token stream, chunk it into sequences, shuffle the sequences once with a fixed seed, save them;
training then reads batches in order.

- A document is one row of the source: a line of a .txt file (the `datasets` "text" builder),
  a record of a .jsonl/.json file, a row of a Parquet file or of a save_to_disk folder, an
  example of a hub dataset, or a document of the built-in synthetic corpus. Empty documents
  are dropped.
- Every document's tokens are followed by a separator: the newline byte 10 for the byte
  tokenizer (so the byte stream of a .txt file is the file itself, less its blank lines), and
  `eos_token_id` for a Hugging Face tokenizer (nothing if it has none). Nothing else is added:
  no BOS, no special tokens from the tokenizer's template.
- The stream is cut into rows of `seq_len + 1` tokens (the inputs plus the shifted targets;
  rows do not overlap) and the remainder at the end is dropped.
- The rows are permuted once by `np.random.default_rng(seed).permutation(n)` and saved with
  `Dataset.save_to_disk` in a folder named by a hash of everything that determines them.
- `TokenBatches.batch(step)` is a pure function of the step number, so the data position a
  checkpoint needs is the step number and nothing else; `TokenBatches.fingerprint`, the
  SHA-256 of the rows in their shuffled order, tells whether a resume reads the same rows.

Where the documents come from is `core/sources.py`; the tokenizers are `core/tokenizer.py`.
This module turns the documents into the prepared rows and reads them back by step.

This module imports no JAX.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from sdcstudy.core.config import DataConfig, UserError
from sdcstudy.core.corpus import SYNTHETIC_SEED, SYNTHETIC_VERSION
from sdcstudy.core.sources import load_documents, resolve_source
from sdcstudy.core.tokenizer import encode_batch, load_tokenizer, separator_ids

PIPELINE_VERSION = 1  # bump when a change alters what prepare() writes for the same inputs
COLUMN = "input_ids"
META_FILE = "sdcstudy.json"  # written last, before the atomic rename: its presence = complete
_HASHED_FILE_BYTES = 64 << 20  # tokenizer files larger than this are identified by size/mtime


class _Tokenize:
    """The batched `map` function: drop empty documents, tokenize, append the separator."""

    def __init__(self, tokenizer, text_field: str):
        self.tokenizer, self.text_field = tokenizer, text_field
        self.separator = np.asarray(separator_ids(tokenizer), dtype=np.int32)

    def __call__(self, batch: dict) -> dict:
        texts = [t for t in batch[self.text_field] if t]
        encoded = encode_batch(self.tokenizer, texts)
        return {"ids": [np.concatenate([np.asarray(ids, dtype=np.int32), self.separator])
                        for ids in encoded]}


# --- prepare: source -> tokens -> stream -> rows -> shuffle -> disk ---------------------------


def default_cache_dir(data_cfg: DataConfig) -> Path:
    root = data_cfg.cache_dir or os.environ.get("SDCSTUDY_CACHE") or "~/.cache/sdcstudy/data"
    return Path(root).expanduser()


def _file_identity(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _tokenizer_identity(name: str):
    """"byte", or a hash of the tokenizer folder's files (their contents, if not huge)."""
    if name == "byte":
        return "byte"
    folder = Path(name).expanduser()
    if not folder.is_dir():
        load_tokenizer(name)  # raises the UserError that names the folder
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        if path.stat().st_size <= _HASHED_FILE_BYTES:
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        else:
            digest.update(json.dumps(_file_identity(path)[1:]).encode())
    return {"folder": str(folder.resolve()), "sha256": digest.hexdigest()}


def _identity(data_cfg: DataConfig, kind: str, files: list[Path], seed: int) -> dict:
    """Everything that determines the prepared rows; its hash names the cache folder."""
    if kind == "synthetic":
        source = {"kind": kind, "bytes": data_cfg.synthetic_tokens, "seed": SYNTHETIC_SEED,
                  "version": SYNTHETIC_VERSION}
    elif kind == "hub":
        source = {"kind": kind, "name": data_cfg.source, "config": data_cfg.hub_config,
                  "split": data_cfg.split, "text_field": data_cfg.text_field}
    else:
        source = {"kind": kind, "files": [_file_identity(p) for p in files]}
        if kind in ("json", "parquet", "saved"):
            source["text_field"] = data_cfg.text_field
        if kind == "saved":
            source["split"] = data_cfg.split
    return {"pipeline": PIPELINE_VERSION, "source": source,
            "tokenizer": _tokenizer_identity(data_cfg.tokenizer), "seq_len": data_cfg.seq_len,
            "seed": seed}


def _is_complete(folder: Path) -> bool:
    return (folder / META_FILE).is_file() and (folder / "state.json").is_file()


@contextlib.contextmanager
def datasets_progress(shown: bool):
    """`datasets`' own progress bars (reading, mapping and saving a corpus) shown or not inside
    the block, as before it afterwards: a command run with --no-progress prints none."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if shown else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


def prepare(data_cfg: DataConfig, seed: int, cache_dir: Path | None = None) -> Path:
    """Build (or reuse) the shuffled token rows for `data_cfg`; returns their folder."""
    if data_cfg.seq_len < 1:
        raise UserError(f"data.seq_len must be at least 1, not {data_cfg.seq_len}.")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir(data_cfg)
    kind, files = resolve_source(data_cfg.source)
    identity = _identity(data_cfg, kind, files, seed)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    final = root / f"{kind}-L{data_cfg.seq_len}-s{seed}-{key}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        _build(data_cfg, kind, files, seed, identity, key, root, work)
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final)  # left by hand or by an older version; never by a crash here
        try:
            os.rename(work / "dataset", final)
        except OSError:
            if not _is_complete(final):  # another process may have finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _build(data_cfg, kind, files, seed, identity, key, root: Path, work: Path) -> None:
    """Run the pipeline inside `work`, leaving the finished dataset in `work / "dataset"`."""
    import datasets

    tokenizer = load_tokenizer(data_cfg.tokenizer)
    docs, field = load_documents(data_cfg, kind, files, root, work)
    tokenized = docs.map(
        _Tokenize(tokenizer, field), batched=True, batch_size=1000,
        remove_columns=docs.column_names,
        features=datasets.Features({"ids": datasets.List(datasets.Value("int32"))}),
        cache_file_name=str(work / "tokens.arrow"), load_from_cache_file=False,
        new_fingerprint=key, desc="Tokenizing")
    total = _write_stream(tokenized, work / "stream.int32")
    row_len = data_cfg.seq_len + 1
    n_rows = total // row_len
    if total == 0:
        raise UserError(f"data.source {data_cfg.source!r} holds no text; give a corpus that is "
                        f"not empty.")
    if n_rows == 0:
        raise UserError(f"data.source {data_cfg.source!r} gives {total} tokens, fewer than one "
                        f"row of data.seq_len + 1 = {row_len}; use a larger corpus or a smaller "
                        f"data.seq_len.")
    permutation = np.random.default_rng(seed).permutation(n_rows)
    rows_sha256 = _write_rows(work / "stream.int32", n_rows, row_len, permutation,
                              work / "rows.arrow")
    rows = datasets.Dataset.from_file(str(work / "rows.arrow"))
    rows.save_to_disk(str(work / "dataset"))
    meta = {"num_sequences": n_rows, "seq_len": data_cfg.seq_len, "tokens": n_rows * row_len,
            "stream_tokens": total, "dropped_tokens": total - n_rows * row_len,
            "documents": len(tokenized), "vocab_size": len(tokenizer),
            "separator": separator_ids(tokenizer), "source": data_cfg.source,
            "tokenizer": data_cfg.tokenizer, "seed": seed, "key": key, "identity": identity,
            "rows_sha256": rows_sha256}
    (work / "dataset" / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _write_stream(tokenized, path: Path) -> int:
    """Append every document's tokens to one flat int32 file; returns the token count."""
    total = 0
    with open(path, "wb") as f:
        for table in tokenized.with_format("arrow").iter(batch_size=10_000):
            for chunk in table.column("ids").chunks:
                values = chunk.flatten().to_numpy().astype(np.int32, copy=False)
                values.tofile(f)
                total += len(values)
    return total


def _write_rows(stream_path: Path, n_rows: int, row_len: int, permutation: np.ndarray,
                path: Path) -> str:
    """Write row `permutation[j]` of the stream as row j of an Arrow file, in bounded memory;
    returns the SHA-256 of the rows in that order (little-endian int32), their fingerprint."""
    import datasets
    import pyarrow as pa

    stream_NR = np.memmap(stream_path, dtype=np.int32, mode="r",
                          shape=(n_rows * row_len,)).reshape(n_rows, row_len)
    features = datasets.Features({COLUMN: datasets.List(datasets.Value("int32"),
                                                        length=row_len)})
    schema = features.arrow_schema
    rows_per_batch = max(1, (4 << 20) // row_len)
    digest = hashlib.sha256()
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for start in range(0, n_rows, rows_per_batch):
            rows = np.ascontiguousarray(stream_NR[permutation[start:start + rows_per_batch]])
            digest.update(rows.astype("<i4", copy=False).tobytes())
            column = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), row_len)
            writer.write_batch(pa.record_batch([column], schema=schema))
    del stream_NR
    return digest.hexdigest()


def describe(path) -> dict:
    """What `prepare` recorded about a prepared folder: sizes, source, tokenizer, seed."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise UserError(f"{str(path)!r} is not a folder written by sdcstudy's data.prepare; "
                        f"run prepare to create it.")
    return json.loads(meta_path.read_text())


# --- reading batches -------------------------------------------------------------------------


class TokenBatches:
    """Batches of the prepared rows, read in their one fixed shuffled order.

    Optimizer step `step` gets rows `(step * microsteps + m) * batch_size + i` (modulo the
    number of rows: running past the end starts a new epoch in the same order), shaped
    (microsteps, batch_size, seq_len + 1). A pure function of `step`: a checkpoint records the
    data position as the step number. The rows are memory-mapped, not copied.
    """

    def __init__(self, path, batch_size: int, microsteps: int = 1):
        import datasets

        if batch_size < 1 or microsteps < 1:
            raise ValueError(f"batch_size and microsteps must be positive, "
                             f"not {batch_size} and {microsteps}")
        self.path = Path(path)
        if not _is_complete(self.path):
            raise UserError(f"{str(path)!r} is not a folder written by sdcstudy's data.prepare; "
                            f"run prepare to create it.")
        self.batch_size, self.microsteps = batch_size, microsteps
        self._dataset = datasets.load_from_disk(str(self.path)).with_format("numpy")
        column = self._dataset.data.column(COLUMN)
        row_len = column.type.list_size
        self._chunks = [chunk.flatten().to_numpy().reshape(-1, row_len)
                        for chunk in column.chunks if len(chunk)]
        self._starts = np.cumsum([0] + [len(c) for c in self._chunks])
        self.num_sequences = int(self._starts[-1])
        self.seq_len = row_len - 1
        # The rows' SHA-256 in their shuffled order, which the batches of every step follow
        # from; None for a folder prepared before prepare recorded it.
        self.fingerprint = describe(self.path).get("rows_sha256")

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.microsteps

    def epoch(self, step: int) -> int:
        """The epoch (0-based) of the first row of `step`."""
        return step * self.rows_per_step // self.num_sequences

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Rows by their position in the shuffled order, as a fresh int32 array."""
        if len(self._chunks) == 1:
            return self._chunks[0][index]
        which = np.searchsorted(self._starts, index, side="right") - 1
        out = np.empty((len(index), self.seq_len + 1), np.int32)
        for c in np.unique(which):
            selected = which == c
            out[selected] = self._chunks[c][index[selected] - self._starts[c]]
        return out

    def batch(self, step: int) -> np.ndarray:
        """int32 (microsteps, batch_size, seq_len + 1) for optimizer step `step`."""
        if step < 0:
            raise ValueError(f"step must be non-negative, not {step}")
        first = step * self.rows_per_step % self.num_sequences
        index = (first + np.arange(self.rows_per_step)) % self.num_sequences
        return self.rows(index).reshape(self.microsteps, self.batch_size, self.seq_len + 1)
