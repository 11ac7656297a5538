"""Promises of docs/gpu.md that hold or fail on the CPU, each where no other test holds it:
the determinism flags read as XLA reads them (a bare `--xla_gpu_deterministic_ops` is on, so
cuDNN's attention is not tried where it cannot launch), which attention the doctor's and the
repeat check's trainings run on a GPU, `model.attention=fused` refused through `sdcstudy run`
where cuDNN cannot launch, and the acceptance's budget: a child past the deadline killed and
its check an ERROR, a check without time SKIPPED and never started, and a check judged from
checks that did not run SKIPPED, never a FAIL.

Tests/test_attention.py holds the attention paths, tests/test_autotune_pin.py the pinned
kernel choices, tests/test_gpu_acceptance.py and tests/test_gpu_free_step.py the judges.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from sdcstudy.core import config as C
from sdcstudy.core import determinism as D
from sdcstudy.core import model as M
from sdcstudy.core import sites as S
from sdcstudy.gpu import acceptance as GA
from sdcstudy.gpu import checks as GC
from sdcstudy.gpu import session as GS

ROOT = Path(__file__).resolve().parents[1]
DETERMINISTIC_OPS, EXCLUDE = (flag.partition("=")[0] for flag in D.DETERMINISM_XLA_FLAGS)


# --- the determinism flags, as XLA reads them ---------------------------------------------------

@pytest.mark.parametrize("flags, on", [
    (DETERMINISTIC_OPS, True),  # bare: XLA sets a boolean flag named without a value
    (f"{EXCLUDE}=false {EXCLUDE}", True),  # the last of a name wins
    (f"{EXCLUDE} {EXCLUDE}=false", False),
    (f"{DETERMINISTIC_OPS}=TRUE", True),
    (f"{DETERMINISTIC_OPS}=0 {EXCLUDE}=False", False),
    (f"{DETERMINISTIC_OPS}_more", False),  # another flag whose name begins with it
    ("", False),
])
def test_a_determinism_flag_is_on_where_xla_reads_it_on(flags, on):
    """Where a flag is on, cuDNN's attention cannot launch with jaxlib 0.11.2 (docs/gpu.md), so
    `auto` must not try it: a bare flag read as off sent the step to cuDNN's kernel, which
    fails at its first launch."""
    assert D.determinism_on(flags) is on
    assert D.cudnn_attention_fails(flags, "0.11.2") is on


def test_xla_reads_the_flags_as_bool_flag_does(tmp_path):
    """The reading above is XLA's own: its debug options, dumped by a CPU compile, name each
    determinism flag's value for a bare name, a value in capitals and a later `=false`."""
    flags = f"{DETERMINISTIC_OPS} {EXCLUDE}=TRUE {EXCLUDE}=false"
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={tmp_path} {flags}"}
    subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"],
                   env=env, check=True, timeout=120, capture_output=True)
    dumped = next(tmp_path.glob("*.debug_options")).read_text()  # the values off XLA's default
    for name in (DETERMINISTIC_OPS, EXCLUDE):
        assert D.bool_flag(flags, name) is (f"{name.lstrip('-')}: true" in dumped), name
    assert D.bool_flag(flags, DETERMINISTIC_OPS) and not D.bool_flag(flags, EXCLUDE)


# --- which attention the acceptance's trainings run on a GPU ------------------------------------

def _path_on_a_gpu(cfg, cudnn_fails: bool) -> str:
    dims = C.model_dims(cfg.model)
    return M.attention_path(dims.attention, S.identity_hook, jnp.dtype(cfg.model.dtype),
                            dims.head_dim, platform="gpu", cudnn_fails=cudnn_fails,
                            length=cfg.data.seq_len)


@pytest.mark.parametrize("cudnn_fails", [False, True])
def test_on_a_gpu_the_doctor_trains_with_xlas_attention_and_the_repeat_check_with_a_kernel(
        tmp_path, monkeypatch, cudnn_fails):
    """docs/gpu.md, `attention_repeat`: the doctor trains in float32, where `auto` runs XLA's
    composition on a GPU (the doc said: unfused attention); the repeat check's training runs
    cuDNN's fused attention, or the Pallas kernels where cuDNN's cannot launch."""
    from sdcstudy import doctor

    assert _path_on_a_gpu(C.from_dict(doctor.DOCTOR), cudnn_fails) == M.XLA
    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: cudnn_fails)
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="quick", budget=240)
    acc = GC.Acceptance(args, sys.executable, {"device_kind": "NVIDIA H200"}, tmp_path)
    started = []
    monkeypatch.setattr(acc, "sdcstudy", lambda label, argv, **k: started.append(argv) or
                        GS.skipped("stop after the first"))
    acc.attention_repeat()
    argv = [str(a) for a in started[0]]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = C.load(ROOT / argv[1], sets)
    assert _path_on_a_gpu(cfg, cudnn_fails) == (M.PALLAS if cudnn_fails else M.CUDNN)


