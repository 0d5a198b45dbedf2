"""The ``cpu`` column group of the trial record (cancelbench/schema.py lists it with
``*CPU_FIELDS``): where the engine's time went between the cancel's receipt and its stop,
filled by the agent (device_agents/cpu_account.py, Linux; elsewhere the columns are null and
``cpu_account_source`` says why).

The cpu group: sources and clocks
---------------------------------
* ``engine_cpu_ms``: the engine process's CPU clock (``clock_getcpuclockid``), every thread.
  ``engine_cpu_wait_ms``: each thread's ``/proc/<pid>/task/<tid>/schedstat`` run delay, summed.
  Both are read in a *receipt snapshot* (on the cancel's thread, after the cancel was set) and a
  *terminal snapshot* (on the engine's thread after ``t_terminal``), and diffed.
* ``trial_cpu_ms``, ``trial_cpu_wait_ms``: the *trial thread* alone (the agent thread that runs
  the engine's native calls and reaches the terminal state): its thread CPU clock
  (``pthread_getcpuclockid``, up to date, also while it runs) and its schedstat run delay, read
  first at the receipt (under the cancel's lock, right after the token is set: so before the
  terminal read, whatever the race) and first at the terminal state (on that thread).
  ``cpu_window_ms`` is the span of those two reads on the agent's monotonic clock
  (CLOCK_MONOTONIC, the clock of every ``t_*_ns``).
* ``trial_observe_cpu_ms``, ``native_seen_where`` (graph_eval, in process): the eval reader,
  which runs on the thread that computes the graph (the trial thread), stamps that thread's CPU
  clock and where it stood when it first saw the token: at the sync of a range it asked to see
  (``range_end``) or at a node's ask (``next_ask``: the cancel came where no node was polled).
  The first minus the receipt read is the engine work done before the cancel was seen.
* ``trial_run_cpu_ms``, ``trial_run_wait_ms``, ``trial_run_wall_ms``, ``host_run_steal_ms``: the
  same thread (and the host's steal) over the whole trial (every trial, references too), for
  comparing hosts between sweeps.
* ``host_*``: ``/proc/loadavg``, ``/proc/stat`` (steal, USER_HZ ticks) and cpufreq.

The residue split
-----------------
The wall-clock residue of a cancelled trial is ``latency_ms`` (t_terminal - t_received). The
report and ``diff`` split it per trial (reports/residue.py)::

    work = min(trial_cpu_ms, latency_ms)               engine work: the trial thread on a CPU
    wait = min(trial_cpu_wait_ms, latency_ms - work)   CPU wait: it was runnable, waiting for a CPU
    rest = latency_ms - work - wait                    neither: blocked (the GIL, a lock, a futex
                                                       or barrier sleep, I/O), and the reads' edge

so ``work + wait + rest == latency_ms`` per trial, each term >= 0. A thread's wall time is
spent on a CPU, waiting for one, or blocked, so the three are what the thread the stop waits
for did meanwhile. Summed CPU of all threads is not used: llama.cpp runs ``n_threads`` compute
threads whose CPU can exceed the wall time.

Limits: (1) the reads cover ``cpu_window_ms``, not exactly ``latency_ms``: the receipt read
follows ``t_received`` by the cancel's lock and the token set (``latency_ms - cpu_window_ms``,
microseconds on an idle host; more if the cancel's thread is preempted in between), and the
terminal read follows ``t_terminal`` by a few microseconds. (2) schedstat adds a wait when it
ends, so a wait in progress at the receipt read is counted whole, its part before the receipt
included: ``trial_cpu_wait_ms`` can exceed ``cpu_window_ms``, hence the cap. (3) With
``n_threads > 1`` the trial thread is one of llama.cpp's compute threads: its work includes
spinning at ggml's barrier for a peer, so a preempted peer shows as *work* here (and as wait in
``engine_cpu_wait_ms``); with one thread the split is the engine's own. (4) External engines:
the agent cannot read another process's thread CPU clock, so the trial-thread columns are the
engine's own readings (protocol 1.3 ``done.cpu`` and ``cancel_seen.cpu_t``/``where``;
``trial_cpu_source`` = ``engine-reported``), checked by the agent against the span it saw
(device_agents/engines/engine_cpu.py) and never read by a verdict. Their ``cpu_window_ms`` is
the engine's receipt -> terminal span (its readings are taken at those stamps). A receipt the
native reader latched from the shared word has the latching reader's stamps: its CPU clock and,
libcancelbench 1.3 on Linux, its run delay (one ``pread`` of the schedstat the thread opened when it
watched the word, about 2 us once per trial on the stop's path); an engine without them has a null
``trial_cpu_wait_ms``. An engine that sends no ``done.cpu`` has no split (its process-wide columns
are filled).

The receipt snapshot's cost (``cpu_snapshot_us``, on the cancel's thread, after the cancel was
set) is the trial thread's read (a clock read and a ``pread``, a few microseconds) plus the
process's: its CPU clock, one ``getrusage`` for the involuntary switches of every thread (in
process; an external engine's threads' ``status`` files instead), every thread's schedstat,
``/proc/loadavg`` and ``/proc/stat``.
"""

