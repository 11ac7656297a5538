"""Detectors and verified rollback (`experiment.mode: detect`) on a one-layer model.

Each module-scoped fixture compiles one detect step; the faulty device is an input of the
step, so a sweep over it (and a healthy run, whose faulty device is one no execution uses)
reuses the compilation.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from sdcstudy import modes
from sdcstudy.core import config as C
from sdcstudy.core import data as D
from sdcstudy.core import digest
from sdcstudy.detect.rollback import DetectionError
from sdcstudy.detect.trainer import DetectTrainer, odd_one_out
from sdcstudy.core.train import compile_step

SMALL = {"model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64},
         "data": {"seq_len": 16, "synthetic_tokens": 20_000}}
NO_DEVICE = -1  # a faulty device that no execution runs on: a healthy run


def one_flip(tmp_path: Path, p_active: float = 1.0) -> str:
    """A profile that flips the top mantissa bit of one FFN output element on the faulty device
    (small enough to leave training finite, never too small to change the gradient), in every
    step (or in a fraction `p_active` of the steps)."""
    path = tmp_path / "one-flip.yaml"
    path.write_text(yaml.safe_dump({"name": "one-flip", "specs": [{
        "site": "fwd/ffn", "kind": "bitflip", "count": 1, "bits": [22],
        "pattern": {"kind": "burst", "p_active": p_active}}]}))
    return str(path)


def make_config(profile: str, kind: str, **detect) -> C.Config:
    return C.from_dict({**SMALL,
                        "experiment": {"mode": "detect", "steps": 6, "batch_size": 4, "seed": 3,
                                       "checkpoint_every": 0},
                        "mesh": {"dp": 2},
                        "suspect": {"profile": profile, "fault_kind": kind},
                        "optim": {"schedule": "constant"},
                        "detect": detect})


class Stepper:
    """A compiled detect step driven by hand, one verdict per step."""

    def __init__(self, cfg: C.Config):
        self.trainer = DetectTrainer.from_config(cfg)
        self.batches = D.TokenBatches(D.prepare(cfg.data, cfg.experiment.seed),
                                      cfg.experiment.batch_size, cfg.experiment.microsteps)
        example = self.trainer.make_batch(self.batches.batch(0))
        self.step, _, _ = compile_step(self.trainer.train_step, self.trainer.init_state(), example)

    def verdicts(self, steps: int, suspect: int) -> list[dict]:
        state, out = self.trainer.init_state(), []
        for s in range(steps):
            batch = {**self.trainer.make_batch(self.batches.batch(s)),
                     "suspect": jnp.int32(suspect)}
            state, _, records = self.step(state, batch)
            out.append(self.trainer.judge(records["detect"]))
        return out


DETECTORS = "shadow,reexec,lockstep,localize"


@pytest.fixture(scope="module")
def transient(tmp_path_factory):
    """Transient flips in about half the steps (and attempts), trained on the ranks' own
    gradients with rollback on: one compilation for the detector and the rollback tests."""
    profile = one_flip(tmp_path_factory.mktemp("transient"), p_active=0.5)
    return Stepper(make_config(profile, "transient", detectors=DETECTORS, shadow_rank=1,
                               advance="primary", rollback=True))


@pytest.fixture(scope="module")
def repeatable(tmp_path_factory):
    profile = one_flip(tmp_path_factory.mktemp("repeatable"))
    return Stepper(make_config(profile, "repeatable", detectors=DETECTORS, shadow_rank=1))


def faulty_steps(verdicts: list[dict]) -> list[dict]:
    """The steps whose result the fault changed (at least two, or the test proves nothing)."""
    changed = [v for v in verdicts if v["truth"]]
    assert len(changed) >= 2, "the fault must change the gradient in some steps"
    return changed


def test_reexecution_catches_transient_faults_and_misses_repeatable_ones(transient, repeatable):
    """If this fails, either re-execution does not draw transient faults afresh, or a
    repeatable fault is not the same wrong answer for the same inputs."""
    for verdict in faulty_steps(transient.verdicts(6, suspect=1)):
        assert verdict["reexec"] == 1
    verdicts = repeatable.verdicts(3, suspect=1)
    assert len(faulty_steps(verdicts)) == 3
    assert [v["reexec"] for v in verdicts] == [0, 0, 0]


def test_shadow_replica_and_lockstep_catch_both_kinds(transient, repeatable):
    for stepper, steps in ((transient, 6), (repeatable, 3)):
        for verdict in faulty_steps(stepper.verdicts(steps, suspect=1)):
            assert verdict["shadow"] == 1 and verdict["lockstep"] == 1


def test_localization_names_the_faulty_rank_and_stays_quiet_when_healthy(transient, repeatable):
    """Three replicas of every rank's step: the faulty device is named at every faulty step
    of a sweep over which rank is faulty and over both fault kinds."""
    for stepper, steps in ((transient, 6), (repeatable, 3)):
        for suspect in (0, 1):
            verdicts = stepper.verdicts(steps, suspect=suspect)
            for verdict in faulty_steps(verdicts):
                assert verdict["localize"] == 1
                assert verdict["localized"] == suspect
            for verdict in verdicts:  # a step the fault left unchanged raises no alarm
                if not verdict["truth"]:
                    assert verdict["localize"] == verdict["lockstep"] == 0
        for verdict in stepper.verdicts(4, suspect=NO_DEVICE):
            assert verdict["truth"] == 0
            assert {k: verdict[k] for k in ("localize", "shadow", "lockstep", "reexec")} == \
                {"localize": 0, "shadow": 0, "lockstep": 0, "reexec": 0}
            assert verdict["localized"] == -1


def test_odd_one_out_needs_three_replicas():
    pair = np.array([[0, 1], [1, 0]], bool)
    assert odd_one_out(pair) == -2  # a pair detects but cannot say which side is wrong
    trio = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], bool)
    assert odd_one_out(trio) == 1
    assert odd_one_out(np.zeros((3, 3), bool)) == -1


# --- verified rollback ------------------------------------------------------------------------


def run_rollback(stepper: Stepper, steps: int, suspect: int):
    from sdcstudy.detect.rollback import VerifiedRollback

    wrapped = VerifiedRollback(stepper.step, stepper.trainer, max_retries=8)
    state = stepper.trainer.init_state()
    for s in range(steps):
        batch = {**stepper.trainer.make_batch(stepper.batches.batch(s)),
                 "suspect": jnp.int32(suspect)}
        state = wrapped(state, batch).state
    # The whole state, the optimizer's moments and the step count with the parameters: a
    # rollback that kept a corrupted moment would leave the parameters' bits as they were.
    return digest.tree_digest(jax.device_get(state)), wrapped.rollbacks


def test_rollback_with_transient_faults_ends_bitwise_equal_to_the_clean_run(transient):
    rollback = transient
    faulty, rollbacks = run_rollback(rollback, 6, suspect=1)
    clean, clean_rollbacks = run_rollback(rollback, 6, suspect=NO_DEVICE)
    assert rollbacks > 0, "the faulty run must have been rolled back at least once"
    assert clean_rollbacks == 0
    assert faulty == clean


def test_rollback_records_what_the_detectors_caught_not_the_clean_re_run(transient):
    """A flagged step is accepted only once a re-run passes every detector, so the accepted
    run's verdict is clean by construction: what the run folder scores (flags, ground truth,
    the faults that landed) must be the step's first execution, or a rolled-back run would
    show no detection and no fault at all."""
    from sdcstudy.detect.rollback import VerifiedRollback

    trainer = transient.trainer
    wrapped = VerifiedRollback(transient.step, trainer, max_retries=8)
    state, recorded = trainer.init_state(), []
    for s in range(6):
        out = wrapped(state, {**trainer.make_batch(transient.batches.batch(s)),
                              "suspect": jnp.int32(1)})
        state = out.state
        tables, counters = trainer.host_tables(s + 1, jax.device_get(out.records))
        recorded.append((out.records["detect"], counters, tables["detections.parquet"]))
    verdicts = [verdict for verdict, _, _ in recorded]
    for verdict in faulty_steps(verdicts):
        assert verdict["lockstep"] == 1 and verdict["rollbacks"] >= 1
    for verdict, counters, detections in recorded:
        # A step was re-run exactly when its first execution was flagged, and then it has a
        # row in detections.parquet.
        assert bool(verdict["rollbacks"]) == trainer.flagged(verdict) == bool(detections)
        if verdict["truth"]:
            assert counters["faults/landed"] >= 1


def test_rollback_gives_up_on_a_repeatable_fault(repeatable):
    """A repeatable fault recurs on every re-run: the run must stop, not loop or go on."""
    from sdcstudy.detect.rollback import VerifiedRollback

    stepper = repeatable
    wrapped = VerifiedRollback(stepper.step, stepper.trainer, max_retries=2)
    with pytest.raises(DetectionError, match="still flagged after 2 rollbacks .* every attempt "
                                              "giving the same loss"):
        wrapped(stepper.trainer.init_state(), stepper.trainer.make_batch(stepper.batches.batch(0)))


class _Judge:
    """A trainer whose loss monitor flags every execution: the step's result is judged alone."""

    detectors = ("monitor", "lockstep")

    def __init__(self, losses):
        self.losses = iter(losses)

    def judge(self, out):
        return {"loss": next(self.losses), "grad_norm": 1.0, "monitor": 1, "lockstep": 0}

    def flagged(self, verdict):
        return any(verdict.get(name) for name in self.detectors)

    def accept(self, verdict):
        raise AssertionError("a flagged step was accepted")


