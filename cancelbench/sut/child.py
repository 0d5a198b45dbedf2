"""The process an :class:`~cancelbench.sut.client.EngineProcess` speaks the protocol to: how it is started
and ended (Popen's ``stdin``, ``stdout``, ``stderr``, ``pid``, ``poll``, ``wait``, plus ``end``).

A child that leads its own process group in the agent's session (a session of its own is an autogroup of
its own under Linux autogroup scheduling: its threads would get a CPU share apart from the agent's, which
no in-process engine sees); a reaper (``python -m cancelbench.sut.reaper``) kills the group if the agent
dies without closing it; ``end`` kills the group and what it started outside it.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

from .leftovers import MARK_ENV, descendants, end_leftovers, group_alive

TERM_GRACE_S = 2.0


class SpawnError(OSError):
    """The engine could not be started; its message is one line."""


class ChildProcess:
    def __init__(self, command: list[str], *, cwd: str | None, env: dict, mark: str, word=None) -> None:
        self.mark = mark
        try:
            self.popen = subprocess.Popen(
                command, cwd=cwd, env={**os.environ, **env, MARK_ENV: mark, **(word.env() if word else {})},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
                bufsize=0, pass_fds=(word.engine_fd,) if word else ())
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the argv or the environment
            raise SpawnError(f"cannot start the engine {command[0]!r}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        # stdout buffered: a line is one read, not one read a byte (a raw pipe's readline), and a read
        # returns what the pipe holds, so a line is not held back for more
        self.stdin, self.stderr = self.popen.stdin, self.popen.stderr
        self.stdout = io.BufferedReader(self.popen.stdout)
        self.pid = self.popen.pid
        self._reaper = self._start_reaper()

    def _start_reaper(self) -> subprocess.Popen | None:
        """A small process that kills the engine's group if this process dies without closing it."""
        try:
            return subprocess.Popen([sys.executable, "-m", "cancelbench.sut.reaper", str(self.pid), self.mark],
                                    stdin=subprocess.PIPE, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:
            return None

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout=timeout)

    def end(self) -> int | None:
        """Whatever is left of the engine's process group: SIGTERM, then SIGKILL; the exit status."""
        pgid = self.pid  # the leader of its own process group
        strays = descendants(pgid)  # its children that left its group (their own session), before it goes
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.popen.poll() is not None and not group_alive(pgid):
                break
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.popen.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        end_leftovers(self.mark, strays)
        # the raw stdout, not its buffer: closing a BufferedReader waits for its lock, which a reader blocked
        # on a pipe a stray process still holds open would never give back
        for stream in (self.stdin, self.popen.stdout, self.stderr):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
        if self._reaper is not None:
            try:
                self._reaper.stdin.close()  # the reaper finds the group gone and exits
            except OSError:
                pass
            try:
                self._reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            self._reaper = None
        return self.popen.poll()
