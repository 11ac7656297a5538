"""The acceptance's `free_step` check (sdcstudy/gpu/free_step.py), on the CPU with its
children replaced: the four runs' environments (the determinism flags off, the first run's
kernel choices loaded and required), the verdict from the two repeats' bits, and a run that
breaks or finds no time reported as no verdict, never a FAIL."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sdcstudy.core.determinism import AUTOTUNE_DUMP_FLAG, AUTOTUNE_FLAG, DETERMINISM_XLA_FLAGS
from sdcstudy.core.determinism import flag_value
from sdcstudy.gpu import checks as GC
from sdcstudy.gpu import floors as GF
from sdcstudy.gpu import free_step as FS
from sdcstudy.gpu import session as GS

H200 = "NVIDIA H200"
DETERMINISM_NAMES = [flag.split("=")[0] for flag in DETERMINISM_XLA_FLAGS
                     if flag.endswith("=true")]


def _acceptance(tmp_path, monkeypatch):
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path / "out", stage="quick", budget=240)
    args.out.mkdir()
    return GC.Acceptance(args, sys.executable, {"device_kind": H200}, tmp_path)


def _fake_runs(acc, monkeypatch, digests: dict, fail: str | None = None):
    """Each child writes its run folder's summary.json (the digest `digests` names, tokens/s
    by run) and the first one the choices its XLA_FLAGS dump to; `fail` names a run that
    crashes."""
    seen = {}

    def sdcstudy(label, argv, cap, env=None, sample=None):
        name = label.removeprefix("free step ")
        folder = argv[argv.index("--out") + 1]
        seen[name] = {"argv": [str(a) for a in argv], "flags": env["XLA_FLAGS"]}
        if name == fail:
            return {"exit_code": 1, "seconds": 2.0, "timed_out": False, "command": []}
        folder.mkdir(parents=True)
        dump = flag_value(env["XLA_FLAGS"], AUTOTUNE_DUMP_FLAG)
        if dump:
            Path(dump).write_text("pinned")
        (folder / "summary.json").write_text(json.dumps({
            "param_digest": digests[name], "tokens_per_s": 300.0 if name == "flags" else 450.0}))
        return {"exit_code": 0, "seconds": 20.0, "timed_out": False, "command": []}

    monkeypatch.setattr(acc, "sdcstudy", sdcstudy)
    return seen


def test_the_free_step_runs_without_the_flags_loads_the_first_choices_and_judges_the_repeats(
        tmp_path, monkeypatch):
    acc = _acceptance(tmp_path, monkeypatch)
    seen = _fake_runs(acc, monkeypatch, {"tuned": "a", "repeat_1": "a", "repeat_2": "a",
                                         "flags": "b"})
    out = acc.free_step()
    assert list(seen) == list(FS.FREE_RUNS)
    choices = tmp_path / FS.FREE_STEP_AUTOTUNE
    pinned = f"{AUTOTUNE_FLAG}={choices}"
    for name in ("tuned", "repeat_1", "repeat_2"):
        assert all(f"{flag}=false" in seen[name]["flags"] for flag in DETERMINISM_NAMES), name
    assert f"{AUTOTUNE_DUMP_FLAG}={choices}" in seen["tuned"]["flags"]
    assert AUTOTUNE_FLAG not in seen["tuned"]["flags"]
    assert all(AUTOTUNE_DUMP_FLAG not in seen[n]["flags"] for n in FS.FREE_RUNS[1:])
    for name in ("repeat_1", "repeat_2"):
        assert pinned in seen[name]["flags"] and FS.REQUIRE_PINNED in seen[name]["flags"]
    assert pinned in seen["flags"]["flags"] and "=false" not in seen["flags"]["flags"]
    for name in FS.FREE_RUNS:  # one model for all four: Pallas attention, sorted gradient
        assert all(s in seen[name]["argv"] for s in FS.FREE_STEP_MODEL), name
    assert out["pass"] is True and out["tuned_run_same_bits"] is True
    assert out["speedup_over_flags"] == pytest.approx(1.5) and out["seconds"] == 80.0


def test_the_free_step_fails_when_the_repeats_differ_and_says_whether_the_tuned_run_did():
    summaries = {name: {"param_digest": digest, "tokens_per_s": 1.0} for name, digest in
                 zip(FS.FREE_RUNS, ("a", "a", "c", "b"))}
    judged = GF.judge_free_step(summaries)
    assert judged["pass"] is False and judged["tuned_run_same_bits"] is True
    summaries["repeat_2"]["param_digest"] = "a"
    summaries["tuned"]["param_digest"] = "t"  # the tuning run may differ: not judged
    judged = GF.judge_free_step(summaries)
    assert judged["pass"] is True and judged["tuned_run_same_bits"] is False
    summaries["repeat_1"]["param_digest"] = summaries["repeat_2"]["param_digest"] = None
    assert GF.judge_free_step(summaries)["pass"] is False


@pytest.mark.parametrize("fail", ["tuned", "repeat_2"])
def test_a_crashed_free_run_is_an_error_never_a_fail(tmp_path, monkeypatch, fail):
    acc = _acceptance(tmp_path, monkeypatch)
    _fake_runs(acc, monkeypatch, dict.fromkeys(FS.FREE_RUNS, "a"), fail=fail)
    out = acc.free_step()
    assert GS.state(out) == "ERROR" and out["error"].startswith(f"{fail}:")


def test_no_pinned_choices_from_the_first_run_is_an_error(tmp_path, monkeypatch):
    acc = _acceptance(tmp_path, monkeypatch)
    _fake_runs(acc, monkeypatch, dict.fromkeys(FS.FREE_RUNS, "a"))
    real = acc.sdcstudy

    def without_pin(label, argv, cap, env=None, sample=None):
        out = real(label, argv, cap, env, sample)
        (tmp_path / FS.FREE_STEP_AUTOTUNE).unlink(missing_ok=True)
        return out

    monkeypatch.setattr(acc, "sdcstudy", without_pin)
    out = acc.free_step()
    assert GS.state(out) == "ERROR" and "pinned no kernel choices" in out["error"]
    assert list(out["runs"]) == ["tuned"]


def test_no_time_left_skips_the_free_step_keeping_the_runs_done(tmp_path, monkeypatch):
    acc = _acceptance(tmp_path, monkeypatch)
    _fake_runs(acc, monkeypatch, dict.fromkeys(FS.FREE_RUNS, "a"))
    real = acc.sdcstudy
    monkeypatch.setattr(acc, "sdcstudy", lambda label, *a, **k: (
        GS.skipped("no time left in --budget") if label.endswith("repeat_2")
        else real(label, *a, **k)))
    out = acc.free_step()
    assert GS.state(out) == "SKIPPED" and list(out["runs"]) == ["tuned", "repeat_1"]


def test_the_free_steps_settings_are_a_valid_config_of_mode_train():
    # A typo in a key would only show on the GPU, whose minutes are scarce.
    from sdcstudy.core import config as C

    preset, batch, seq_len, steps = FS.FREE_STEP
    root = Path(FS.__file__).resolve().parents[2]
    cfg = C.load(root / FS.FREE_STEP_CONFIG, list(FS.free_step_sets()))
    dims = C.model_dims(cfg.model)
    assert (cfg.experiment.mode, cfg.experiment.batch_size, cfg.data.seq_len) == (
        "train", batch, seq_len)
    assert (dims.d_model, dims.attention, dims.embedding_grad) == (768, "pallas", "sorted")
