"""Two real processes, one node each, paired through `jax.distributed` on loopback (gloo).

Each process sees one CPU device (its node); the same run in one process with two simulated
devices must give the same bits: both run the same shard_map program, and the cross-node
all-gathers and masked integer sums only move bits. If the two-process files differ, then
global arrays are built or fetched wrongly (`distributed.put` / `fetch`) or node i is not
on process i.

Every subprocess has a hard deadline and is killed by its pid, also when a test fails. A shared
persistent compilation cache lets the dead-peer run reuse the two-process program.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from sdcstudy.core import config as C
from sdcstudy.core import data as D
from sdcstudy.core import distributed
from sdcstudy.core import runfolder as RF

RUN_TIMEOUT_S = 120  # --timeout of the runs: start-up, heartbeats, each collective
DEADLINE_S = 240  # hard limit for one group of processes
DEAD_PEER_TIMEOUT_S = 60  # longer than process 0 needs to reach its first step

# Count-based faults, so that a few steps of a tiny model always have mismatches and faults to
# carry across the processes.
PROFILE = """\
name: two-sites
specs:
  - {site: fwd/attn, kind: bitflip, count: 2, bit_class: any}
  - {site: bwd/ffn, kind: random, count: 1, value_std: 3.0}
"""
CONFIG = {"experiment": {"mode": "lockstep", "steps": 3, "batch_size": 4, "microsteps": 2,
                         "checkpoint_every": 0},
          "model": {"n_layers": 1}, "optim": {"warmup_steps": 1}, "data": {"seq_len": 32}}
TIMING_KEYS = ("compile_s", "wall_time_s", "tokens_per_s")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    (root / "profile.yaml").write_text(PROFILE)
    cfg = {**CONFIG, "suspect": {"profile": str(root / "profile.yaml")}}
    RF.atomic_write_text(root / "config.yaml", json.dumps(cfg))
    loaded = C.load(root / "config.yaml")
    D.prepare(loaded.data, loaded.experiment.seed)  # once, not in three processes at a time
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(root: Path, devices: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SDCSTUDY_COORDINATOR", "SDCSTUDY_NUM_PROCESSES",
                                "SDCSTUDY_PROCESS_ID", "SDCSTUDY_TIMEOUT_S"))}
    flags = [f"--xla_force_host_platform_device_count={devices}"]
    if distributed.xla_knows_flag(distributed.COLLECTIVE_TIMEOUT_FLAG):
        # The same in every run, whatever --timeout says: XLA flags are part of the
        # compilation cache key, and a killed peer fails a collective at once anyway.
        flags.append(f"{distributed.COLLECTIVE_TIMEOUT_FLAG}={RUN_TIMEOUT_S}")
    env.update({"XLA_FLAGS": " ".join(flags),
                "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "PYTHONUNBUFFERED": "1"})
    return env


class Processes:
    """Subprocesses with their logs; `stop` kills (by pid) whatever still runs."""

    def __init__(self, root: Path):
        self.root, self.procs = root, {}

    def start(self, name, args, devices):
        log = open(self.root / f"{name}.log", "w")
        cmd = [sys.executable, "-m", "sdcstudy", "run", str(self.root / "config.yaml"), *args,
               "--no-progress"]
        self.procs[name] = (subprocess.Popen(cmd, env=_env(self.root, devices), stdout=log,
                                             stderr=subprocess.STDOUT), log)
        return self.procs[name][0]

    def log(self, name) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def wait(self, deadline_s=DEADLINE_S) -> dict:
        end = time.monotonic() + deadline_s
        for proc, _ in self.procs.values():
            try:
                proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        late = [name for name, (proc, _) in self.procs.items() if proc.poll() is None]
        self.stop()
        assert not late, f"{late} still ran after {deadline_s} s:\n" + self.logs()
        return {name: proc.returncode for name, (proc, _) in self.procs.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.log(name)[-3000:]}" for name in self.procs)

    def stop(self):
        for proc, log in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


@pytest.fixture
def processes(setup):
    group = Processes(setup)
    yield group
    group.stop()


def _pair(processes, tag, out, port, *extra, timeout=RUN_TIMEOUT_S):
    return [processes.start(f"{tag}-p{i}",
                            ["--out", str(out), "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", "2", "--process-id", str(i),
                             "--timeout", str(timeout), *extra], devices=1)
            for i in range(2)]


def _metrics(run_dir):
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in RF.read_jsonl(run_dir / RF.METRICS)]


def _summary(run_dir):
    summary = RF.json_load(run_dir / RF.SUMMARY)
    return {k: v for k, v in summary.items() if k not in TIMING_KEYS}


def test_two_processes_match_one_process_bit_for_bit(setup, processes):
    multi, single = setup / "multi", setup / "single"
    # The one-process reference runs beside the pair: three processes on two cores.
    processes.start("single", ["--out", str(single)], devices=2)
    _pair(processes, "pair", multi, _free_port())
    codes = processes.wait()
    assert set(codes.values()) == {0}, processes.logs()

    env = RF.json_load(multi / RF.ENV)
    assert (env["process_count"], env["device_count"], env["local_device_count"]) == (2, 2, 1)
    assert (multi / RF.CHECKPOINTS / "3").is_dir()  # both processes took part in the save
    assert _metrics(multi) == _metrics(single)
    assert [r["step"] for r in _metrics(multi)] == [1, 2, 3]
    for table in (RF.MISMATCH, RF.FAULTS):
        a, b = RF.read_table(multi / table), RF.read_table(single / table)
        assert len(a) > 0
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert RF.read_table(multi / RF.MISMATCH)["mismatches"].sum() > 0
    assert _summary(multi)["param_digest"] == _summary(single)["param_digest"]
    assert _summary(multi) == _summary(single)


def test_dead_peer_ends_the_run_with_a_clear_error(setup, processes):
    """Process 1 is killed once both have joined; process 0 must fail its first collective
    and exit non-zero with one line naming the lost peer, within a bounded time, never hang.
    (The compiled step is in the cache when the test above ran first.)"""
    out = setup / "dead"
    first, second = _pair(processes, "dead", out, _free_port(), timeout=DEAD_PEER_TIMEOUT_S)
    end = time.monotonic() + DEADLINE_S
    while not all("joined the run" in processes.log(f"dead-p{i}") for i in range(2)):
        assert first.poll() is None and second.poll() is None, processes.logs()
        assert time.monotonic() < end, "the pair never joined:\n" + processes.logs()
        time.sleep(0.1)
    os.kill(second.pid, signal.SIGKILL)
    killed = time.monotonic()
    codes = processes.wait(deadline_s=DEAD_PEER_TIMEOUT_S)
    assert time.monotonic() - killed < DEAD_PEER_TIMEOUT_S
    assert codes["dead-p0"] == distributed.EXIT_LOST_PEER, processes.logs()
    assert "sdcstudy: error: process 0 of 2 lost its peers" in processes.log("dead-p0"), \
        processes.logs()
    assert not (out / RF.SUMMARY).exists()


def test_launch_settings_from_arguments_environment_and_slurm():
    """What decides between one process and several, and the mistakes it names."""
    assert distributed.launch_settings(environ={}) is None
    launch = distributed.launch_settings("h:1234", 2, 1, environ={})
    assert (launch.coordinator, launch.num_processes, launch.process_id, launch.detect) == \
        ("h:1234", 2, 1, False)
    assert launch.timeout_s == distributed.DEFAULT_TIMEOUT_S
    env = {"SDCSTUDY_COORDINATOR": "h:9", "SDCSTUDY_NUM_PROCESSES": "2",
           "SDCSTUDY_PROCESS_ID": "0", "SDCSTUDY_TIMEOUT_S": "7"}
    launch = distributed.launch_settings(environ=env)
    assert (launch.coordinator, launch.process_id, launch.timeout_s) == ("h:9", 0, 7)
    assert distributed.launch_settings(process_id=1, environ=env).process_id == 1
    slurm = {"SLURM_JOB_ID": "5", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    assert distributed.launch_settings(environ=slurm).detect
    assert distributed.launch_settings(environ={**slurm, "SLURM_NTASKS": "1"}) is None
    with pytest.raises(C.UserError, match="--process-id is missing"):
        distributed.launch_settings("h:1", 2, environ={})
    with pytest.raises(C.UserError, match="between 0 and"):
        distributed.launch_settings("h:1", 2, 2, environ={})
    with pytest.raises(C.UserError, match="HOST:PORT"):
        distributed.launch_settings("h", 2, 0, environ={})
    assert distributed.xla_knows_flag("--xla_force_host_platform_device_count")
    assert not distributed.xla_knows_flag("--xla_no_such_flag_in_any_version")
