"""Figures 5-6's chance from the seed-to-seed scatter (`reproduce.seed_scatter`): the share's
Clopper-Pearson bounds, an entry only from one command's folders, the chance set only where
the band is the entry's, the summary counting a measured share as rare only by its upper
bound, and the whole path (reproduce twice, collect, merge) with a fake runner."""

import json
from pathlib import Path

import pytest
from report_runs import write_run

from sdcstudy import cli, runner
from sdcstudy.core import config as C
from sdcstudy.core.errors import UserError
from sdcstudy.dev import seed_scatter as DS
from sdcstudy.faults import published as PB
from sdcstudy.reproduce import bands as B
from sdcstudy.reproduce import pass_chance as PC
from sdcstudy.reproduce import scorecard as S
from sdcstudy.reproduce import scorecard_read as SR
from sdcstudy.reproduce import seed_scatter as SS
from sdcstudy.reproduce.bands import Row


@pytest.mark.parametrize("passed,draws", [(0, 3), (1, 3), (3, 3), (4, 8), (7, 8), (12, 20)])
def test_the_shares_bounds_are_clopper_pearsons(passed, draws):
    lo, hi = PC.lower_bound(passed, draws), PC.upper_bound(passed, draws)
    assert lo <= passed / draws <= hi
    if passed > 0:  # P(X >= passed) at the lower bound is the test's 5%
        assert 1 - B.binomial_below(passed - 1, draws, lo) == pytest.approx(0.05, abs=1e-6)
    else:
        assert lo == 0
    if passed < draws:  # P(X <= passed) at the upper bound is 5% too
        assert B.binomial_below(passed, draws, hi) == pytest.approx(0.05, abs=1e-6)
    else:
        assert hi == 1
    assert PC.upper_bound(0, 3) == pytest.approx(1 - 0.05 ** (1 / 3))


def wcnts_row(ours, node=1, band="[0.0123, 0.111]", verdict=None, chance=None) -> Row:
    verdict = verdict or ("pass" if 0.0123 <= ours <= 0.111 else "fail")
    return Row(node, "Figure 5", "WCNTS", 0.037, ours, ours / 0.037, band, verdict,
               pass_probability=chance)


def request(seed=None, **extra) -> dict:
    overrides = [f"suspect.fault_seed={seed}"] if seed is not None else []
    return {"preset": "tiny", "steps": 200, "dtype": None, "fault_model": "additive",
            "modes": ["paramsync"], "overrides": overrides, **extra}


def test_an_entry_holds_each_seeds_verdict_and_value():
    entry = SS.collect([(request(), [wcnts_row(0.045), wcnts_row(0.02, node=2)]),
                        (request(1), [wcnts_row(0.2), wcnts_row(0.03, node=2)]),
                        (request(2, modes=["paramsync", "free"]), [wcnts_row(0.05)])])
    assert entry["fault_seeds"] == [None, 1, 2] and entry["overrides"] == []
    by_node = {r["node"]: r for r in entry["rows"]}
    assert by_node[1]["verdicts"] == ["pass", "fail", "pass"]
    assert by_node[1]["values"] == [0.045, 0.2, 0.05]
    assert by_node[2]["verdicts"] == ["pass", "pass", None]
    assert SS.share(by_node[1]) == (2, 3) and SS.share(by_node[2]) == (2, 2)


@pytest.mark.parametrize("scored,message", [
    ([(request(), [])], "at least 2"),
    ([(request(), []), (request(1, preset="small"), [])], "other settings"),
    ([(request(), []), (request(1, overrides=["model.dtype=bfloat16"]), [])], "other settings"),
    ([(request(1), []), (request(1), [])], "share a fault seed"),
    ([(request(), [wcnts_row(0.04)]), (request(1), [wcnts_row(0.04, band="[0, 1]")])],
     "has band"),
])
def test_an_entry_is_one_command_with_other_fault_seeds(scored, message):
    with pytest.raises(ValueError, match=message):
        SS.collect(scored)


