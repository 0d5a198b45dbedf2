"""One thread fires every driver-delivered cancel of a sweep at its due time.

The device runs share one event loop (device_run.py), which must never wait for
a deadline: a loop that is busy finishing another device's record fires late.
So the loop hands each due cancel to this thread and awaits the result. The
thread sleeps to just before the earliest due time, then yields the GIL in a
loop (never spins holding it: every other driver thread would wait a whole
switch interval), stamps ``t_issued_driver_ns`` and submits the Ray call.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import sys
import threading
import time
from typing import Callable

from .clock import driver_now_ns

SPIN_NS = 200_000  # the last this-many ns before a deadline: yield the GIL in a loop instead of sleeping
# How long a thread that wants the GIL waits before it asks the holder to let go (Python's
# default is 5 ms). The timer thread waking for a cancel competes with the event loop
# finishing records; at the default a cancel could wait 5 ms for the GIL alone.
SWITCH_INTERVAL_S = 0.0001


# The switch interval is process-wide: lowered while any timer is open, restored when the
# last one closes (two sweeps in one process, e.g. a benchmark's, overlap their timers).
_interval_lock = threading.Lock()
_open_timers = 0
_interval_before = 0.0


def _lower_switch_interval() -> None:
    global _open_timers, _interval_before
    with _interval_lock:
        if _open_timers == 0:
            _interval_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_interval_before, SWITCH_INTERVAL_S))
        _open_timers += 1


def _restore_switch_interval() -> None:
    global _open_timers
    with _interval_lock:
        _open_timers -= 1
        if _open_timers == 0:
            sys.setswitchinterval(_interval_before)


def sleep_until_driver(deadline_ns: int) -> None:
    """Sleep to the deadline, then yield (time.sleep(0) releases the GIL) until it passes."""
    while True:
        left = deadline_ns - driver_now_ns()
        if left <= 0:
            return
        time.sleep((left - SPIN_NS) / 1e9 if left > 2 * SPIN_NS else 0)


class CancelTimer:
    """``fire_at(due_ns, submit)`` -> a future of ``(t_issued_driver_ns, submit())``,
    resolved on this thread at the first moment the driver clock passes ``due_ns``
    (at once if it already has)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Callable[[], object], concurrent.futures.Future]] = []
        self._seq = itertools.count()  # ties fire in the order they were asked for
        self._cond = threading.Condition()
        self._closed = False
        _lower_switch_interval()
        self._thread = threading.Thread(target=self._loop, name="cancel-timer", daemon=True)
        self._thread.start()

    def fire_at(self, due_ns: int, submit: Callable[[], object]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                fut.set_exception(RuntimeError("the cancel timer is closed"))
                return fut
            heapq.heappush(self._heap, (due_ns, next(self._seq), submit, fut))
            self._cond.notify()
        return fut

    def fire_after(self, event: concurrent.futures.Future,
                   schedule: Callable[[object], tuple[int, Callable[[], object]] | None]) -> concurrent.futures.Future:
        """Once ``event`` resolves, ``schedule(its value)`` gives ``(due_ns, submit)`` (or None: no
        cancel) for :meth:`fire_at`. The hand-over runs on the thread that resolves ``event``
        (Ray's, for an ObjectRef's ``future()``), never on the driver's event loop: a loop busy
        with other devices' records would otherwise make every cancel late by its backlog.
        The result: ``None``, or ``(t_seen_ns, value, t_issued_driver_ns, submit())`` where
        ``t_seen_ns`` is when the driver learnt of the event."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def on_event(f: concurrent.futures.Future) -> None:
            seen = driver_now_ns()
            try:
                value = f.result()
                planned = schedule(value)
                if planned is None:
                    out.set_result(None)
                    return
                fired = self.fire_at(*planned)
            except BaseException as exc:
                out.set_exception(exc)
                return

            def on_fired(g: concurrent.futures.Future) -> None:
                try:
                    issued, submitted = g.result()
                except BaseException as exc:
                    out.set_exception(exc)
                    return
                out.set_result((seen, value, issued, submitted))
            fired.add_done_callback(on_fired)

        event.add_done_callback(on_event)
        return out

    def close(self) -> None:
        """Stop the thread; cancels still waiting fail (their trials are ending anyway)."""
        with self._cond:
            was_closed, self._closed = self._closed, True
            self._cond.notify()
        self._thread.join(timeout=5)
        if not was_closed:
            _restore_switch_interval()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._heap:
                    self._cond.wait()
                if self._closed:
                    pending, self._heap = self._heap, []
                    break
                due = self._heap[0][0]
                left = due - driver_now_ns()
                if left > 2 * SPIN_NS:  # a new, earlier cancel wakes this wait (notify)
                    self._cond.wait((left - SPIN_NS) / 1e9)
                    continue
            sleep_until_driver(due)
            with self._cond:
                now = driver_now_ns()
                ready = []
                while self._heap and self._heap[0][0] <= now:
                    ready.append(heapq.heappop(self._heap))
            for _, _, submit, fut in ready:
                issued = driver_now_ns()
                try:
                    fut.set_result((issued, submit()))
                except BaseException as exc:  # e.g. the agent is gone: the trial's own result says so
                    fut.set_exception(exc)
        for _, _, _, fut in pending:
            fut.set_exception(RuntimeError("the cancel timer is closed"))
