"""The trainer: learning, gradient accumulation, optimizers, resume bit for bit, bad input."""

import hashlib
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitwise import bits, state_bits
from sdcstudy import cli
from sdcstudy.core import config as C
from sdcstudy.core import runfolder as RF
from sdcstudy import runner
from sdcstudy.core import train

BASE = {"experiment": {"steps": 12, "batch_size": 4, "microsteps": 2, "checkpoint_every": 4},
        "optim": {"warmup_steps": 3}, "data": {"seq_len": 32}}


def _cfg(*overrides, base=BASE):
    return C.from_dict(base, list(overrides))


def _view(run_dir):
    """Everything of a run that must be bitwise reproducible (wall-clock times excluded): the
    metrics, the parameters' digest and the whole final state (parameters, Adam's moments, step
    counter) of its last checkpoint, by their bits."""
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in RF.read_jsonl(run_dir / RF.METRICS)]
    return {"metrics": bits(rows), "param_digest": RF.json_load(run_dir / RF.SUMMARY)[
        "param_digest"], **{f"state/{name}": v for name, v in state_bits(run_dir).items()}}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "full"
    runner.run(_cfg(), out, progress=False)
    return out


def test_resume_is_bitwise_identical(uninterrupted, tmp_path):
    # Stopped at step 5 (between checkpoints 4 and 8: the stop itself checkpoints) and resumed
    # to 12, metrics, parameters and optimizer state must equal the uninterrupted run bit for
    # bit. If this fails, something the step depends on (data position, schedule, RNG) is not
    # a function of the checkpointed state, or the checkpoint restored a part of it wrong.
    out = tmp_path / "split"
    first = runner.run(_cfg(), out, stop_after=5, progress=False)
    assert first["steps_done"] == 5
    runner.run(_cfg(), out, resume=True, progress=False)
    assert _view(out) == _view(uninterrupted)
    assert [r["step"] for r in RF.read_jsonl(out / RF.METRICS)] == list(range(1, 13))


def test_resume_after_lost_metrics_rewinds_to_the_checkpoint(uninterrupted, tmp_path):
    # A crash after step 6 leaves metrics for steps 5-6 but a checkpoint only at 4: the resumed
    # run must redo 5-6 and still end identical, with no duplicate rows.
    out = tmp_path / "crash"
    runner.run(_cfg(), out, stop_after=6, progress=False)
    shutil.rmtree(out / RF.CHECKPOINTS / "6")
    runner.run(_cfg(), out, resume=True, progress=False)
    assert _view(out) == _view(uninterrupted)


def test_a_run_shows_its_compile_before_its_steps(uninterrupted, tmp_path, capsys):
    # Compiling is most of a short run on the CPU: the run shows a line counting its seconds
    # before the step bar starts, and the run is the same for it.
    out = tmp_path / "shown"
    shutil.copytree(uninterrupted, out)
    (out / RF.SUMMARY).unlink()
    shutil.rmtree(out / RF.CHECKPOINTS / "12")  # resumes from 8: steps 9-12 run again
    runner.run(_cfg(), out, resume=True, progress=True)
    err = capsys.readouterr().err
    assert "train: preparing and compiling the step: 00:" in err
    assert err.index("train: preparing and compiling the step") < err.index("12/12")
    assert _view(out) == _view(uninterrupted)


def test_resume_refuses_another_config(uninterrupted, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted, out)
    config_path = out / RF.CONFIG
    code = cli.main(["run", str(config_path), "--out", str(out), "--resume",
                     "--set", "optim.lr=0.5", "--no-progress"])
    assert code == 2 and "optim.lr" in capsys.readouterr().err


def test_resume_may_change_how_the_run_keeps_checkpoints(uninterrupted, tmp_path):
    # Settings that change no bit (checkpoint cadence, how many are kept, the name) may change
    # on resume; the run still ends as the uninterrupted one did, and config.yaml holds the
    # settings it resumed with.
    out = tmp_path / "cadence"
    shutil.copytree(uninterrupted, out)
    (out / RF.SUMMARY).unlink()
    shutil.rmtree(out / RF.CHECKPOINTS / "12")  # resumes from 8
    changed = ("experiment.checkpoint_every=2", "experiment.checkpoint_keep=3",
               "experiment.name=renamed")
    runner.run(_cfg(*changed), out, resume=True, progress=False)
    assert _view(out) == _view(uninterrupted)
    assert sorted(int(p.name) for p in (out / RF.CHECKPOINTS).iterdir()) == [8, 10, 12]
    assert C.load(out / RF.CONFIG).experiment.checkpoint_every == 2


