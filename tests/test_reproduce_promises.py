"""Promises of docs/reproduction.md held here: the committed scorecards (docs/scorecards/) are
what today's scoring code writes and judges from what their JSON keeps; a run stopped by a
non-finite loss fails its rows with the reason and is kept by a merge, which copies no
checkpoint and refuses shards of a changed fault zoo; a row too rare for its bursts gives its
counts; a layer without mismatches has no severity events; Figure 10's run row counts the
attention-output faults first. Pure Python but for the stand-in runner's commands (no
compile)."""

import dataclasses
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from report_runs import abft_rows
from test_reproduce import (FakeRunner, entry, fault_rows, lockstep_run, made, paired_run,
                            reproduce, scorecard, with_faults)

from sdcstudy import cli, runner
from sdcstudy.core import runfolder as RF
from sdcstudy.core.train import NonFiniteError
from sdcstudy.faults import published_layers as PL
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import claim_rows as CR
from sdcstudy.reproduce import exposure_rows as X
from sdcstudy.reproduce import mismatch_rows as M
from sdcstudy.reproduce import pass_chance as PC
from sdcstudy.reproduce import plan as P
from sdcstudy.reproduce import scorecard as S
from sdcstudy.reproduce import seed_scatter as SS
from sdcstudy.reproduce import training_rows as TR
from sdcstudy.reproduce.bands import Row

CARDS = Path(S.PAPER_SCALE).parent
# The committed cards that are a scorecard.json as `scorecard.write` wrote it (a card "derived"
# from its markdown, its runs gone, keeps three digits and is not scored again here).
NAMES = [p.stem for p in sorted(CARDS.glob("*.md")) if p.stem != "fault_models"
         and "derived" not in json.loads(p.with_suffix(".json").read_text())]
FIELDS = [f.name for f in dataclasses.fields(Row)]


def committed(name: str) -> tuple[dict, dict, list[Row]]:
    """(scorecard.json, its request as a manifest reads it, its rows as `bands.Row`s)."""
    data = json.loads((CARDS / f"{name}.json").read_text())
    rows = [Row(**{k: r[k] for k in FIELDS}) for r in data["rows"]]
    return data, P.with_defaults(data["request"]), rows


def test_the_committed_scorecards_are_all_here():
    """The cards the page lists; a card added or renamed is checked below too."""
    assert set(NAMES) >= {"tiny", "tiny-flip", "tiny-chosen", "tiny-bf16", "small",
                          "small-lockstep", "small-bf16"}


@pytest.mark.parametrize("name", NAMES)
def test_a_committed_scorecard_is_what_todays_code_writes_from_its_rows(name):
    """scorecard.md is `scorecard.markdown` of the JSON's rows, request and provenance, byte for
    byte; the tallies are today's counts of those rows; every row has today's role (its
    model's calibration sources, fixed by construction where `bands.fixed` says); the rows of
    Figure 10 at the paper's sizes are today's from the committed measurement, the "not
    reproducible here" rows today's, and Figures 5-6's chances today's from the committed
    seed scatter. If this failed, the card was scored by other code than this checkout's
    (score its runs again, docs/reproduction.md "Re-running them") or was edited by hand."""
    data, request, rows = committed(name)
    assert S.markdown(rows, request, data.get("provenance")) == \
        (CARDS / f"{name}.md").read_text()
    assert data["counts"] == S.counts(rows)
    assert data["counts_by_role"] == S.counts_by_role(rows)
    assert (data["unexplained"], data["engine_failures"]) == (S.unexplained(rows),
                                                              S.engine_failures(rows))
    for row in rows:
        role = B.role(row.node, row.source, P.node_model(request, row.node))
        if role == B.HELD_OUT and B.fixed(row):
            role = B.FIXED
        assert row.role == role, (row.node, row.source, row.quantity)

    abft = [{"name": P.run_name(n, "abft"), "node": n, "mode": "abft",
             "fault_model": P.node_model(request, n)}
            for n in request["nodes"] if "abft" in request["modes"]]
    paper = S.paper_scale_rows(abft)
    PC.say_why_none(paper)
    in_card = [r for r in rows if r.quantity.startswith(S.PAPER_ROWS)]
    assert sorted(map(dataclasses.astuple, in_card)) == sorted(map(dataclasses.astuple, paper))
    assert sorted(map(dataclasses.astuple, [r for r in rows if r.verdict == B.NOT_HERE])) == \
        sorted(map(dataclasses.astuple, CR.unscored_rows()))

    measured = [dataclasses.replace(r) for r in rows]
    for row in measured:  # the chances the scatter gave, asked of it again
        if row.source in SS.SOURCES and (row.pass_probability is None
                                         or row.pass_probability_max is not None):
            row.pass_probability = row.pass_probability_max = None
    SS.annotate(measured, SS.by_node(request))
    assert [(r.pass_probability, r.pass_probability_max) for r in measured] == \
        [(r.pass_probability, r.pass_probability_max) for r in rows]


