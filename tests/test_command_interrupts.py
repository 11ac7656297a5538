"""Ctrl-C and SIGTERM in the commands other than `run`, `sweep`, `reproduce` and `doctor`
(tested in their own modules): exit 130 or 143 with one sentence, never a FAIL or 3; nothing
half-written left under a final name; nothing of the user's removed; the command that goes
on named where there is one.

The stops are raised in process from a patched function at the moment they stand for (no
program is compiled); a real signal is sent only where Python's own handling of it is what
is tested.
"""

import gc
import os
import signal
import time

import pytest

from sdcstudy.core import interrupts


def _ctrl_c_inside_a_gc_callback():
    """A SIGINT whose handler runs inside a garbage-collection callback, as after a long XLA
    compile (JAX registers such a callback): Python prints "Exception ignored" and goes on."""
    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(10))  # the handler runs here, and its KeyboardInterrupt is swallowed

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert fired


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_stop_python_swallowed_in_a_gc_callback_is_sent_again(capsys):
    # `sdcstudy bench faults` got SIGINT (and another time SIGTERM) while compiling: the
    # KeyboardInterrupt landed in JAX's gc callback, stderr showed "Exception ignored in:
    # <function _xla_gc_callback>" and a traceback, and the bench measured on to exit 0.
    # If this fails, a stop that lands in a gc callback or a __del__ is lost again.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts.resent_when_swallowed():
                _ctrl_c_inside_a_gc_callback()
                _busy(5.0)  # the command goes on; the stop must reach it here
    finally:
        signal.signal(signal.SIGINT, before)
    assert "Exception ignored" not in capsys.readouterr().err


def test_the_signal_of_a_stop():
    assert interrupts.signum_of(KeyboardInterrupt()) == signal.SIGINT
    assert interrupts.signum_of(interrupts.Interrupted(signal.SIGTERM)) == signal.SIGTERM
    assert interrupts.signum_of(type("T", (KeyboardInterrupt,), {"exit_code": 143})()) == 15
    stop = interrupts.Stopped(signal.SIGTERM, "run it again")
    assert (stop.exit_code, str(stop)) == (143, "interrupted by SIGTERM; run it again")


def test_golden_record_stopped_while_writing_leaves_no_folder(tmp_path, monkeypatch, capsys):
    # A SIGTERM while golden record wrote its files left config.yaml, env.json and golden.json
    # without a manifest, and the same command was then refused ("already exists and is not
    # empty; a golden record is never overwritten"). If this fails, that half record is back.
    from sdcstudy import cli
    from sdcstudy.core import runfolder as RF
    from sdcstudy.golden import record as GR

    def stopped_while_writing(cfg, out_dir, *rest):
        RF.atomic_write_text(out_dir / GR.CONFIG, "experiment: {mode: train}\n")
        RF.atomic_write_json(out_dir / GR.ENV, {})
        RF.atomic_write_json(out_dir / GR.META, {})
        raise interrupts.Interrupted(signal.SIGTERM)

    monkeypatch.setattr(GR, "_record", stopped_while_writing)
    out = tmp_path / "golden"
    assert cli.main(["golden", "record", "--out", str(out), "--no-progress"]) == 143
    assert capsys.readouterr().err.splitlines() == [
        "sdcstudy: interrupted by SIGTERM; nothing of the golden record was kept: run the "
        "same command again"]
    assert not out.exists()

    def whole(cfg, out_dir, *rest):  # stopped after the manifest: the record stands
        for name in GR.FILES:
            RF.atomic_write_text(out_dir / name, "x")
        GR.write_manifest(out_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(GR, "_record", whole)
    assert cli.main(["golden", "record", "--out", str(out), "--no-progress"]) == 130
    assert "was written whole before the stop" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted([GR.MANIFEST, *GR.FILES])


def _report_run(path, loss: float):
    """A hand-made lock-step run folder of 2 steps for `sdcstudy report`."""
    from report_runs import grid_rows, write_run

    rows = grid_rows(steps=2, layers=1, tp=1, elements=100, microsteps=1,
                     cell=lambda step, micro, layer, site, rank: (step, 0.5))
    metrics = [{"step": s, "loss/healthy": loss, "grad/nts": 0.0} for s in (1, 2)]
    return write_run(path, mode="lockstep", profile="paper-node-1", metrics=metrics,
                     mismatch=rows)


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_report_stopped_while_writing_leaves_no_half_report(tmp_path, monkeypatch, capsys):
    # Ctrl-C while `sdcstudy report` wrote its tables left runs.csv and table1 without
    # report.md in a new --out, and the same command was then refused ("already exists and
    # holds no report.md"); into an earlier report folder it left the earlier report.md
    # beside new tables. If this fails, a stopped report is half written again.
    from sdcstudy import cli
    from sdcstudy.report import writer

    a, b = _report_run(tmp_path / "a", 3.0), _report_run(tmp_path / "b", 4.0)
    write, calls = writer._write, []

    def stopped_at_the_second_table(path, text):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        write(path, text)

    monkeypatch.setattr(writer, "_write", stopped_at_the_second_table)
    out = tmp_path / "report"
    assert cli.main(["report", str(a), "--out", str(out)]) == 130
    assert capsys.readouterr().err == "sdcstudy: interrupted\n"
    assert not out.exists()  # the same command may run again
    monkeypatch.setattr(writer, "_write", write)
    assert cli.main(["report", str(a), "--out", str(out)]) == 0
    earlier = _files(out)
    assert writer.REPORT in earlier
    calls.clear()
    monkeypatch.setattr(writer, "_write", stopped_at_the_second_table)
    assert cli.main(["report", str(a), str(b), "--out", str(out)]) == 130
    assert _files(out) == earlier  # the earlier report, whole, and nothing else


def test_a_stop_while_a_report_is_moved_into_place_waits_for_it(tmp_path, monkeypatch):
    # The report's files are moved from its hidden folder into --out with SIGINT and SIGTERM
    # held back (milliseconds): a Ctrl-C then stops the command after the move, with the new
    # report whole. If this fails, a signal in that moment leaves a mixed folder.
    from sdcstudy import cli
    from sdcstudy.report import writer

    a = _report_run(tmp_path / "a", 3.0)
    replace, sent = os.replace, []

    def ctrl_c_while_moving(src, dst):
        if writer.STAGING in str(src) and writer.STAGING not in str(dst) and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(10))  # where the handler would run
        replace(src, dst)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(writer.os, "replace", ctrl_c_while_moving)
    out = tmp_path / "report"
    try:
        assert cli.main(["report", str(a), "--out", str(out)]) == 130
    finally:
        signal.signal(signal.SIGINT, before)
    files = _files(out)
    assert "runs.csv" in files and writer.REPORT in files
    assert not any(name.startswith(".") for name in files)


