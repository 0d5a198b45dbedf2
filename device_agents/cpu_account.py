"""Where the engine's time went between the cancel's receipt and its stop: CPU time,
time spent waiting runnable for a CPU, involuntary context switches of the engine
process's threads, and the host's noise facts over the same window (stdlib only).

Linux reads the engine process's CPU clock (every thread, up to date) and, for each of
its threads, ``/proc/<pid>/task/<tid>/schedstat`` (ns on a CPU, ns waiting on a runqueue,
timeslices: the scheduler's own per-thread clocks, kernel CONFIG_SCHED_INFO) and
``.../status`` (``nonvoluntary_ctxt_switches``) (in-process engines: the agent's own
process; external ones: the engine's),
``/proc/loadavg`` (load, runnable tasks), ``/proc/stat`` (steal) and cpufreq's
``scaling_cur_freq``. In process, the involuntary switches of every thread come from one
``getrusage(RUSAGE_SELF)`` (exited threads too) instead of each thread's ``status``.

The *trial thread* (the one that runs the engine's native calls and reaches the terminal state:
the thread that builds the :class:`Window`, in process) is read on its own, first at the receipt
(under the cancel's lock, right after the cancel was set: a clock read and one ``pread``) and
first at the terminal state (on that thread, before anything else): its CPU clock
(``pthread_getcpuclockid``, up to date), its schedstat run delay and the agent's monotonic clock.
They split the wall-clock residue (reports/residue.py); an external engine's trial thread is not
known to the agent, so those columns are null there. A :class:`Window` snapshots the threads at the receipt
(:meth:`Window.at_receipt`, right after the cancel was set, so it never delays it) and
at the terminal state, and diffs them. The wait and switches of threads that exit inside
the window are missed (llama.cpp's CPU threads are OpenMP's, alive across calls). Elsewhere (macOS) nothing
is read: the columns are null and ``cpu_account_source`` says why.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from dataclasses import dataclass

SOURCE = "schedstat"
MAX_FREQ_CPUS = 64  # cpufreq files read at most (one per CPU the engine may run on)
_TICK_MS = 1000.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


# -- pure parsing (unit-tested on captured file contents) ---------------------------------
def parse_schedstat(text: str) -> tuple[int, int, int]:
    """``/proc/.../schedstat``: (ns on a CPU, ns waiting runnable on a runqueue, timeslices)."""
    run, wait, slices = text.split()[:3]
    return int(run), int(wait), int(slices)


_NIVCSW = "\nnonvoluntary_ctxt_switches:"


def parse_nonvoluntary(text: str) -> int | None:
    """``/proc/.../status``: the thread's involuntary context switches, None if not listed."""
    at = text.find(_NIVCSW)
    return None if at < 0 else int(text[at + len(_NIVCSW):].split(None, 1)[0])


def parse_loadavg(text: str) -> tuple[float, int]:
    """``/proc/loadavg``: (1-minute load average, tasks runnable now, the reader included)."""
    fields = text.split()
    return float(fields[0]), int(fields[3].split("/")[0])


def parse_steal_ticks(text: str) -> int | None:
    """``/proc/stat``: steal time of all CPUs (USER_HZ ticks), None where the kernel's
    ``cpu`` line has no steal field."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            values = line.split()[1:]
            return int(values[7]) if len(values) > 7 else None
    return None


def parse_khz(text: str) -> int | None:
    """cpufreq's ``scaling_cur_freq`` (kHz); None for anything that is not a number."""
    text = text.strip()
    return int(text) if text.isdigit() else None


# -- reading -----------------------------------------------------------------------------
def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096).decode("ascii", "replace")
    finally:
        os.close(fd)


def _steal_ticks() -> int | None:
    try:
        return parse_steal_ticks(_read("/proc/stat"))
    except OSError:
        return None


@dataclass(frozen=True)
class Snapshot:
    cpu_ns: int  # the process CPU clock: all threads, the exited ones too
    threads: dict[int, tuple[int, int, int]]  # tid -> (ns on CPU, ns waiting runnable, involuntary switches)
    load_1m: float
    procs_running: int
    steal_ticks: int | None
    nivcsw: int | None = None  # in process: getrusage's involuntary switches of every thread (then not per thread)


def thread_cpu_ns(tid: int) -> int:
    """CPU time of thread ``tid`` of this process, up to date (its thread CPU clock,
    pthread_getcpuclockid(3); Linux encodes it as below)."""
    return time.clock_gettime_ns(((~tid) << 3) | 6)  # CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD_MASK (posix-timers.h)


