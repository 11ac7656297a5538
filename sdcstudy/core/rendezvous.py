"""Before `jax.distributed` starts: process 0 listens on the coordinator's address and meets
every other process there over a plain TCP socket, so that a launch mistake ends with one
sentence instead of a C++ abort, a timeout or a run that goes on wrong (docs/pairing.md,
"Launch mistakes"). Process 0 binds the address itself (a port in use is refused at once,
naming its holder: `portholders`), the address jax's coordinator binds after it
(`bind_address`). Every other process connects and says who it is and what it runs
(`hello`); process 0 waits until each id 1..N-1 has said hello once, then answers every one
"ok", closes the socket and lets jax's coordinator take the port. A different N, an id given
twice, a second process 0 or a version or setting that differs from process 0's ends every
process that took part with one sentence (`UserError`, exit 2). A process that comes after
the others met finds jax's coordinator, which does not answer in this protocol, and says so.

Slurm's detection skips the meeting; `distributed.compare_settings` uses `settings_problem`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import json
import os
import select
import socket
import time
from importlib import metadata
from pathlib import Path

from sdcstudy.core.errors import UserError
from sdcstudy.core.portholders import held_by

PROTOCOL = "sdcstudy-join/1"
ENV_BIND = "JAX_COORDINATOR_BIND_ADDRESS"
ALL_INTERFACES = "::"
MAX_LINE = 1 << 20  # a hello carries the whole config
HELLO_WAIT_S = 5.0  # how long process 0 waits for a connected process to say who it is
RETRY_S = 0.2


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port" (brackets dropped)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _resolve(host: str, port: int) -> list[tuple]:
    """(family, sockaddr) of every address `host` has on this machine, in resolver order."""
    found = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if (family, sockaddr[:2]) not in [(f, s[:2]) for f, s in found]:
            found.append((family, sockaddr))
    return found


def bind_address(coordinator: str, environ=None) -> str:
    """The address jax's coordinator (and the meeting) listens on, as "host:port".

    `JAX_COORDINATOR_BIND_ADDRESS` when set; else the coordinator's own host: an IP address as
    given, a name as this machine resolves it. Every interface listens, as jax's default does,
    for a name this machine cannot resolve (yet: a Kubernetes pod's own DNS name), and for this
    host's own name where the hosts file maps it to loopback only (Debian's 127.0.1.1): the
    other hosts reach that name by another address.
    """
    environ = os.environ if environ is None else environ
    if environ.get(ENV_BIND):
        return environ[ENV_BIND]
    host, port = split_address(coordinator)
    if not _is_ip(host):
        try:
            addresses = [ipaddress.ip_address(s[0].split("%")[0]) for _, s in _resolve(host, port)]
        except (OSError, ValueError):
            addresses = []
        own_name = host.split(".")[0] == socket.gethostname().split(".")[0]
        if not addresses or own_name and all(a.is_loopback for a in addresses):
            host = ALL_INTERFACES
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- the meeting ---------------------------------------------------------------------------

PACKAGES = ("sdcstudy", "jax", "jaxlib")  # what the compiled step (so its bits) depends on


def versions() -> dict[str, str]:
    """The installed versions of `PACKAGES`, sdcstudy's with a digest of its source files
    (two checkouts of one version may differ)."""
    package, sha = Path(__file__).resolve().parents[1], hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        sha.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    found = {}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return {**found, "sdcstudy": f"{found.get('sdcstudy')} (source {sha.hexdigest()[:12]})"}


def hello(num_processes: int, process_id: int, run: dict | None = None) -> dict:
    """What a process says of itself; `run` (flat: "--out", "experiment.steps", ...), what it
    was asked to run, and the versions must be the same on every process."""
    return {"protocol": PROTOCOL, "num_processes": num_processes, "process_id": process_id,
            "pid": os.getpid(), "host": socket.gethostname(),
            "run": json.loads(json.dumps({**versions(), **(run or {})}, default=str))}


def _who(said: dict) -> str:
    return f"pid {said.get('pid')} on {said.get('host')}"


def _send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # that process is gone; it learns nothing more from us
        conn.sendall(json.dumps({"protocol": PROTOCOL, **message}).encode() + b"\n")


def _read_line(conn: socket.socket, timeout_s: float) -> bytes:
    """Bytes up to the first newline (or EOF, or MAX_LINE bytes) within `timeout_s`."""
    end = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data and len(data) < MAX_LINE:
        conn.settimeout(max(end - time.monotonic(), 0.01))
        chunk = conn.recv(MAX_LINE)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n")[0]


def _parse(line: bytes) -> dict | None:
    """A message of this protocol, or None for anything else."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) and message.get("protocol") == PROTOCOL \
        else None


