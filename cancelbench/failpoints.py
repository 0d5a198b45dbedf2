"""Failpoints: the one home of every test hook in product code.

A failpoint is an environment variable a test sets to make the product do
something a real run never does, at a named point, so the test can observe
behaviour that timing alone would not produce reliably. Each is read where it
acts, through this module; unset (every real run), each reader returns None at
the cost of one ``os.environ`` lookup, and the product code path is unchanged.

| variable | where it acts | what it does |
|---|---|---|
| ``CANCELBENCH_TEST_STEP_DELAY=FACTOR,PERIOD`` | inside each step call of a built-in engine (in the agent, or in its own process) | one trial in PERIOD (chosen by a hash of its id) has every step call last FACTOR times as long, busy in native code with the GIL free: run-to-run variance for the anchor tests |
| ``CANCELBENCH_TEST_COMPACT_PAUSE=STEP`` | compaction, at STEP (written, committed, removing) | the first time compaction reaches STEP it writes ``.compact-paused`` in the partition and waits to be killed: a SIGKILL at exactly that point |
| ``CANCELBENCH_TEST_CLOCK_SKEW_NS=N`` | the native library, at its first load | adds N ns to the agent clock: a known skew for the clock-offset estimate |
| ``CANCELBENCH_TEST_ENGINE_SIGNAL=SIGNAME,SUFFIX`` | a built-in engine in a process of its own (``cancelbench.sut.builtin``), at the first step call of a trial whose id ends with SUFFIX | the engine process sends itself SIGNAME (``SIGILL``): the crash of a field-scale model mid-trial, at a known trial |

Tests that run agents on other hosts (tests/netns.py) drop every ``CANCELBENCH_TEST``
variable from the hosts' environment. Every ``CANCELBENCH_TEST`` name in product
code lives in this file (tests/test_docs.py checks that).
"""

from __future__ import annotations

import hashlib
import os

STEP_DELAY = "CANCELBENCH_TEST_STEP_DELAY"
COMPACT_PAUSE = "CANCELBENCH_TEST_COMPACT_PAUSE"
CLOCK_SKEW_NS = "CANCELBENCH_TEST_CLOCK_SKEW_NS"
CRASH_SIGNAL = "CANCELBENCH_TEST_ENGINE_SIGNAL"
ALL = (STEP_DELAY, COMPACT_PAUSE, CLOCK_SKEW_NS, CRASH_SIGNAL)


def step_delay(trial_id: str) -> float | None:
    """``CANCELBENCH_TEST_STEP_DELAY``: how many times as long this trial's step calls last
    (the agent stretches each inside the call: ``DeviceAgent``'s step delay), or None."""
    spec = os.environ.get(STEP_DELAY)
    if not spec:
        return None
    factor, period = spec.split(",")
    # A real hash: crc32 is linear, so ids that differ in their last digits (ref.000, ref.001,
    # ref.002) shared one parity, and every reference run of a workload was slowed or none was.
    if int.from_bytes(hashlib.sha256(trial_id.encode()).digest()[:8], "big") % int(period):
        return None
    return float(factor)


def compact_pause() -> str | None:
    """``CANCELBENCH_TEST_COMPACT_PAUSE``: the compaction step to stop at, or None."""
    return os.environ.get(COMPACT_PAUSE) or None


def clock_skew_ns() -> int | None:
    """``CANCELBENCH_TEST_CLOCK_SKEW_NS``: the agent-clock skew to add, or None."""
    skew = os.environ.get(CLOCK_SKEW_NS)
    return int(skew) if skew else None


def engine_signal(trial_id: str) -> int | None:
    """``CANCELBENCH_TEST_ENGINE_SIGNAL``: the signal this trial's engine process sends itself at the
    trial's first step call, or None."""
    spec = os.environ.get(CRASH_SIGNAL)
    if not spec:
        return None
    import signal

    name, suffix = spec.split(",", 1)
    return int(getattr(signal, name)) if trial_id.endswith(suffix) else None