def test_fused_where_cudnn_cannot_launch_is_refused_by_sdcstudy_run(tmp_path, capsys,
                                                                    monkeypatch):
    """docs/gpu.md: where cuDNN's kernel cannot launch, `model.attention=fused` is refused when
    the step is traced, before it compiles: exit 2 and one sentence through `sdcstudy run`
    (the attention is asked as on such a GPU; the CPU traces the rest), no env.json written."""
    from sdcstudy import cli

    real = M.attention_path
    monkeypatch.setattr(M, "attention_path", lambda *a, **k: real(
        *a, **{**k, "platform": "gpu", "cudnn_fails": True}))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() adds flags
    out = tmp_path / "run"
    code = cli.main(["run", str(ROOT / "configs" / "tiny.yaml"), "--out", str(out),
                     "--no-progress", "--set", "model.dtype=bfloat16", "--set",
                     "model.attention=fused", "--set", "experiment.steps=1", "--set",
                     "experiment.batch_size=2", "--set", "data.seq_len=16"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(
        "sdcstudy: error: model.attention=fused would run cuDNN's fused attention")
    assert lines[0].endswith("use model.attention=auto or unfused.")
    assert not (out / "env.json").exists() and not (out / "checkpoints").exists()


# --- the acceptance's budget ------------------------------------------------------------------

def _session(tmp_path, monkeypatch, budget: int) -> GS.Session:
    monkeypatch.setattr(GS, "versions", lambda: {})
    args = SimpleNamespace(out=tmp_path, stage="quick", budget=budget)
    return GS.Session(args, sys.executable, {"device_kind": "NVIDIA H200"}, tmp_path)


def test_a_check_without_time_left_is_skipped_and_never_started(tmp_path, monkeypatch):
    session = _session(tmp_path, monkeypatch, budget=GS.MIN_CHECK_S - 1)
    started = tmp_path / "started"
    run = session.child("late", ["-c", f"open({str(started)!r}, 'w')"], cap=600)
    assert GS.state(run) == "SKIPPED" and run["skipped"] == "no time left in --budget"
    assert not started.exists()


def test_a_child_still_running_at_the_deadline_is_killed_and_its_check_is_an_error(
        tmp_path, monkeypatch):
    """The deadline of --budget, not only the check's cap, ends a child; the check that reads
    it reports ERROR ("timed out"), never FAIL, and the acceptance COULD NOT RUN (exit 3)."""
    monkeypatch.setattr(GS, "MIN_CHECK_S", 0.5)
    session = _session(tmp_path, monkeypatch, budget=2)
    begin = time.monotonic()
    run = session.child("slow", ["-c", "import time; time.sleep(15)"], cap=600)
    assert run["timed_out"] is True and time.monotonic() - begin < 10
    session.record("slow", GS.broke(run))
    assert GS.state(session.report["checks"]["slow"]) == "ERROR"
    assert session.report["checks"]["slow"]["error"] == "timed out"
    assert session.finish() == 3 and session.report["verdict"] == "COULD NOT RUN"


@pytest.mark.parametrize("only, reason", [
    ("pinned_autotune", "the tuned or the pinned bench train measured nothing"),
    ("determinism_cost", "the tuned or the pinned bench train measured nothing"),
    ("kernel_census", "no medium bfloat16 bench train wrote a census"),
    ("torch_ratio", "our medium bfloat16 step measured nothing"),
])
def test_only_a_check_judged_from_others_is_skipped_naming_them(tmp_path, monkeypatch, only,
                                                                 reason):
    """`--only` with a check whose figures come from checks it does not name: SKIPPED with
    the reason, the acceptance INCOMPLETE (exit 2), no child started and never a FAIL."""
    monkeypatch.setattr(GC, "cudnn_fails_here", lambda: False)
    monkeypatch.setattr(GS, "versions", lambda: {})
    session = GC.Acceptance(SimpleNamespace(out=tmp_path, stage="full", budget=540),
                            sys.executable, {"device_kind": "NVIDIA H200"}, tmp_path)
    monkeypatch.setattr(session, "child", lambda *a, **k: pytest.fail("a child started"))
    args = SimpleNamespace(stage="full", only=only)
    assert GA.run_checks(session, GA.checks_to_run(args)) == 2
    saved = json.loads((tmp_path / GS.RESULT).read_text())
    assert saved["verdict"] == "INCOMPLETE" and list(saved["checks"]) == [only]
    assert saved["checks"][only]["skipped"] == reason
