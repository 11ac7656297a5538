"""The checks of a run of several processes, without starting any: the meeting's refusals
(`rendezvous`), what the processes must agree on (`distributed.run_settings`), how a lost peer
is named (`distributed._describe`), and the mesh's sentences.

The meeting is plain sockets, so two processes of it are two threads here. What would be wrong
if a test failed is in its docstring; tests/test_distributed.py starts real processes.
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import types

import jax
import pytest

from sdcstudy.core import config as C
from sdcstudy.core import distributed, rendezvous
from sdcstudy.core import mesh as M
from sdcstudy.core.config import UserError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _meet_both(runs: list[dict | None], timeout_s: int = 20) -> list[BaseException | None]:
    """Processes 0 and 1 of 2 meet (threads); what each raised, or None."""
    coordinator = f"127.0.0.1:{_free_port()}"
    raised: list[BaseException | None] = [None, None]

    def one(process_id):
        try:
            rendezvous.meet(coordinator, 2, process_id, timeout_s, environ={},
                            run=runs[process_id])
        except BaseException as error:  # noqa: BLE001 - handed to the test
            raised[process_id] = error

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    assert not any(thread.is_alive() for thread in threads), "the meeting hung"
    return raised


def _settings(tmp_path, overrides=(), out="pair1", resume=False, stop_after=None) -> dict:
    cfg = C.load("configs/tiny.yaml", list(overrides))
    args = argparse.Namespace(out=str(tmp_path / out), resume=resume, stop_after=stop_after)
    return distributed.run_settings(cfg, args)


def test_processes_started_with_other_settings_are_refused_naming_them(tmp_path):
    """A suspect started with another --set (measured before: optim.lr ran to the end, both
    exits 0, the suspect's divergence recorded as param/diff_l2 under process 0's config.yaml;
    experiment.steps ended one process in a gloo SIGABRT) must be refused in the meeting, on
    both processes, with one sentence naming the keys and both values."""
    healthy = _settings(tmp_path, ["experiment.steps=3"])
    suspect = _settings(tmp_path, ["experiment.steps=5", "optim.lr=0.01"])
    raised = _meet_both([healthy, suspect])
    assert all(isinstance(e, UserError) for e in raised), raised
    assert str(raised[0]) == str(raised[1])
    sentence = str(raised[0])
    assert sentence.startswith(f"process 1 (pid {os.getpid()} on ")
    assert "was started with experiment.steps=5 and optim.lr=0.01 and process 0 (" in sentence
    assert "with experiment.steps=3 and optim.lr=0.003: start every process with the same " \
        "config file and --set values." in sentence


@pytest.mark.parametrize("suspect_flags, shown, fix", [
    ({"out": "elsewhere"}, "--out ", "give every process the same --out"),
    ({"resume": True}, "was started with --resume and process 0", "pass --resume and"),
    ({"stop_after": 5}, "was started with --stop-after 5 and process 0",
     "--stop-after to every process alike"),
])
def test_processes_started_with_other_run_flags_are_refused(tmp_path, suspect_flags, shown, fix):
    """--out (process 1 would write its checkpoint shards elsewhere), --resume on one side only
    (one process restores step k, the other starts at step 1) and --stop-after (one stops, the
    other waits in the next collective) must be the same on every process."""
    raised = _meet_both([_settings(tmp_path), _settings(tmp_path, **suspect_flags)])
    assert all(isinstance(e, UserError) for e in raised), raised
    assert shown in str(raised[0]) and fix in str(raised[0]), raised[0]


def test_processes_with_the_same_settings_meet(tmp_path):
    """The same settings (and versions) pass: the check must not refuse a good launch."""
    assert _meet_both([_settings(tmp_path), _settings(tmp_path)]) == [None, None]


def test_other_versions_are_refused_before_other_settings():
    """Another jax (or sdcstudy source) on one host compiles another step, whose bits and
    collectives need not match: refused, naming both versions."""
    me = rendezvous.hello(2, 0, {"experiment.steps": 3})
    said = rendezvous.hello(2, 1, {"experiment.steps": 5})
    said["run"]["jax"] = "0.9.0"
    sentence = rendezvous._problem(me, said, {})
    assert "was started with jax 0.9.0 and experiment.steps=5 and process 0 (pid " in sentence
    assert f"with jax {me['run']['jax']} and experiment.steps=3: install the same sdcstudy, " \
        f"jax and jaxlib on every host; start every process with the same config" in sentence
    assert set(rendezvous.PACKAGES) <= set(me["run"])
    assert "(source " in me["run"]["sdcstudy"]


def test_run_settings_hold_every_config_key_and_the_run_flags(tmp_path):
    settings = _settings(tmp_path, ["model.n_layers=1"], out="runs/../pair1", stop_after=2)
    assert settings["model.n_layers"] == 1 and settings["paft.noise.sigma2"] is not None
    assert set(C.all_keys()) < set(settings)
    assert settings["--out"] == os.path.abspath(tmp_path / "pair1")
    assert (settings["--resume"], settings["--stop-after"]) == (False, 2)


def test_a_process_that_never_came_is_named_in_the_singular():
    """Was: "process(es) 1 did not reach"."""
    coordinator = f"127.0.0.1:{_free_port()}"
    with pytest.raises(UserError, match=r"^process 0 of 2: process 1 did not reach "):
        rendezvous.meet(coordinator, 2, 0, 1, environ={})
    with pytest.raises(UserError, match=r"^process 0 of 3: processes 1 and 2 did not reach "):
        rendezvous.meet(coordinator, 3, 0, 1, environ={})


@pytest.mark.parametrize("args, sentence", [
    (("h:1", 0, 0), "--num-processes must be at least 1, not 0."),
    (("h:99999", 2, 0), "--coordinator must be HOST:PORT"),
])
def test_launch_settings_refuse_a_count_or_port_that_cannot_be(args, sentence):
    """Was: "--process-id must be between 0 and --num-processes - 1 (-1)"; and a port above
    65535 went on to the meeting, where (measured) both processes waited out the whole
    timeout and then blamed each other ("did not reach", "could not reach")."""
    with pytest.raises(UserError, match=sentence.replace(".", r"\.")):
        distributed.launch_settings(*args, environ={})


def test_a_failed_gloo_collective_is_a_lost_peer_even_under_a_checkpoint_save():
    """A peer killed mid-run fails gloo's collective with a ValueError in jax 0.10.2
    (measured: `UNKNOWN: Gloo AllGather failed: ... Connection reset by peer`), also inside a
    checkpoint save, which the runner turns into a write error ("make room or fix the
    folder"): both must read as a lost peer, exit 3, naming the collective's error."""
    gloo = ValueError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error "
                      "[127.0.0.1]:26549: Connection reset by peer")
    code, sentence = distributed._describe(gloo)
    assert code == distributed.EXIT_LOST_PEER == 3
    assert sentence.startswith("process 0 of 1 lost its peers (UNKNOWN: Gloo AllGather failed")
    try:
        try:
            raise RuntimeError(f"checkpoint: {gloo}") from gloo
        except RuntimeError:
            raise OSError("could not write run folder: make room or fix the folder") from None
    except OSError as write_error:
        code, sentence = distributed._describe(write_error)
    assert code == 3 and "lost its peers (UNKNOWN: Gloo AllGather failed" in sentence
    code, sentence = distributed._describe(ValueError("a bug of ours"))
    assert code == 3 and "could not run: ValueError: a bug of ours" in sentence
    # The runner's own WriteError (a CouldNotRun: its sentence whole, not "a bug") still
    # reads as a lost peer when a failed collective is behind it.
    from sdcstudy.runner import WriteError

    try:
        raise WriteError("could not write run folder 'r': make room or fix the folder") from gloo
    except WriteError as write_error:
        code, sentence = distributed._describe(write_error)
    assert code == 3 and "lost its peers (UNKNOWN: Gloo AllGather failed" in sentence
    code, sentence = distributed._describe(WriteError("could not write run folder 'r'."))
    assert code == 3 and sentence == "process 0 of 1: could not write run folder 'r'."


