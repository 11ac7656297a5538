"""Two real processes, one node each, paired through `jax.distributed` on loopback (gloo).

Each process sees one CPU device (its node); the same run in one process with two simulated
devices must give the same bits: both run the same shard_map program, and the cross-node
all-gathers and masked integer sums only move bits. If the two-process files differ, then
global arrays are built or fetched wrongly (`hostarrays.put` / `fetch`) or node i is not
on process i.

Every subprocess has a hard deadline and is killed by its pid, also when a test fails. A shared
persistent compilation cache lets the dead-peer run reuse the two-process program.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from bitwise import bits, state_bits
from sdcstudy.core import config as C
from sdcstudy.core import data as D
from sdcstudy.core import distributed, portholders, rendezvous, xlaflags
from sdcstudy.core import runfolder as RF
from sdcstudy.core import tablelog as TL

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
    if xlaflags.xla_knows_flag(xlaflags.COLLECTIVE_TIMEOUT_FLAG):
        # The same in every run, whatever --timeout says: XLA flags are part of the
        # compilation cache key, and a killed peer fails a collective at once anyway.
        flags.append(f"{xlaflags.COLLECTIVE_TIMEOUT_FLAG}={RUN_TIMEOUT_S}")
    (root / "tmp").mkdir(exist_ok=True)  # the processes' temporary folders, looked at below
    env.update({"XLA_FLAGS": " ".join(flags), "TMPDIR": str(root / "tmp"),
                "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "PYTHONUNBUFFERED": "1"})
    return env


class Processes:
    """Subprocesses with their logs; `stop` kills (by pid) whatever still runs."""

    def __init__(self, root: Path):
        self.root, self.procs = root, {}

    def start(self, name, args, devices, **env):
        log = open(self.root / f"{name}.log", "w")
        cmd = [sys.executable, "-m", "sdcstudy", "run", str(self.root / "config.yaml"), *args,
               "--no-progress"]
        self.procs[name] = (subprocess.Popen(cmd, env={**_env(self.root, devices), **env},
                                             stdout=log, stderr=subprocess.STDOUT), log)
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


# Lock-step carries the taps' comparisons across the processes; parameter sync the healthy
# node's parameters (free running and fine-tuning, which runs the pair free, matched as well
# when checked by hand, 2026-12-01: each costs a pair of processes more).
@pytest.mark.parametrize("mode", ["lockstep", "paramsync"])
def test_two_processes_match_one_process_bit_for_bit(setup, processes, mode):
    multi, single = setup / f"multi-{mode}", setup / f"single-{mode}"
    mode_set = ["--set", f"experiment.mode={mode}"]
    # The one-process reference runs beside the pair: three processes on two cores.
    processes.start("single", ["--out", str(single), *mode_set], devices=2)
    _pair(processes, "pair", multi, _free_port(), *mode_set)
    codes = processes.wait()
    assert set(codes.values()) == {0}, processes.logs()

    env = RF.json_load(multi / RF.ENV)
    assert (env["process_count"], env["device_count"], env["local_device_count"]) == (2, 2, 1)
    assert (multi / RF.CHECKPOINTS / "3").is_dir()  # both processes took part in the save
    # The whole final state (each node's parameters and optimizer state, the step counter):
    # each process wrote its node's shards, read back here as whole arrays.
    assert state_bits(multi) == state_bits(single)
    assert bits(_metrics(multi)) == bits(_metrics(single))
    assert [r["step"] for r in _metrics(multi)] == [1, 2, 3]
    tables = (RF.MISMATCH, RF.FAULTS) if mode == "lockstep" else (RF.FAULTS,)
    for table in tables:
        a, b = TL.read_table(multi / table), TL.read_table(single / table)
        assert len(a) > 0
        pd.testing.assert_frame_equal(a, b, check_exact=True)
        assert bits(a) == bits(b)
    if mode == "lockstep":
        assert TL.read_table(multi / RF.MISMATCH)["mismatches"].sum() > 0
    else:  # the suspect's faults moved its gradient, and the sync undid it each step
        assert not (multi / RF.MISMATCH).exists()
        assert max(row["grad/diff_l2"] for row in _metrics(multi)) > 0
    assert _summary(multi)["param_digest"] == _summary(single)["param_digest"]
    assert bits(_summary(multi)) == bits(_summary(single))


def test_dead_peer_ends_the_run_with_a_clear_error(setup, processes):
    """Process 1 is killed once both have joined; process 0 must fail its first collective
    and exit 3 (could not run, not a FAIL) with one line naming the lost peer, within a bounded
    time, never hang. (The compiled step is in the cache when the test above ran first.)

    While both run, jax's coordinator must listen on 127.0.0.1 alone, the address given (it
    listened on every interface before)."""
    out, port = setup / "dead", _free_port()
    first, second = _pair(processes, "dead", out, port, timeout=DEAD_PEER_TIMEOUT_S)
    end = time.monotonic() + DEADLINE_S
    while not all("joined the run" in processes.log(f"dead-p{i}") for i in range(2)):
        assert first.poll() is None and second.poll() is None, processes.logs()
        assert time.monotonic() < end, "the pair never joined:\n" + processes.logs()
        time.sleep(0.1)
    assert portholders.listeners(port) == [("127.0.0.1", first.pid)]
    os.kill(second.pid, signal.SIGKILL)
    killed = time.monotonic()
    codes = processes.wait(deadline_s=DEAD_PEER_TIMEOUT_S)
    assert time.monotonic() - killed < DEAD_PEER_TIMEOUT_S
    assert codes["dead-p0"] == distributed.EXIT_LOST_PEER == 3, processes.logs()
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
    assert xlaflags.xla_knows_flag("--xla_force_host_platform_device_count")
    assert not xlaflags.xla_knows_flag("--xla_no_such_flag_in_any_version")
    assert not xlaflags.xla_knows_flag("--xla_force_host_platform_device")  # begins one


@pytest.mark.parametrize("flag", [
    xlaflags.COLLECTIVE_TIMEOUT_FLAG,
    "--xla_cpu_collective_timeout",  # begins the flag above
    "--xla_cpu_collective_call_warn_stuck_seconds",  # in the library, but no flag XLA parses
])
def test_xla_knows_a_flag_exactly_when_xla_starts_with_it(flag):
    """`xla_knows_flag` against XLA itself: a backend started with `flag` in XLA_FLAGS aborts
    on an unknown flag. The heuristic said yes to the last two before it read the name's end."""
    env = {**os.environ, "XLA_FLAGS": f"{flag}=5", "JAX_PLATFORMS": "cpu"}
    started = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                             capture_output=True, timeout=120).returncode == 0
    assert xlaflags.xla_knows_flag(flag) == started


