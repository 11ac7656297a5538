"""XLA flags a process sets before JAX starts its backend, where this jaxlib knows them (XLA
aborts the process on a flag it does not know).

- `set_collective_timeout` makes a CPU collective that waits too long an error, not a hang
  (a run of several processes, `distributed.initialize`).
- `tolerate_slow_threads` keeps XLA:CPU from aborting a process whose device threads meet at a
  collective late because the machine is loaded (the CLI calls it for every command).
"""

from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path

COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"
RENDEZVOUS_TERMINATE_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
RENDEZVOUS_PATIENCE_S = 600  # seconds after XLA's 20 s warning; its own default is 40


@functools.cache
def xla_knows_flag(flag: str) -> bool:
    """Whether this jaxlib's XLA registers `flag`; XLA aborts the process on an unknown one.
    A flag's name is a C string in the library, so it is searched with its ending NUL: a name
    that only begins a longer flag's is not taken for a flag."""
    import jaxlib

    name = flag.lstrip("-").split("=")[0].encode() + b"\0"
    libraries = sorted(Path(jaxlib.__file__).parent.glob("*.so"),
                       key=lambda p: p.name != "libjax_common.so")
    for library in libraries:
        try:
            with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(name) >= 0:
                    return True
        except (OSError, ValueError):
            continue
    return False


def set_collective_timeout(seconds: int) -> bool:
    """Make a CPU collective that waits longer than `seconds` an error, not a hang (XLA_FLAGS,
    before JAX starts its backend; a value already there wins); whether the flag is set."""
    return _add_xla_flag(COLLECTIVE_TIMEOUT_FLAG, seconds)


def _add_xla_flag(flag: str, value) -> bool:
    """`flag`=`value` added to XLA_FLAGS unless the flag is there already, and only where this
    jaxlib knows it (XLA aborts on an unknown flag); whether the flag is set."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if any(f.split("=")[0] == flag for f in flags):
        return True
    if not xla_knows_flag(flag):
        return False
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{flag}={value}"])
    return True


def tolerate_slow_threads(seconds: int = RENDEZVOUS_PATIENCE_S) -> bool:
    """Let the local devices' threads meet at a CPU collective however late one of them comes,
    up to `seconds` after XLA's "may be stuck" warning.

    XLA:CPU runs each simulated device on its own thread and by default aborts the process
    (SIGABRT, nothing checkpointed since the last save) when one of them reaches a collective
    a minute after the others (a warning at 20 s, then 40 s more). Measured: two bfloat16
    `small` runs beside the test suite on 2 cores saw threads 28 and 38 s late, and one died
    of a later one. A real deadlock still ends after `seconds`. Goes into XLA_FLAGS before
    JAX starts its backend; a value already there wins. Returns whether the flag is set.
    """
    return _add_xla_flag(RENDEZVOUS_TERMINATE_FLAG, seconds)