COUNT = re.compile(rf"^(?:(?:{B.EXCESS}|{B.MISSING}): )?(?:the largest of )?(\d+) mismatches")
OLD_BURSTY = re.compile(r"^expected [\d.e+-]+ steps with bursts")  # before the counts


def _count(reason: str) -> int | None:
    """The mismatches a site or layer row's reason gives: "no mismatch ..." is 0."""
    if reason.startswith("no mismatch"):
        return 0
    found = COUNT.match(reason)
    return int(found.group(1)) if found else None


def _rejudged(row: Row, plan_entry: dict, n: int) -> Row:
    """The row as today's `mismatch_rows` judges its numbers (ours, the run's count) under
    today's plan entry."""
    expected = plan_entry["sites"].get(row.quantity.split(" layer ")[0], B.NO_SITE)
    if row.source == "Table 1":
        return M._frequency_row(row.node, row.quantity, row.published, row.ours, n, expected,
                                plan_entry)
    if row.source == "Table 2":
        return M.severity_row(row.node, row.quantity, row.published, row.ours, n, expected,
                              plan_entry)
    site, layer = row.quantity.split(" layer ")
    stat = "freq" if row.source in ("Table 6", "Table 7") else "severity"
    return M._layer_row(row.node, row.source, site, int(layer), stat,
                        PL.layer_range(row.source, row.node, site), row.ours, n, expected,
                        plan_entry["layers"], plan_entry)


def _judged_by_mismatch_rows(row: Row) -> bool:
    """A row of Tables 1, 2 or 6-9 that the run's own numbers judged (not a zero the paper
    published, not at the paper's exposure, not of a run that did not finish)."""
    return (row.source in ("Table 1", "Table 2", "Table 6", "Table 7", "Table 8", "Table 9")
            and row.band not in (B.ZERO_BAND, "-") and not row.quantity.endswith(X.SUFFIX))


def _ran_lockstep(name: str) -> bool:
    return any(r.source == "Table 1" and r.verdict != "not run" for r in committed(name)[2])


@pytest.mark.parametrize("name", [n for n in NAMES if _ran_lockstep(n)])
def test_a_committed_cards_mismatch_rows_are_judged_alike_today(name):
    """Each Table 1, 2 and 6-9 row of a committed card, its value and count judged again by
    today's bands under today's plan (the profiles' expectations): the same verdict, band,
    ratio, expected value and reason, and for the frequencies the same chance. If this
    failed, a band, a count check or a profile's expectation moved since the card was scored:
    score its runs again. (Rows at the paper's exposure: the next test.)"""
    _, request, rows = committed(name)
    plan = {e["node"]: e for e in P.build({**request, "modes": ["lockstep"]})[0]}
    judged = [r for r in rows if _judged_by_mismatch_rows(r) and r.verdict != "not run"]
    assert judged
    for row in judged:
        n = _count(row.reason)
        if n is None:  # a bursty row too rare, scored before its reason gave the counts
            assert OLD_BURSTY.match(row.reason) and row.verdict == B.TOO_RARE, row.reason
            assert plan[row.node]["active_steps"] < B.MIN_ACTIVE_STEPS
            continue
        now = _rejudged(row, plan[row.node], n)
        where = (row.node, row.source, row.quantity)
        assert (now.verdict, now.band, now.ratio, now.expected) == \
            (row.verdict, row.band, row.ratio, row.expected), where
        assert row.reason.split(PC.NO_CHANCE)[0] == now.reason, where
        if row.source in ("Table 1", "Table 6", "Table 7"):
            assert now.pass_probability == row.pass_probability, where