@pytest.mark.parametrize("losses, words", [
    ([2.0, 2.0, 2.0], r"flagged after 2 rollbacks \(by monitor\), every attempt giving the same "
                      r"loss .* or a false alarm on a clean step"),
    ([float("nan")] * 3, "every attempt giving the same loss"),
    ([2.0, 2.5, 3.0], "giving different results: a transient fault")])
def test_a_step_still_flagged_names_its_detectors_and_what_can_cause_it(losses, words):
    # A monitor that flags a clean step flags its identical re-runs too (measured: the healthy
    # profile with detect.spike_grad=1.0 stopped at step 12): the error must not blame a fault
    # it cannot know of.
    from sdcstudy.core.step import StepOut
    from sdcstudy.detect.rollback import VerifiedRollback

    def compiled(state, batch):
        return StepOut({"step": state["step"] + 1}, {}, {"detect": {}})

    rollback = VerifiedRollback(compiled, _Judge(losses), max_retries=2)
    with pytest.raises(DetectionError, match=words):
        rollback({"step": jnp.int32(11)}, {})


KILLED_CHILD = textwrap.dedent("""
    import asyncio, os, sys, yaml
    from pathlib import Path
    from orbax.checkpoint._src.path import atomicity
    from sdcstudy import runner
    from sdcstudy.core import config as C

    out, pause_step = Path(sys.argv[1]), sys.argv[2]
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        # The controlled point: step `pause_step` is written but not yet committed.
        if self.get_final().name == pause_step:
            (out.parent / "paused").write_text(str(os.getpid()))
            await asyncio.sleep(600)
        return await original(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    cfg = C.from_dict(yaml.safe_load(Path(sys.argv[3]).read_text()))
    runner.run(cfg, out, progress=False)
""")