def test_an_entry_extended_keeps_the_earlier_seeds_not_scored_again():
    """Seeds 1 and 2 scored earlier, their folders gone; the base and seeds 3, 4 scored now:
    the base's new verdict replaces the old, 1 and 2 stay as scored then, after the new ones;
    a row the earlier entry lacks has no verdict there; another band or command is refused."""
    older = SS.collect([(request(), [wcnts_row(0.2)]), (request(1), [wcnts_row(0.04)]),
                        (request(2), [wcnts_row(0.5)])])
    older["scored_by"] = "dd9ad19"
    newer = SS.collect([(request(), [wcnts_row(0.045), wcnts_row(0.02, node=2)]),
                        (request(3), [wcnts_row(0.05), wcnts_row(0.03, node=2)]),
                        (request(4), [wcnts_row(0.3), wcnts_row(0.5, node=2)])])
    entry = SS.extend(older, newer)
    assert entry["fault_seeds"] == [None, 3, 4, 1, 2]
    by_node = {r["node"]: r for r in entry["rows"]}
    assert by_node[1]["verdicts"] == ["pass", "pass", "fail", "pass", "fail"]
    assert by_node[1]["values"] == [0.045, 0.05, 0.3, 0.04, 0.5]
    assert by_node[2]["verdicts"] == ["pass", "pass", "fail", None, None]
    assert entry["kept"] == {"fault_seeds": [1, 2], "scored_by": ["dd9ad19", "dd9ad19"]}
    entry["scored_by"] = "e90354c"
    again = SS.extend(entry, SS.collect([(request(), [wcnts_row(0.046)]),
                                         (request(5), [wcnts_row(0.06)])]))
    assert again["fault_seeds"] == [None, 5, 3, 4, 1, 2]
    assert again["kept"] == {"fault_seeds": [3, 4, 1, 2],
                             "scored_by": ["e90354c", "e90354c", "dd9ad19", "dd9ad19"]}
    assert SS.share(by_node[1]) == (3, 5)
    other_band = SS.collect([(request(), [wcnts_row(0.04, band="[0, 1]")]),
                             (request(5), [wcnts_row(0.04, band="[0, 1]")])])
    with pytest.raises(ValueError, match="has band"):
        SS.extend(older, other_band)
    with pytest.raises(ValueError, match="another command"):
        SS.extend(older, SS.collect([(request(preset="small"), []),
                                     (request(1, preset="small"), [])]))


def test_rows_take_the_entrys_bounds_only_where_their_band_is_its():
    entry = SS.collect([(request(), [wcnts_row(0.045), wcnts_row(0.02, node=2)]),
                        (request(1), [wcnts_row(0.2), wcnts_row(0.03, node=2)]),
                        (request(2), [wcnts_row(0.05), wcnts_row(0.03, node=2)])])
    rows = [wcnts_row(0.045), wcnts_row(0.02, node=2, band="[0.01, 0.1]"),
            wcnts_row(0.04, node=3), wcnts_row(0.04, chance=0.5),
            Row(1, "Table 1", "fwd/attn", 1e-6, 1e-6, 1.0, "[x]", "pass")]
    SS.annotate(rows, {1: entry, 2: entry, 3: entry})
    assert rows[0].pass_probability == pytest.approx(PC.lower_bound(2, 3))
    assert rows[0].pass_probability_max == pytest.approx(PC.upper_bound(2, 3))
    assert rows[1].pass_probability is None  # another band: the seeds did not judge this one
    assert rows[2].pass_probability is None  # no seeds of this node
    assert (rows[3].pass_probability, rows[3].pass_probability_max) == (0.5, None)  # kept
    assert rows[4].pass_probability is None  # not a row the scatter measures
    SS.annotate(rows, None)  # no entry: nothing to do


