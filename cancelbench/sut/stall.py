"""The cancel's stall (docs/sut-protocol.md, "The outcome rule"): how long a cancel and the done after it
were held off a CPU on this host, from the kernel's schedstat run delay (time runnable on a runqueue).
Kernel facts, not the engine's word: the outcome rule allows for them, so a done the engine decided before
the cancel could reach it, then read late on a loaded host, is not taken for a drop."""

from __future__ import annotations

import sys

from cancelbench.device_agents import cpu_account

# (each engine thread's run delay, the agent's stdout reader's), ns
RunDelays = tuple[dict[int, int], int]


def run_delays(engine_pid: int, reader_tid: int | None, engine_tids: tuple[int, ...] | None = None) -> RunDelays | None:
    """Now: the run delay of each thread of the engine process and of the agent's reader thread (a thread of
    this process). ``engine_tids``: the engine's threads are these threads of this process (the in-process
    channel: the agent's other threads are not the engine's). None where there is none (not Linux, no reader
    yet, the engine gone)."""
    if reader_tid is None or sys.platform != "linux":
        return None
    own = cpu_account.own_thread_reading(reader_tid)
    if own is None:
        return None
    if engine_tids is not None:
        readings = {tid: cpu_account.own_thread_reading(tid) for tid in engine_tids}
        return {tid: r[2] for tid, r in readings.items() if r is not None}, own[2]
    try:
        engine = {tid: wait for tid, (_, wait, _) in cpu_account.read_threads(engine_pid).items()}
    except OSError:
        return None
    return engine, own[2]


def stall_ns(before: RunDelays | None, after: RunDelays | None) -> int | None:
    """The longest any engine thread waited for a CPU between the two readings (a thread that started since
    counts from 0), plus the agent's reader's wait. An engine that drops a cancel runs on after it: its
    threads run rather than wait. None when either reading is missing."""
    if before is None or after is None:
        return None
    engine = max((w - before[0].get(tid, 0) for tid, w in after[0].items()), default=0)
    return max(0, engine) + max(0, after[1] - before[1])