# --- launch mistakes: one sentence each, before any JAX program compiles --------------------

REFUSAL_TIMEOUT_S = 30  # --timeout of the refusals below; jax aborted after it before
REFUSAL_DEADLINE_S = 60


def _launch(processes, name, out, port, num_processes, process_id):
    return processes.start(name, ["--out", str(out), "--coordinator", f"127.0.0.1:{port}",
                                  "--num-processes", str(num_processes),
                                  "--process-id", str(process_id),
                                  "--timeout", str(REFUSAL_TIMEOUT_S)], devices=1)


def _refused(processes, sentence_start: str) -> dict[str, str]:
    """Every process exits 2 with one error line starting `sentence_start`, no C++ stack and
    no traceback; returns each process's error line."""
    codes = processes.wait(deadline_s=REFUSAL_DEADLINE_S)
    assert set(codes.values()) == {2}, processes.logs()
    lines = {}
    for name in codes:
        log = processes.log(name)
        assert "Check failure" not in log and "Traceback" not in log, processes.logs()
        errors = [line for line in log.splitlines() if line.startswith("sdcstudy: error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"sdcstudy: error: {sentence_start}"), \
            processes.logs()
        lines[name] = errors[0]
    return lines


def test_a_port_in_use_is_refused_naming_its_holder(setup, processes):
    """Process 0 cannot listen on its coordinator port: one sentence naming the address and
    the process holding it (this test), at once (was: "could not join ... Failed to start RPC
    server", while its peer aborted S later)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        _launch(processes, "busy-p0", setup / "busy", port, 2, 0)
        [line] = _refused(processes, f"process 0 of 2 cannot listen on 127.0.0.1:{port} "
                                     f"for its peers: the port is in use by pid "
                                     f"{os.getpid()} (").values()
    assert "choose a free port for --coordinator" in line


def test_processes_that_disagree_on_the_count_each_say_so(setup, processes):
    """Process 0 of 3 and process 1 of 2: both exit 2 with the same sentence naming both
    counts (was: SIGABRT with a C++ stack in `CoordinationServiceAgent::Connect`)."""
    port = _free_port()
    first = _launch(processes, "count-p0", setup / "count", port, 3, 0)
    second = _launch(processes, "count-p1", setup / "count", port, 2, 1)
    lines = _refused(processes, f"process 1 (pid {second.pid} on ")
    for line in lines.values():
        assert f"was started with --num-processes 2 and process 0 (pid {first.pid} on " in line
        assert line.endswith("with 3: start every process with the same --num-processes.")


@pytest.mark.parametrize("num_processes, duplicate", [(3, 1), (2, 0)])
def test_two_processes_with_one_id_each_say_so(setup, processes, num_processes, duplicate):
    """Two processes given the same --process-id: every process exits 2 with one sentence
    naming the id and both pids (was: SIGABRT, or one of them aborting while the others ran
    on). A second process 0 finds the port taken and hears the sentence from the first (each
    with its own --out, as on two hosts: one shared folder is refused by its lock first); the
    others share process 0's --out, as they must (another --out is refused for itself)."""
    port = _free_port()
    ids = [0, 1, 1] if duplicate else [0, 0]
    started = [_launch(processes, f"dup{duplicate}-{k}",
                       setup / f"dup{duplicate}-{k if duplicate == 0 else 0}", port,
                       num_processes, i) for k, i in enumerate(ids)]
    lines = _refused(processes, f"two processes were started with --process-id {duplicate} (")
    twins = [p.pid for p, i in zip(started, ids) if i == duplicate]
    for line in lines.values():
        assert all(f"pid {pid} on " in line for pid in twins), line
        assert line.endswith(f"give each process its own id, from 0 to {num_processes - 1}.")


def test_processes_started_with_another_setting_are_refused(setup, processes):
    """The suspect started with another optim.lr ran to the end beside the healthy node, both
    exiting 0, its divergence recorded as SDC under process 0's config.yaml: now both exit 2
    with one sentence naming the setting and both values, before anything compiles."""
    port = _free_port()
    out = setup / "other-lr"
    first = processes.start("lr-p0", ["--out", str(out), "--coordinator", f"127.0.0.1:{port}",
                                      "--num-processes", "2", "--process-id", "0",
                                      "--timeout", str(REFUSAL_TIMEOUT_S)], devices=1)
    processes.start("lr-p1", ["--out", str(out), "--coordinator", f"127.0.0.1:{port}",
                              "--num-processes", "2", "--process-id", "1", "--set",
                              "optim.lr=0.01", "--timeout", str(REFUSAL_TIMEOUT_S)], devices=1)
    for line in _refused(processes, "process 1 (pid ").values():
        assert "was started with optim.lr=0.01 and process 0 " in line
        assert f"(pid {first.pid} on " in line
        assert line.endswith("start every process with the same config file and --set values.")
    assert not (out / "checkpoints").exists()


# Imported by a process at start-up (PYTHONPATH): it reaches MODULE.FUNCTION 5 s late, as a
# loaded host would.
LATE = """\
import time
from {module} import {name} as _module
_function = _module.{function}
def _late(*args, **kwargs):
    time.sleep(5)
    return _function(*args, **kwargs)
_module.{function} = _late
"""


def _late_pair(processes, setup, tag, late_at, *extra, devices=(1, 1)):
    """Two processes of one run, process 1 reaching `late_at` ("package.module:function") 5 s
    after process 0 would (`LATE`)."""
    port = _free_port()
    module, function = late_at.split(":")
    folder = setup / f"late-{tag}"
    folder.mkdir(exist_ok=True)
    package, _, name = module.rpartition(".")
    (folder / "sitecustomize.py").write_text(LATE.format(module=package, name=name,
                                                         function=function))
    late = {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    for i in range(2):
        processes.start(f"{tag}-p{i}", ["--out", str(setup / tag), "--coordinator",
                                        f"127.0.0.1:{port}", "--num-processes", "2",
                                        "--process-id", str(i), *extra,
                                        "--timeout", str(REFUSAL_TIMEOUT_S)],
                        devices=devices[i], **(late if i else {}))


def test_a_process_short_of_devices_is_refused_by_every_process(setup, processes):
    """mesh.dp=2 with process 1 holding one CPU device: both exit 2 with one sentence naming
    process 1 (was: process 0 exited 2 when it built the mesh, and process 1, still preparing
    its data, was ended by jax once the coordinator had gone, with a C++ stack, exit 134).
    Process 1 is slow here to reach its mesh, as a loaded host is."""
    _late_pair(processes, setup, "short", "sdcstudy.core.mesh:make_node_mesh",
               "--set", "mesh.dp=2", devices=(2, 1))
    for line in _refused(processes, "process ").values():
        assert line.endswith("of 2: process 1 has 1 device but a node needs 2 (dp=2 x tp=1); "
                             "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=2 "
                             "on every process."), line
    assert not (setup / "short" / "checkpoints").exists()


def test_a_one_process_mode_on_two_processes_is_refused_by_both(setup, processes):
    """experiment.mode abft (one process) started as two: both exit 2 with the one sentence
    (was: process 0 exited at once, and process 1, slow to reach the check, was ended by jax
    when the coordinator went, with a C++ stack)."""
    _late_pair(processes, setup, "one", "sdcstudy.modes:check_processes",
               "--set", "experiment.mode=abft")
    for line in _refused(processes, "process ").values():
        assert line.endswith("experiment.mode abft runs in one process, not 2; only lockstep, "
                             "paramsync, free, finetune pair processes (docs/pairing.md)."), line
    assert not (setup / "one" / "checkpoints").exists()


def _slurm_task(processes, name, out, port, task, *extra):
    """One task of a two-task Slurm step on this host, as srun would start it: no launch
    flags, jax's Slurm detection finds the coordinator (this host, `port`), count and id."""
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
             "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task),
             "JAX_COORDINATOR_PORT": str(port)}
    return processes.start(name, ["--out", str(out), "--timeout", str(RUN_TIMEOUT_S), *extra],
                           devices=1, **slurm)


def test_slurm_tasks_started_alike_run_and_started_otherwise_are_refused(setup, processes):
    """Under Slurm's detection there is no meeting before jax. A task started with another
    optim.lr then ran to the end beside the healthy one, its divergence recorded as SDC; now
    both tasks exit 2 with the meeting's sentence, compared once they joined. Tasks started
    alike run the pair to its end (the comparison refuses nothing they legitimately differ in:
    pids, hosts, task ids)."""
    port, out = _free_port(), setup / "slurm-other"
    first = _slurm_task(processes, "slurm-other-p0", out, port, 0)
    _slurm_task(processes, "slurm-other-p1", out, port, 1, "--set", "optim.lr=0.01")
    for line in _refused(processes, "process ").values():
        assert "process 1 (pid " in line and "was started with optim.lr=0.01 and process 0 " \
            f"(pid {first.pid} on " in line, line
        assert line.endswith("start every process with the same config file and --set values.")
    assert not (out / RF.CHECKPOINTS).exists()

    port, out = _free_port(), setup / "slurm-alike"
    alike = Processes(setup)
    try:
        for task in range(2):
            _slurm_task(alike, f"slurm-alike-p{task}", out, port, task)
        assert set(alike.wait().values()) == {0}, alike.logs()
    finally:
        alike.stop()
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3]
    assert TL.read_table(out / RF.MISMATCH)["mismatches"].sum() > 0  # the pair compared
    assert RF.json_load(out / RF.ENV)["process_count"] == 2


def test_the_meeting_binds_the_address_given_and_names_a_ports_holder(monkeypatch):
    """`bind_address`: an IP as given, a name as resolved, this host's own name mapped to
    loopback only (Debian's 127.0.1.1) and a name that does not resolve on every interface,
    JAX_COORDINATOR_BIND_ADDRESS first; `listeners` finds a listening socket's address and pid
    in /proc."""
    monkeypatch.setattr(socket, "gethostname", lambda: "healthy-host")
    assert rendezvous.bind_address("127.0.0.1:4100", {}) == "127.0.0.1:4100"
    assert rendezvous.bind_address("[::1]:4100", {}) == "[::1]:4100"
    assert rendezvous.bind_address("localhost:4100", {}) == "localhost:4100"
    assert rendezvous.bind_address("h:1", {rendezvous.ENV_BIND: "0.0.0.0:1"}) == "0.0.0.0:1"
    monkeypatch.setattr(rendezvous, "_resolve",
                        lambda host, port: [(socket.AF_INET, ("127.0.1.1", port))])
    assert rendezvous.bind_address("healthy-host:4100", {}) == "[::]:4100"
    assert rendezvous.bind_address("other-host:4100", {}) == "other-host:4100"

    def unknown(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(rendezvous, "_resolve", unknown)
    assert rendezvous.bind_address("pair-0.pair:4100", {}) == "[::]:4100"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        assert portholders.listeners(server.getsockname()[1]) == []
        server.listen()
        assert portholders.listeners(server.getsockname()[1]) == [("127.0.0.1", os.getpid())]


def test_a_signal_to_one_process_stops_both_at_the_same_checkpoint(setup, processes):
    """A scheduler may signal the processes of a run at different moments, or only one. The
    one signalled must not stop alone: its peer would wait in the next step's collective and
    the save would wait for the peer, until the timeout ends both as lost peers (exit 3) with
    nothing checkpointed. Every process asks the others at each safe point
    (`interrupts.stop_signal`), so both finish the same step, save it together and exit 143."""
    out, port = setup / "signalled", _free_port()
    scratch = set((setup / "tmp").glob("sdcstudy-peer-*"))
    first, second = _pair(processes, "signal", out, port, "--set", "experiment.steps=2000",
                          "--set", "experiment.checkpoint_every=5")
    end = time.monotonic() + DEADLINE_S
    while not (out / RF.CHECKPOINTS / "5").is_dir():
        assert first.poll() is None and second.poll() is None, processes.logs()
        assert time.monotonic() < end, "the pair never reached step 5:\n" + processes.logs()
        time.sleep(0.1)
    os.kill(second.pid, signal.SIGTERM)
    codes = processes.wait()
    assert codes == {"signal-p0": 143, "signal-p1": 143}, processes.logs()
    stopped = [re.search(r"the latest checkpoint is step (\d+)", processes.log(f"signal-p{i}"))
               for i in range(2)]
    assert all(stopped), processes.logs()
    step = int(stopped[0].group(1))
    assert int(stopped[1].group(1)) == step and 5 <= step < 2000
    assert (out / RF.CHECKPOINTS / str(step)).is_dir()
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 1))
    # Process 1's scratch folder (it writes no run folder) is gone with it.
    assert set((setup / "tmp").glob("sdcstudy-peer-*")) == scratch
