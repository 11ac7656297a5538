"""`python -m sdcstudy.dev.card_figures`: a committed scorecard's row figures drawn again by this
checkout's code (docs/figures' reproduce-*-wcnts.png and reproduce-tiny-sites.png)."""

import json
from pathlib import Path

import pytest

from sdcstudy.dev import card_figures as CF

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def test_a_committed_scorecard_draws_the_figures_its_rows_hold(tmp_path, capsys):
    card = ROOT / "docs" / "scorecards" / "small.json"
    rows = CF.card_rows(card)
    assert {r.node for r in rows if r.source == "Figure 5"} == {1, 7, 10, 11, 14}
    assert CF.main([str(card), "--out", str(tmp_path), "--prefix", "reproduce-small-"]) == 0
    assert (tmp_path / "reproduce-small-wcnts.png").read_bytes().startswith(PNG)
    # small's scorecard ran no lock-step: no Table 1 or 2 row to draw
    assert [p.name for p in tmp_path.iterdir()] == ["reproduce-small-wcnts.png"]
    assert capsys.readouterr().out.splitlines() == [
        f"wcnts: {tmp_path / 'reproduce-small-wcnts.png'}", "sites: no rows to draw"]


@pytest.mark.parametrize("text, says", [
    (None, "can not be read (No such file or directory)."),
    ("{not json", "is not a scorecard.json"),
    (json.dumps({"rows": [{"node": 1}]}), "is not a scorecard.json"),
    (json.dumps([1, 2]), "is not a scorecard.json")])
def test_a_file_that_is_no_scorecard_is_one_sentence_and_exit_2(tmp_path, capsys, text, says):
    card = tmp_path / "card.json"
    if text is not None:
        card.write_text(text)
    assert CF.main([str(card), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"card_figures: {str(card)!r} ") and \
        says in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("card, figures", [("tiny", ("wcnts", "sites")), ("small", ("wcnts",))])
def test_the_committed_row_figures_are_what_todays_code_draws_from_their_cards(tmp_path, card,
                                                                              figures):
    """docs/figures' reproduce-tiny-wcnts.png, reproduce-tiny-sites.png and
    reproduce-small-wcnts.png are, pixel for pixel, what `card_figures` draws today from the
    committed tiny.json and small.json (docs/reproduction.md). If this failed, the figures
    code or the card moved without the figures: draw them again with the command there."""
    from matplotlib import image

    prefix = f"reproduce-{card}-"
    assert CF.main([str(ROOT / "docs" / "scorecards" / f"{card}.json"), "--out", str(tmp_path),
                    "--prefix", prefix]) == 0
    for kind in figures:
        name = prefix + CF.NAMES[kind]
        drawn, committed = image.imread(tmp_path / name), image.imread(ROOT / "docs" /
                                                                        "figures" / name)
        assert drawn.shape == committed.shape and (drawn == committed).all(), name