_SCHEDSTAT_FDS: dict[int, int] = {}  # tid -> its schedstat, kept open (this process's trial threads)


def own_thread_reading(tid: int) -> tuple[int, int, int] | None:
    """(agent monotonic ns, CPU ns, run delay ns) of this process's thread ``tid``: one clock read
    and one ``pread`` of its kept-open schedstat, no lock taken; None once the thread is gone."""
    for _ in (0, 1):
        fd = _SCHEDSTAT_FDS.get(tid)
        try:
            if fd is None:
                fd = _SCHEDSTAT_FDS[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            now = time.monotonic_ns()  # CLOCK_MONOTONIC: the agent's clock (native.now_ns)
            cpu = thread_cpu_ns(tid)
            return now, cpu, parse_schedstat(os.pread(fd, 256, 0).decode("ascii"))[1]
        except (OSError, ValueError):
            old = _SCHEDSTAT_FDS.pop(tid, None)
            if old is not None:
                os.close(old)
    return None


def forget_own_thread(tid: int) -> None:
    """Thread ``tid`` (an in-process channel's engine) ends: its kept-open schedstat is closed."""
    fd = _SCHEDSTAT_FDS.pop(tid, None)
    if fd is not None:
        os.close(fd)


class ThreadFiles:
    """The schedstat and status files of one process's threads, opened once and kept open
    across trials: a snapshot is a pread of each schedstat (opening /proc files costs 5x more).
    A thread's status (10x a schedstat's cost) is read again only if it ran since it was last
    read: an involuntary switch preempts a running thread, so one that did not run has none."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status = pid != os.getpid()  # in process, getrusage counts the switches (Snapshot.nivcsw)
        self._fds: dict[int, tuple[int, int]] = {}
        self._last: dict[int, tuple[int, int, int]] = {}  # tid -> its values at the last read
        self._lock = threading.Lock()

    def _open(self, tid: int) -> tuple[int, int] | None:
        base = f"/proc/{self.pid}/task/{tid}"
        try:
            sched = os.open(f"{base}/schedstat", os.O_RDONLY)
        except OSError:
            return None
        try:
            return sched, os.open(f"{base}/status", os.O_RDONLY)
        except OSError:
            os.close(sched)
            return None

    def _drop(self, tid: int) -> None:
        self._last.pop(tid, None)
        for fd in self._fds.pop(tid, ()):
            os.close(fd)

    def _read_one(self, tid: int) -> tuple[int, int, int] | None:
        for attempt in (0, 1):  # a stale fd (the tid now names another thread) is opened again once
            fds = self._fds.get(tid) or self._open(tid)
            if fds is None:
                return None
            self._fds[tid] = fds
            try:
                run, wait, _ = parse_schedstat(os.pread(fds[0], 256, 0).decode("ascii"))
                last = self._last.get(tid)
                if not self.status:
                    switches = 0
                elif last is not None and last[0] == run:  # it has not run since: its switches are the same
                    switches = last[2]
                else:
                    switches = parse_nonvoluntary(os.pread(fds[1], 4096, 0).decode("ascii", "replace")) or 0
                self._last[tid] = (run, wait, switches)
                return self._last[tid]
            except (OSError, ValueError):
                self._drop(tid)
        return None

    def read(self) -> dict[int, tuple[int, int, int]]:
        """Every live thread: tid -> (ns on CPU, ns waiting runnable, involuntary switches).
        A thread that exits while being read is left out; a process that is gone raises OSError."""
        with self._lock:
            out = {}
            for name in os.listdir(f"/proc/{self.pid}/task"):
                values = self._read_one(int(name))
                if values is not None:
                    out[int(name)] = values
            for tid in set(self._fds) - set(out):
                self._drop(tid)
            return out

    def close(self) -> None:
        with self._lock:
            for tid in list(self._fds):
                self._drop(tid)


_FILES: dict[int, ThreadFiles] = {}  # pid -> its open files (the agent's own; an external engine's)
_FILES_LOCK = threading.Lock()


def files_of(pid: int) -> ThreadFiles:
    """The kept-open files of ``pid``; those of other pids beyond the last few are closed."""
    with _FILES_LOCK:
        files = _FILES.pop(pid, None) or ThreadFiles(pid)
        _FILES[pid] = files  # most recent last
        while len(_FILES) > 4:
            _FILES.pop(next(iter(_FILES))).close()
        return files


def read_threads(pid: int) -> dict[int, tuple[int, int, int]]:
    return files_of(pid).read()


def process_cpu_ns(pid: int) -> int:
    """CPU time of all of ``pid``'s threads, the exited ones included, brought up to date (its
    process CPU clock, clock_getcpuclockid(3); Linux encodes it as below). A schedstat's figure
    of a thread running now lags to its last scheduler tick; this one does not."""
    return time.clock_gettime_ns(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of the process (kernel posix-timers.h)


def snapshot(pid: int) -> Snapshot:
    """The process clock first (the figure nearest the receipt), then its threads, then the host."""
    cpu = process_cpu_ns(pid)
    nivcsw = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw if pid == os.getpid() else None
    threads = read_threads(pid)
    load, running = parse_loadavg(_read("/proc/loadavg"))
    return Snapshot(cpu, threads, load, running, parse_steal_ticks(_read("/proc/stat")), nivcsw)


def diff(before: Snapshot, after: Snapshot) -> dict:
    """The window's columns: CPU time from the process clock; run delay and switches of the
    threads alive at its end, counted from zero if they started in it."""
    wait = switches = 0
    for tid, (_, w, s) in after.threads.items():
        _, w0, s0 = before.threads.get(tid, (0, 0, 0))
        wait, switches = wait + w - w0, switches + s - s0
    if before.nivcsw is not None and after.nivcsw is not None:
        switches = after.nivcsw - before.nivcsw
    steal = (None if before.steal_ticks is None or after.steal_ticks is None
             else (after.steal_ticks - before.steal_ticks) * _TICK_MS)
    return {"engine_cpu_ms": (after.cpu_ns - before.cpu_ns) / 1e6, "engine_cpu_wait_ms": wait / 1e6,
            "engine_involuntary_switches": switches, "engine_threads": len(after.threads), "host_loadavg_1m": after.load_1m,
            "host_procs_running": max(before.procs_running, after.procs_running), "host_steal_ms": steal}


def cpu_mhz(pid: int) -> float | None:
    """Mean current frequency of the CPUs ``pid`` may run on (the first MAX_FREQ_CPUS), MHz;
    None where cpufreq is not exposed (most VMs)."""
    try:
        cpus = sorted(os.sched_getaffinity(pid))[:MAX_FREQ_CPUS]
    except OSError:
        return None
    khz = []
    for cpu in cpus:
        try:
            value = parse_khz(_read(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq"))
        except OSError:
            return None
        if value is not None:
            khz.append(value)
    return sum(khz) / len(khz) / 1000.0 if khz else None


def unavailable_reason(pid: int) -> str | None:
    """Why this host cannot account the engine's threads, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"unavailable: {sys.platform} has no per-thread run delay cancelbench reads (Linux schedstat only)"
    if not os.path.exists(f"/proc/{pid}/task/{pid}/schedstat"):
        return "unavailable: no /proc/<pid>/task/<tid>/schedstat (kernel without CONFIG_SCHED_INFO, or pid gone)"
    return None