def _additive_exposure_rows(name: str) -> list[Row]:
    """The card's judged or too rare rows at the paper's exposure of additive-model nodes."""
    _, request, rows = committed(name)
    return [r for r in rows if X.is_exposure_row(r) and r.verdict != "not run"
            and P.node_model(request, r.node) == "additive"]


@pytest.mark.parametrize("name", [n for n in NAMES if _additive_exposure_rows(n)])
def test_a_committed_cards_rows_at_the_papers_exposure_are_judged_alike_today(name):
    """Each additive node's Table 2 and Tables 8-9 row at the paper's exposure of a committed
    card has today's band and chance (`EXPOSURE_SPREAD`, `LAYER_EXPOSURE_SPREAD`, the law's
    scatter), and its value today's verdict in it; too rare rows have no value. (The value
    itself, c U / ln 2, needs the runs' units.) If this failed, the band moved since the card
    was scored: score its runs again, and correct the figures this page quotes."""
    for row in _additive_exposure_rows(name):
        if row.source == "Table 2":
            lo, hi, chance = X.site_band(row.published)
        else:
            lo, hi = X.layer_band(row.node, row.quantity.split(" layer ")[0])
            chance = X.layer_pass_probability()
        where = (row.node, row.source, row.quantity)
        assert (row.band, row.pass_probability) == (B.interval(lo, hi), chance), where
        if row.verdict == B.TOO_RARE:
            assert row.ours is None, where
        else:
            assert row.verdict == ("pass" if B.within(row.ours, lo, hi) else "fail"), where


# --- a run stopped by a non-finite loss, merged ---------------------------------------------


class Diverging(FakeRunner):
    """The stand-in runner, whose run `stop` becomes non-finite (as `runner.run` raises it)
    after writing a checkpoint; every other run finishes and leaves a checkpoint, as
    `FakeRunner`'s do."""

    def __init__(self, stop: str):
        super().__init__()
        self.stop = stop

    def __call__(self, cfg, out_dir, **kwargs):
        out_dir = Path(out_dir)
        if out_dir.name == self.stop:
            self.calls.append((out_dir.name, kwargs.get("resume", False)))
            (out_dir / RF.CHECKPOINTS / "2").mkdir(parents=True, exist_ok=True)
            raise NonFiniteError("loss/suspect is nan at step 3")
        return super().__call__(cfg, out_dir, **kwargs)


