"""The in-process channel (a workload's ``engine_process = "channel"``): the engine protocol's
messages between the agent and an engine library :class:`~cancelbench.sut.server.Server` on a
thread of the agent's own process.

For the simulated engine, which measures the harness alone: the scale benchmark runs many of
them a host, and a child process each would double its processes. Everything else is the one
path of an engine in a process of its own: the same lines, encoded, decoded and validated by the
same code, the same :class:`~cancelbench.sut.client.EngineProcess` (clock check, reach pings, the
outcome rule, restarts), the same shared cancel word, whose address the server is handed directly
(no descriptor to inherit). What the channel leaves out is the pipes and their reader threads: a
line to the engine is handled by the server on the thread that writes it
(:meth:`~cancelbench.sut.server.Server.take_line`, stamped then), and a line from the engine is put
on the client's queue on the engine's thread as it is written
(:meth:`~cancelbench.sut.client.EngineProcess.take_line`): two thread wakes a line fewer, which on
a host of many simulated devices is CPU the other devices' trials get (docs/scale.md).

:class:`ThreadEngine` has the part of :class:`~cancelbench.sut.child.ChildProcess` the client uses
(``stdin``, ``pid``, ``poll``, ``wait``, ``end``) and ``connect``, which the client calls instead of
starting its readers. Its ``pid`` is the agent's own, so the CPU account reads the agent's threads
and the stall the engine's (``engine_tids``). A thread cannot be killed: ``end`` ends the engine's
input (the library then cancels the run in flight and returns) and waits for it. Only an engine
that honours that may run here, which is why only a simulated engine may (``EngineSpec.simulated``;
orchestrator/workloads.py).
"""
from __future__ import annotations

import os
import subprocess
import threading
from typing import Callable

from cancelbench.native import now_ns

from .child import TERM_GRACE_S
from .protocol import MAX_LINE_BYTES


class _ToEngine:
    """The engine's stdin as the client writes it: each whole line handed to the server on the writing
    thread (the client writes under its own lock, one line at a time), stamped when written."""

    def __init__(self, server) -> None:
        self._server = server
        self._buf = bytearray()
        self._closed = False
        self._lock = threading.Lock()

    def write(self, data: bytes) -> int:
        if self._closed:
            raise ValueError("the engine's input is closed")
        t = now_ns()
        self._buf += data
        while (i := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:i + 1])
            del self._buf[:i + 1]
            self._server.take_line(line if len(line) <= MAX_LINE_BYTES else None, t)
        if len(self._buf) > MAX_LINE_BYTES:  # a line with no end in sight: discarded, as the stdin thread does
            self._buf.clear()
            self._server.take_line(None, t)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.end_of_input()


class ThreadEngine:
    """A built-in engine's protocol server on a thread of this process (see the module docstring)."""

    def __init__(self, engine_name: str, *, word=None) -> None:
        from .builtin import BuiltinEngine
        from .server import Server

        self.pid = os.getpid()
        self._rc: int | None = None
        self._to_agent: Callable[[bytes, int], bool] | None = None
        # eof_grace_s None: the server never exits the process (it is the agent's)
        self.server = Server(BuiltinEngine(engine_name, in_agent=True), lambda n: b"", self._write,
                             eof_grace_s=None, word=None if word is None else word.address)
        self.stdin = _ToEngine(self.server)
        self._thread = threading.Thread(target=self._serve, name=f"engine-{engine_name}", daemon=True)

    def _write(self, line: bytes) -> None:
        self._to_agent(line, now_ns())

    def connect(self, take_line: Callable[[bytes, int], bool]) -> int:
        """Start the engine, its lines going to ``take_line`` (the client's); the thread that stamps them
        (the engine's, as the client's reader would: the stall counts its wait once)."""
        self._to_agent = take_line
        self._thread.start()
        return self._thread.native_id

    @property
    def engine_tids(self) -> tuple[int, ...]:
        """The engine's thread: the stall reads it, not the agent's others."""
        return () if self._thread.native_id is None else (self._thread.native_id,)

    def _serve(self) -> None:
        from cancelbench.device_agents.cpu_account import forget_own_thread

        rc = 1
        try:
            rc = self.server.serve(read_input=False)
        finally:
            forget_own_thread(threading.get_native_id())  # the trial thread's readings (sut/trial_thread.py)
            self._rc = rc
            self.server.close_output(lambda: self._to_agent(b"", now_ns()))  # the agent's end of stream

    def poll(self) -> int | None:
        return None if self._thread.is_alive() or not self._thread.ident else self._rc

    def wait(self, timeout: float | None = None) -> int:
        if self._thread.ident:
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(f"engine thread {self._thread.name}", timeout)
        return self._rc

    def end(self) -> int | None:
        """End the engine's input (a run in flight is cancelled, the server returns), wait for it. A thread
        that does not return is left (a daemon): said by poll()."""
        self.stdin.close()
        if self._thread.ident:
            self._thread.join(TERM_GRACE_S)
        return self.poll()
