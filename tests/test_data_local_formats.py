"""Local corpora in the forms they come in: C4's own gzipped JSON-lines files, Parquet files and
folders written by `datasets`' save_to_disk give the same prepared rows as the same documents in
a plain .jsonl file, and a bad one ends in one sentence that names it. If a test here fails, a
format was refused, read as another kind (a save_to_disk folder read as two JSON files), or a
damaged file surfaced as a traceback. Everything runs offline on files written into tmp_path.
"""

import gzip
import json

import numpy as np
import pytest

from sdcstudy.core import data
from sdcstudy.core.config import DataConfig, UserError

RECORDS = [{"text": f"document {i}: " + "wörds and more words " * (1 + i % 4),
            "url": f"https://example.invalid/{i}", "timestamp": "2019-04-25T00:00:00Z"}
           for i in range(80)]
RECORDS[5]["text"] = ""  # empty documents are dropped, whatever the format


def _prepare(tmp_path, source, **kwargs):
    cfg = DataConfig(source=str(source), seq_len=16, **kwargs)
    return data.prepare(cfg, seed=3, cache_dir=tmp_path / "cache")


def _rows(path) -> np.ndarray:
    batches = data.TokenBatches(path, batch_size=1, microsteps=1)
    return batches.rows(np.arange(batches.num_sequences))


@pytest.fixture
def plain_rows(tmp_path):
    """The rows of RECORDS written as a plain .jsonl file: what every other form must give."""
    source = tmp_path / "plain.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in RECORDS))
    rows = _rows(_prepare(tmp_path, source))
    assert rows.shape[0] > 20
    return rows


def test_a_gzipped_json_lines_file_as_c4_ships_reads_like_plain_json_lines(tmp_path, plain_rows):
    source = tmp_path / "c4-train.00000-of-01024.json.gz"
    with gzip.open(source, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in RECORDS)
    np.testing.assert_array_equal(_rows(_prepare(tmp_path, source)), plain_rows)
    lines = tmp_path / "corpus.txt.gz"  # gzipped text: a line a document, blank ones dropped
    with gzip.open(lines, "wt", encoding="utf-8") as f:
        f.writelines(r["text"] + "\n" for r in RECORDS)
    np.testing.assert_array_equal(_rows(_prepare(tmp_path, lines)), plain_rows)
    folder = tmp_path / "c4" / "en"  # a folder of such shards
    folder.mkdir(parents=True)
    for shard, part in enumerate((RECORDS[:30], RECORDS[30:])):
        with gzip.open(folder / f"c4-train.{shard:05d}-of-00002.json.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    np.testing.assert_array_equal(_rows(_prepare(tmp_path, folder)), plain_rows)


def test_a_parquet_file_reads_its_text_column(tmp_path, plain_rows):
    pd = pytest.importorskip("pandas")
    source = tmp_path / "corpus.parquet"
    pd.DataFrame(RECORDS).to_parquet(source)
    np.testing.assert_array_equal(_rows(_prepare(tmp_path, source)), plain_rows)


def test_a_save_to_disk_folder_reads_its_rows_and_a_dict_its_split(tmp_path, plain_rows):
    datasets = pytest.importorskip("datasets")
    columns = {key: [r[key] for r in RECORDS] for key in RECORDS[0]}
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(columns).save_to_disk(str(saved))
    np.testing.assert_array_equal(_rows(_prepare(tmp_path, saved)), plain_rows)
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns),
                          "validation": datasets.Dataset.from_dict({"text": ["other"] * 40})}
                         ).save_to_disk(str(splits))
    np.testing.assert_array_equal(_rows(_prepare(tmp_path, splits)), plain_rows)
    with pytest.raises(UserError, match="no split 'test' .*train, validation.*data.split"):
        _prepare(tmp_path, splits, split="test")


def test_a_bad_file_of_each_format_is_one_sentence(tmp_path):
    pd = pytest.importorskip("pandas")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(UserError, match="could not read .*broken.parquet.* as Parquet"):
        _prepare(tmp_path, broken)
    not_gzip = tmp_path / "not-gzip.jsonl.gz"
    not_gzip.write_text('{"text": "plain text under a .gz name"}\n')
    with pytest.raises(UserError, match="could not read .*not-gzip.jsonl.gz"):
        _prepare(tmp_path, not_gzip)
    other_column = tmp_path / "other.parquet"
    pd.DataFrame({"body": ["a document"] * 10}).to_parquet(other_column)
    with pytest.raises(UserError, match="no field 'text' .*body.*data.text_field"):
        _prepare(tmp_path, other_column)
    with pytest.raises(UserError, match="'corpus.json.gz' does not exist"):
        _prepare(tmp_path, "corpus.json.gz")
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("a line\n")
    pd.DataFrame({"text": ["a row"]}).to_parquet(folder / "b.parquet")
    with pytest.raises(UserError, match="mixes parquet and text files"):
        _prepare(tmp_path, folder)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")]


def test_the_prepared_rows_carry_their_fingerprint(tmp_path, plain_rows):
    # What a checkpoint can record to tell that a resume reads the rows the run read: the
    # SHA-256 of the rows in their shuffled order, the same from any form of the same documents
    # and from the same corpus prepared again, another for a corpus that changed.
    import hashlib

    source = tmp_path / "plain.jsonl"
    first = data.TokenBatches(_prepare(tmp_path, source), batch_size=1)
    assert first.fingerprint == hashlib.sha256(plain_rows.astype("<i4").tobytes()).hexdigest()
    again = tmp_path / "again.json.gz"
    with gzip.open(again, "wt") as f:
        f.write(source.read_text())
    assert data.TokenBatches(_prepare(tmp_path, again), batch_size=1).fingerprint == \
        first.fingerprint
    with source.open("a") as f:
        f.write(json.dumps({"text": "one more document at the end of the corpus"}) + "\n")
    assert data.TokenBatches(_prepare(tmp_path, source), batch_size=1).fingerprint != \
        first.fingerprint
