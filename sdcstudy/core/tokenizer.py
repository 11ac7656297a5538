"""Tokenizers for the pretraining data and fine-tuning: UTF-8 bytes, or a Hugging Face
tokenizer saved in a local folder, and the tokens that end every document.

`load_tokenizer(data.tokenizer)` gives a `ByteTokenizer` (vocabulary 256, no special tokens,
documents end with the newline byte 10) or a `transformers` tokenizer read with no network
access (documents end with its `eos_token_id`, nothing if it has none); `encode_batch` turns a
batch of texts into token ids with no special tokens added. `core/data.py` tokenizes the corpus
with them; the cache key of a prepared folder identifies the tokenizer by its files.

This module imports no JAX.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sdcstudy.core.config import UserError
from sdcstudy.core.errors import first_line

NEWLINE = 10  # the byte tokenizer's document separator


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no special tokens; documents end with b"\\n"."""

    vocab_size = 256
    eos_id = None
    separator_ids = (NEWLINE,)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]


def load_tokenizer(name: str):
    """"byte", or a local folder holding a Hugging Face tokenizer (from `save_pretrained`)."""
    if name == "byte":
        return ByteTokenizer()
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise UserError(f"tokenizer folder {name!r} does not exist; set data.tokenizer to "
                        f"\"byte\" or to a folder written by a tokenizer's save_pretrained.")
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # any failure here means the folder is not a usable tokenizer
        raise UserError(f"could not load a Hugging Face tokenizer from {name!r} "
                        f"({first_line(e)}); point data.tokenizer at a folder written by "
                        f"save_pretrained.") from None


def separator_ids(tokenizer) -> list[int]:
    """The tokens that end every document: b"\\n" for bytes, EOS for a Hugging Face tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return list(tokenizer.separator_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return [] if eos is None else [int(eos)]


def encode_batch(tokenizer, texts: list[str]) -> list:
    """Token ids of each text, no special tokens added."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_batch(texts)
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
