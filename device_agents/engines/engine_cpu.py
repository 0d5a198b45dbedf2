"""An out-of-process engine's own CPU account of its trial thread (protocol 1.3: ``done.cpu`` and
``cancel_seen.where`` / ``cpu_t``), checked and turned into the record's residue-split columns.

The agent cannot read a thread CPU clock of another process (Linux refuses it across thread
groups) and a running thread's schedstat CPU figure lags to its last tick, so these figures are
the engine's (cancelbench/sut/trial_thread.py is the engine library's side). They are
descriptive: no verdict reads them (the outcome rule reads the agent's own facts). Each is
checked against what the agent saw: readings of one thread never run backwards, its CPU never
outruns wall time between the readings it took of itself (READ_SLACK_NS), their span lies within
the time the run was in the engine's hands (the agent's run write to its done read, widened by
the clock's uncertainty), and a receipt's reading comes only with a receipt. A figure
that breaks a check fails the trial (``ValueError`` naming the field), as an impossible
timestamp does.
"""

from __future__ import annotations

from cancelbench.sut.protocol import CPU_MOMENTS

SOURCE = "engine-reported"  # the record's trial_cpu_source for these (in process: "agent")
# One thread cannot run more CPU than wall time passes, but its CPU clock (the scheduler's clock of the
# CPU it ran on) and CLOCK_MONOTONIC are two clocks: a thread that moved between CPUs reads per-CPU
# scheduler clocks that disagree by tens of us on a VM (seen here: 36 us of CPU over 8 us of wall), and
# a reading's two reads are a few us apart. So a CPU difference may exceed its wall difference by this
# much: far below any unit mix-up (us for ns is 1000x) or another thread's clock over a long run.
READ_SLACK_NS = 1_000_000


def _moments(cpu: dict) -> list[tuple[str, int, int, int | None]]:
    """(moment, t, cpu, wait or None) of each reading sent, in the run's order."""
    out = []
    for m in CPU_MOMENTS:
        if f"{m}_cpu" in cpu or f"{m}_t" in cpu:
            if f"{m}_cpu" not in cpu or f"{m}_t" not in cpu:
                raise ValueError(f"done.cpu.{m}_t and {m}_cpu come together (one has no other)")
            out.append((m, cpu[f"{m}_t"], cpu[f"{m}_cpu"], cpu.get(f"{m}_wait")))
        elif f"{m}_wait" in cpu:
            raise ValueError(f"done.cpu.{m}_wait without {m}_t and {m}_cpu")
    return out


def check(cpu: dict, seen_cpu: int | None, received: bool, span_ns: int) -> None:
    """ValueError naming the field where ``done.cpu`` (and ``cancel_seen.cpu_t``) cannot be one
    thread's readings within a run the agent saw last ``span_ns``."""
    if not received and any(k.startswith("receipt_") for k in cpu):
        raise ValueError("done.cpu has a receipt's reading in a done that says no cancel was received")
    moments = _moments(cpu)
    for (m0, t0, c0, w0), (m1, t1, c1, w1) in zip(moments, moments[1:]):
        for kind, v0, v1 in (("t", t0, t1), ("cpu", c0, c1), ("wait", w0, w1)):
            if v0 is not None and v1 is not None and v1 < v0:
                raise ValueError(f"done.cpu.{m1}_{kind} ({v1}) is less than done.cpu.{m0}_{kind} ({v0}): "
                                 "not one thread's readings in the order of the run")
    # CPU against wall time only between readings the trial thread took of itself: the receipt's is
    # taken by the thread that took the cancel, which a loaded host may preempt between its clock read
    # and its CPU read while the trial thread runs on (its CPU then outruns its stale _t).
    own = [m for m in moments if m[0] != "receipt"]
    for (m0, t0, c0, _), (m1, t1, c1, _) in zip(own, own[1:]):
        if c1 - c0 > t1 - t0 + READ_SLACK_NS:
            raise ValueError(f"done.cpu: the trial thread ran {(c1 - c0) / 1e6:.3f} ms of CPU between {m0} and "
                             f"{m1}, {(t1 - t0) / 1e6:.3f} ms apart: more than one thread can")
    if moments:
        (m0, t0, c0, _), (m1, t1, c1, _) = moments[0], moments[-1]
        if t1 - t0 > span_ns:
            raise ValueError(f"done.cpu.{m1}_t - {m0}_t = {(t1 - t0) / 1e6:.3f} ms, more than the "
                             f"{span_ns / 1e6:.3f} ms the run was in the engine's hands")
        if seen_cpu is not None and not c0 <= seen_cpu <= c1:
            raise ValueError(f"cancel_seen.cpu_t ({seen_cpu}) lies outside the trial thread's CPU clock over "
                             f"the run (done.cpu.{m0}_cpu .. {m1}_cpu)")


def columns(cpu: dict, seen: dict | None, received: bool) -> dict:
    """The record's columns from checked readings: the residue split over receipt -> terminal
    (``trial_cpu_ms``, ``trial_cpu_wait_ms``, and ``cpu_window_ms``, the span of those two
    readings on the engine's clock), the work before the sight (``trial_observe_cpu_ms``), where
    it was seen, and the whole run's figures (run -> end); ``trial_cpu_source`` where any came
    from the engine. A reading not sent: its columns null."""
    out: dict = {}
    where = (seen or {}).get("where")
    if where is not None:
        out["native_seen_where"] = where
    got = {m: (t, c, w) for m, t, c, w in _moments(cpu)}
    receipt, terminal = got.get("receipt") if received else None, got.get("terminal")
    if receipt is not None and terminal is not None:
        out["trial_cpu_ms"] = (terminal[1] - receipt[1]) / 1e6
        out["cpu_window_ms"] = (terminal[0] - receipt[0]) / 1e6
        if receipt[2] is not None and terminal[2] is not None:
            out["trial_cpu_wait_ms"] = (terminal[2] - receipt[2]) / 1e6
    seen_cpu = (seen or {}).get("cpu_t")
    if seen_cpu is not None and receipt is not None:
        out["trial_observe_cpu_ms"] = max(0, seen_cpu - receipt[1]) / 1e6
    run, end = got.get("run"), got.get("end")
    if run is not None and end is not None:
        out.update(trial_run_cpu_ms=(end[1] - run[1]) / 1e6, trial_run_wall_ms=(end[0] - run[0]) / 1e6)
        if run[2] is not None and end[2] is not None:
            out["trial_run_wait_ms"] = (end[2] - run[2]) / 1e6
    if set(out) - {"native_seen_where"}:
        out["trial_cpu_source"] = SOURCE
    return out
