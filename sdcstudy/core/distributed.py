"""Each node of a pair in its own process: joining the run and ending it together.

A paired run on two processes puts node i on process i (`mesh.make_node_mesh`); both run the
same shard_map step, whose all-gathers and sums over `node` cross between the processes (gloo
over TCP on CPU, NCCL on GPU). Nothing in the step changes: only the host side does.

- `initialize` joins the run through `jax.distributed` with one timeout S for what waits on
  a peer: start-up, shutdown and (on CPU) each collective; a peer silent for 2 S is dead. A
  dead or stuck peer ends the run with an error instead of a hang. Before jax, the processes
  meet over a plain socket (`rendezvous`), so that a launch mistake (a port in use, another
  process count, an id twice, other versions or `run_settings`) ends with one sentence.
  `meet_peers` then runs the first collective while the processes are together; every process
  refuses alike one short of devices (`check_devices`) and, under Slurm's detection (no
  meeting), other versions or settings (`compare_settings`).
- `ends_together` turns any error of a multi-process run into one line and an immediate exit:
  the shutdown handshake at interpreter exit would otherwise wait for peers that never come.

Settings come from arguments, else `SDCSTUDY_COORDINATOR`, `SDCSTUDY_NUM_PROCESSES`,
`SDCSTUDY_PROCESS_ID` and `SDCSTUDY_TIMEOUT_S`, else (inside a Slurm step of several tasks)
from jax's own Slurm detection. None of them means one process, as before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sdcstudy.core import errors, rendezvous, xlaflags
from sdcstudy.core.config import UserError
from sdcstudy.core.errors import first_line

ENV_COORDINATOR = "SDCSTUDY_COORDINATOR"
ENV_NUM_PROCESSES = "SDCSTUDY_NUM_PROCESSES"
ENV_PROCESS_ID = "SDCSTUDY_PROCESS_ID"
ENV_TIMEOUT = "SDCSTUDY_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
              "SLURM_LOCALID")
EXIT_LOST_PEER = errors.EXIT_COULD_NOT_RUN  # not a FAIL: nothing was compared
FAILED_STATUSES = ("UNKNOWN", "INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED",
                   "CANCELLED", "DATA_LOSS")


@dataclass(frozen=True)
class Launch:
    """How this process joins a run; None fields are left to jax's Slurm detection."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    timeout_s: int
    detect: bool = False


def _int_setting(value, env_name: str, what: str, environ) -> int | None:
    raw = value if value is not None else environ.get(env_name) or None
    if raw is None:
        return None
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise UserError(f"{what} must be an integer, not {raw!r} (from {env_name} or the "
                        f"command line).") from None


def in_slurm_step(environ=None) -> bool:
    """True inside a Slurm step of several tasks, where jax can find the peers by itself."""
    environ = os.environ if environ is None else environ
    return all(v in environ for v in SLURM_VARS) and environ["SLURM_NTASKS"].isdigit() \
        and int(environ["SLURM_NTASKS"]) > 1