def test_a_stopped_run_fails_its_rows_with_the_reason_and_a_merge_keeps_it(monkeypatch,
                                                                         tmp_path, capsys):
    """A free run whose loss becomes non-finite is noted in stopped.json, the command goes on
    with the next run, and its row fails with the reason, saying truly why it states no
    chance; --merge keeps that record (the run is neither finished nor "not run"), copies the
    finished runs without their checkpoints and leaves the shards as they were; a shard whose
    plan another fault zoo made is refused in one sentence, nothing written."""
    runs = Diverging("paper-node-1-free")
    monkeypatch.setattr(runner, "run", runs)
    assert reproduce(tmp_path / "s", "--modes", "paramsync,free") == 0
    assert [name for name, _ in runs.calls] == [f"paper-node-{n}-{m}" for n in (1, 14)
                                                for m in ("paramsync", "free")]
    why = "loss/suspect is nan at step 3"
    assert json.loads((tmp_path / "s" / "stopped.json").read_text()) == {
        "paper-node-1-free": why}
    (row,) = [r for r in scorecard(tmp_path / "s") if (r["node"], r["source"]) ==
              (1, "Figure 6")]
    assert row["verdict"] == "fail" and row["pass_probability"] is None
    assert row["reason"] == f"the run stopped: {why}{PC.NO_CHANCE}{S.STOPPED_NO_CHANCE}"
    assert {r["verdict"] for r in scorecard(tmp_path / "s") if (r["node"], r["source"]) ==
            (14, "Figure 6")} != {"fail"}

    capsys.readouterr()
    assert cli.main(["reproduce", "--merge", str(tmp_path / "s"), "--out",
                     str(tmp_path / "m"), "--no-progress"]) == 0
    assert "in none of the merged folders" not in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "stopped.json").read_text()) == {
        "paper-node-1-free": why}
    assert scorecard(tmp_path / "m") == scorecard(tmp_path / "s")
    assert not list((tmp_path / "m" / "runs").glob(f"*/{RF.CHECKPOINTS}"))
    assert len(list((tmp_path / "s" / "runs").glob(f"*/{RF.CHECKPOINTS}"))) == 4

    manifest = json.loads((tmp_path / "s" / "reproduce.json").read_text())
    manifest["plan"][0]["sites"]["fwd/attn"]["mismatches"] *= 2  # a profile changed since
    (tmp_path / "s" / "reproduce.json").write_text(json.dumps(manifest))
    assert reproduce(tmp_path / "t", "--modes", "paramsync,free", "--shard", "1/2") == 0
    assert cli.main(["reproduce", "--merge", str(tmp_path / "t"), str(tmp_path / "s"),
                     "--out", str(tmp_path / "m2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "planned other runs" in err and err.count("\n") == 0, err
    assert not (tmp_path / "m2").exists()


# --- too rare, no events -------------------------------------------------------------------


def test_a_row_too_rare_for_its_bursts_gives_the_observed_and_expected_counts():
    """"too rare for this run, with the observed and expected counts": a bursty profile's row
    (fewer than 30 bursts expected) says how many mismatches it saw and expected, as a row
    with fewer than 100 expected does."""
    steps_with_bursts = entry(active_steps=5.0)
    reason = B.too_rare(steps_with_bursts, 400.0, 371)
    assert reason.startswith("371 mismatches over the run, 400 expected") and "5 steps" in reason
    layer = B.too_rare(steps_with_bursts, 200.0, 0, "in this layer")
    assert layer.startswith("0 mismatches in this layer, 200 expected")
    assert B.too_rare(entry(), 400.0, 371) is None


def test_a_layer_without_a_mismatch_has_no_severity_events():
    """Tables 8-9: "the layer had a mismatch; else no events", as Table 2 at a site; the layer
    beside it, with its mismatches, is judged."""
    freq = {"fwd/ffn": 4e-7}
    rows = M.layer_rows(1, "n", lockstep_run(freq, {"fwd/ffn": 10.0}), entry(expected=made(freq)))
    by = {(r.source, r.quantity): r for r in rows}
    quiet = by[("Table 8", "fwd/attn layer 1")]
    assert (quiet.verdict, quiet.ours, quiet.reason) == ("no events", None,
                                                         "no mismatch in this layer")
    assert by[("Table 8", "fwd/ffn layer 1")].verdict == "pass"


def test_figure10s_run_row_counts_the_attention_output_faults_first():
    """"Event counts first ... Figure 10 the attention-output faults of the ABFT run": 40 of
    them where 2 are expected fail the row as excess events whatever ABFT flagged, faults at
    the other sites do not enter it, and a run where no corruption landed has no events."""
    steps = 10
    checks = abft_rows(steps, 2, 1, lambda step, micro, layer, matmul, direction, rank: False)
    plan = entry(node=1, mode="abft", steps=steps, expected={"fwd/attn": 2.0, "fwd/ffn": 2.0})

    def row(faults, landed=5):
        run = with_faults(paired_run("abft", {"loss": [3.0] * steps}, landed, checks), faults)
        return TR.figure10_row(1, "n", run, plan)

    two = pd.concat([fault_rows([3, 7], site="fwd/attn"), fault_rows([2, 4], site="fwd/ffn")])
    assert row(two).verdict == "pass"
    many = pd.concat([two, fault_rows([5] * 38, site="fwd/attn")])
    assert row(many).verdict == "fail" and B.count_failed(row(many))
    assert "40 attention-output faults where the profile expects 2" in row(many).reason
    assert row(pd.concat([two, fault_rows([5] * 38, site="fwd/ffn")])).verdict == "pass"
    assert row(two, landed=0).verdict == "no events"
