"""A starved device thread must not abort a healthy run.

XLA:CPU runs each simulated device on its own thread; by default it aborts the whole process
(SIGABRT) when one of them reaches a collective long after the others, which a loaded machine
causes without anything being wrong. `xlaflags.tolerate_slow_threads` (the CLI calls it
before JAX starts) gives such a thread `RENDEZVOUS_PATIENCE_S`. Two real processes run one
all-reduce whose device 0 first sleeps 5 s in a host callback, with XLA's "may be stuck"
warning after 1 s: with a termination timeout of 2 s (counted from the warning) the process
aborts (the flag is the one XLA obeys), with the flag as the CLI sets it the process finishes
with the right sum (XLA accepts it). The second test holds the value the CLI sets.
"""

import os
import subprocess
import sys

from sdcstudy.core import xlaflags

LATE_S = 5
WARN_FLAG = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"

PROGRAM = f"""
import sys, time
from sdcstudy.core import xlaflags
if sys.argv[1] == "patient":
    assert xlaflags.tolerate_slow_threads()
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

def late_on_device_0(x):
    def host(v):
        if v[0] == 0:
            time.sleep({LATE_S})
        return v
    x = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jax.lax.psum(x, "d")

mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
step = jax.jit(jax.shard_map(late_on_device_0, mesh=mesh, in_specs=P("d"), out_specs=P()))
print("sum", float(step(jnp.arange(2.0))[0]), flush=True)
"""


def _start(mode: str, extra_flags: str = "") -> subprocess.Popen:
    flags = f"--xla_force_host_platform_device_count=2 {WARN_FLAG}=1 {extra_flags}"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-c", PROGRAM, mode], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=90)
    return process.returncode, out, err


def test_a_late_thread_aborts_under_a_short_limit_and_not_under_the_clis_patience():
    impatient = _start("impatient", f"{xlaflags.RENDEZVOUS_TERMINATE_FLAG}=2")
    patient = _start("patient")
    try:
        code, out, err = _finish(impatient)
        assert code != 0 and "sum" not in out, (code, out, err[-2000:])
        assert "Termination timeout" in err, err[-2000:]
        code, out, err = _finish(patient)
        assert code == 0 and "sum 1.0" in out, (code, out, err[-2000:])
        assert "may be stuck" in err, err[-2000:]  # it was late, and waited for
    finally:  # both end by their process ids, also when an assertion or a deadline fails
        for process in (impatient, patient):
            process.kill()


def test_the_patience_flag_is_added_once_and_a_given_value_wins(monkeypatch):
    flag = xlaflags.RENDEZVOUS_TERMINATE_FLAG
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert xlaflags.tolerate_slow_threads()
    assert xlaflags.tolerate_slow_threads()
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        f"{flag}={xlaflags.RENDEZVOUS_PATIENCE_S}"]
    monkeypatch.setenv("XLA_FLAGS", f"{flag}=30")
    assert xlaflags.tolerate_slow_threads()
    assert os.environ["XLA_FLAGS"] == f"{flag}=30"