def test_each_node_takes_the_entry_of_its_own_runs(tmp_path):
    """Under --fault-model chosen a node kept additive ran the additive command's runs and takes
    its entry; a flip node, and the row across nodes of mixed models, take none; an entry of the
    chosen command's own seeds, where there is one, covers every node and that row."""
    path = tmp_path / SS.SCATTER.name
    additive = SS.collect([(request(), [wcnts_row(0.045)]), (request(1), [wcnts_row(0.05)])])
    path.write_text(json.dumps({"schema": SS.SCHEMA, "entries": [additive]}))
    nodes = {"nodes": [1, 2, 10]}
    assert SS.by_node(request(**nodes), path) == {1: additive, 2: additive, 10: additive,
                                                  B.ACROSS_NODES: additive}
    chosen = SS.by_node(request(fault_model="chosen", **nodes), path)
    assert chosen == {2: additive}  # nodes 1 and 10 keep the flip model
    assert SS.by_node(request(fault_model="flip", **nodes), path) == {}
    assert SS.by_node(request(**nodes), tmp_path / "missing.json") == {}
    # seeds of the chosen command itself (small's): every node and the row across nodes
    own = SS.collect([(request(fault_model="chosen"), [wcnts_row(0.04)]),
                      (request(1, fault_model="chosen"), [wcnts_row(0.05)])])
    path.write_text(json.dumps({"schema": SS.SCHEMA, "entries": [additive, own]}))
    assert SS.by_node(request(fault_model="chosen", **nodes), path) == {
        1: own, 2: own, 10: own, B.ACROSS_NODES: own}
    assert SS.by_node(request(**nodes), path)[1] == additive


def test_a_measured_share_is_rare_only_by_its_upper_bound():
    wide = wcnts_row(0.5)  # 0 of 3 seeds pass: at most 0.63, no evidence the band is rare
    wide.pass_probability, wide.pass_probability_max = 0.0, PC.upper_bound(0, 3)
    tight = wcnts_row(0.5, node=2)  # 0 of 80: at most 0.037
    tight.pass_probability, tight.pass_probability_max = 0.0, PC.upper_bound(0, 80)
    exact = wcnts_row(0.5, node=3, chance=0.01)
    words = S.chance_words([wide, tight, exact])
    assert "3 state the chance" in words and "2 failing and 0 passing rows" in words
    assert S.chance_cell(wide) == "0 to 0.63" and S.chance_cell(exact) == "0.01"


# --- the whole path, with a fake runner whose WCNTS moves with the fault seed ------------------


class SeededRunner:
    """Stands in for `runner.run`: a paramsync run whose noise-to-signal ratio is 0.05 under
    fault seeds 0-1 and 0.2 (above node 1's band) under the others, and a free run whose loss
    and gradient norm differ by 0.1% at every step."""

    def __call__(self, cfg, out_dir, *, resume=False, progress=True, echo=print, **_):
        mode, profile, steps = cfg.experiment.mode, cfg.suspect.profile, cfg.experiment.steps
        seed = cfg.suspect.fault_seed or 0
        nts = 0.05 if seed < 2 else 0.2
        metrics = [{"step": s, "loss/healthy": 3.0, "loss/suspect": 3.001,
                    "param/diff_l2": 0.01 * s, "grad/nts": nts, "grad/diff_l2": nts,
                    "grad/norm": 1.0, "grad/norm_suspect": 1.001, "faults/landed": 1,
                    "faults/unlogged": 100} for s in range(1, steps + 1)]
        assert PB.paper_node_number(profile) == 1
        write_run(Path(out_dir), mode=mode, profile=profile, metrics=metrics,
                  summary={"faults/landed": steps, "faults/unlogged": 100 * steps},
                  config=C.to_dict(cfg))  # unlogged: the count check sees a lower bound
        return {"run_dir": str(out_dir)}


