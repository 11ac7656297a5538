"""How a signal stops a run: SIGINT or SIGTERM, while the run loop holds its folder, is noted
and acted on at the loop's next safe point (the step finished, recorded and checkpointed);
`Interrupted` is the stop, with the sentence that says how to continue. In a run of several
processes the processes agree at each safe point, so a signal that reached one of them stops
them all after the same step (`stop_signal`). Outside a run's loop a command stops at once:
`resent_when_swallowed` keeps Python from losing that stop, and `Stopped` is a command's stop
with its own sentence.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

import numpy as np

from sdcstudy.core import runfolder as RF

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESEND_S = 0.05  # how soon a stop that Python swallowed is sent again


def stop_signal(signum: int | None) -> int | None:
    """The stop signal to act on at a safe point of the run: this process's own (None: none),
    and in a run of several processes the largest any process received, so that a signal that
    reached one process only (or each at a different step) stops them all at the same step.

    Every process must call it at the same safe points (a collective); one process alone
    costs nothing."""
    import jax

    if jax.process_count() == 1:
        return signum
    from jax.experimental import multihost_utils

    received = multihost_utils.process_allgather(np.int32(signum or 0))
    return int(np.max(received)) or None


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a run (`exit_code` 128 + its number); `run_dir`, its latest
    `checkpoint` and `kept` (False: a new run that left no folder behind) say how to go on."""

    def __init__(self, signum: int = signal.SIGINT, run_dir: Path | None = None):
        self.signum, self.run_dir, self.exit_code = signum, run_dir, 128 + signum
        steps = []
        if run_dir is not None:  # imports JAX: not for a stop without a run folder
            from sdcstudy.core.checkpoint import saved_steps

            steps = saved_steps(run_dir / RF.CHECKPOINTS)
        self.checkpoint = steps[-1] if steps else None
        self.kept = run_dir is not None and (run_dir / RF.CONFIG).is_file()
        super().__init__(self.sentence())

    def sentence(self, command: str | None = None) -> str:
        """What stopped, and `command` to go on (default: the folder's config.yaml, resumed)."""
        what = f"interrupted by {signal.Signals(self.signum).name}"
        if self.run_dir is None:
            return what
        if not self.kept:
            return (f"{what} before its first step, so {str(self.run_dir)!r} was not kept: run "
                    f"{'it again' if command is None else f'again with: {command}'}")
        done = (f"the latest checkpoint is step {self.checkpoint}" if self.checkpoint is not None
                else "it has no checkpoint yet (--resume starts it over)")
        command = command or shlex.join(["sdcstudy", "run", str(self.run_dir / RF.CONFIG),
                                         "--out", str(self.run_dir), "--resume"])
        return f"{what}; {done}: continue with: {command}"


class Signals:
    """SIGINT and SIGTERM while a run holds its folder (main thread only). Inside the loop
    (`deferring`) the first one is only noted in `received`, and the loop stops at its next
    safe point; elsewhere, or the second time, one raises `Interrupted` at once."""

    received: int | None = None
    deferring = False

    def __enter__(self):
        self._before = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS
                        if threading.current_thread() is threading.main_thread()}
        return self

    def __exit__(self, *exc):
        for s, handler in self._before.items():  # None: not set from Python
            signal.signal(s, signal.SIG_DFL if handler is None else handler)

    def agreed(self) -> int | None:
        """The signal to stop on at this safe point: the one received here, or in a run of
        several processes any process's (`stop_signal`; every process asks at the
        same steps, so all stop at the same one and save the same checkpoint together)."""
        agreed = stop_signal(self.received)
        if self.received is None:  # a signal that lands during the call counts at the next
            self.received = agreed
        return agreed

    def _handle(self, signum, _frame):
        if not (self.deferring and self.received is None):
            raise Interrupted(signum)
        self.received = signum
        with contextlib.suppress(OSError, ValueError):  # unbuffered: never inside a print
            os.write(sys.stderr.fileno(), f"\nsdcstudy: {signal.Signals(signum).name}: finishing "
                     f"and checkpointing this step (a second signal stops at once)\n".encode())


def signum_of(stop: KeyboardInterrupt) -> int:
    """The signal behind a stop: `Interrupted`'s, SIGTERM for an exception that carries exit
    code 143 (the CLI's SIGTERM), else SIGINT (Ctrl-C's plain KeyboardInterrupt)."""
    signum = getattr(stop, "signum", None)
    if signum is None:
        signum = getattr(stop, "exit_code", 128 + signal.SIGINT) - 128
    return signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a command outside a run's loop: `exit_code` 130 or 143, and
    `str()` the sentence that says what was kept and how to go on (`then`)."""

    def __init__(self, signum: int, then: str):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}; {then}")


@contextlib.contextmanager
def resent_when_swallowed():
    """While the block runs, a stop that Python swallowed is sent again.

    Python runs a signal's handler at the next line of Python code, and after a long call into
    C (XLA compiling) that line is often a garbage-collection callback (JAX registers one) or a
    `__del__`, where an exception is only printed ("Exception ignored in ...", a traceback)
    and the command went on to its end, exit 0. Here such a KeyboardInterrupt (Ctrl-C,
    `Interrupted`, the CLI's SIGTERM) prints nothing, and its signal reaches this process
    again `RESEND_S` later, until it lands where it stops the command. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before, active = sys.unraisablehook, [True]

    def resend(signum: int) -> None:
        if active[0]:
            os.kill(os.getpid(), signum)

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            return before(unraisable)
        timer = threading.Timer(RESEND_S, resend, (signum_of(unraisable.exc_value),))
        timer.daemon = True
        timer.start()

    sys.unraisablehook = hook
    try:
        yield
    finally:
        active[0] = False
        sys.unraisablehook = before


@contextlib.contextmanager
def held_back():
    """SIGINT and SIGTERM that arrive inside the block (milliseconds of work that must not be
    cut in half: files moved into place) act when it ends, as they would have at once.
    Main thread only (elsewhere no handler can be set, and none runs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    before = {s: signal.signal(s, lambda signum, _frame: received.append(signum))
              for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():  # None: not set from Python
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if received:
            signal.raise_signal(received[0])