class Window:
    """One trial's window, receipt -> terminal, on the engine process ``pid``. Thread-safe:
    the receipt is taken on the cancel's thread, the terminal on the engine's. Built on the
    trial's thread (the agent's run_trial), whose tid it keeps as the trial thread (in process)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._lock = threading.Lock()
        self._receipt: Snapshot | None = None
        self._terminal: Snapshot | None = None
        self._mhz: float | None = None
        self._cost_us: float | None = None
        self._asked = False  # a cancel was received: the window exists
        self._why: str | None = unavailable_reason(pid)
        self.trial_tid: int | None = threading.get_native_id() if pid == os.getpid() else None
        self._trial: list = [None, None]  # the trial thread's (monotonic ns, CPU ns, run delay ns): receipt, terminal
        self._t0 = 0
        # the whole trial's, for every trial (uncancelled too): how much the engine's thread waited for a CPU
        self._run0 = own_thread_reading(self.trial_tid) if self._why is None and self.trial_tid is not None else None
        # the host's steal over the whole trial too: a residue (a ms or two) is far shorter than
        # /proc/stat's 10 ms tick, so steal over residues alone is one tick or none (reports/noise.py)
        self._steal0 = _steal_ticks() if self._run0 is not None else None

    def owe_receipt(self) -> None:
        """Called under the cancel's lock: a receipt snapshot is coming, so a terminal one waits for it.
        The trial thread is read here (a clock and a pread), so its reading precedes the terminal's.
        The same thread must call :meth:`at_receipt` next."""
        self._lock.acquire()
        self._t0 = time.perf_counter_ns()
        if self._why is None and self.trial_tid is not None and self._trial[0] is None:
            self._trial[0] = own_thread_reading(self.trial_tid)

    def at_receipt(self) -> None:
        """The receipt snapshot (after :meth:`owe_receipt`); its own cost (the trial thread's read
        included) is recorded."""
        try:
            self._asked = True
            if self._why is None:
                self._receipt = self._take()
                self._cost_us = (time.perf_counter_ns() - self._t0) / 1e3
        finally:
            self._lock.release()

    def at_terminal(self) -> None:
        if (self.trial_tid is not None and self._trial[0] is not None and self._trial[1] is None
                and threading.get_native_id() == self.trial_tid):
            self._trial[1] = own_thread_reading(self.trial_tid)  # first, before waiting for the lock
        with self._lock:
            if self._receipt is not None and self._terminal is None:
                self._terminal = self._take()
                self._mhz = cpu_mhz(self.pid) if self._terminal is not None else None

    def watch(self, pid: int) -> None:
        """The engine runs in ``pid`` (maybe restarted; the agent's own on the in-process channel), not on
        the agent's trial thread: a receipt already taken (a cancel latched before the run) is taken again."""
        with self._lock:
            if pid == self.pid and self.trial_tid is None:
                return
            self.pid, self._why, self.trial_tid = pid, unavailable_reason(pid), None
            self._trial = [None, None]
            if self._receipt is not None:
                self._receipt = self._take()

    def _take(self) -> Snapshot | None:
        try:
            return snapshot(self.pid)
        except OSError as exc:
            gone = not os.path.exists(f"/proc/{self.pid}")
            self._why = f"unavailable: engine process {self.pid} " + ("gone" if gone else f"unreadable ({exc})")
            return None

    def _trial_columns(self) -> dict:
        before, after = self._trial
        if before is None or after is None:
            return {}
        return {"trial_cpu_ms": (after[1] - before[1]) / 1e6, "trial_cpu_wait_ms": (after[2] - before[2]) / 1e6,
                "cpu_window_ms": (after[0] - before[0]) / 1e6, "trial_cpu_source": "agent"}

    def observe_columns(self, seen_cpu_ns: int, seen_where: str | None) -> dict:
        """``trial_observe_cpu_ms``: the trial thread's CPU clock at the eval reader's first sight of
        the token (``seen_cpu_ns``, stamped on that thread; 0 = not stamped) minus its receipt read;
        ``native_seen_where``: where that reader saw it."""
        before = self._trial[0]
        if not seen_cpu_ns or before is None:
            return {}
        return {"trial_observe_cpu_ms": max(0, seen_cpu_ns - before[1]) / 1e6, "native_seen_where": seen_where}

    def _run_columns(self) -> dict:
        """The trial thread over the whole trial: Window built (run_trial entered) -> now (the record's
        columns taken, on that thread, right after the engine's run)."""
        end = own_thread_reading(self.trial_tid) if self._run0 is not None and self.trial_tid is not None else None
        steal1 = _steal_ticks() if self._steal0 is not None else None  # the host's: an engine's process or not
        steal = {} if steal1 is None else {"host_run_steal_ms": (steal1 - self._steal0) * _TICK_MS}
        if end is None or threading.get_native_id() != self.trial_tid:
            return steal
        return {"trial_run_cpu_ms": (end[1] - self._run0[1]) / 1e6, "trial_run_wait_ms": (end[2] - self._run0[2]) / 1e6,
                "trial_run_wall_ms": (end[0] - self._run0[0]) / 1e6, **steal, "trial_cpu_source": "agent"}

    def columns(self) -> dict:
        """The record's columns: the whole trial's trial-thread figures, and the window's (none
        if no cancel was received)."""
        run = self._run_columns()
        return {**run, **self._window_columns()}

    def _window_columns(self) -> dict:
        self.at_terminal()  # a trial that ended without a terminal state (an error): now
        with self._lock:
            if not self._asked:
                return {}
            if self._why is not None:
                return {"cpu_account_source": self._why}
            if self._receipt is None or self._terminal is None:
                return {}
            return {**diff(self._receipt, self._terminal), "host_cpu_mhz": self._mhz,
                    "cpu_snapshot_us": self._cost_us, "cpu_account_source": SOURCE, **self._trial_columns()}
