"""One writer per run folder: a folder claimed atomically and held under an exclusive lock.

Every command that writes a folder (`run`, `run --resume`, `sweep`, `golden record`, `demo`)
holds it for as long as it writes:

    with runlock.hold(run_dir, create=True):   # a new folder: absent, or empty
        ...                                     # write it
    with runlock.hold(run_dir, create=False):  # an existing folder, e.g. to resume it
        ...

The lock is `flock` on `LOCK` inside the folder, which holds the holder's process id so a
refused writer can name it. The kernel releases a flock when its holder dies, so a lock file
left by a killed process blocks nothing: only a live holder refuses. The file is removed when
the holder lets go; a writer that opens a file that was removed meanwhile tries again.

With several JAX processes only process 0 writes the run folder, so only it calls `hold`.
Imports no JAX.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

from sdcstudy.core.errors import UserError

LOCK = ".lock"
PID_WAIT_S = 1.0  # how long a refused writer waits for a new holder to write its pid
_held_here: dict[Path, int] = {}  # folder -> its lock's descriptor, for `check`
PEEK_RETRIES = 4  # tries, 50 ms apart, before a lock counts as held (`holder` looks briefly)


class FolderHeld(UserError):
    """Another live process holds the folder."""


class FolderTaken(UserError):
    """A new folder was asked for, and the path holds something already."""


def holder(path: Path) -> int | None:
    """The process id holding `path`, or None when no live process holds it."""
    lock = Path(path) / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    """The pid written in an open lock file; a holder that has just taken it gets a moment."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _held(path: Path, what: str, pid: int) -> FolderHeld:
    by = f"process {pid}" if pid > 0 else "another process"
    return FolderHeld(f"{what} {str(path)!r} is being written by {by}; wait for it to end or "
                      f"choose another --out.")


def _check_new(path: Path, what: str, hint: str) -> None:
    """Refuse a path that is a file, or a folder holding anything but a lock file."""
    if path.exists() and not path.is_dir():
        raise FolderTaken(f"{what} {str(path)!r} is a file, not a folder; choose another --out.")
    if path.is_dir() and any(p.name != LOCK for p in path.iterdir()):
        raise FolderTaken(f"{what} {str(path)!r} already exists and is not empty; {hint}.")


def refuse_early(path: Path, create: bool, what: str = "run folder",
                 hint: str = "pass --resume to continue it or choose another --out") -> None:
    """Raise the sentence `hold(path, create)` would refuse with now, taking nothing: a command
    calls it before its slow imports (JAX), so a second writer is told at once. `hold` still
    decides, atomically; a folder taken between the two is refused there."""
    path = Path(path)
    if pid := holder(path):
        raise _held(path, what, pid)
    if create:
        _check_new(path, what, hint)


def _lock(fd: int) -> None:
    """flock LOCK_EX, or BlockingIOError while a writer holds it; `holder`'s brief shared look
    is waited out."""
    for _ in range(PEEK_RETRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.05)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _acquire(path: Path, what: str) -> int:
    """An open, exclusively locked `LOCK` in `path` with our pid in it."""
    lock = path / LOCK
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(fd)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise _held(path, what, pid or -1) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the holder before us may have removed the file after we opened it
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def check(path: Path) -> None:
    """Raise FileNotFoundError when the folder this process holds was removed or replaced
    (writers that make missing parents would otherwise carry on into a new, empty one)."""
    fd = _held_here.get(Path(path).resolve())
    if fd is None:
        return
    try:
        same = os.stat(Path(path) / LOCK).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        raise FileNotFoundError(errno.ENOENT, "it was removed or replaced while this process "
                                              "wrote it")


def _empty(path: Path) -> None:
    """Remove what a failed writer left in a folder it claimed new (its lock aside); what
    cannot be removed stays."""
    with contextlib.suppress(OSError):
        for entry in path.iterdir():
            if entry.name == LOCK:
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()


def _release(path: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):  # removed while still locked: no one else
        (path / LOCK).unlink()                     # can take the old file meanwhile
    os.close(fd)


@contextlib.contextmanager
def hold(path: Path, create: bool, what: str = "run folder",
         hint: str = "pass --resume to continue it or choose another --out",
         keep: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Hold `path` for writing until the block ends.

    create=True: a new folder, made here (parents too); an existing one must be empty but for
    a lock left by a dead process. create=False: an existing folder. Refused with one sentence
    (a `UserError`, nothing changed) when another live process holds it; `hint` ends the
    sentence that refuses an existing folder. A folder made here that is still empty when the
    block fails is removed again. With `keep`, a new folder whose block fails is first emptied
    unless `keep(path)` says it holds something worth keeping, so that the same command may
    take it again.
    """
    path = Path(path)
    made = False
    if create:
        if pid := holder(path):
            raise _held(path, what, pid)
        _check_new(path, what, hint)
        try:
            path.mkdir(parents=True)
            made = True
        except FileExistsError:
            pass  # someone made it at the same moment: the lock decides
        except OSError as e:
            raise UserError(f"cannot make {what} {str(path)!r} ({e.strerror}).") from None
    elif not path.is_dir():
        raise UserError(f"{what} {str(path)!r} does not exist.")
    try:
        fd = _acquire(path, what)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise UserError(f"cannot write {what} {str(path)!r} ({e.strerror}).") from None
        raise
    failed = True
    _held_here[path.resolve()] = fd
    try:
        if create:
            _check_new(path, what, hint)  # filled between the first check and the lock
        yield path
        failed = False
    finally:
        del _held_here[path.resolve()]
        if create and failed and keep is not None and not keep(path):
            _empty(path)
        _release(path, fd)
        if made and failed:
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty: the writer left nothing behind