def _shown(key: str, value) -> str:
    """A setting as a user gives it: `jax 0.10.2`, `--resume`, `no --stop-after`, `a.b=3`."""
    if key in PACKAGES or key.startswith("--") and value not in (None, False, True):
        return f"{key} {value}"
    if key.startswith("--"):
        return key if value is True else f"no {key}"
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def _listed(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]


def settings_problem(said: dict, me: dict) -> str | None:
    """The sentence refusing a process whose versions or settings differ from process 0's."""
    theirs, mine = said.get("run") or {}, me["run"]
    differing = [key for key in sorted(set(theirs) | set(mine), key=lambda k: (
        k not in PACKAGES, k[:2] != "--", k)) if theirs.get(key) != mine.get(key)]
    if not differing:
        return None
    fixes = [fix for keys, fix in (
        (PACKAGES, "install the same sdcstudy, jax and jaxlib on every host"),
        (("--out",), "give every process the same --out, a folder every host sees"),
        (("--resume", "--stop-after"), "pass --resume and --stop-after to every process alike"))
        if set(keys) & set(differing)]
    if any(key not in PACKAGES and key[:2] != "--" for key in differing):
        fixes.append("start every process with the same config file and --set values")
    more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
    return (f"process {said.get('process_id')} ({_who(said)}) was started with "
            f"{_listed([_shown(k, theirs.get(k)) for k in differing[:3]])} and process 0 "
            f"({_who(me)}) with {_listed([_shown(k, mine.get(k)) for k in differing[:3]])}"
            f"{more}: {'; '.join(fixes)}.")


def _problem(me: dict, said: dict, met: dict[int, dict]) -> str | None:
    """The sentence that refuses what a process said to process 0 (`me`, its own hello), or
    None to accept it."""
    num_processes = me["num_processes"]
    their_count, their_id = said.get("num_processes"), said.get("process_id")
    if their_count != num_processes:
        return (f"process {their_id} ({_who(said)}) was started with --num-processes "
                f"{their_count} and process 0 ({_who(me)}) with {num_processes}: start every "
                f"process with the same --num-processes.")
    if their_id == 0 or their_id in met:
        first = me if their_id == 0 else met[their_id]
        return (f"two processes were started with --process-id {their_id} ({_who(first)} and "
                f"{_who(said)}): give each process its own id, from 0 to {num_processes - 1}.")
    if not isinstance(their_id, int) or not 0 < their_id < num_processes:
        return f"process {their_id} ({_who(said)}) has no place in a run of {num_processes}."
    return settings_problem(said, me)


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _listen(bind: str, coordinator: str, num_processes: int) -> list[socket.socket]:
    """Listening sockets on every address `bind` names; a port in use is refused at once."""
    host, port = split_address(bind)
    servers = []
    try:
        targets = [(socket.AF_INET6, (ALL_INTERFACES, port, 0, 0))] if host == ALL_INTERFACES \
            else _resolve(host, port)
        for family, sockaddr in targets:
            server = socket.socket(family, socket.SOCK_STREAM)
            servers.append(server)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not REUSEPORT
            if family == socket.AF_INET6 and host == ALL_INTERFACES:
                server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            server.bind(sockaddr)
            server.listen(64)
    except OSError as e:
        _close(servers)
        if e.errno == errno.EADDRINUSE:
            _ask_the_holder(coordinator, num_processes)
            raise UserError(f"process 0 of {num_processes} cannot listen on {bind} for its "
                            f"peers: the port is in use{held_by(port)}; choose a free port for "
                            f"--coordinator on every process, or end that program.") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"process 0 of {num_processes} cannot listen on {bind}: that "
                            f"address is not one of this host's; start process 0 on the host "
                            f"that --coordinator names.") from None
        raise UserError(f"process 0 of {num_processes} cannot listen on {bind} ({e.strerror}); "
                        f"choose another --coordinator address or port.") from None
    return servers


