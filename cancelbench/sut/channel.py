"""The in-process channel (a workload's ``engine_process = "channel"``): the engine protocol's
messages between the agent and an engine library :class:`~cancelbench.sut.server.Server` on a
thread of the agent's own process, over two pipes.

For the simulated engine, which measures the harness alone: the scale benchmark runs many of
them a host, and a child process each would double its processes. Everything else is the one
path of an engine in a process of its own: the same lines, the same
:class:`~cancelbench.sut.client.EngineProcess` (reader thread, clock check, reach pings, the
outcome rule), the same shared cancel word, whose address the server is handed directly (no
descriptor to inherit). :class:`ThreadEngine` has the part of :class:`~cancelbench.sut.child.ChildProcess`
the client uses (``stdin``, ``stdout``, ``stderr``, ``pid``, ``poll``, ``wait``, ``end``); its
``pid`` is the agent's own, so the CPU account and the stall read the agent's threads, the
engine's among them.

A thread cannot be killed: ``end`` closes the engine's stdin (the library then delivers a cancel
to the run in flight and stops) and waits for it. Only an engine that honours that may run here,
which is why only a simulated engine may (``EngineSpec.simulated``; orchestrator/workloads.py).
"""
from __future__ import annotations

import io
import os
import subprocess
import threading

from .child import TERM_GRACE_S


class ThreadEngine:
    """A built-in engine's protocol server on a thread of this process (see the module docstring)."""

    def __init__(self, engine_name: str, *, word=None) -> None:
        from .builtin import BuiltinEngine
        from .server import Server, fd_writer

        to_engine_r, to_engine_w = os.pipe()
        from_engine_r, from_engine_w = os.pipe()
        for fd in (to_engine_r, to_engine_w, from_engine_r, from_engine_w):
            os.set_inheritable(fd, False)
        self.stdin = os.fdopen(to_engine_w, "wb", buffering=0)
        self.stdout = io.BufferedReader(io.FileIO(from_engine_r, "rb"))  # one read a line, as a child's
        self.stderr = io.BytesIO()  # an engine in this process writes to the agent's own stderr
        self.pid = os.getpid()
        self._rc: int | None = None
        self._from_engine_w = from_engine_w

        def read(n: int) -> bytes:
            # The server's stdin thread reads until the end of the stream, then never again: it closes its
            # end itself, so the number is never closed under a read in flight (and reused by another file).
            data = os.read(to_engine_r, n)
            if not data:
                os.close(to_engine_r)
            return data

        # eof_grace_s None: the server never exits the process (it is the agent's)
        self.server = Server(BuiltinEngine(engine_name, in_agent=True), read, fd_writer(from_engine_w),
                             eof_grace_s=None, word=None if word is None else word.address)
        self._thread = threading.Thread(target=self._serve, name=f"engine-{engine_name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from cancelbench.device_agents.cpu_account import forget_own_thread

        rc = 1
        try:
            rc = self.server.serve()
        finally:
            forget_own_thread(threading.get_native_id())  # the trial thread's readings (sut/trial_thread.py)
            self.server.close_output(lambda: os.close(self._from_engine_w))  # the agent's reader: end of stream
            self._rc = rc

    @property
    def engine_tids(self) -> tuple[int, ...]:
        """The engine's threads (the server's and its stdin thread): the stall reads these, not the agent's."""
        tids = (self._thread.native_id, self.server.reader_tid)
        return tuple(t for t in tids if t is not None)

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self._rc

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(f"engine thread {self._thread.name}", timeout)
        return self._rc

    def end(self) -> int | None:
        """Close the engine's stdin (a run in flight is cancelled, the server returns), wait for it;
        the agent's ends closed. A thread that does not return is left (a daemon): said by poll()."""
        try:
            self.stdin.close()
        except OSError:
            pass
        self._thread.join(TERM_GRACE_S)
        if self.server.reader_tid is not None:  # the stall's readings of the stdin thread (engine_tids)
            from cancelbench.device_agents.cpu_account import forget_own_thread

            forget_own_thread(self.server.reader_tid)
        try:
            self.stdout.raw.close()  # the raw stream, not its buffer (client.ChildProcess.end says why)
        except OSError:
            pass
        return self.poll()
