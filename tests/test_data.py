"""The data pipeline of Ma et al., appendix B.1: tokenize, concatenate, chunk, shuffle once, save;
read batches in order. Everything here runs offline on small files written into tmp_path."""

import json
import time
import zlib

import numpy as np
import pytest

from sdcstudy.core import data
from sdcstudy.core import tokenizer as TK
from sdcstudy.core.config import DataConfig, UserError
from sdcstudy.core.corpus import SYNTHETIC_SEED, synthetic_corpus, synthetic_entropy


def _prepare(tmp_path, seed=0, **kwargs):
    cfg = DataConfig(**kwargs)
    return data.prepare(cfg, seed=seed, cache_dir=tmp_path / "cache")


def _all_rows(path):
    batches = data.TokenBatches(path, batch_size=1, microsteps=1)
    return batches.rows(np.arange(batches.num_sequences))


def _check_rows(path, stream: np.ndarray, seq_len: int, seed: int):
    """The saved rows are the stream's non-overlapping (seq_len + 1)-slices, permuted by seed."""
    row_len = seq_len + 1
    n_rows = len(stream) // row_len
    stream_rows = stream[:n_rows * row_len].reshape(n_rows, row_len)
    rows = _all_rows(path)
    assert rows.shape == (n_rows, row_len) and rows.dtype == np.int32
    permutation = np.random.default_rng(seed).permutation(n_rows)
    assert not np.array_equal(permutation, np.arange(n_rows))  # the check below means something
    np.testing.assert_array_equal(rows, stream_rows[permutation])
    assert data.describe(path)["num_sequences"] == n_rows


# --- synthetic corpus and byte tokenizer -----------------------------------------------------


def test_synthetic_corpus_is_fixed_by_its_seed():
    """Same seed, same text (runs and prepared caches would not be reproducible otherwise)."""
    first = synthetic_corpus(20_000, seed=3)
    assert first == synthetic_corpus(20_000, seed=3)
    assert first != synthetic_corpus(20_000, seed=4)
    assert sum(len(d) + 1 for d in first) >= 20_000
    assert all(d and d.isascii() and "\n" not in d for d in first)
    # A larger corpus extends a smaller one rather than reshuffling it.
    larger = synthetic_corpus(40_000, seed=3)
    assert larger[:len(first)] == first


def test_synthetic_corpus_is_learnable():
    """A tiny byte model must reach well below ln 256 = 5.55 nats; if these fail the generator
    has lost its structure (the measured values are 0.33 nats/byte and about 1.3 bits/byte)."""
    assert synthetic_entropy(100_000, seed=0) < 0.5
    text = ("\n".join(synthetic_corpus(100_000, seed=0)) + "\n").encode()
    assert len(zlib.compress(text, 9)) * 8 / len(text) < 1.6


def test_byte_tokenizer_round_trips_utf8():
    tokenizer = TK.load_tokenizer("byte")
    assert isinstance(tokenizer, TK.ByteTokenizer) and tokenizer.vocab_size == 256
    text = "Grüße, 日本語 and 🙂\ttabs"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) > 127
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(list("é".encode())[:1]) == "\ufffd"  # half a character: replaced
    assert TK.separator_ids(tokenizer) == [10]


# --- prepare ---------------------------------------------------------------------------------

_TEXTS = {
    "a.txt": "First line of a.\n\nSecond line, after a blank one.\nÜnïcödé line ✓\n",
    "b.txt": "b has no trailing newline",
    "sub/c.txt": "\n\nc starts with blank lines\nand has two more\nlines here.\n",
}


def _write_txt_folder(folder):
    for name, text in _TEXTS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text * 7, encoding="utf-8")
    (folder / "README.md").write_text("not corpus\n")
    (folder / ".hidden.txt").write_text("hidden files are skipped\n")