def test_checkpoints_hashed_before_the_keeping_settings_were_free_still_resume():
    # A checkpoint written before checkpoint_every and the like were left out of its record's
    # hash names them; it resumes under the same settings, and under others it does not.
    from sdcstudy.core import checkpoint

    def hash_as_before(cfg):
        d = {k: v for k, v in C.to_dict(cfg).items() if k != "logging"}
        d["experiment"] = {k: v for k, v in d["experiment"].items() if k != "steps"}
        return hashlib.sha256(RF.dumps(d, indent=None).encode()).hexdigest()[:16]

    cfg, cadence = _cfg(), _cfg("experiment.checkpoint_every=2")
    assert checkpoint.written_by({"config_hash": hash_as_before(cfg)}, cfg)
    assert not checkpoint.written_by({"config_hash": hash_as_before(cfg)}, cadence)
    assert checkpoint.written_by({"config_hash": checkpoint.config_hash(cfg)}, cadence)
    assert not checkpoint.written_by({"config_hash": checkpoint.config_hash(cfg)},
                                     _cfg("optim.lr=0.5"))


def test_damaged_checkpoint_is_a_clear_error_and_left_alone(uninterrupted, tmp_path, capsys):
    out = tmp_path / "damaged"
    shutil.copytree(uninterrupted, out)
    (out / RF.SUMMARY).unlink()  # killed before its summary: --resume restores checkpoint 12
    latest = out / RF.CHECKPOINTS / "12"
    victims = sorted(p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 64)
    for p in victims:
        data = bytearray(p.read_bytes())
        data[len(data) // 2: len(data) // 2 + 32] = b"\xff" * 32
        p.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code = cli.main(["run", str(out / RF.CONFIG), "--out", str(out), "--resume",
                     "--set", "experiment.steps=12", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "damaged" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # The sentence names the way on: the checkpoint before it. Followed, the run ends as the
    # uninterrupted one did.
    assert (f"move {str(latest.resolve())!r} out of {str(latest.parent.resolve())!r} and run "
            f"the same command again to resume from step 8, the checkpoint before it") in err
    shutil.move(latest, tmp_path / "damaged-12")
    assert cli.main(["run", str(out / RF.CONFIG), "--out", str(out), "--resume",
                     "--no-progress"]) == 0
    assert _view(out) == _view(uninterrupted)


def test_loss_falls_well_below_uniform(tmp_path):
    # The synthetic corpus has learnable structure: 200 steps of the tiny model must reach
    # under half of the uniform loss ln(256) = 5.55.
    cfg = C.from_dict({"experiment": {"steps": 200, "batch_size": 16, "checkpoint_every": 0},
                       "data": {"seq_len": 64}})
    summary = runner.run(cfg, tmp_path / "learn", progress=False)
    rows = RF.read_jsonl(tmp_path / "learn" / RF.METRICS)
    assert rows[0]["loss/healthy"] > 0.9 * math.log(256)
    assert np.mean([r["loss/healthy"] for r in rows[-10:]]) < 0.5 * math.log(256)
    assert summary["loss/uniform"] == pytest.approx(math.log(256))


def _gradients(cfg, tokens):
    trainer = train.Trainer.from_config(cfg)
    state = trainer.init_state()
    return jax.jit(lambda p, t: train.accumulate_gradients(trainer.loss, p, {"tokens": t})[:2])(
        state["params"], tokens)


def test_gradient_accumulation_equals_one_big_batch():
    # Two microsteps of 4 sequences must give the gradient of one batch of 8: the same
    # mathematics, summed in another order, so equal within float32 rounding (1e-5 relative
    # to the largest entry; a wrong normalisation would be off by a factor 2).
    tokens = np.random.default_rng(0).integers(0, 256, size=(8, 33), dtype=np.int32)
    loss1, g1 = _gradients(_cfg(), tokens[None])
    loss2, g2 = _gradients(_cfg(), tokens.reshape(2, 4, 33))
    assert float(loss1) == pytest.approx(float(loss2), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


def test_sgd_with_weight_decay_matches_the_formula():
    # sgd applies L2 weight decay to the gradient: p' = p - lr * (clip(g) + wd * p).
    o = C.OptimConfig(name="sgd", lr=0.1, schedule="constant", weight_decay=0.01, clip_norm=1.0)
    tx = train.make_optimizer(o, steps=10)
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = {"w": jnp.array([3.0, 4.0, 0.0])}  # norm 5: clipped to norm 1
    state = train.apply_update(tx, {"params": params, "opt_state": tx.init(params),
                                    "step": jnp.int32(0)}, grads)
    expected = params["w"] - 0.1 * (grads["w"] / 5.0 + 0.01 * params["w"])
    np.testing.assert_allclose(state["params"]["w"], expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "sgdm"])
def test_every_optimizer_lowers_the_loss(name):
    cfg = _cfg(f"optim.name={name}", "optim.lr=0.3" if name.startswith("sgd") else "optim.lr=3e-3",
               "optim.schedule=constant")
    trainer = train.Trainer.from_config(cfg)
    state = trainer.init_state()
    tokens = np.random.default_rng(1).integers(0, 16, size=(1, 8, 33), dtype=np.int32)
    step = jax.jit(trainer.train_step)
    first = None
    for _ in range(15):
        state, metrics, *_ = step(state, {"tokens": tokens})
        first = first if first is not None else float(metrics["loss/healthy"])
    assert float(metrics["loss/healthy"]) < first - 0.5


def test_schedule_warms_up_then_decays():
    o = C.OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    s = train.learning_rate_schedule(o, steps=100)
    assert float(s(0)) == 0.0 and float(s(10)) == pytest.approx(1.0)
    assert float(s(100)) == pytest.approx(0.1)
    assert float(s(5)) == pytest.approx(0.5)
    assert float(train.learning_rate_schedule(C.OptimConfig(lr=2.0, schedule="constant"), 5)(3)) == 2.0


# dp=2 against one device is the same algorithm summed in another order, not the same bits:
# on CPU the two differ by about 1e-6 relative (float32 reassociation of the batch sums).
DP_RTOL = 1e-5


def test_data_parallel_matches_single_device(tmp_path):
    # dp=2 splits each microbatch over two devices; the gradient must still be the mean over
    # the whole batch. Plain SGD at a constant, non-zero rate makes the parameters a linear
    # function of every step's gradient: a gradient summed over the workers instead of
    # averaged (twice as large) fails both the gradient norms and the final parameters.
    cfg = ("experiment.steps=3", "experiment.checkpoint_every=0", "optim.name=sgd",
           "optim.lr=0.5", "optim.schedule=constant", "optim.clip_norm=null",
           "optim.weight_decay=0")
    a = runner.run(_cfg(*cfg), tmp_path / "dp1", progress=False)
    b = runner.run(_cfg(*cfg, "mesh.dp=2"), tmp_path / "dp2", progress=False)
    ra, rb = (RF.read_jsonl(tmp_path / d / RF.METRICS) for d in ("dp1", "dp2"))
    assert [r["lr"] for r in ra] == [r["lr"] for r in rb] == [0.5] * 3
    for key in ("loss/healthy", "grad/norm"):
        np.testing.assert_allclose([r[key] for r in rb], [r[key] for r in ra], rtol=DP_RTOL,
                                   err_msg=key)
    pa, pb = (train.final_params(tmp_path / d) for d in ("dp1", "dp2"))
    moved = 0.0
    for x, y, init in zip(jax.tree.leaves(pa), jax.tree.leaves(pb),
                          jax.tree.leaves(train.Trainer.from_config(_cfg(*cfg)).init_state()
                                          ["params"])):
        step = np.abs(x - np.asarray(init)).max()
        np.testing.assert_allclose(y, x, rtol=DP_RTOL, atol=DP_RTOL * step)
        moved = max(moved, step)
    assert moved > 1e-3  # the rate was not zero: the parameters carry the gradients
    env = json.loads((tmp_path / "dp2" / RF.ENV).read_text())
    assert env["device_count"] == 8 and a["steps_done"] == b["steps_done"] == 3
