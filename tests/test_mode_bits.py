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


def test_a_base_made_with_other_packages_or_another_cpu_says_so_before_comparing(
        tmp_path, monkeypatch, capsys):
    # XLA's code, and with it the bits, follow the packages and the CPU: the committed base of
    # c18766d differed from its own tree's bits once the packages were reinstalled
    # (2026-11-30). A record holds its environment, and a comparison names what differs.
    monkeypatch.setattr(MB, "record", _fake_record)
    base = tmp_path / "base.json"
    assert MB.main(["--out", str(base), "--modes", "train"]) == 0
    recorded = json.loads(base.read_text())
    assert recorded[MB.ENVIRONMENT] == MB.environment()
    capsys.readouterr()
    assert MB.main(["--compare", str(base), "--modes", "train"]) == 0
    assert "recorded with" not in capsys.readouterr().err
    recorded[MB.ENVIRONMENT]["packages"]["jax"] = "0.0.1"
    here_cpu = MB.environment()["cpu"]
    recorded[MB.ENVIRONMENT]["cpu"] = {"model": "another CPU", "isa": here_cpu["isa"]}
    base.write_text(json.dumps(recorded))
    assert MB.main(["--compare", str(base), "--modes", "train"]) == 0
    err = capsys.readouterr().err
    here = MB.environment()["packages"]["jax"]
    assert (f"jax 0.0.1 (here {here}), another CPU (model another CPU (here "
            f"{here_cpu['model']}))") in err
    # A field the record lacks (env.json gained it later) is not a difference; one it holds is.
    recorded[MB.ENVIRONMENT] = MB.environment()
    del recorded[MB.ENVIRONMENT]["cpu"]["schedulable_cores"]
    base.write_text(json.dumps(recorded))
    assert MB.main(["--compare", str(base), "--modes", "train"]) == 0
    assert "recorded with" not in capsys.readouterr().err
    recorded[MB.ENVIRONMENT]["cpu"]["cores"] = here_cpu["cores"] + 1
    base.write_text(json.dumps(recorded))
    assert MB.main(["--compare", str(base), "--modes", "train"]) == 0
    assert (f"another CPU (cores {here_cpu['cores'] + 1} (here {here_cpu['cores']}))"
            in capsys.readouterr().err)
    del recorded[MB.ENVIRONMENT]
    base.write_text(json.dumps(recorded))
    assert MB.main(["--compare", str(base), "--modes", "train"]) == 0
    assert "no record of its packages and CPU" in capsys.readouterr().err


def test_a_metric_is_compared_by_its_bits():
    # Metrics are JSON numbers: by value -0.0 equals 0.0 and 1 equals 1.0, which a change of
    # the bits computed can turn one into the other; NaN equals NaN.
    run = {"metrics": [{"step": 1, "loss": 0.0, "grad/norm": float("nan")}]}
    same = json.loads(json.dumps(run))
    assert MB.first_difference(run, same) is None
    signed = {"metrics": [{"step": 1, "loss": -0.0, "grad/norm": float("nan")}]}
    assert MB.first_difference(run, signed) == "/metrics[0]/loss: 0.0 != -0.0"
    whole = {"metrics": [{"step": 1.0, "loss": 0.0, "grad/norm": float("nan")}]}
    assert MB.first_difference(run, whole) == "/metrics[0]/step: 1 != 1.0"