def test_a_demo_stopped_leaves_no_folder_and_says_to_run_it_again(tmp_path, monkeypatch,
                                                                   capsys):
    # A demo stopped in its first run left DIR/lockstep and the sentence of that run alone
    # (`sdcstudy run .../lockstep/config.yaml ... --resume`), and `sdcstudy demo --out DIR`
    # again was refused (the folder is not empty): the demo has no --resume.
    from sdcstudy import cli, runner
    from sdcstudy.core import runfolder as RF

    def stopped(cfg, out, **_):  # the lock-step run, stopped after its folder was written
        out.mkdir(parents=True)
        (out / RF.CONFIG).write_text("experiment: {mode: lockstep}\n")
        raise interrupts.Interrupted(signal.SIGTERM, out)

    monkeypatch.setattr(runner, "run", stopped)
    out = tmp_path / "demo"
    assert cli.main(["demo", "--out", str(out), "--no-progress"]) == 143
    assert not out.exists()
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"sdcstudy: interrupted by SIGTERM; the demo folder {str(out)!r} was not kept: run the "
        f"same command again")


def test_a_bench_stopped_while_its_programs_compile_returns_without_waiting(monkeypatch):
    # `sdcstudy bench` compiles its contenders in a thread pool; left with a `with`, a Ctrl-C
    # (or SIGTERM) waited for the compiles under way before the command could exit (11.5 s,
    # measured). The stop now returns at once; the compile left running ends with the process.
    import threading
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp

    from sdcstudy.bench import timing

    release, finished = threading.Event(), []
    compile_program = jax.stages.Lowered.compile

    def blocked_compile(self, *args, **kwargs):  # a compile that runs until the test is done
        finished.append(release.wait(timeout=10))
        return compile_program(self, *args, **kwargs)

    def place(trainer, tokens, initial_states=None):
        if trainer.name == "b":
            raise KeyboardInterrupt  # Ctrl-C while the second contender is set up
        return jnp.zeros(4), jnp.ones(4), None

    monkeypatch.setattr(jax.stages.Lowered, "compile", blocked_compile)
    monkeypatch.setattr(timing, "place", place)
    trainers = {name: SimpleNamespace(name=name, train_step=lambda state, batch: state + batch)
                for name in ("a", "b")}
    try:
        with pytest.raises(KeyboardInterrupt):
            timing.build_runners(trainers, None, threads=1, echo=lambda *_: None)
        assert finished == []  # returned while a's compile still ran, not after it
    finally:
        release.set()
