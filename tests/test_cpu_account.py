"""The engine's CPU accounting (device_agents/cpu_account.py): the /proc parsers on captured
file contents, the window's diff, and real threads on this host (a busy thread's CPU time
grows; a process that waits behind two busy loops on its CPU accrues run delay)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from cancelbench import native
from cancelbench.device_agents import cpu_account as ca
from cancelbench.device_agents.engines.base import CancelControl, Progress

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc")

STATUS = """Name:\tpython
State:\tR (running)
Tgid:\t4242
voluntary_ctxt_switches:\t150
nonvoluntary_ctxt_switches:\t17
"""
STAT = """cpu  342179 0 44332 136229 1058 0 444 140 0 0
cpu0 171000 0 22000 68000 500 0 200 70 0 0
intr 1 2 3
procs_running 7
procs_blocked 0
"""
STAT_OLD_KERNEL = "cpu  342179 0 44332 136229 1058 0 444\nprocs_running 2\n"  # no steal field (before 2.6.11)


def test_parsers_read_captured_files():
    assert ca.parse_schedstat("13077990 14661885 5\n") == (13077990, 14661885, 5)
    assert ca.parse_nonvoluntary(STATUS) == 17  # not the voluntary line above it
    assert ca.parse_nonvoluntary("Name:\tx\n") is None
    assert ca.parse_loadavg("2.43 3.38 2.93 3/115 2271\n") == (2.43, 3)
    assert ca.parse_steal_ticks(STAT) == 140
    assert ca.parse_steal_ticks(STAT_OLD_KERNEL) is None
    assert ca.parse_khz("2400000\n") == 2400000
    assert ca.parse_khz("<unknown>\n") is None


def test_diff_counts_new_threads_from_zero_and_keeps_missing_steal_null():
    before = ca.Snapshot(5_000_000, {1: (1_000_000, 500_000, 2), 2: (10, 10, 0), 3: (7, 7, 7)}, 0.5, 3, None)
    after = ca.Snapshot(9_500_000, {1: (4_000_000, 2_500_000, 5), 2: (10, 10, 0), 4: (1_000_000, 0, 1)}, 1.5, 5, 200)
    cols = ca.diff(before, after)
    assert cols["engine_cpu_ms"] == pytest.approx(4.5)  # the process clock (the exited thread 3's time too)
    assert cols["engine_cpu_wait_ms"] == pytest.approx(2.0)  # thread 1: 2 ms; 4 (new): 0; 3 exited
    assert cols["engine_involuntary_switches"] == 4
    assert cols["engine_threads"] == 3
    assert cols["host_loadavg_1m"] == 1.5 and cols["host_procs_running"] == 5
    assert cols["host_steal_ms"] is None  # one side without a steal field: unknown, never 0
    cols = ca.diff(ca.Snapshot(0, {}, 0.1, 9, 100), ca.Snapshot(0, {}, 0.1, 2, 103))
    assert cols["host_steal_ms"] == pytest.approx(3 * 1000.0 / os.sysconf("SC_CLK_TCK"))
    assert cols["host_procs_running"] == 9


def test_other_platforms_say_plainly_what_is_not_available(monkeypatch):
    monkeypatch.setattr(ca.sys, "platform", "darwin")
    w = ca.Window(os.getpid())
    assert w.columns() == {}  # no cancel received: no window, no columns
    w.owe_receipt()
    w.at_receipt()
    w.at_terminal()
    assert w.columns() == {"cpu_account_source": "unavailable: darwin has no per-thread run delay cancelbench "
                                                  "reads (Linux schedstat only)"}


def _busy_until(stop: threading.Event, counter: list) -> None:
    while not stop.is_set():
        counter[0] += 1


@linux_only
def test_a_busy_threads_cpu_time_grows():
    stop, counter, tid = threading.Event(), [0], []
    t = threading.Thread(target=lambda: (tid.append(threading.get_native_id()), _busy_until(stop, counter)))
    t.start()
    try:
        while not tid:
            threading.Event().wait(0.001)
        before = ca.read_threads(os.getpid())[tid[0]]
        seen = counter[0]
        while counter[0] < seen + 200_000:  # it has done this much work since the snapshot
            threading.Event().wait(0.001)
        after = ca.read_threads(os.getpid())[tid[0]]
    finally:
        stop.set()
        t.join()
    assert after[0] > before[0]  # ns on a CPU grew
    # every thread of the process (one another module's Ray client started or ended meanwhile may differ)
    listed = {int(x) for x in os.listdir("/proc/self/task")}
    got = set(ca.read_threads(os.getpid()))
    again = {int(x) for x in os.listdir("/proc/self/task")}
    assert listed & again <= got <= listed | again, (listed, got, again)


BUSY = "while True: pass"
# Waits for a line, does a fixed amount of work, says so, waits to be told to exit.
WORK = "import sys\nsys.stdin.readline()\nn = 0\nfor i in range(3_000_000): n += i\nprint('done', flush=True)\nsys.stdin.readline()\n"


def _pinned(code: str, cpu: int, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}), **kw)


@linux_only
def test_an_engine_behind_two_busy_loops_on_its_cpu_waits_runnable():
    """Three runnable tasks on one CPU: the scheduler gives the engine about a third, so its run
    delay outgrows its CPU time; the window on its process (an external engine's path) says so."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    busy = [_pinned(BUSY, cpu) for _ in range(2)]
    engine = _pinned(WORK, cpu, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        w = ca.Window(os.getpid())
        w.watch(engine.pid)
        w.owe_receipt()
        w.at_receipt()
        engine.stdin.write("go\n")
        engine.stdin.flush()
        assert engine.stdout.readline().strip() == "done"
        w.at_terminal()
        cols = w.columns()
    finally:
        for p in busy + [engine]:
            p.kill()
            p.wait()
    assert cols["cpu_account_source"] == "schedstat"
    assert cols["engine_cpu_ms"] > 0 and cols["engine_threads"] >= 1
    assert cols["engine_cpu_wait_ms"] > cols["engine_cpu_ms"]  # waited for its CPU longer than it ran
    assert cols["engine_involuntary_switches"] > 0  # preempted by the busy loops
    assert cols["host_procs_running"] >= 3  # the two loops and the engine, at least at one end
    assert cols["cpu_snapshot_us"] > 0


@linux_only
def test_cancel_control_takes_the_window_from_receipt_to_terminal():
    ctl = CancelControl(native.CancelToken(), Progress())
    ctl.cpu = ca.Window(os.getpid())
    assert ctl.request(native.now_ns())
    sum(range(200_000))  # the engine works on after the receipt
    requested, _ = ctl.close()
    assert requested
    cols = ctl.cpu.columns()
    assert cols["cpu_account_source"] == "schedstat" and cols["engine_cpu_ms"] > 0
    assert cols["engine_threads"] == len(os.listdir("/proc/self/task"))
    # the trial thread (this one, which built the window) worked between its two reads
    assert 0 < cols["trial_cpu_ms"] and cols["trial_cpu_wait_ms"] >= 0 and cols["cpu_window_ms"] > 0
    assert cols["trial_run_cpu_ms"] >= cols["trial_cpu_ms"]  # the whole trial holds the window
    assert cols["trial_run_wall_ms"] >= cols["cpu_window_ms"] and cols["host_run_steal_ms"] >= 0
    late = CancelControl(native.CancelToken(), Progress())
    late.cpu = ca.Window(os.getpid())
    late.close()
    assert not late.request(native.now_ns())  # after the terminal state: not this trial's, no window
    assert set(late.cpu.columns()) == {"trial_run_cpu_ms", "trial_run_wait_ms", "trial_run_wall_ms",
                                       "host_run_steal_ms", "trial_cpu_source"}  # only the whole trial's
    assert cols["trial_cpu_source"] == late.cpu.columns()["trial_cpu_source"] == "agent"  # read in process


@linux_only
def test_the_trial_threads_reads_bracket_its_work_and_a_window_on_another_thread_has_none():
    """The split's figures are the building thread's: a cancel taken on another thread reads it
    there (under the cancel's lock), the terminal read is its own; built elsewhere, no split."""
    ctl = CancelControl(native.CancelToken(), Progress())
    ctl.cpu = ca.Window(os.getpid())
    t = threading.Thread(target=lambda: ctl.request(native.now_ns()))
    t.start()
    t.join()
    t0 = time.thread_time_ns()
    sum(range(300_000))
    worked_ms = (time.thread_time_ns() - t0) / 1e6
    ctl.close()
    cols = ctl.cpu.columns()
    assert worked_ms <= cols["trial_cpu_ms"] <= cols["cpu_window_ms"] + cols["trial_cpu_wait_ms"]
    other: dict = {}
    th = threading.Thread(target=lambda: other.update(w=ca.Window(os.getpid())))
    th.start()
    th.join()
    w = other["w"]
    w.owe_receipt()
    w.at_receipt()
    w.at_terminal()  # not on the window's trial thread (gone): no terminal read of it
    assert "trial_cpu_ms" not in w.columns() and w.columns()["cpu_account_source"] == "schedstat"


@linux_only
def test_the_work_before_the_eval_reader_saw_the_cancel_is_the_trial_threads():
    """The cancel is taken on another thread; this (the trial) thread then works in an unpolled
    stretch (no reader asked) before the eval reader's next ask sees the token: that work, and
    not the time before the receipt, is trial_observe_cpu_ms, inside trial_cpu_ms. The abort
    reader (compute threads, not the graph's caller) stamps no CPU clock."""
    ctl = CancelControl(native.CancelToken(), Progress())
    ctl.cpu = ca.Window(os.getpid())
    sum(range(300_000))  # before the receipt: not in it
    t = threading.Thread(target=lambda: ctl.request(native.now_ns()))
    t.start()
    t.join()
    t0 = time.thread_time_ns()
    sum(range(300_000))  # the caller's work between two graphs: no node asked
    unpolled_ms = (time.thread_time_ns() - t0) / 1e6
    ev = native._lib().cb_token_eval_reader
    assert ev(None, True, ctl.token.address) is True  # a set token: "show me", then stop
    assert ev(None, False, ctl.token.address) is False
    after_ms = time.thread_time_ns() / 1e6
    sum(range(300_000))  # the stop unwinds
    ctl.close()
    cols = {**ctl.cpu.columns(), **ctl.cpu.observe_columns(ctl.token.seen_cpu_ns, ctl.token.seen_where)}
    assert ctl.token.seen_cpu_ns / 1e6 <= after_ms  # this thread's CPU clock, not a wall clock
    assert unpolled_ms <= cols["trial_observe_cpu_ms"] < cols["trial_cpu_ms"], cols
    assert cols["native_seen_where"] == "next_ask"  # no range was computing: seen at the next node's ask
    abort = native.CancelToken()
    abort.set()
    assert abort.read() and abort.seen_ns > 0 and abort.seen_cpu_ns == 0
    assert abort.seen_where is None and ca.Window(os.getpid()).observe_columns(0, None) == {}
    # a cancel that comes while a range the reader asked to see is computed: seen at its sync
    ranged = native.CancelToken()
    ranged.set_slice_us(10_000_000)
    addr = ranged.address
    ranged.set()
    ev(None, False, addr)  # the sync of a range in flight when the token was set
    assert ranged.seen_where == "range_end" and ranged.seen_cpu_ns > 0
    ranged.reset()
    assert ranged.seen_where is None and ranged.seen_cpu_ns == 0 and ranged.seen_ns == 0


@linux_only
def test_an_engine_process_gone_is_said_plainly():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    w = ca.Window(os.getpid())
    w.watch(child.pid)
    w.owe_receipt()
    w.at_receipt()
    child.kill()
    child.wait()
    w.at_terminal()
    cols = w.columns()  # the host's steal over the trial is read whatever became of the engine process
    assert cols.pop("host_run_steal_ms") >= 0
    assert cols == {"cpu_account_source": f"unavailable: engine process {child.pid} gone"}


@linux_only
def test_a_thread_that_did_not_run_is_not_read_again(monkeypatch):
    """The receipt's cost: a thread's status (10x a schedstat) is read only if it ran since its
    last read; an idle thread keeps its values, the reading thread's are read afresh."""
    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait) for _ in range(8)]
    for t in idle:
        t.start()
    try:
        files = ca.ThreadFiles(os.getpid())
        first = files.read()
        reads = []
        real = ca.parse_nonvoluntary
        monkeypatch.setattr(ca, "parse_nonvoluntary", lambda text: reads.append(1) or real(text))
        second = files.read()
    finally:
        stop.set()
        for t in idle:
            t.join()
        files.close()
    assert threading.get_native_id() in second and len(second) == len(first) >= 9
    assert len(reads) < len(second)  # the idle threads were not read again
    assert all(second[t.native_id] == first[t.native_id] for t in idle)