def test_prepare_txt_folder_is_chunked_concatenated_and_shuffled(tmp_path):
    """Lines are documents, blank ones dropped, each ending in b"\\n"; files in sorted order."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_txt_folder(corpus)
    path = _prepare(tmp_path, seed=5, source=str(corpus), seq_len=16)
    stream = b"".join(line.encode() + b"\n" for name in sorted(_TEXTS)
                      for line in (_TEXTS[name] * 7).split("\n") if line)
    assert len(stream) // 17 > 20
    _check_rows(path, np.frombuffer(stream, np.uint8).astype(np.int32), seq_len=16, seed=5)
    info = data.describe(path)
    assert info["dropped_tokens"] == len(stream) % 17 and info["source"] == str(corpus)
    # Another seed: the same rows in another order.
    other = _all_rows(_prepare(tmp_path, seed=6, source=str(corpus), seq_len=16))
    mine = _all_rows(path)
    assert not np.array_equal(other, mine)
    np.testing.assert_array_equal(np.unique(other, axis=0), np.unique(mine, axis=0))


def test_prepare_jsonl_reads_the_text_field(tmp_path):
    records = [{"id": i, "body": f"record {i}: " + "wörds " * (i % 5), "text": "ignored"}
               for i in range(60)]
    records[3]["body"] = ""  # empty documents are dropped
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    path = _prepare(tmp_path, seed=1, source=str(source), text_field="body", seq_len=8)
    stream = b"".join(r["body"].encode() + b"\n" for r in records if r["body"])
    _check_rows(path, np.frombuffer(stream, np.uint8).astype(np.int32), seq_len=8, seed=1)
    assert data.describe(path)["documents"] == 59


def test_prepare_with_a_local_hugging_face_tokenizer(tmp_path):
    """A tokenizer folder from save_pretrained: token ids from it, EOS after every document."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = "the cat sat on a mat and dog ran far".split()
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder = tmp_path / "tokenizer"
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]",
                                         eos_token="</s>").save_pretrained(str(folder))

    loaded = TK.load_tokenizer(str(folder))
    assert loaded(["the cat zebra"], add_special_tokens=False)["input_ids"] == [[2, 3, 0]]
    assert TK.separator_ids(loaded) == [1]

    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words + ["zebra"], size=rng.integers(1, 9))) for _ in range(80)]
    source = tmp_path / "corpus.txt"
    source.write_text("\n".join(lines) + "\n")
    path = _prepare(tmp_path, seed=2, source=str(source), tokenizer=str(folder), seq_len=12)
    stream = np.array([t for line in lines for t in core.encode(line).ids + [1]], np.int32)
    _check_rows(path, stream, seq_len=12, seed=2)
    assert data.describe(path)["vocab_size"] == len(vocab)


def test_prepare_reuses_a_complete_cache_and_keys_it_by_content(tmp_path, monkeypatch):
    source = tmp_path / "corpus.txt"
    source.write_text("some text to tokenize\n" * 50)
    first = _prepare(tmp_path, source=str(source), seq_len=16)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("prepare rebuilt a cache it should have reused")

    with monkeypatch.context() as m:
        m.setattr(data, "_build", no_rebuild)
        assert _prepare(tmp_path, source=str(source), seq_len=16) == first
    # Anything that changes the rows changes the folder.
    assert _prepare(tmp_path, source=str(source), seq_len=8) != first
    assert _prepare(tmp_path, seed=1, source=str(source), seq_len=16) != first
    source.write_text("other text to tokenize\n" * 50)
    assert _prepare(tmp_path, source=str(source), seq_len=16) != first
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")]
    assert not (tmp_path / "cache" / "hf").exists()  # local sources leave no datasets cache


