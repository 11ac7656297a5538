"""The paired harness end to end: healthy pairs agree exactly, mismatches equal the injected
ground truth, summary aggregates follow docs/metrics.md's formulas, synchronization is exact,
and the healthy node trains as one device does."""

import contextlib
import io
import math

import jax
import numpy as np
import pandas as pd
import pytest

import sdcstudy
from sdcstudy.core import config as C
from sdcstudy.core import data as D
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL
from sdcstudy import modes, runner
from sdcstudy.core import stats, train
from sdcstudy.paired.lockstep import SITE_NAMES

# tp=2 and dp=2 on both nodes (8 simulated devices), two microsteps: every axis of the
# statistics blocks is exercised.
BASE = {"experiment": {"steps": 3, "batch_size": 4, "microsteps": 2, "checkpoint_every": 0},
        "mesh": {"tp": 2, "dp": 2}, "optim": {"warmup_steps": 1}, "data": {"seq_len": 32}}

# Faults at the four compared sites, disjoint per (site, layer) so that no element is hit twice.
SITE_PROFILE = """\
name: four-sites
description: faults at the outputs of the four compared sites
specs:
  - {site: fwd/attn, kind: bitflip, count: 3, bit_class: any}
  - {site: fwd/ffn, kind: bitflip, rate: 2.0e-3, bit_class: exponent, layers: [1]}
  - {site: fwd/ffn, kind: nan, count: 1, layers: [2], pattern: {kind: steps, steps: [2]}}
  - {site: bwd/attn, kind: random, count: 2, value_std: 3.0}
  - {site: bwd/ffn, kind: bitflip, rate: 1.0e-3, bit_class: mantissa, tp_ranks: [1]}
"""

# A fault inside the FFN: lock-step repairs the FFN output, but the weight gradients of the
# down projection already saw the corrupted activation, so the states differ before the sync.
INNER_PROFILE = """\
name: inner
specs:
  - {site: fwd/ffn_act, kind: scale, count: 4, scale: [10.0, 100.0]}
"""


def _cfg(*overrides):
    return C.from_dict(BASE, list(overrides))


