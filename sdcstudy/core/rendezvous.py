"""Before `jax.distributed` starts: process 0 listens on the coordinator's address and meets
every other process there over a plain TCP socket, so that a launch mistake ends with one
sentence instead of a C++ abort or a timeout.

Measured with jax 0.10.2 on loopback, without this meeting: a port in use gave "could not
join ... within S s" on process 0 and, S later, a SIGABRT with a C++ stack on the others;
processes that disagree on the process count, or two processes with one id, ended in SIGABRT
(`CoordinationServiceAgent::Connect`) or, depending on who came first, one of them aborted
while the others ran on. So, before jax:

- process 0 binds the coordinator's address itself: the port in use is refused at once,
  naming the process that holds it when this host can tell (`listeners`); the same address
  is what jax's coordinator binds afterwards (`bind_address`), not every interface;
- every other process connects and says who it is (`hello`); process 0 waits until each id
  1..N-1 has said hello once, with the same N, then answers every one "ok", closes the socket
  and lets jax's coordinator take the port. A different N, an id given twice or a second
  process 0 ends every process that took part with one sentence (a `UserError`, exit 2);
- a process that comes after the others have met finds jax's coordinator on the port, which
  does not answer in this protocol, and says so.

Slurm's own detection (no explicit settings) skips the meeting: Slurm gives the counts and ids.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import select
import socket
import time
from pathlib import Path

from sdcstudy.core.errors import UserError

PROTOCOL = "sdcstudy-join/1"
ENV_BIND = "JAX_COORDINATOR_BIND_ADDRESS"
ALL_INTERFACES = "::"
MAX_LINE = 4096
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


# --- who holds a port ----------------------------------------------------------------------


def _proc_address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
    address = ipaddress.ip_address(raw)
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def _socket_owners(inodes: set[int]) -> dict[int, int]:
    """inode -> pid for the sockets among `inodes` that this user may see."""
    owners = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                    owners[int(target[8:-1])] = int(proc.name)
        except OSError:
            continue
    return owners


def listeners(port: int) -> list[tuple[str, int | None]]:
    """(address, pid or None) of every TCP socket listening on `port` on this host (Linux
    /proc; an empty list elsewhere). A pid is None for another user's process."""
    sockets = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                sockets.append((_proc_address(address), int(fields[9])))
    owners = _socket_owners({inode for _, inode in sockets}) if sockets else {}
    return [(address, owners.get(inode)) for address, inode in sockets]


def describe_pid(pid: int) -> str:
    """"pid P (its command line)", the command line cut to 120 characters."""
    try:
        command = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(
            errors="replace").replace("\0", " ").split())
    except OSError:
        command = ""
    return f"pid {pid} ({command[:120]})" if command else f"pid {pid}"


def _holder(port: int) -> str:
    pids = sorted({pid for _, pid in listeners(port) if pid is not None})
    return f" by {', '.join(describe_pid(p) for p in pids)}" if pids else " by another program"


# --- the meeting ---------------------------------------------------------------------------


def hello(num_processes: int, process_id: int) -> dict:
    return {"protocol": PROTOCOL, "num_processes": num_processes, "process_id": process_id,
            "pid": os.getpid(), "host": socket.gethostname()}


def _who(said: dict) -> str:
    return f"pid {said.get('pid')} on {said.get('host')}"


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps({"protocol": PROTOCOL, **message}).encode() + b"\n")
    except OSError:
        pass  # that process is gone; it learns nothing more from us


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


def _problem(num_processes: int, said: dict, met: dict[int, dict]) -> str | None:
    """The sentence that refuses what a process said, or None to accept it."""
    me = hello(num_processes, 0)
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
    return None


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
        for server in servers:
            server.close()
        if e.errno == errno.EADDRINUSE:
            _ask_the_holder(coordinator, num_processes)
            raise UserError(f"process 0 of {num_processes} cannot listen on {bind} for its "
                            f"peers: the port is in use{_holder(port)}; choose a free port for "
                            f"--coordinator on every process, or end that program.") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"process 0 of {num_processes} cannot listen on {bind}: that "
                            f"address is not one of this host's; start process 0 on the host "
                            f"that --coordinator names.") from None
        raise UserError(f"process 0 of {num_processes} cannot listen on {bind} ({e.strerror}); "
                        f"choose another --coordinator address or port.") from None
    return servers


def _ask_the_holder(coordinator: str, num_processes: int) -> None:
    """When the port's holder is a process 0 still meeting its peers, it refuses a second
    process 0 with the sentence naming both: raise that sentence. (Refused connections are
    tried again a few times: the holder may be between its bind and its listen.)"""
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
                  deadline: float) -> None:
    """Process 0: wait for ids 1..N-1, refuse a mistake, answer "ok" to all."""
    met: dict[int, tuple[socket.socket, dict]] = {}
    servers = _listen(bind, coordinator, num_processes)
    try:
        while len(met) < num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(met))
                raise UserError(f"process 0 of {num_processes}: process(es) "
                                f"{', '.join(map(str, missing))} did not reach {coordinator} "
                                f"within {timeout_s} s; start every process with this "
                                f"--coordinator and --num-processes (or a longer --timeout).")
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
                problem = _problem(num_processes, said, {i: s for i, (_, s) in met.items()})
                if problem:
                    for other in [conn] + [c for c, _ in met.values()]:
                        _send(other, {"error": problem})
                    conn.close()
                    raise UserError(problem)
                met[said["process_id"]] = (conn, said)
        for server in servers:  # closed before "ok": what answers next is jax's coordinator
            server.close()
        for conn, _ in met.values():
            _send(conn, {"ok": True})
    finally:
        for conn, _ in met.values():
            conn.close()
        for server in servers:
            server.close()


def _join_meeting(coordinator: str, num_processes: int, process_id: int, timeout_s: int,
                  deadline: float) -> None:
    """Any other process: say hello to process 0 until it answers, within the deadline."""
    me = f"process {process_id} of {num_processes}"
    last = "nothing answered"
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection(split_address(coordinator), timeout=RETRY_S * 10)
        except OSError as e:  # process 0 not listening yet (or its host not up yet)
            last = e.strerror or type(e).__name__
            time.sleep(RETRY_S)
            continue
        try:
            with conn:
                conn.sendall(json.dumps(hello(num_processes, process_id)).encode() + b"\n")
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
         environ=None) -> str:
    """Meet every process of the run before jax does; returns the address jax's coordinator
    binds (`bind_address`)."""
    bind = bind_address(coordinator, environ)
    deadline = time.monotonic() + timeout_s
    if process_id == 0:
        _host_meeting(coordinator, bind, num_processes, timeout_s, deadline)
    else:
        _join_meeting(coordinator, num_processes, process_id, timeout_s, deadline)
    return bind
