"""The ``--out`` lock: one sweep writes a results directory at a time.

``flock`` on ``DIR/.cancelbench.lock`` for the life of a sweep (:func:`locked_output`);
the lock file, and the directories created for it, are removed again when the sweep
leaves them empty. Re-exported by ``cancelbench.sink``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .inputs import DatasetError

LOCK_FILE = ".cancelbench.lock"  # held (flock) by the sweep writing the directory


def _create_dirs(path: Path) -> list[Path]:
    """mkdir -p that returns the directories it created (deepest last)."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir()
    return list(reversed(missing))


@contextlib.contextmanager
def locked_output(out_dir: Path) -> Iterator[Path]:
    """Hold an exclusive lock on a results directory for the life of a sweep.

    ``flock`` on ``DIR/.cancelbench.lock``: a second sweep into the same
    directory fails at once with a :class:`DatasetError` (exit 2). The lock file,
    and the directories created for it, are removed again when the block
    leaves them empty (a sweep refused later has written nothing).
    """
    out_dir = Path(out_dir)
    try:
        created = _create_dirs(out_dir)
    except (FileExistsError, NotADirectoryError):
        raise DatasetError(f"--out {out_dir}: a file is in the way (need a directory)") from None
    except OSError as exc:
        raise DatasetError(f"--out {out_dir}: cannot create the directory ({exc.strerror})") from None
    if not out_dir.is_dir():
        raise DatasetError(f"--out {out_dir}: is a file, not a directory")
    path = out_dir / LOCK_FILE
    try:
        fd = _acquire(path)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield out_dir
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # while still held: a waiter that opened it sees the inode change
        os.close(fd)
        _remove_empty(created)


def _acquire(path: Path) -> int:
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DatasetError(f"--out {path.parent}: cannot write there ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise DatasetError(f"{path.parent} is being written by another cancelbench sweep (pid {holder}); "
                                   "wait for it to end or choose another --out") from None
            raise DatasetError(f"--out {path.parent}: cannot lock it ({exc.strerror})") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else its holder removed it between our open and flock: take the new one
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):  # deepest first
        with contextlib.suppress(OSError):
            d.rmdir()
