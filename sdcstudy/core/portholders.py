"""Who holds a TCP port on this host: the sockets listening on it (Linux /proc) and the
processes that own them, named by pid and command line, for the sentence that refuses a port
in use (`rendezvous`: process 0 cannot listen on the coordinator's address).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


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


def held_by(port: int) -> str:
    """" by pid P (its command line), ..." for the processes listening on `port`, or " by
    another program" when none of them is this user's to see."""
    pids = sorted({pid for _, pid in listeners(port) if pid is not None})
    return f" by {', '.join(describe_pid(p) for p in pids)}" if pids else " by another program"