@pytest.mark.slow
def test_seeds_collected_then_merged_state_the_figures_chances(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(runner, "run", SeededRunner())
    monkeypatch.setattr(SS, "SCATTER", tmp_path / "scorecards" / SS.SCATTER.name)
    folders = []
    for seed in (None, 1, 2):
        folders.append(tmp_path / f"seed{seed}")
        extra = ["--set", f"suspect.fault_seed={seed}"] if seed is not None else []
        assert cli.main(["reproduce", "--nodes", "1", "--modes", "paramsync,free", "--steps",
                         "6", "--no-progress", "--out", str(folders[-1]), *extra]) == 0
    before = json.loads((folders[0] / S.JSON).read_text())["rows"]
    assert {r["pass_probability"] for r in before if r["source"] == "Figure 5"} == {None}
    capsys.readouterr()
    assert DS.main([*map(str, folders), "--out", str(tmp_path / "scorecards")]) == 0
    out = capsys.readouterr().out
    assert "| WCNTS | [0.0123, 0.111] | 2 of 3 seeds pass" in out, out
    # seed 1's folder "gone": scored again without it, --keep keeps its verdicts as scored
    scatter = tmp_path / "scorecards" / SS.SCATTER.name
    for keep, seeds in ((["--keep"], [None, 2, 1]), ([], [None, 2])):
        assert DS.main([str(folders[0]), str(folders[2]), "--out", str(tmp_path / "scorecards"),
                        *keep]) == 0
        (entry,) = json.loads(scatter.read_text())["entries"]
        assert entry["fault_seeds"] == seeds
    assert DS.main([*map(str, folders), "--out", str(tmp_path / "scorecards")]) == 0
    assert cli.main(["reproduce", "--merge", str(folders[0]), "--out", str(tmp_path / "m"),
                     "--no-progress"]) == 0
    rows = json.loads((tmp_path / "m" / S.JSON).read_text())["rows"]
    wcnts = next(r for r in rows if r["source"] == "Figure 5" and r["quantity"] == "WCNTS")
    assert (wcnts["pass_probability"], wcnts["pass_probability_max"]) == pytest.approx(
        (PC.lower_bound(2, 3), PC.upper_bound(2, 3)))
    text = (tmp_path / "m" / S.MARKDOWN).read_text()
    low, high = PC.lower_bound(2, 3), PC.upper_bound(2, 3)
    assert f"| {low:.2g} to {high:.2g} |" in text
    read = SR.find(SR.read(text), 1, "Figure 5", "WCNTS")
    assert (read["P(pass)"], read["P(pass) max"]) == (float(f"{low:.2g}"), float(f"{high:.2g}"))
    # the same seed twice, or a folder that is not a reproduce folder: one sentence, exit 2
    for argv in ([str(folders[1]), str(folders[1])], [str(folders[0]), str(tmp_path)]):
        capsys.readouterr()
        assert DS.main([*argv, "--out", str(tmp_path / "other")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("seed_scatter: ") and err.count("\n") == 0
        assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("text", ["{not json", "[]", '{"schema": "other/1", "entries": []}',
                                  '{"schema": "sdcstudy-seed-scatter/1", "entries": 3}'])
def test_a_file_that_is_not_a_scatter_is_refused_in_one_sentence(tmp_path, capsys, text):
    """A damaged or foreign seed_scatter.json: `read` refuses it (UserError, one sentence naming
    the file and the command that writes one), and the collector exits 2 before scoring
    anything, leaving the file as it was. If this failed, a traceback would end the collector
    or the scorecard, or the file would be overwritten with one entry."""
    path = tmp_path / SS.SCATTER.name
    path.write_text(text)
    with pytest.raises(UserError, match="is not a seed scatter sdcstudy wrote") as caught:
        SS.read(path)
    assert "\n" not in str(caught.value) and "sdcstudy.dev.seed_scatter" in str(caught.value)
    assert DS.main([str(tmp_path / "no-such-folder"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a seed scatter" in err
    assert path.read_text() == text
