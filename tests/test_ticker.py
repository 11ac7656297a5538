"""The elapsed-time line shown while a step compiles (core/ticker.py): it is redrawn while the
work runs, left on screen when it ends, and gone without a trace when progress is off."""

import io
import re
import threading
import time

import pytest

from sdcstudy.core.ticker import ticking


def _tickers():
    return [t for t in threading.enumerate() if t.name == "sdcstudy-ticker"]


def test_the_line_is_redrawn_while_the_work_runs_and_left_when_it_ends():
    out = io.StringIO()
    redrawn = lambda: out.getvalue().count("\rtrain: compiling the step: 00:")  # noqa: E731
    with ticking("train: compiling the step", file=out, interval=0.01):
        deadline = time.monotonic() + 10  # however busy the machine, not a time limit
        while redrawn() < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(_tickers()) == 1
    text = out.getvalue()
    # Drawn at the start, redrawn by the thread while the block waited, drawn once more at the
    # end and left on its own line: if the thread never redraws, the count stays at 2.
    assert text.count("\rtrain: compiling the step: 00:") >= 5
    assert text.endswith("\n") and not _tickers()


def test_nothing_is_shown_when_progress_is_off():
    out = io.StringIO()
    with ticking("train: compiling the step", enabled=False, file=out, interval=0.01):
        time.sleep(0.05)
        assert not _tickers()
    assert out.getvalue() == ""


def test_a_failure_in_the_work_ends_the_line_and_its_thread():
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="compile failed"):
        with ticking("train: compiling the step", file=out, interval=0.01):
            raise RuntimeError("compile failed")
    assert out.getvalue().endswith("\n") and not _tickers()


def test_a_counted_line_counts_items_done_from_several_threads(capsys):
    # `golden check --device all`: each device's thread prints its verdict and counts itself
    # done; the messages go to stdout whole, the count to the line.
    out = io.StringIO()
    with ticking("golden check", file=out, interval=0.01, total=8, unit="devices") as line:
        def one(i):
            line.write(f"  device {i}: PASS")
            line.advance()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    printed = capsys.readouterr().out.splitlines()
    assert sorted(printed) == sorted(f"  device {i}: PASS" for i in range(8))
    text = out.getvalue()
    assert re.search(r"golden check: 0/8 devices done \[00:\d\d\]", text)
    assert re.search(r"golden check: 8/8 devices done \[00:\d\d\]$", text.rstrip("\n"))


def test_without_the_line_messages_are_printed_and_counting_does_nothing(capsys):
    with ticking("golden check", enabled=False, total=2, unit="devices") as line:
        line.write("  device 0: PASS")
        line.advance()
    assert capsys.readouterr() == ("  device 0: PASS\n", "")