def _write_profile(tmp_path, text, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def _metric_rows(run_dir):
    return RF.read_jsonl(run_dir / RF.METRICS)


# The healthy pairs and their plain run have one layer (the faulty run keeps two, for the
# statistics' average over layers): one layer compiles in half the time and shows as much.
ONE_LAYER = "model.n_layers=1"


@pytest.fixture(scope="module", params=["lockstep", "paramsync", "free"])
def healthy_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("healthy") / request.param
    shown = io.StringIO()
    with contextlib.redirect_stderr(shown):
        summary = runner.run(_cfg(f"experiment.mode={request.param}", ONE_LAYER), out,
                             progress=True)
    (out.parent / "stderr.txt").write_text(shown.getvalue())
    return request.param, out, summary


def test_the_step_bar_shows_the_suspects_loss_beside_the_healthy_one(healthy_run):
    # A suspect gone NaN in a free run showed nowhere on the terminal until it was over.
    mode, out, _ = healthy_run
    last = _metric_rows(out)[-1]
    bar = (out.parent / "stderr.txt").read_text().split("\r")[-1]
    assert f"loss={last['loss/healthy']:.3f}, suspect={last['loss/suspect']:.3f}" in bar, bar


def test_healthy_pair_agrees_exactly(healthy_run):
    mode, out, summary = healthy_run
    rows = _metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["grad/diff_l2"] == 0.0 and r["param/diff_l2"] == 0.0 and r["grad/nts"] == 0.0
        assert r["loss/suspect"] == r["loss/healthy"]
        assert r["grad/norm_suspect"] == r["grad/norm"] > 0
    assert summary["wcnts"] == 0.0 and summary["param/diff_l2"] == 0.0
    assert summary["grad/nonfinite_steps"] == 0 and summary["grad/first_nonfinite_step"] is None
    assert summary["loss_spikes"] == []
    if mode == "lockstep":
        mismatch = TL.read_table(out / RF.MISMATCH)
        # every (step, microstep, layer, site, tp_rank) has a row, and none has a mismatch
        assert len(mismatch) == 3 * 2 * 1 * 4 * 2  # steps, microsteps, layers, sites, tp
        assert mismatch["mismatches"].sum() == 0 and (mismatch["elements"] > 0).all()
        assert summary["freq"] == {site: 0.0 for site in SITE_NAMES}


# The paired program against the plain one: the same training summed in another order (tp
# splits the matmuls, dp the batch), so equal within float32 reassociation, not bit for bit.
# Measured on CPU over 15 steps: every mode within 2e-6 relative of one device with two
# layers, within 1.4e-7 with the one layer here.
PLAIN_RTOL = 2e-6


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The healthy runs' training on one device, by the plain trainer (mode `train`)."""
    out = tmp_path_factory.mktemp("plain") / "train"
    runner.run(_cfg("experiment.mode=train", "mesh.tp=1", "mesh.dp=1", ONE_LAYER), out,
               progress=False)
    return _metric_rows(out)


def test_healthy_node_trains_as_the_plain_trainer(healthy_run, plain_run):
    # Node 0 agreeing with node 1 proves nothing when both are wrong: the healthy node must
    # train as one device does. A gradient summed over dp or tp ranks instead of averaged, a
    # lost tensor-parallel reduction or a wrong update fails the gradient norms, or the losses
    # after the first non-zero learning rate (step 2 here; step 3's loss is after it).
    mode, out, _ = healthy_run
    rows = _metric_rows(out)
    assert [r["lr"] for r in rows] == [r["lr"] for r in plain_run] and rows[1]["lr"] > 0
    for key in ("loss/healthy", "grad/norm"):
        np.testing.assert_allclose([r[key] for r in rows], [r[key] for r in plain_run],
                                   rtol=PLAIN_RTOL, err_msg=f"{mode}: {key}")


@pytest.fixture(scope="module")
def faulty_lockstep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faulty")
    profile = _write_profile(tmp, SITE_PROFILE, "four-sites")
    out = tmp / "run"
    summary = runner.run(_cfg("experiment.mode=lockstep", f"suspect.profile={profile}"), out,
                         progress=False)
    return out, summary


KEYS = ["step", "microstep", "layer", "site", "tp_rank"]


def test_mismatches_equal_the_injected_ground_truth(faulty_lockstep):
    out, summary = faulty_lockstep
    run = sdcstudy.load_run(out)
    faults, mismatch = run.faults, run.mismatch
    assert list(mismatch.columns) == list(TL.MISMATCH_COLUMNS)
    assert list(faults.columns) == list(TL.FAULT_COLUMNS)
    assert set(faults["node"]) == {1} and set(faults["site"]) == set(SITE_NAMES)
    assert faults["microstep"].isin([0, 1]).all()
    truth = faults.groupby(KEYS).size().rename("injected")
    found = mismatch.set_index(KEYS)["mismatches"]
    joined = pd.concat([truth, found], axis=1).fillna(0)
    # every corruption is found where it was made, and nothing else is
    assert (joined["injected"] == joined["mismatches"]).all(), joined[
        joined["injected"] != joined["mismatches"]]
    assert joined["injected"].sum() == len(faults) == summary["faults/landed"]
    assert sum(summary["mismatches"].values()) == len(faults)
    # the NaN at fwd/ffn layer 2, step 2 (and any exponent flip that made an Inf or NaN) is
    # counted as non-finite, where it was made
    assert (faults["kind"] == "nan").sum() == 2 * 2 * 2  # per microstep, dp worker, tp rank
    # each row names the device it struck: one NaN on each (microstep, dp rank, tp rank)
    nan_at = faults[faults["kind"] == "nan"].groupby(["microstep", "dp_rank", "tp_rank"]).size()
    assert len(nan_at) == 8 and (nan_at == 1).all()
    bad = faults[~np.isfinite(faults["corrupted"])].groupby(KEYS).size()
    nonfinite = mismatch.set_index(KEYS)["nonfinite"]
    assert (nonfinite[nonfinite > 0] == bad.reindex(nonfinite[nonfinite > 0].index)).all()
    assert nonfinite.sum() == bad.sum() == sum(summary["nonfinite"].values())


def _severity_from_faults(group):
    original = group["original"].to_numpy()
    corrupted = group["corrupted"].to_numpy()
    finite = np.isfinite(corrupted) & np.isfinite(original)
    denominator = np.where(original == 0, stats.smallest_normal(np.float32), np.abs(original))
    relative = np.abs(corrupted - original)[finite] / denominator[finite]
    return relative.mean() if relative.size else 0.0


def test_row_severity_equals_the_injected_relative_errors(faulty_lockstep):
    # dp workers of one tp rank share a row, so group the ground truth the same way
    out, _ = faulty_lockstep
    faults = TL.read_table(out / RF.FAULTS)
    rows = TL.read_table(out / RF.MISMATCH).set_index(KEYS)
    expected = faults.groupby(KEYS).apply(_severity_from_faults, include_groups=False)
    got = rows.loc[expected.index, "severity"]
    np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-5)
    assert (rows.drop(expected.index)["severity"] == 0).all()


