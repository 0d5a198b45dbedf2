"""The shared cancel word (docs/sut-protocol.md, "The shared cancel word"): a small
shared-memory region per engine process whose first 8 bytes the agent stores a trial's
sequence number in before it writes that trial's ``cancel`` line, so the engine's native
readers see the cancel at their next poll, with no thread to wake (libcancelbench
``cb_token_watch``).

Private to the two processes:

* Linux: an anonymous ``memfd`` (no name in any file system), sealed against shrinking and
  growing (an untrusted engine cannot make the agent's store fault) and against future
  writes, then handed to the engine as a read-only descriptor it inherits (``pass_fds``),
  its number in ``CANCELBENCH_CANCEL_WORD_FD``. The engine can map it read-only only.
* macOS: ``shm_open`` of a random name with mode 0600, unlinked at once (the name exists
  for microseconds, for this user only), the descriptor inherited the same way. Not run
  here (no macOS machine); without either, :func:`create` returns None and cancels go by
  the line alone.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
import sys

from cancelbench import native

FD_ENV = "CANCELBENCH_CANCEL_WORD_FD"  # cancel_token.h CB_WORD_FD_ENV
REGION_BYTES = 4096  # cancel_token.h CB_WORD_REGION_BYTES
# fcntl seals (linux/fcntl.h); F_SEAL_FUTURE_WRITE is Linux 5.1+ and not in every Python's fcntl
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE = 0x1, 0x2, 0x4, 0x10
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)


class CancelWord:
    """The agent's side of one engine process's cancel word."""

    def __init__(self, mm: mmap.mmap, engine_fd: int, kind: str) -> None:
        self._mm = mm
        self._cell = ctypes.c_uint64.from_buffer(mm)  # keeps the mapping exported until close
        self.address = ctypes.addressof(self._cell)
        self.engine_fd = engine_fd  # the read-only descriptor the engine inherits
        self.kind = kind  # memfd | shm

    def store(self, seq: int) -> int:
        """Store trial ``seq`` (the run's ``cancel_seq``); the agent's clock just before the store."""
        t = native.now_ns()
        native.word_store(self.address, seq)
        return t

    def load(self) -> int:
        return native.word_load(self.address)

    def env(self) -> dict:
        return {FD_ENV: str(self.engine_fd)}

    def engine_started(self) -> None:
        """The engine holds its copy of the descriptor: the agent's copy is closed."""
        if self.engine_fd >= 0:
            os.close(self.engine_fd)
            self.engine_fd = -1

    def close(self) -> None:
        self.engine_started()
        if self._mm is not None:
            del self._cell
            self._mm.close()
            self._mm = None


def create() -> CancelWord | None:
    """A new region for one engine process, or None where the platform has no private one."""
    try:
        if hasattr(os, "memfd_create"):
            return _memfd()
        if sys.platform == "darwin":
            return _shm()
    except OSError:
        return None
    return None


def _memfd() -> CancelWord:
    fd = os.memfd_create("cancelbench-cancel-word", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, REGION_BYTES)
        mm = mmap.mmap(fd, REGION_BYTES)  # the agent's writable mapping, made before the seals
        seals = F_SEAL_SHRINK | F_SEAL_GROW
        try:
            fcntl.fcntl(fd, F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL)
        except OSError:
            # A kernel before 5.1 has no future-write seal: the engine could reopen its descriptor through
            # /proc read-write and write the word. It would only fool itself: the word carries the agent's
            # cancel to the engine, and the outcome never depends on it (the agent's own stamps judge).
            fcntl.fcntl(fd, F_ADD_SEALS, seals | F_SEAL_SEAL)
        engine_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)
    return CancelWord(mm, engine_fd, "memfd")


def _shm() -> CancelWord:  # macOS (not run here)
    import _posixshmem

    name = "/cb-" + secrets.token_hex(8)
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        _posixshmem.shm_unlink(name)
        os.ftruncate(fd, REGION_BYTES)
        mm = mmap.mmap(fd, REGION_BYTES)
        engine_fd = os.dup(fd)  # shm_open gives no read-only reopen once unlinked: the engine maps it read-only
    finally:
        os.close(fd)
    return CancelWord(mm, engine_fd, "shm")


def inherited() -> int | None:
    """The engine's side: the address of the word the agent handed over (read-only), or None."""
    value = os.environ.get(FD_ENV)
    if not value or not value.isdigit():
        return None
    try:
        return native.word_map(int(value))
    except (OSError, RuntimeError):  # not a region, or no native library here: the line alone
        return None
