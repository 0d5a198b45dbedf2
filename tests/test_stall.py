"""The cancel's stall (cancelbench.sut.stall): the outcome rule's allowance for a cancel held off a CPU."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from cancelbench.sut import stall


def test_the_stall_is_the_longest_engine_wait_plus_the_readers():
    before = ({1: 100, 2: 5_000}, 40)
    after = ({1: 900, 2: 5_300, 3: 2_000}, 90)  # thread 3 started since: counted from 0
    assert stall.stall_ns(before, after) == 2_000 + 50  # not the sum of the engine's threads (3,100)
    assert stall.stall_ns(before, ({}, 30)) == 0  # a reading that went back (a reused tid) is never negative
    assert stall.stall_ns(None, after) is None and stall.stall_ns(before, None) is None


@pytest.mark.skipif(sys.platform != "linux", reason="schedstat is Linux's")
def test_run_delays_are_read_from_the_kernel_for_the_engine_and_the_reader():
    got = stall.run_delays(os.getpid(), threading.get_native_id())
    assert got is not None
    engine, reader = got
    assert threading.get_native_id() in engine and all(w >= 0 for w in engine.values()) and reader >= 0
    assert stall.run_delays(os.getpid(), None) is None  # no reader thread yet: nothing measured