def test_killing_a_snapshot_write_never_mixes_two_steps(tmp_path, transient):
    rollback = transient
    """The process is killed while step 3's snapshot is being written: the latest snapshot on
    disk is then step 2, whole, bit for bit the state the uninterrupted run has at step 2."""
    from sdcstudy.core.checkpoint import Checkpointer

    cfg = C.from_dict(C.to_dict(rollback.trainer.cfg))
    cfg.experiment.checkpoint_every = 1
    cfg.experiment.steps = 4
    config_file = tmp_path / "config.yaml"
    config_file.write_text(C.dump(cfg))
    out = tmp_path / "run"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(out), "3",
                              str(config_file)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "paused").exists():
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the child never reached the snapshot write"
            time.sleep(0.2)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    # Before the folder is opened again: opening it clears half-written steps (in the
    # background), which would race with this look.
    assert any("tmp" in p.name for p in (out / "checkpoints").iterdir()), \
        "the kill must have hit a write in progress"
    ckpt = Checkpointer(out / "checkpoints", asynchronous=False)
    assert ckpt.latest_step() == 2
    state, record = ckpt.restore(2, rollback.trainer.init_state())
    ckpt.close()
    assert int(state["step"]) == 2 and record["step"] == 2
    reference, _ = run_rollback(rollback, 2, suspect=1)
    assert digest.tree_digest(jax.device_get(state)) == reference


# --- the benchmark's scores and the report ----------------------------------------------------