def test_a_device_out_of_memory_is_no_lost_peer():
    """XLA's allocation failure is a JaxRuntimeError, which a run of several processes read as
    a failed collective ("lost its peers"): it is the setup's size, said as one process says it."""
    import jax

    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating "
                                     "17932051265668 bytes.")
    code, sentence = distributed._describe(oom)
    assert code == 3 and "lost its peers" not in sentence
    assert "ran out of memory (XLA asked for 17.9 TB at once)" in sentence


def test_a_mode_that_runs_in_one_process_is_refused_on_two():
    """`train` on two processes trained a copy on each and failed at its first checkpoint
    ("Cannot serialize host local jax.Array", exit 3 on both): refused before anything runs."""
    from sdcstudy import modes
    from sdcstudy.core import config as C
    from sdcstudy.core.errors import ConfigError

    for mode in ("train", "abft", "paft", "detect"):
        with pytest.raises(ConfigError, match=f"experiment.mode {mode} runs in one process, "
                                              f"not 2; only lockstep, paramsync, free, finetune"):
            modes.check_processes(C.from_dict({"experiment": {"mode": mode}}), 2)
        modes.check_processes(C.from_dict({"experiment": {"mode": mode}}), 1)
    for mode in ("lockstep", "paramsync", "free", "finetune"):
        modes.check_processes(C.from_dict({"experiment": {"mode": mode}}), 2)