from __future__ import annotations

import pyarrow as pa

_I32, _I64, _F64, _STR = pa.int32(), pa.int64(), pa.float64(), pa.string()

# (name, type, group, doc)
CPU_FIELDS: list[tuple] = [
    ("engine_cpu_ms", _F64, "cpu", "CPU time of the engine process (in-process engines: the agent's; external: the "
     "engine's), every thread, from the cancel's receipt to the terminal state, ms: its process CPU clock (Linux "
     "clock_getcpuclockid, the scheduler's), read right after the cancel was set (t_received + cpu_snapshot_us) and "
     "at the terminal state (external: the done read), diffed. Not the agent's monotonic clock"),
    ("engine_cpu_wait_ms", _F64, "cpu", "time that process's threads waited runnable for a CPU over the same window, "
     "summed, ms (/proc/<pid>/task/<tid>/schedstat run delay, counted when a thread gets its CPU; threads that exit "
     "inside the window are missed): a busy host shows here, not in engine_cpu_ms"),
    ("engine_involuntary_switches", _I64, "cpu", "involuntary context switches of the engine process's threads over "
     "the window: preempted while runnable (in process: getrusage(RUSAGE_SELF) ru_nivcsw, every thread, exited "
     "ones too; external engines: /proc/<pid>/task/<tid>/status nonvoluntary_ctxt_switches of the threads alive "
     "at the terminal snapshot)"),
    ("engine_threads", _I32, "cpu", "threads of the engine process accounted (alive at the terminal snapshot)"),
    ("host_loadavg_1m", _F64, "cpu", "the host's 1-minute load average at the terminal snapshot (/proc/loadavg)"),
    ("host_procs_running", _I32, "cpu", "tasks runnable on the host at receipt or terminal, the more (/proc/loadavg "
     "nr_running, as /proc/stat procs_running), the engine's busy threads and the reader included (about 3: idle 2 cores, 2 threads)"),
    ("host_steal_ms", _F64, "cpu", "steal time over the window, all CPUs summed (/proc/stat, USER_HZ ticks: "
     "10 ms resolution), ms; null where the kernel reports no steal field"),
    ("host_cpu_mhz", _F64, "cpu", "mean current frequency of the CPUs the engine may run on (the first 64), at "
     "the terminal snapshot (cpufreq scaling_cur_freq), MHz; null where cpufreq is not exposed (most VMs)"),
    ("cpu_snapshot_us", _F64, "cpu", "what the receipt snapshot cost the cancel's thread (its own duration, "
     "perf_counter, the trial thread's read included), us: it runs after the cancel was set, so it delays no stop "
     "(in process it holds the GIL between its reads: a stop that returns to Python meanwhile waits for it)"),
    ("trial_cpu_ms", _F64, "cpu", "engine work: CPU time of the trial thread (the agent thread that runs the "
     "engine's native calls and reaches the terminal state; llama.cpp's calling thread, one of its n_threads) "
     "between its receipt read (on the cancel's thread, under the cancel's lock right after the cancel was set) "
     "and its terminal read (on the trial thread, first thing after t_terminal), ms: its thread CPU clock "
     "(pthread_getcpuclockid, up to date). With n_threads > 1 it includes spinning at ggml's barrier for a "
     "peer thread (a preempted peer shows as work here and as wait in engine_cpu_wait_ms). External engines: "
     "their own readings (done.cpu receipt_cpu -> terminal_cpu; trial_cpu_source engine-reported); null where the "
     "engine sends none, and records before it"),
    ("trial_cpu_wait_ms", _F64, "cpu", "CPU wait: the trial thread's run delay between the same reads "
     "(/proc/<pid>/task/<tid>/schedstat, added when a wait ends: a wait in progress at the receipt read is "
     "counted whole), ms; null for an external engine's receipt latched from the shared word (no run delay read then)"),
    ("cpu_window_ms", _F64, "cpu", "the span of those two reads on the agent's monotonic clock, ms: what "
     "trial_cpu_ms and trial_cpu_wait_ms cover; latency_ms - cpu_window_ms is the part of the wall-clock "
     "residue they miss (the cancel's lock and token set before the receipt read); external engines: the engine's "
     "receipt -> terminal span on its clock"),
    ("trial_observe_cpu_ms", _F64, "cpu", "engine work before the cancel was seen: the trial thread's CPU clock when "
     "graph_eval's eval reader first saw the token (stamped in native code on the thread that computes the graph, "
     "the trial thread: ggml's scheduler calls back on its caller) minus its receipt read, ms (0 where the reader "
     "saw the token before the receipt read). Its part of trial_cpu_ms ran where no node was polled: the rest of "
     "the range in flight, or an unpolled stretch (a graph's tail, the caller's work between two graphs). Null for "
     "other mechanisms, a cancel no eval reader saw, an external engine that sends no cancel_seen.cpu_t"),
    ("native_seen_where", _STR, "cpu", "where graph_eval's eval reader first saw the token (native stamp): "
     "range_end (at the sync of a node range it asked to see: the cancel came while that range was computed, so the "
     "stop waits for the range) | next_ask (at the next node asked: the cancel came where no sync was due, a graph's "
     "unsynced tail or the engine's own work between or before graphs, such as building the next graph, which no "
     "node reader can poll; trial_observe_cpu_ms is that stretch's work). Null for other mechanisms and external "
     "engines that send no cancel_seen.where"),
    ("trial_run_cpu_ms", _F64, "cpu", "the trial thread's CPU time over the whole trial, every trial (references too): "
     "from run_trial entered to the record's columns taken right after the engine's run, ms (its thread CPU clock; "
     "external engines: their done.cpu run -> end readings)"),
    ("trial_run_wait_ms", _F64, "cpu", "the trial thread's run delay (schedstat) over the same span, ms: with "
     "trial_run_cpu_ms, how much of its runnable time the engine's thread waited for a CPU over a whole sweep "
     "(diff and trend compare it between sweeps: reports/noise.py)"),
    ("trial_run_wall_ms", _F64, "cpu", "the same span on the agent's monotonic clock, ms (external engines: the "
     "agent's run write to its done read)"),
    ("host_run_steal_ms", _F64, "cpu", "steal time over the same span, all CPUs summed (/proc/stat, USER_HZ ticks: "
     "10 ms resolution), ms: with trial_run_wall_ms, the CPUs the hypervisor took over a whole sweep (a residue "
     "alone is shorter than one tick); null where the kernel reports no steal field or the engine is external"),
    ("trial_cpu_source", _STR, "cpu", "who read the trial-thread columns (trial_cpu_ms, trial_cpu_wait_ms, "
     "cpu_window_ms, trial_observe_cpu_ms, trial_run_*): agent (in process: the agent read its own thread) | "
     "engine-reported (an external engine's done.cpu and cancel_seen.cpu_t, protocol 1.3, checked against the "
     "span the agent saw: descriptive, no verdict reads them); null where none was read"),
    ("cpu_account_source", _STR, "cpu", "where the cpu columns come from: schedstat | unavailable: <why> (macOS, a "
     "kernel without CONFIG_SCHED_INFO, the engine process gone); null when no cancel was received"),
]
