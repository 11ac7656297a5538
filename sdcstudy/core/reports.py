"""Report files a command writes beside or as its result (`--json`, `--junit`, `--plot`,
`--out`): written atomically, and a file that cannot be written is one sentence, never a
traceback or a FAIL's exit code (core/errors.py).

- A command with a verdict (doctor, fleet simulate, golden check) prints its verdict first,
  then calls `write_report_file`: a file that cannot be written is one warning on stderr that
  names it, and the verdict keeps its exit code.
- A command whose output *is* the file (`report --out`, `plan --json`, `bench --json`) writes
  inside `writing(path)`: a file that cannot be written ends the command with
  `ReportWriteError` (exit 3).

Imports no JAX.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from pathlib import Path
from typing import Any, Callable

from sdcstudy.core import runfolder as RF
from sdcstudy.core.errors import ReportWriteError, first_line


def unwritten(path, error: OSError, what: str = "report file") -> str:
    """The sentence for `path` that could not be written: which file, and the system's why."""
    why = error.strerror or first_line(error)
    if isinstance(error, (FileExistsError, NotADirectoryError)):  # mkdir of a parent
        why = "a folder on its path is a file"
    elif isinstance(error, IsADirectoryError):
        why = "it is a folder"
    return (f"could not write the {what} {str(path)!r} ({why}); give a path in a folder that "
            f"exists, can be written and has room")


@contextlib.contextmanager
def writing(path, what: str = "report file"):
    """Turns an OSError raised inside the block (a read-only folder, a full disk, a path that is
    a folder) into `ReportWriteError` naming `path`."""
    try:
        yield
    except OSError as e:
        raise ReportWriteError(unwritten(path, e, what) + ".") from e


def check_writable(path, folder, what: str = "report file") -> None:
    """Before the work whose result `path` will hold: `ReportWriteError` naming `path` unless
    `folder`, or the nearest folder above it that exists (the missing ones are made when the
    file is written), is a folder that can be written."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    error = None
    if not folder.is_dir():
        error = NotADirectoryError(20, "Not a directory")
    elif not os.access(folder, os.W_OK | os.X_OK):
        error = PermissionError(13, "Permission denied")
    if error is not None:
        raise ReportWriteError(unwritten(path, error, what) + ".")


def warn_unwritten(error: ReportWriteError, warn: Callable[[str], None] | None = None) -> None:
    """The one warning line of a report file that could not be written, beside a verdict that
    stands (on stderr unless `warn` says where)."""
    line = f"sdcstudy: warning: {str(error)[:-1]}; the result printed above stands."
    (warn or (lambda text: print(text, file=sys.stderr, flush=True)))(line)


def write_report_file(path, content: str | bytes | Callable[[Path], Any],
                      what: str = "report file", warn: Callable[[str], None] | None = None
                      ) -> bool:
    """Write `content` to `path` atomically (text, bytes, or a function that writes the file at
    the path it is given, such as a plot); True when written, else False after one warning
    naming the file (`warn_unwritten`). For a file beside a verdict that is already printed."""
    path = Path(path)
    try:
        with writing(path, what):
            if callable(content):
                content(path)
            elif isinstance(content, str):
                RF.atomic_write_text(path, content)
            else:
                RF.atomic_write_bytes(path, content)
    except ReportWriteError as e:
        warn_unwritten(e, warn)
        return False
    return True


def write_report_json(path, obj: Any, what: str = "JSON report",
                      warn: Callable[[str], None] | None = None) -> bool:
    """`write_report_file` of `obj` as indented JSON."""
    return write_report_file(path, RF.dumps(obj) + "\n", what, warn)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported when first
    drawn: the commands that draw nothing never import matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path, **savefig_options) -> Path:
    """`fig` as the PNG `path`, atomically: written beside it under a temporary name, then
    renamed, and the temporary removed if anything fails. The caller closes the figure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, **savefig_options)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return path


def publish(path: Path, make) -> Path | None:
    """Write the new file `path` through `make(tmp)`, which writes a hidden temporary file beside
    it and returns None when it has nothing to write; the path written, or None. A file at
    `path` is never replaced: one that appeared after the command checked its outputs (another
    command given the same name while this one measured, as `sdcstudy bench` does) is kept, and
    this file goes to the first free `NAME-2.EXT`, `NAME-3.EXT`, ... (a hard link makes taking
    the name and writing it one step; where the file system has none, the name is taken only
    if it is still free)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        try:
            if make(tmp) is None:
                return None
        except ReportWriteError as error:  # it names the temporary file: name the user's
            raise ReportWriteError(str(error).replace(str(tmp), str(path))) from error
        for n in itertools.count(1):
            target = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
            try:
                os.link(tmp, target)
                return target
            except FileExistsError:
                continue
            except OSError:  # no hard links here
                if target.exists() or target.is_symlink():
                    continue
                os.replace(tmp, target)
                return target
    finally:
        tmp.unlink(missing_ok=True)
