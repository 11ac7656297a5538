"""A run on a local corpus resumes at its exact data position, and a resume whose corpus is gone
is one sentence that changes nothing.

The corpus is a gzipped JSON-lines file as C4 ships (c4-train.*.json.gz); the run is stopped
after step 3 and resumed with its prepared data deleted, so the resume prepares the rows again
from the file. If the first test fails, the data a step reads depends on more than the corpus,
the seed and the step (the preparation is not deterministic, or the position is not the step);
if the second fails, a missing corpus on resume surfaced as a traceback or touched the folder.
"""

import gzip
import json
import shutil

import pytest

from bitwise import bits, state_bits
from sdcstudy import cli, runner
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF

STEPS = 6


def _cfg(corpus, cache):
    return C.from_dict({"experiment": {"steps": STEPS, "batch_size": 2, "checkpoint_every": 2},
                        "optim": {"warmup_steps": 2},
                        "data": {"source": str(corpus), "seq_len": 16,
                                 "cache_dir": str(cache)}})


def _view(run_dir):
    """The metrics, the parameters' digest and the whole final state (parameters, optimizer
    state, step counter) of the last checkpoint, by their bits."""
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in RF.read_jsonl(run_dir / RF.METRICS)]
    return {"metrics": bits(rows), "param_digest": RF.json_load(run_dir / RF.SUMMARY)[
        "param_digest"], **{f"state/{name}": v for name, v in state_bits(run_dir).items()}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("c4") / "c4-train.00000-of-01024.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(120):
            f.write(json.dumps({"text": f"Document {i} says " + "something else " * (i % 7),
                                "url": f"https://example.invalid/{i}"}) + "\n")
    return path


def test_a_run_on_a_local_corpus_resumes_at_its_data_position(corpus, tmp_path):
    cache = tmp_path / "cache"
    whole = tmp_path / "whole"
    runner.run(_cfg(corpus, cache), whole, progress=False)
    split = tmp_path / "split"
    assert runner.run(_cfg(corpus, cache), split, stop_after=3, progress=False)[
        "steps_done"] == 3
    shutil.rmtree(cache)  # the resume prepares the rows again from the file
    runner.run(_cfg(corpus, cache), split, resume=True, progress=False)
    assert _view(split) == _view(whole)
    assert [r["step"] for r in RF.read_jsonl(split / RF.METRICS)] == list(range(1, STEPS + 1))


def test_a_resume_whose_corpus_is_gone_is_one_sentence(corpus, tmp_path, capsys):
    moved = tmp_path / "corpus.json.gz"
    shutil.copy(corpus, moved)
    out = tmp_path / "run"
    runner.run(_cfg(moved, tmp_path / "cache"), out, stop_after=2, progress=False)
    moved.unlink()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = cli.main(["run", str(out / RF.CONFIG), "--out", str(out), "--resume", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"data.source {str(moved)!r} does not exist" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_resume_whose_corpus_was_edited_is_refused(corpus, tmp_path, capsys):
    # The checkpoint holds the prepared rows' fingerprint: a corpus edited since the run
    # started gives other rows, and a resume that trained on them would mix two corpora with
    # exit 0. If this fails, the edit went unnoticed or the refusal touched the folder.
    edited = tmp_path / "corpus.json.gz"
    shutil.copy(corpus, edited)
    out = tmp_path / "run"
    runner.run(_cfg(edited, tmp_path / "cache"), out, stop_after=2, progress=False)
    with gzip.open(edited, "at", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one document more, added after the run started"}) + "\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = cli.main(["run", str(out / RF.CONFIG), "--out", str(out), "--resume", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"the data of {str(out)!r} changed since checkpoint 2" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
