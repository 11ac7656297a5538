"""`python -m sdcstudy.dev.mode_bits`'s comparison, with the runs themselves stood in for (the
real record takes minutes): which modes it compares, and what it says."""

import json

from sdcstudy.dev import mode_bits as MB


def _fake_record(modes, progress=print):
    return {mode: {"param_digest": f"digest of {mode}"} for mode in modes}


def test_a_base_from_before_a_mode_compares_the_others_unless_that_mode_is_asked_for(
        tmp_path, monkeypatch, capsys):
    # A base recorded before `stacks` existed (docs/results holds one) must still compare the
    # nine modes it has, and say it left `stacks` out; asked for by name, `stacks` is a
    # difference (exit 1), and so is any mode whose bits moved.
    monkeypatch.setattr(MB, "record", _fake_record)
    base = tmp_path / "base.json"
    older = [m for m in MB.MODES if m != "stacks"]
    base.write_text(json.dumps(_fake_record(older)))
    assert MB.main(["--compare", str(base)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"identical: {', '.join(older)}" and "left out: stacks" in err
    assert MB.main(["--compare", str(base), "--modes", "train,stacks"]) == 1
    assert capsys.readouterr().out.strip() == f"stacks: not in {base}"
    moved = _fake_record(older)
    moved["free"]["param_digest"] = "another digest"
    base.write_text(json.dumps(moved))
    assert MB.main(["--compare", str(base)]) == 1
    assert capsys.readouterr().out.strip() == (
        "differs: free/param_digest: 'another digest' != 'digest of free'")