def test_a_crash_while_preparing_leaves_nothing_that_is_reused(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing rows")

    with monkeypatch.context() as m:
        m.setattr(data, "_write_rows", crash)
        with pytest.raises(RuntimeError):
            _prepare(tmp_path, synthetic_tokens=5_000, seq_len=16)
    assert list((tmp_path / "cache").iterdir()) == []
    path = _prepare(tmp_path, synthetic_tokens=5_000, seq_len=16)
    assert data.describe(path)["num_sequences"] == data.describe(path)["tokens"] // 17


def test_prepare_synthetic_matches_the_corpus(tmp_path):
    path = _prepare(tmp_path, seed=7, synthetic_tokens=30_000, seq_len=32)
    text = "".join(d + "\n" for d in synthetic_corpus(30_000, SYNTHETIC_SEED))
    _check_rows(path, np.frombuffer(text.encode(), np.uint8).astype(np.int32), 32, seed=7)


# --- batches ---------------------------------------------------------------------------------


def test_batches_are_a_pure_function_of_the_step_and_wrap_around(tmp_path):
    path = _prepare(tmp_path, seed=0, synthetic_tokens=40_000, seq_len=16)
    batches = data.TokenBatches(path, batch_size=3, microsteps=2)
    n = batches.num_sequences
    assert batches.seq_len == 16 and n == data.describe(path)["num_sequences"]
    # Rows spread over several Arrow record batches, so the chunk lookup is exercised.
    assert len(batches._chunks) > 1

    import datasets

    reference = np.stack(datasets.load_from_disk(str(path)).with_format("numpy")[:]["input_ids"])
    steps_per_epoch = n // 6
    for step in [0, 1, 7, steps_per_epoch, steps_per_epoch + 1, 3 * steps_per_epoch + 5]:
        rows = (step * 6 + np.arange(6)) % n
        expected = reference[rows].reshape(2, 3, 17)
        got = batches.batch(step)
        assert got.dtype == np.int32 and got.shape == (2, 3, 17)
        np.testing.assert_array_equal(got, expected)
        assert batches.epoch(step) == step * 6 // n
    # Out of order, or from a fresh reader (a resumed run), the same step gives the same rows.
    again = data.TokenBatches(path, batch_size=3, microsteps=2)
    np.testing.assert_array_equal(again.batch(5), batches.batch(5))
    # A step whose rows run past the end wraps to the start of the same order.
    wrap_step = next(s for s in range(n) if (s * 6) % n > n - 6)
    first = (wrap_step * 6) % n
    wrapped = batches.batch(wrap_step).reshape(6, 17)
    np.testing.assert_array_equal(wrapped[n - first:], reference[:6 - (n - first)])


def test_batch_is_fast(tmp_path):
    batches = data.TokenBatches(_prepare(tmp_path, synthetic_tokens=40_000, seq_len=64), 8, 2)
    batches.batch(0)
    start = time.perf_counter()
    for step in range(200):
        batches.batch(step)
    assert (time.perf_counter() - start) / 200 < 1e-3


# --- errors a user can make ------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["./no/such/corpus.txt", "/no/such/folder", "corpus.jsonl"])
def test_missing_source_is_a_user_error(tmp_path, missing):
    with pytest.raises(UserError, match="does not exist") as info:
        _prepare(tmp_path, source=missing)
    assert repr(missing) in str(info.value)


def test_jsonl_without_the_text_field_is_a_user_error(tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text('{"body": "text under another name"}\n' * 10)
    with pytest.raises(UserError, match="no field 'text'.*body") as info:
        _prepare(tmp_path, source=str(source))
    assert str(source) in str(info.value)


def test_empty_and_too_small_corpora_are_user_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="holds no text"):
        _prepare(tmp_path, source=str(empty))
    small = tmp_path / "small.txt"
    small.write_text("short\n")
    with pytest.raises(UserError, match="gives 6 tokens, fewer than one row"):
        _prepare(tmp_path, source=str(small), seq_len=64)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")]


def test_missing_tokenizer_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="tokenizer folder .*nope"):
        TK.load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="tokenizer folder"):
        _prepare(tmp_path, tokenizer=str(tmp_path / "nope"), synthetic_tokens=1000)


def test_unreachable_hub_dataset_is_a_user_error(tmp_path, monkeypatch):
    """The tests run offline (conftest), which is exactly what an unreachable hub looks like."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="'wikipedia'.*20220301.en.*Hugging Face Hub"):
        _prepare(tmp_path, source="wikipedia", hub_config="20220301.en")


def test_a_folder_that_was_not_prepared_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="run prepare"):
        data.TokenBatches(tmp_path, batch_size=1, microsteps=1)
