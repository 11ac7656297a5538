"""A progress line for work whose next event may be minutes away (compiling a step, every
device of a node compiling at once): the seconds so far, redrawn every `interval` seconds while
the work runs, left on screen with its total when it ends.

    with ticking("lockstep: preparing and compiling the step", enabled=progress):
        compiled = jitted.lower(state, batch).compile()

    with ticking("golden check", enabled=progress, total=8, unit="devices") as line:
        ...  # in each device's thread, when it is done:
        line.write("  device 3: PASS (15.2 s)")
        line.advance()

XLA compiles without holding Python's lock, so a thread can redraw the line meanwhile.
"""

from __future__ import annotations

import contextlib
import threading

from tqdm.auto import tqdm

FORMAT = "{desc}: {elapsed}"
COUNTED_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} done [{elapsed}]"


class Line:
    """The line's handle: `advance` counts one more item done, `write` prints a message (on
    stdout, above the line; plain `print` when the line is not shown). Both are safe from
    several threads."""

    def __init__(self, bar=None):
        self._bar = bar
        self._lock = threading.Lock()

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def write(self, text: str) -> None:
        with self._lock:
            if self._bar is None:
                print(text, flush=True)
            else:
                self._bar.write(text)

    def refresh(self) -> None:
        with self._lock:
            self._bar.refresh()


@contextlib.contextmanager
def ticking(desc: str, enabled: bool = True, interval: float = 1.0, file=None,
            total: int | None = None, unit: str = "it"):
    """Show `desc` and the time elapsed (and, with `total`, how many of them are done) until
    the block ends; nothing shown when not `enabled`. Yields a `Line`."""
    if not enabled:
        yield Line()
        return
    bar = tqdm(total=total, desc=desc, unit=unit, file=file, dynamic_ncols=True, leave=True,
               mininterval=0, bar_format=FORMAT if total is None else COUNTED_FORMAT)
    line, done = Line(bar), threading.Event()

    def redraw():
        while not done.wait(interval):
            line.refresh()

    drawer = threading.Thread(target=redraw, name="sdcstudy-ticker", daemon=True)
    drawer.start()
    try:
        yield line
    finally:
        done.set()
        drawer.join()
        line.refresh()
        bar.close()
