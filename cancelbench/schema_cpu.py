"""The ``cpu`` column group of the trial record (cancelbench/schema.py lists it with
``*CPU_FIELDS``): where the engine's time went between the cancel's receipt and its stop,
filled by the agent (device_agents/cpu_account.py). Its own module to keep schema.py short.

The split of the wall-clock residue (``latency_ms``) into engine work, CPU wait and the rest
is computed by the readers from ``trial_cpu_ms``, ``trial_cpu_wait_ms`` and ``latency_ms``
(reports/residue.py, ``split``), so a record keeps the raw readings."""

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
     "peer thread (a preempted peer shows as work here and as wait in engine_cpu_wait_ms). Null for external "
     "engines (their trial thread is not known to the agent) and records before it"),
    ("trial_cpu_wait_ms", _F64, "cpu", "CPU wait: the trial thread's run delay between the same reads "
     "(/proc/<pid>/task/<tid>/schedstat, added when a wait ends: a wait in progress at the receipt read is "
     "counted whole), ms"),
    ("cpu_window_ms", _F64, "cpu", "the span of those two reads on the agent's monotonic clock, ms: what "
     "trial_cpu_ms and trial_cpu_wait_ms cover; latency_ms - cpu_window_ms is the part of the wall-clock "
     "residue they miss (the cancel's lock and token set before the receipt read)"),
    ("cpu_account_source", _STR, "cpu", "where the cpu columns come from: schedstat | unavailable: <why> (macOS, a "
     "kernel without CONFIG_SCHED_INFO, the engine process gone); null when no cancel was received"),
]
