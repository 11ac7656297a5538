"""docs/config.md is what `sdcstudy.reference` writes, and what it documents is what runs
write: every config key has a meaning, and every metrics.jsonl and summary.json field of a
real tiny run is in its mode's tables."""

import json

import pytest

from sdcstudy import modes, reference, runner
from sdcstudy.core import config as C


def test_page_is_up_to_date():
    assert reference.PAGE.read_text() == reference.render(), \
        f"docs/config.md is out of date; run `{reference.REGENERATE}`"


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(reference.render().replace("| `experiment.steps`", "| `experiment.stepz`"))
    monkeypatch.setattr(reference, "PAGE", stale)
    assert reference.main(["--check"]) == 1
    assert reference.REGENERATE in capsys.readouterr().err
    assert reference.main(["--write"]) == 0 and reference.main(["--check"]) == 0


def test_every_key_has_a_meaning_and_every_mode_is_listed():
    keys = reference.config_keys()
    assert {k for k, *_ in keys} >= {"experiment.mode", "paft.loss.p", "model.d_model"}
    assert [k for k, _, _, meaning in keys if not meaning] == []
    kinds = {k: kind for k, kind, _, _ in keys}
    assert kinds["optim.clip_norm"] == "float | null" and kinds["abft.enabled"] == "bool"
    page = reference.render()
    for name in modes.REGISTRY:
        assert f"### `{name}`" in page
    assert "| `paft.sync_every` | int | `0` |" in page and "| `paft` |" in page


@pytest.mark.parametrize("mode", ["train", "lockstep", "abft"])
def test_real_run_writes_only_documented_fields(tmp_path, mode):
    cfg = C.from_dict({"experiment": {"mode": mode, "steps": 2, "batch_size": 2,
                                      "checkpoint_every": 0},
                       "data": {"seq_len": 16}, "optim": {"warmup_steps": 0},
                       "model": {"n_layers": 1}})  # the fields of two layers are the same
    out = tmp_path / mode
    runner.run(cfg, out, progress=False)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert reference.undocumented(mode, summary, rows) == [], \
        f"{mode}: summary.json or metrics.jsonl fields missing from docs/config.md"
