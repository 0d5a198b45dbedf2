"""Where a command may write, checked before it writes anything; and a stdout that may close.

Every file a command writes besides its dataset (``report --json/--html/--markdown/--junit``,
the same options of ``diff`` and ``trend``, ``lock --out``) goes through :func:`check_outputs`
first, all of them before any is written, and then :func:`write_outputs`, which writes every
file under a temporary name and renames them only when all were written. A path is refused
(:class:`OutputError`, exit 2) when it is empty; when it exists and is not a regular file (a
directory, a device, a FIFO, a socket, a symbolic link: a rename would replace the link, and a
device or FIFO is not a report); when its directory does not exist or cannot be written; when
two options name the same file; and when it is an input (the same file, also through another
name: resolved paths and device/inode are compared) or lies inside an input dataset directory.

``sweep --out`` goes through :func:`check_sweep_out`: not empty, not a symbolic link, not
inside another dataset, and not a non-empty directory that is no cancelbench dataset.

:func:`guard_stdout` makes a closed stdout (``>&-``) or a reader that stops early (``| head``)
harmless: what is left to print is dropped, the exit status stays the command's own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path


class OutputError(ValueError):
    """An output path that must not be written: one line, exit 2, nothing written."""


MANIFEST = "manifest.json"
RECORDS = "records"
# What may sit in a directory a new sweep writes into without it being "someone else's".
SWEEP_OWN_NAMES = {".cancelbench.lock"}


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _resolved(path: Path) -> Path:
    """The absolute path with every symbolic link above the last component resolved."""
    path = Path(os.path.abspath(path))
    return path.parent.resolve() / path.name


def _ids(path: Path) -> Iterable[tuple[int, int]]:
    """(device, inode) of ``path`` and of every directory above it."""
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            st = os.stat(p)
            yield st.st_dev, st.st_ino


def _input_conflict(out: Path, inputs: Sequence[str | Path]) -> str | None:
    """Why ``out`` (resolved) would overwrite an input, or None."""
    try:
        out_st = os.stat(out)
    except OSError:
        out_st = None
    above = set(_ids(out.parent))
    for given in inputs:
        src = Path(given)
        try:
            st = os.stat(src)
        except OSError:
            continue  # a missing input is the command's own error, reported as such
        resolved = src.resolve()
        if stat.S_ISDIR(st.st_mode):
            if resolved in (out, *out.parents) or (st.st_dev, st.st_ino) in above:
                return f"is inside the input {given} (it would change what it reads)"
        elif resolved == out or (out_st is not None and (out_st.st_dev, out_st.st_ino) == (st.st_dev, st.st_ino)):
            return f"is the input {given}"
    return None


def check_outputs(outputs: Sequence[tuple[str, str | Path | None]], inputs: Sequence[str | Path] = ()
                  ) -> list[tuple[str, Path]]:
    """Check every (option, path) pair (None: not asked for); return those asked for.

    Raises :class:`OutputError` naming the option and the path for the first that must not be
    written; nothing is written by the check itself."""
    chosen: list[tuple[str, Path]] = []
    seen: dict[Path, str] = {}
    for option, given in outputs:
        if given is None:
            continue
        if str(given).strip() == "":
            raise OutputError(f"{option}: an empty path; give a file name")
        path = Path(given)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise OutputError(f"{option} {given}: cannot be checked ({exc.strerror or exc})") from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{option} {given}: is {_kind(st.st_mode)}, not a regular file; name a file to write")
        parent = Path(os.path.abspath(path)).parent
        if not parent.is_dir():
            raise OutputError(f"{option} {given}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(f"{option} {given}: directory {parent} is not writable")
        if st is not None and not os.access(path, os.W_OK):
            raise OutputError(f"{option} {given}: the file is not writable")
        resolved = _resolved(path)
        problem = _input_conflict(resolved, inputs)
        if problem:
            raise OutputError(f"{option} {given}: {problem}")
        if resolved in seen:
            raise OutputError(f"{seen[resolved]} and {option} name the same file {given}")
        seen[resolved] = option
        chosen.append((option, path))
    return chosen


def write_outputs(files: Sequence[tuple[Path, str]]) -> None:
    """Write every (path, text) whole, or none of them: each goes to a temporary name beside
    its target first; only when all are written are they renamed into place."""
    temps: list[tuple[Path, Path]] = []
    try:
        for path, text in files:
            tmp = Path(path).with_name(f".{Path(path).name}.{uuid.uuid4().hex}.tmp")
            temps.append((tmp, Path(path)))
            tmp.write_text(text, encoding="utf-8")
        for tmp, path in temps:
            os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def enclosing_dataset(path: Path) -> Path | None:
    """The cancelbench dataset (a directory with a manifest or records/) above ``path``, if any."""
    for parent in _resolved(path).parents:
        if (parent / MANIFEST).exists() or (parent / RECORDS).is_dir():
            return parent
    return None


def check_sweep_out(out: str | Path) -> None:
    """Refuse a ``sweep --out`` that would mix a sweep into something else (OutputError)."""
    if str(out).strip() == "":
        raise OutputError("--out: an empty path; give the results directory")
    path = Path(out)
    if path.is_symlink():
        raise OutputError(f"--out {out}: is a symbolic link; give the directory it points to "
                          f"({os.path.realpath(path)}) or another one")
    outer = enclosing_dataset(path)
    if outer is not None:
        raise OutputError(f"--out {out}: is inside the dataset {outer} (its reports would read this sweep's "
                          "records too); choose a directory outside it")
    if path.is_dir() and not (path / MANIFEST).exists() and not (path / RECORDS).exists():
        foreign = sorted(p.name for p in path.iterdir() if p.name not in SWEEP_OWN_NAMES)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise OutputError(f"--out {out}: is a non-empty directory that is not a cancelbench dataset "
                              f"(holds {shown}); choose a new or empty directory")
    for name in ("report.txt", "report.html"):  # the sweep's own, rewritten at its end
        target = path / name
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise OutputError(f"--out {out}: {target} is {_kind(os.lstat(target).st_mode)}; the sweep writes "
                              "its report there: move it away")


# ------------------------------------------------------------------ stdout --
class _TolerantStdout:
    """sys.stdout that drops what it cannot write once the reader has gone (EPIPE): the
    descriptor is pointed at /dev/null, so the interpreter's final flush cannot fail either."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.closed_by_reader = False

    def _gone(self) -> None:
        self.closed_by_reader = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.EBADF):
                raise
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.EBADF):
                raise
            self._gone()
            with contextlib.suppress(OSError):
                self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_stdout() -> None:
    """Make stdout safe to write whatever became of it: a descriptor closed before the start
    (``>&-``) is reopened on /dev/null (also so no file the command opens lands on fd 1); a
    reader that goes away later turns the rest of the output into nothing (no traceback)."""
    try:
        os.fstat(1)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as the process
    if sys.stdout is not None and not isinstance(sys.stdout, _TolerantStdout):
        sys.stdout = _TolerantStdout(sys.stdout)


def finish_stdout() -> None:
    """Flush stdout at the end of a command (a late EPIPE is dropped, not a traceback at exit)."""
    if sys.stdout is not None:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
