"""A progress line for work of unknown length (compiling a step): the seconds so far, redrawn
every `interval` seconds while the work runs, left on screen with its total when it ends.

    with ticking("lockstep: compiling the step", enabled=progress):
        compiled = jitted.lower(state, batch).compile()

XLA compiles without holding Python's lock, so a thread can redraw the line meanwhile.
"""

from __future__ import annotations

import contextlib
import threading

from tqdm.auto import tqdm

FORMAT = "{desc}: {elapsed}"


@contextlib.contextmanager
def ticking(desc: str, enabled: bool = True, interval: float = 1.0, file=None):
    """Show `desc` and the time elapsed until the block ends; nothing when not `enabled`."""
    if not enabled:
        yield
        return
    line = tqdm(total=None, desc=desc, bar_format=FORMAT, file=file, dynamic_ncols=True,
                leave=True, mininterval=0)
    done = threading.Event()

    def redraw():
        while not done.wait(interval):
            line.refresh()

    drawer = threading.Thread(target=redraw, name="sdcstudy-ticker", daemon=True)
    drawer.start()
    try:
        yield
    finally:
        done.set()
        drawer.join()
        line.refresh()
        line.close()