def test_scores_count_recall_latency_and_precision_by_hand():
    import pandas as pd

    from sdcstudy.detect.tables import detector_scores

    # Events at steps 2 and 9; the detector flags at 4 (2 steps late), 15 (no event within
    # the 5-step window: a false flag) and never after step 9.
    frame = pd.DataFrame({"step": range(1, 17),
                          "detect/truth": [s in (2, 9) for s in range(1, 17)],
                          "detect/monitor": [s in (4, 15) for s in range(1, 17)]})
    scores = detector_scores(frame, "monitor", window=5)
    assert scores["events"] == 2 and scores["flags"] == 2
    assert scores["recall"] == 0.5
    assert scores["latency_steps"] == 2.0
    assert scores["precision"] == 0.5
    # With no window (the run advanced on the clean gradient) only same-step flags count, and
    # a detection's latency is 0 by definition.
    same_step = detector_scores(frame.assign(**{"detect/monitor": frame["detect/truth"]}),
                                "monitor", window=0)
    assert same_step["recall"] == 1.0
    assert (same_step["latency_steps"], same_step["latency_steps_max"]) == (0.0, 0)


def test_report_has_the_detector_table(tmp_path):
    """`sdcstudy report` on detect-mode run folders (written here by hand) shows the table."""
    from sdcstudy.report import writer as report

    def fake_run(name: str, profile: str, truth: list[int], flags: list[int]):
        cfg = make_config("healthy", "transient")
        cfg.suspect.profile = profile
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.yaml").write_text(C.dump(cfg))
        rows = [{"step": s + 1, "loss/healthy": 1.0, "detect/truth": t, "detect/shadow": f}
                for s, (t, f) in enumerate(zip(truth, flags))]
        (folder / "metrics.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in rows))
        (folder / "summary.json").write_text("{}")
        return folder

    import json

    runs = [fake_run("healthy", "healthy", [0, 0, 0, 0], [0, 1, 0, 0]),
            fake_run("faulty", "exponent-flip", [1, 0, 1, 0], [1, 0, 0, 0])]
    result = report.write_report(runs, tmp_path / "report")
    assert "detectors.csv" in result["files"]
    import pandas as pd

    table = pd.read_csv(tmp_path / "report" / "detectors.csv")
    (row,) = table.to_dict("records")
    assert (row["profile"], row["detector"], row["events"]) == ("exponent-flip", "shadow", 2)
    assert row["recall"] == 0.5 and row["false_alarms"] == 0.25


def test_bad_detect_settings_end_in_one_sentence():
    with pytest.raises(C.ConfigError, match="not one of monitor"):
        modes.check(make_config("healthy", "transient", detectors="shadow,lockstpe"))
    with pytest.raises(C.ConfigError, match="detect.replicas must be from 3 to 16"):
        modes.check(make_config("healthy", "transient", replicas=2))
    with pytest.raises(C.ConfigError, match="detect.advance=primary"):
        modes.check(make_config("healthy", "transient", rollback=True))
    with pytest.raises(C.ConfigError, match="suspect.fault_kind"):
        make_config("healthy", "sometimes")
    with pytest.raises(C.ConfigError, match="all names every detector, so it stands alone"):
        modes.check(make_config("healthy", "transient", detectors="all,abft"))
    with pytest.raises(C.ConfigError, match="did you mean 'all'"):
        modes.check(make_config("healthy", "transient", detectors="ALL"))
    with pytest.raises(C.ConfigError, match="names 'shadow' twice"):
        modes.check(make_config("healthy", "transient", detectors="shadow,reexec,shadow"))
    # A mistyped count must be refused before a plan of a million copies is built (it hung).
    with pytest.raises(C.ConfigError, match="detect.replicas must be from 3 to 16"):
        modes.check(make_config("healthy", "transient", replicas=1_000_000))


@pytest.mark.parametrize("site", ["update", "collective/grad_allreduce"])
def test_a_fault_site_the_detect_step_never_applies_is_refused(site, tmp_path):
    """The detect step has no all-reduce, and its update comes after every comparison: a
    spec at either site would inject nothing while the run read as a healthy device."""
    profile = tmp_path / "unapplied.yaml"
    profile.write_text(yaml.safe_dump({"name": "unapplied", "specs": [
        {"site": site, "kind": "bitflip", "bits": [30], "rate": 1.0}]}))
    with pytest.raises(C.ConfigError, match=f"may not use the site '{site}'"):
        DetectTrainer.from_config(make_config(str(profile), "transient"))
