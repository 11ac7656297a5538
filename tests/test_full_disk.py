"""A run whose disk fills up ends with one sentence, and continues once room is made.

On a real filesystem that is full (a small tmpfs, mounted where the test may: as root with a
working `mount`; skipped with the reason elsewhere), orbax's background save fails with the
writes of the other arrays still under way. If a test here fails, those writes' errors came
out as "never retrieved" tracebacks at exit, or the run did not end with exit 3 (could not run,
core/errors.py; never 1, a FAIL verdict) and the one sentence naming its last good checkpoint
and the --resume command, or that command did not finish the run once room was made.

Every subprocess has a deadline; the tmpfs is unmounted whatever happens. The race that once
put a traceback above that sentence (a write finishing in the instant its event loop closed,
reported by concurrent.futures) is forced without a disk in the last test.
"""

import asyncio
import concurrent.futures
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest

from sdcstudy.core import checkpoint
from sdcstudy.core import runfolder as RF

DEADLINE_S = 240  # one tiny lock-step run: start-up, compile, 30 steps
DISK = "16m"  # the tmpfs; a ballast file leaves ROOM_BYTES of it free
ROOM_BYTES = 3 << 20  # the first checkpoint (about 2.2 MB) fits, the second does not
RUN = ["configs/tiny.yaml", "--set", "experiment.mode=lockstep", "--set", "experiment.steps=30",
       "--set", "experiment.checkpoint_every=10"]


def _mount_tmpfs(where) -> str | None:
    """Mount a tmpfs of DISK at `where`; why not, if it could not be."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount command"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


@pytest.fixture
def full_disk(tmp_path):
    """A tmpfs with ROOM_BYTES free; the ballast file that fills the rest is `disk/ballast`."""
    disk = tmp_path / "disk"
    if (why := _mount_tmpfs(disk)) is not None:
        pytest.skip(f"no small filesystem to fill: {why}")
    try:
        stat = os.statvfs(disk)
        with open(disk / "ballast", "wb") as ballast:
            ballast.write(bytes(stat.f_bavail * stat.f_frsize - ROOM_BYTES))
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True, timeout=60).returncode:
            subprocess.run(["umount", "--lazy", str(disk)], capture_output=True, timeout=60)


def _sdcstudy(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.run([sys.executable, "-m", "sdcstudy", *args, "--no-progress"], env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)


@pytest.mark.slow
def test_a_full_disk_ends_with_one_sentence_and_resume_completes(full_disk):
    """Checkpoint 10 fits, 20 does not: exit 3 and the one sentence alone on stderr (no
    traceback of orbax's unfinished writes); once the ballast is deleted, the printed command
    runs steps 11-30 and leaves checkpoints 20 and 30, with no temporary folder of the failed
    save."""
    out = full_disk / "run"
    failed = _sdcstudy("run", *RUN, "--out", str(out))
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert "never retrieved" not in failed.stderr, failed.stderr[-3000:]
    [sentence] = failed.stderr.splitlines()
    # Which write meets the full disk first, checkpoint 20's or the metrics' beside its
    # background save, depends on the machine's load; either is the one sentence.
    assert re.match(rf"sdcstudy: error: could not write run folder {re.escape(repr(str(out)))} "
                    rf"\((saving a checkpoint|writing its files): No space left on device\)",
                    sentence), sentence
    assert "its last good checkpoint is step 10" in sentence, sentence
    command = f"sdcstudy run {out / RF.CONFIG} --out {out} --resume"
    assert sentence.endswith(f"continue with: {command}"), sentence

    (full_disk / "ballast").unlink()  # make room, as the sentence asks
    resumed = _sdcstudy(*command.split()[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert [row["step"] for row in RF.read_jsonl(out / RF.METRICS)] == list(range(1, 31))
    assert RF.json_load(out / RF.SUMMARY)["steps_done"] == 30
    assert checkpoint.saved_steps(out / RF.CHECKPOINTS) == [20, 30]
    assert sorted(p.name for p in (out / RF.CHECKPOINTS).iterdir()) == ["20", "30"]


class _ClosingLoop(asyncio.SelectorEventLoop):
    """Says it is open the first time it is asked after closing: the instant between asyncio's
    check and its call, in which a write thread found the loop open and then closed (the
    traceback a full-disk run once printed above its sentence)."""

    def __init__(self):
        super().__init__()
        self.lies = 1

    def is_closed(self) -> bool:
        if super().is_closed() and self.lies:
            self.lies -= 1
            return False
        return super().is_closed()


def _finish_a_write_as_its_loop_closes(result) -> None:
    write = concurrent.futures.Future()
    loop = _ClosingLoop()
    asyncio.wrap_future(write, loop=loop)  # the loop's side of the write, as orbax chains it
    loop.close()
    write.set_exception(result) if isinstance(result, BaseException) else write.set_result(result)


def test_a_write_that_finishes_as_its_loop_closes_is_not_reported(caplog):
    """A checkpointer in the process keeps concurrent.futures from reporting the closed loop
    (nothing else reports it, and the save's own failure reaches the caller through orbax);
    the report of any other callback error is kept."""
    checkpoint._orbax_failures_reach_the_caller_only()
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        _finish_a_write_as_its_loop_closes(OSError(28, "No space left on device"))
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        other = concurrent.futures.Future()
        other.add_done_callback(lambda f: 1 / 0)
        other.set_result(None)
    [record] = caplog.records
    assert record.getMessage().startswith("exception calling callback")
    assert isinstance(record.exc_info[1], ZeroDivisionError)