def launch_settings(coordinator: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None, timeout_s: int | None = None,
                    environ=None) -> Launch | None:
    """Arguments first, then SDCSTUDY_* variables, then Slurm; None for a one-process run."""
    environ = os.environ if environ is None else environ
    coordinator = coordinator or environ.get(ENV_COORDINATOR) or None
    num_processes = _int_setting(num_processes, ENV_NUM_PROCESSES, "the number of processes",
                                 environ)
    process_id = _int_setting(process_id, ENV_PROCESS_ID, "the process id", environ)
    timeout_s = _int_setting(timeout_s, ENV_TIMEOUT, "the timeout", environ)
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    if timeout_s < 1:
        raise UserError(f"the timeout must be at least 1 second, not {timeout_s}.")
    given = {"--coordinator": coordinator, "--num-processes": num_processes,
             "--process-id": process_id}
    missing = [flag for flag, value in given.items() if value is None]
    if len(missing) == len(given):
        return Launch(None, None, None, timeout_s, detect=True) if in_slurm_step(environ) \
            else None
    if missing:
        if in_slurm_step(environ):
            return Launch(coordinator, num_processes, process_id, timeout_s, detect=True)
        raise UserError(f"a run on several processes needs --coordinator HOST:PORT, "
                        f"--num-processes N and --process-id I (or {ENV_COORDINATOR}, "
                        f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} missing.")
    if num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, not {num_processes}.")
    if not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be between 0 and --num-processes - 1 "
                        f"({num_processes - 1}), not {process_id}.")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--coordinator must be HOST:PORT (process 0's address), "
                        f"not {coordinator!r}.")
    if num_processes == 1:
        return None
    return Launch(coordinator, num_processes, process_id, timeout_s)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout_s: int | None = None,
               run: dict | None = None) -> bool:
    """Join a run of several processes before JAX starts; False (and nothing done) for one.

    With explicit settings every local device stays visible (process i holds all of node i's
    devices; `JAX_LOCAL_DEVICE_IDS` narrows them); under Slurm jax detects the rest. `run`
    (`run_settings`) must be the same on every process, or the meeting refuses the run.
    """
    launch = launch_settings(coordinator, num_processes, process_id, timeout_s)
    if launch is None:
        return False
    seconds = launch.timeout_s
    who = "this process" if launch.detect else \
        f"process {launch.process_id} of {launch.num_processes}"
    where = launch.coordinator or "the Slurm job's first node"
    print(f"sdcstudy: {who} waiting up to {seconds} s for its peers at {where}",
          file=sys.stderr, flush=True)
    # Before importing jax, so that a launch mistake is refused in a moment; a process that
    # comes while process 0 imports jax finds no listener and asks again.
    bind = None if launch.detect else rendezvous.meet(
        launch.coordinator, launch.num_processes, launch.process_id, seconds, run=run)
    xlaflags.set_collective_timeout(launch.timeout_s)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=launch.coordinator, num_processes=launch.num_processes,
            process_id=launch.process_id,
            cluster_detection_method=None if launch.detect else "deactivate",
            initialization_timeout=seconds, heartbeat_timeout_seconds=2 * seconds,
            shutdown_timeout_seconds=seconds, coordinator_bind_address=bind)
    except Exception as e:
        raise UserError(f"{who} could not join the run through {where} within {seconds} s "
                        f"({first_line(e, 300)}); start every process with the same coordinator "
                        f"and process count.") from e
    meet_peers()
    check_devices(run)
    if launch.detect:  # no meeting before jax: compare what it would have compared
        compare_settings(run)
    print(f"sdcstudy: process {jax.process_index()} of {jax.process_count()} joined the run "
          f"through {launch.coordinator or 'the Slurm coordinator'}", file=sys.stderr,
          flush=True)
    return True


def run_settings(cfg, args) -> dict:
    """What every process of a run must be started with alike, flat: each config key (the
    file's value or its --set) and --out (absolute), --resume and --stop-after of `args`."""
    from sdcstudy.core.config import all_keys, to_dict

    tree = to_dict(cfg)
    out = None if args.out is None else os.path.abspath(args.out)
    return {**{key: functools.reduce(dict.get, key.split("."), tree) for key in all_keys()},
            "--out": out, "--resume": bool(args.resume), "--stop-after": args.stop_after}


class SharedRefusal(UserError):
    """A refusal that every process of the run reaches at the same point with the same
    sentence, decided from what all of them know alike: they leave together through jax's
    shutdown barrier (`ends_together`), so that no process is ended by its peers' exit first
    (a C++ abort, exit 134, in place of the sentence)."""


def check_devices(run: dict | None) -> None:
    """Right after the processes joined, where each sees every process's devices: refuse, on
    every process alike, a run whose processes hold fewer devices than a node needs."""
    from sdcstudy.core import mesh

    if run and (short := mesh.devices_short(run["mesh.dp"], run["mesh.tp"])):
        raise SharedRefusal(short)


def compare_settings(run: dict | None) -> None:
    """The meeting's comparison of versions and settings (`rendezvous`), made after the
    processes joined where they did not meet before jax (Slurm's detection): every process
    gathers every process's hello and finds the same first difference from process 0's."""
    import jax
    from jax.experimental import multihost_utils

    said = json.dumps(rendezvous.hello(jax.process_count(), jax.process_index(), run)).encode()
    lengths = multihost_utils.process_allgather(np.array([len(said)], np.int32)).ravel()
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(said)] = np.frombuffer(said, np.uint8)
    rows = multihost_utils.process_allgather(padded)
    hellos = [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths)]
    for hello in hellos[1:]:
        if problem := rendezvous.settings_problem(hello, hellos[0]):
            raise SharedRefusal(problem)