def _fake_processes(monkeypatch, local_counts):
    devices = [types.SimpleNamespace(process_index=p, id=p * 100 + k)
               for p, n in enumerate(local_counts) for k in range(n)]
    monkeypatch.setattr(jax, "process_count", lambda: len(local_counts))
    monkeypatch.setattr(jax, "devices", lambda: devices)


def test_scratch_folders_of_processes_gone_are_removed_by_the_next(tmp_path, monkeypatch):
    """Process 1 keeps a copy of its tables in a scratch folder; killed (SIGKILL, or jax ending
    it once the coordinator is gone) it cannot remove it, and such folders piled up in the
    temporary directory. The next process removes those of this host's processes that no
    longer run, and no other."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead, host = int(ended.stdout), socket.gethostname().replace("-", "_")
    stale = tmp_path / f"sdcstudy-peer-{host}-{dead}-abc"
    stale.mkdir()
    (stale / "metrics.jsonl").write_text("{}\n")
    alive = tmp_path / f"sdcstudy-peer-{host}-{os.getpid()}-def"
    elsewhere = tmp_path / f"sdcstudy-peer-otherhost-{dead}-ghi"
    for kept in (alive, elsewhere):
        kept.mkdir()
    with distributed.scratch_folder() as scratch:
        assert scratch.is_dir() and scratch.parent == tmp_path
        assert not stale.exists() and alive.is_dir() and elsewhere.is_dir()
    assert not scratch.exists()


def test_mesh_sentences_say_one_device_node_and_process_in_the_singular(monkeypatch):
    """Was: "process 1 has 1 devices", "the mesh has 1 nodes; start 1 processes"."""
    _fake_processes(monkeypatch, [2, 1])
    with pytest.raises(UserError, match=r"^process 1 has 1 device but a node needs 2 "):
        M.make_node_mesh(2, dp=2)
    with pytest.raises(UserError, match=r"the mesh has 1 node; start 1 process\.$"):
        M.make_node_mesh(1)
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"but only 8 are visible"):
        M.make_mesh(2, 8)
    with pytest.raises(UserError, match=r"but only 1 is visible"):
        M.make_mesh(2, devices=jax.devices()[:1])


@pytest.mark.parametrize("processes", [3, 4])
def test_a_paired_mode_on_more_than_two_processes_is_refused_by_every_process_alike(
        monkeypatch, processes):
    """docs/pairing.md: a paired mode needs exactly two processes. Started on 3, the mesh
    refused it with a plain error on each process: process 0 left at once and process 2, a
    moment later, was ended by jax with a C++ abort (exit 134; measured on loopback, tiny
    lockstep). The refusal is a `SharedRefusal`, so that every process leaves through jax's
    shutdown barrier with the sentence."""
    from sdcstudy.core.distributed import SharedRefusal
    from sdcstudy.paired.trainer import PairedTrainer

    monkeypatch.setattr(jax, "process_count", lambda: processes)
    cfg = C.load("configs/tiny.yaml", ["experiment.mode=lockstep"])
    with pytest.raises(SharedRefusal, match=f"^a paired mode runs on two processes \\(node i "
                                            f"on process i\\), not {processes}: start 2 "
                                            f"processes"):
        PairedTrainer.from_config(cfg)