def _ask_the_holder(coordinator: str, num_processes: int) -> None:
    """A process 0 holding the port refuses a second one with a sentence naming both: raise
    it. (Tried a few times: the holder may be between its bind and its listen.)"""
    for _ in range(3):
        try:
            with socket.create_connection(split_address(coordinator), timeout=1) as conn:
                conn.sendall(json.dumps(hello(num_processes, 0)).encode() + b"\n")
                answer = _parse(_read_line(conn, 1))
            break
        except ConnectionRefusedError:
            time.sleep(RETRY_S / 2)
        except OSError:
            return
    else:
        return
    if answer and answer.get("error"):
        raise UserError(answer["error"])


def _host_meeting(coordinator: str, bind: str, num_processes: int, timeout_s: int,
                  deadline: float, run: dict | None = None) -> None:
    """Process 0: wait for ids 1..N-1, refuse a mistake, answer "ok" to all."""
    met: dict[int, tuple[socket.socket, dict]] = {}
    me = hello(num_processes, 0, run)
    servers = _listen(bind, coordinator, num_processes)
    try:
        while len(met) < num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(met))
                who = f"process {missing[0]}" if len(missing) == 1 else \
                    f"processes {_listed([str(i) for i in missing])}"
                raise UserError(f"process 0 of {num_processes}: {who} did not reach "
                                f"{coordinator} within {timeout_s} s; start every process with "
                                f"this --coordinator and --num-processes (or a longer "
                                f"--timeout).")
            ready, _, _ = select.select(servers, [], [], min(left, RETRY_S))
            for server in ready:
                conn, _ = server.accept()
                try:
                    said = _parse(_read_line(conn, min(HELLO_WAIT_S, left)))
                except OSError:
                    said = None
                if said is None:  # not a process of this protocol: not one of ours
                    conn.close()
                    continue
                problem = _problem(me, said, {i: s for i, (_, s) in met.items()})
                if problem:
                    for other in [conn] + [c for c, _ in met.values()]:
                        _send(other, {"error": problem})
                    conn.close()
                    raise UserError(problem)
                met[said["process_id"]] = (conn, said)
        _close(servers)  # before "ok": what answers next is jax's coordinator
        for conn, _ in met.values():
            _send(conn, {"ok": True})
    finally:
        _close([conn for conn, _ in met.values()] + servers)


def _join_meeting(coordinator: str, num_processes: int, process_id: int, timeout_s: int,
                  deadline: float, run: dict | None = None) -> None:
    """Any other process: say hello to process 0 until it answers, within the deadline."""
    me, last = f"process {process_id} of {num_processes}", "nothing answered"
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection(split_address(coordinator), timeout=RETRY_S * 10)
        except OSError as e:  # process 0 not listening yet (or its host not up yet)
            last = e.strerror or type(e).__name__
            time.sleep(RETRY_S)
            continue
        try:
            with conn:
                conn.sendall(json.dumps(hello(num_processes, process_id, run)).encode() + b"\n")
                line = _read_line(conn, deadline - time.monotonic())
        except socket.timeout:
            raise UserError(f"{me} reached {coordinator} but had no answer within "
                            f"{timeout_s} s: process 0 is still waiting for other processes "
                            f"(its log names them), or another program holds that "
                            f"port.") from None
        except OSError:  # process 0 closed its door as we came: ask again
            line = b""
        if not line:
            time.sleep(RETRY_S)
            continue
        answer = _parse(line)
        if answer is None:
            raise UserError(f"{me}: what listens at {coordinator} is not a process 0 waiting "
                            f"for its peers: that run has already met all its processes "
                            f"(was --process-id {process_id} given twice?), or another program "
                            f"holds the port; check --coordinator.")
        if answer.get("error"):
            raise UserError(answer["error"])
        return
    raise UserError(f"{me} could not reach process 0 at {coordinator} within {timeout_s} s "
                    f"({last}); start process 0 with the same --coordinator, on that host.")


def meet(coordinator: str, num_processes: int, process_id: int, timeout_s: int,
         environ=None, run: dict | None = None) -> str:
    """Meet every process of the run before jax does (`run`: see `hello`); returns the address
    jax's coordinator binds (`bind_address`)."""
    bind = bind_address(coordinator, environ)
    deadline = time.monotonic() + timeout_s
    if process_id == 0:
        _host_meeting(coordinator, bind, num_processes, timeout_s, deadline, run)
    else:
        _join_meeting(coordinator, num_processes, process_id, timeout_s, deadline, run)
    return bind