def meet_peers() -> None:
    """One small all-gather across the processes, right after they have all joined.

    gloo gives a peer only 30 s to reach the first collective of a device group (jax offers
    no setting for it); later ones wait for the collective timeout. Meeting here, when the
    processes are known to be together, keeps data preparation or a slower compile from
    ending the run. The groups are those of the node axis: the k-th device of every process.
    """
    import jax
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    processes = jax.process_count()
    local = min(sum(d.process_index == p for d in jax.devices()) for p in range(processes))
    grid = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[:local]
            for p in range(processes)]
    mesh = Mesh(np.array(grid, dtype=object), ("process", "local"),
                axis_types=(AxisType.Auto,) * 2)
    ids = np.arange(processes, dtype=np.int32)
    x = jax.make_array_from_callback(ids.shape, NamedSharding(mesh, PartitionSpec("process")),
                                     lambda index: ids[index])
    gathered = jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
    if not np.array_equal(np.asarray(gathered.addressable_data(0)), ids):
        raise UserError("the processes could not exchange data; check that every process "
                        "runs the same version of sdcstudy and jax.")


def is_writer() -> bool:
    """Process 0 writes the run folder; the others compute and take part in every collective."""
    import jax

    return jax.process_index() == 0


# --- ending a run --------------------------------------------------------------------------

SCRATCH_PREFIX = "sdcstudy-peer-"


@contextlib.contextmanager
def scratch_folder():
    """A temporary folder where a process that writes no run folder (process 1 of a pair) keeps
    its logs and tables, removed at the end of the block. A process killed (SIGKILL, or jax
    ending it once its coordinator is gone) cannot remove its own: the folders of this host's
    processes that no longer run are removed first (the name holds host and pid)."""
    import socket

    host = socket.gethostname().replace("-", "_")
    for stale in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{host}-*-*"):
        pid = stale.name[len(SCRATCH_PREFIX) + len(host) + 1:].split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{host}-{os.getpid()}-") as name:
        yield Path(name)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _describe(error: BaseException) -> tuple[int, str]:
    """Exit code and one sentence, as the CLI gives them for one process (core/errors.py): a
    lost peer or anything unforeseen could not run (3), never a FAIL (1)."""
    import jax

    from sdcstudy.core.train import NonFiniteError

    me = f"process {jax.process_index()} of {jax.process_count()}"
    if isinstance(error, UserError):
        return errors.EXIT_BAD_INPUT, f"{me}: {error}"
    if isinstance(error, KeyboardInterrupt):  # interrupts.Interrupted: 143 for SIGTERM
        return (getattr(error, "exit_code", errors.EXIT_SIGINT),
                f"{me}: {error or 'interrupted'}")
    if isinstance(error, NonFiniteError):
        return errors.EXIT_FAIL, f"{me}: {error}"
    if oom := errors.out_of_memory(error):  # a JaxRuntimeError too, but no peer's fault
        return errors.EXIT_COULD_NOT_RUN, f"{me}: {oom}"
    if failed := _failed_collective(error):  # also under a WriteError (a checkpoint's save)
        return EXIT_LOST_PEER, (f"{me} lost its peers ({first_line(failed, 300)}): another process "
                                f"died, hung past the timeout or cannot be reached; see its "
                                f"log.")
    if isinstance(error, errors.CouldNotRun):
        return errors.EXIT_COULD_NOT_RUN, f"{me}: {error}"
    if os.environ.get("SDCSTUDY_TRACEBACK"):
        traceback.print_exception(error, file=sys.stderr)
    return errors.EXIT_COULD_NOT_RUN, f"{me}: {errors.unexpected(error)}"


def _failed_collective(error: BaseException | None) -> BaseException | None:
    """The failed collective behind `error` (or behind what it caused: a checkpoint save's
    `WriteError`), or None: a JaxRuntimeError, or (gloo, jax 0.10.2) a ValueError that starts
    with the status: `UNKNOWN: Gloo AllGather failed: ... Connection reset by peer`."""
    import jax

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, jax.errors.JaxRuntimeError) or isinstance(error, ValueError) \
                and str(error).split(":")[0] in FAILED_STATUSES:
            return error
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def ends_together():
    """In a multi-process run, end this process at once on any error, with one line on stderr.

    Its peers then fail their next collective (or miss its heartbeat) and end the same way,
    each within the timeout; a one-process run raises as before.
    """
    try:
        yield
    except BaseException as error:
        import jax

        if not jax.distributed.is_initialized() or jax.process_count() == 1:
            raise
        code, message = _describe(error)
        print(f"sdcstudy: error: {message}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if isinstance(error, SharedRefusal):
            with contextlib.suppress(Exception):
                jax.distributed.shutdown()  # every peer comes: it refused alike
        os._exit(code)
