"""Pinned kernel choices (core/determinism.py `autotune_options`, docs/gpu.md): on a GPU the
first compile of a run's step dumps XLA's tuned choices into the run folder, every later one
loads them, env.json records their SHA-256, and a folder whose env.json names them refuses to
run (exit 2, one sentence) when the file is missing or different.

The options are GPU flags, which XLA's CPU compiler never reads, so what is tested here is the
plumbing, with a stand-in file: which option a compile gets, what env.json records, and the
refusal through `sdcstudy run`. Whether XLA honours a loaded file is measured on a GPU by
`sdcstudy accept-gpu` (the `pinned_autotune` check).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sdcstudy.core import determinism as D
from sdcstudy.core import runfolder as RF
from sdcstudy.core.errors import UserError

DUMP, LOAD = D.AUTOTUNE_DUMP_FLAG.lstrip("-"), D.AUTOTUNE_FLAG.lstrip("-")
STAND_IN = b'results { device: "stand-in" }\n'


@pytest.fixture(autouse=True)
def no_autotune_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def pin(run_dir: Path, content: bytes = STAND_IN) -> Path:
    """A run folder as a GPU run leaves it: the dumped file and env.json naming it."""
    run_dir.mkdir(exist_ok=True)
    (run_dir / D.AUTOTUNE_FILE).write_bytes(content)
    env = {"gpu_stack": D.gpu_stack("", run_dir)}
    (run_dir / RF.ENV).write_text(json.dumps(env))
    return run_dir


def test_first_compile_dumps_later_ones_load(tmp_path):
    """A new folder on a GPU gets the dump option (text, in the folder); once the file is
    there, the load option; a process that does not write the folder never dumps; off a GPU
    nothing is added (no other compiler reads them)."""
    pinned = str(tmp_path / D.AUTOTUNE_FILE)
    assert D.autotune_options(tmp_path, "gpu") == {DUMP: pinned}
    assert D.autotune_options(tmp_path, "gpu", dump=False) is None
    assert D.autotune_options(tmp_path, "cpu") is None
    assert pinned.endswith(".txt")  # XLA writes text for .txt: a reviewable diff
    pin(tmp_path)
    assert D.autotune_options(tmp_path, "gpu") == {LOAD: pinned}
    assert D.autotune_options(tmp_path, "gpu", dump=False) == {LOAD: pinned}
    assert D.ENV_FILE == RF.ENV


def test_xla_flags_naming_a_file_win(tmp_path, monkeypatch):
    """A file named in XLA_FLAGS is loaded by XLA itself; the run adds nothing beside it."""
    monkeypatch.setenv("XLA_FLAGS", f"{D.AUTOTUNE_FLAG}=/elsewhere/tuned.txt")
    assert D.autotune_options(tmp_path, "gpu") is None


def test_env_json_records_the_pinned_file(tmp_path):
    """The fingerprint names the folder's file and its SHA-256, so two nodes can compare."""
    pin(tmp_path)
    stack = D.fingerprint(None, tmp_path)["gpu_stack"]
    assert stack["autotune_results_file"] == D.AUTOTUNE_FILE
    assert stack["autotune_results_sha256"] == hashlib.sha256(STAND_IN).hexdigest()
    assert "autotune_results_file" not in D.fingerprint(None, tmp_path / "none")["gpu_stack"]


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_a_missing_or_different_file_is_refused(tmp_path, platform):
    """Where env.json names pinned choices, a missing file or one with another SHA-256 is
    refused on every platform: a run would otherwise pick other kernels without a word."""
    pin(tmp_path)
    (tmp_path / D.AUTOTUNE_FILE).write_bytes(STAND_IN + b"# edited\n")
    with pytest.raises(UserError, match="is not the file the run folder's env.json pinned"):
        D.autotune_options(tmp_path, platform)
    (tmp_path / D.AUTOTUNE_FILE).unlink()
    with pytest.raises(UserError, match="which is missing; copy it back"):
        D.autotune_options(tmp_path, platform)


def test_sdcstudy_run_refuses_with_one_sentence(tmp_path, capsys):
    """Through the command line (its main, in this process): resuming a folder whose pinned
    file was deleted ends with exit 2 and one sentence naming the file and the fix, before
    anything compiles."""
    from sdcstudy import cli

    run_dir = tmp_path / "run"
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    pin(run_dir)
    (run_dir / RF.CONFIG).write_text(config.read_text())
    (run_dir / D.AUTOTUNE_FILE).unlink()
    code = cli.main(["run", str(run_dir / RF.CONFIG), "--out", str(run_dir), "--resume",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdcstudy: error: the run folder's env.json")
    assert D.AUTOTUNE_FILE in lines[0] and lines[0].endswith("start a new run.")