def test_summary_aggregates_follow_the_formulas(faulty_lockstep):
    out, _ = faulty_lockstep
    summary = RF.json_load(out / RF.SUMMARY)
    mismatch = TL.read_table(out / RF.MISMATCH)
    for site in SITE_NAMES:
        rows = mismatch[mismatch["site"] == site]
        freqs, severities = [], []
        for (step, micro), at in rows.groupby(["step", "microstep"]):
            # eq. (1)-(2): per layer sum over tp ranks, divide, then average over layers
            per_layer = [layer_rows["mismatches"].sum() / layer_rows["elements"].sum()
                         for _, layer_rows in at.groupby("layer")]
            freqs.append(np.mean(per_layer))
            severities.append(at["severity"].max())  # eq. (3)-(4)
        assert summary["freq"][site] == pytest.approx(np.mean(freqs), rel=1e-12)
        assert summary["max_severity"][site] == pytest.approx(max(severities), rel=1e-12)
        assert summary["freq"][site] > 0
    hist = summary["bit_histogram"]
    assert set(hist) == set(SITE_NAMES) and all(len(h["bits"]) == 32 for h in hist.values())
    # bwd/ffn only has mantissa flips; fwd/ffn layer 1 only exponent flips (+ NaN patterns)
    assert hist["bwd/ffn"]["exponent"] == hist["bwd/ffn"]["sign"] == 0
    assert hist["bwd/ffn"]["mantissa"] == summary["mismatches"]["bwd/ffn"]
    assert sum(hist["fwd/attn"]["bits"]) == summary["mismatches"]["fwd/attn"]


def test_lockstep_repairs_four_site_faults_before_any_weight_gradient(faulty_lockstep):
    # Why a lock-step run's WCNTS is not Figure 5's (docs/metrics.md): a fault at one of the
    # four compared sites is repaired before any weight gradient reads it, so the gradients of
    # the two nodes stay equal bit for bit however many faults land there. A tap that repaired
    # too late, or a weight gradient taken from the suspect's unrepaired tensor, fails this.
    out, summary = faulty_lockstep
    rows = _metric_rows(out)
    assert sum(r["faults/landed"] for r in rows) > 0
    assert all(r["grad/diff_l2"] == 0.0 and r["grad/norm_suspect"] == r["grad/norm"]
               for r in rows)
    assert summary["wcnts"] == 0.0 and summary["grad/nonfinite_steps"] == 0


def _drive(cfg, steps):
    """The compiled paired step, step by step, without the host loop."""
    trainer = modes.build(cfg).trainer
    e = cfg.experiment
    batches = D.TokenBatches(D.prepare(cfg.data, e.seed), e.batch_size, e.microsteps)
    state = trainer.init_state()
    example = trainer.make_batch(batches.batch(0))
    shardings = trainer.shardings(state, example)
    step_fn, _, _ = train.compile_step(trainer.train_step, state, example, shardings)
    for step in range(steps):
        batch = jax.device_put(trainer.make_batch(batches.batch(step)), shardings[1])
        state, metrics, *_ = step_fn(state, batch)
        yield jax.device_get(state), {k: float(v) for k, v in jax.device_get(metrics).items()}


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


@pytest.mark.parametrize("mode", ["lockstep", "paramsync"])
def test_synchronized_states_are_bitwise_equal_after_every_step(mode, tmp_path):
    path = _write_profile(tmp_path, INNER_PROFILE, "p")
    diverged = []
    for state, metrics in _drive(_cfg(f"experiment.mode={mode}", f"suspect.profile={path}",
                                      "mesh.dp=1", "model.n_layers=1"), 3):
        for leaf in jax.tree.leaves({"params": state["params"], "opt": state["opt_state"]}):
            assert np.array_equal(_bits(leaf[0]), _bits(leaf[1]))
        diverged.append(metrics["param/diff_l2"])
        assert metrics["grad/diff_l2"] > 0 and math.isfinite(metrics["grad/nts"])
    # before the sync the suspect had really diverged, so a missing overwrite would show (the
    # first step's warm-up learning rate is 0: only the optimizer moments differ there)
    assert all(d > 0 for d in diverged[1:])


def test_free_running_diverges_and_keeps_diverging(tmp_path):
    path = _write_profile(tmp_path, INNER_PROFILE, "p")
    diffs = [m["param/diff_l2"] for _, m in _drive(
        _cfg("experiment.mode=free", f"suspect.profile={path}", "mesh.dp=1",
             "model.n_layers=1"), 3)]
    assert diffs[0] == 0 < diffs[1] and diffs[-1] > 0  # step 1: warm-up learning rate 0
