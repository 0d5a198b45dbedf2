"""The trial thread's own CPU account, taken by the engine library (protocol 1.3, ``done.cpu``).

The agent reads an in-process engine's trial thread itself (device_agents/cpu_account.py). An
engine in another process it cannot: Linux lets a thread's CPU clock be read only from its own
process, and a running thread's schedstat CPU figure lags to its last tick. So the engine reads
its trial thread (the thread that runs the engine's native calls and reaches the terminal
decision: the one ``engine.run`` runs on) at four moments and sends the readings; the agent turns
them into the residue split's columns, labelled engine-reported (descriptive: no verdict reads
them, and the agent checks each against the spans it saw itself).

A reading is (when, CPU clock ns, run delay ns or None): the engine's clock (the one its hello
declares and its pongs read) when it was taken, then the thread's CPU clock (readable from any
thread of the process, up to date) and its schedstat run delay (Linux; None elsewhere).
"""

from __future__ import annotations

import sys
import threading
import time

from cancelbench.sut.protocol import CPU_MOMENTS

Reading = tuple[int, int, int | None]


class TrialThread:
    """Readings of the thread that built it (the trial thread), from any thread; the first
    reading of each moment is kept. Thread-safe (a dict store per moment)."""

    def __init__(self) -> None:
        self.tid = threading.get_native_id()
        self.readings: dict[str, Reading] = {}
        self._clock: int | None = None
        if sys.platform != "linux":
            try:  # where Python has it (not macOS): the thread's CPU clock, no run delay
                self._clock = time.pthread_getcpuclockid(threading.get_ident())
            except (AttributeError, OSError):
                self._clock = None
        self.take("run")

    def read(self) -> Reading | None:
        """The thread's (now, CPU ns, run delay ns) now; None where its CPU clock cannot be read."""
        if sys.platform == "linux":  # CLOCK_MONOTONIC, then the clock and a pread: cpu_account's reading
            from cancelbench.device_agents.cpu_account import own_thread_reading

            return own_thread_reading(self.tid)
        if self._clock is None:
            return None
        now = time.monotonic_ns()
        return now, time.clock_gettime_ns(self._clock), None

    def take(self, moment: str, reading: Reading | None = None) -> None:
        """Keep ``reading`` (default: one read now) as ``moment``'s, unless it has one."""
        if moment in self.readings:
            return
        reading = self.read() if reading is None else reading
        if reading is not None:
            self.readings[moment] = reading

    def fields(self, with_receipt: bool) -> dict[str, int]:
        """``done.cpu``: ``<moment>_t``, ``<moment>_cpu`` and ``<moment>_wait`` of each reading (a
        receipt's only when the done carries one)."""
        out: dict[str, int] = {}
        for moment in CPU_MOMENTS:
            if moment == "receipt" and not with_receipt:
                continue
            reading = self.readings.get(moment)
            if reading is not None:
                out[f"{moment}_t"], out[f"{moment}_cpu"] = int(reading[0]), int(reading[1])
                if reading[2] is not None:
                    out[f"{moment}_wait"] = int(reading[2])
        return out
