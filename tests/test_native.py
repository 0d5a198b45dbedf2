"""The native cancel token, its reader, and the known-answer probe."""

import ctypes
import threading
import time

import llama_cpp

from cancelbench import native


def test_token_set_reset_and_first_seen():
    t = native.CancelToken()
    assert not t.is_set() and t.seen_ns == 0 and t.set_ns == 0
    assert t.read() is False
    assert t.polls == 1 and t.seen_ns == 0
    before = native.now_ns()
    set_ns = t.set()
    assert before <= set_ns <= native.now_ns()
    assert t.set() == set_ns  # a second set keeps the first time
    assert t.is_set()
    assert t.read() is True
    first_seen = t.seen_ns
    assert first_seen >= set_ns
    assert t.read() is True and t.seen_ns == first_seen  # only the first reader stamps
    assert t.polls == 3
    t.reset()
    assert not t.is_set() and t.seen_ns == 0 and t.polls == 0 and t.set_ns == 0


def test_reader_is_a_native_bool_fn_of_void_ptr_reading_byte_zero():
    """The exported reader has the exact abort-callback shape and reads the token's first byte."""
    t = native.CancelToken()
    fn = llama_cpp.ggml_abort_callback(native.reader_address())  # bool (*)(void *)
    assert fn(ctypes.c_void_p(t.address)) is False
    # A binding that only knows "a byte at this address" sets the same flag.
    ctypes.c_uint8.from_address(t.address).value = 1
    assert fn(ctypes.c_void_p(t.address)) is True
    assert t.seen_ns > 0


def test_now_ns_is_the_monotonic_clock():
    """Interleaved with Python's CLOCK_MONOTONIC reads, the native stamps keep call order:
    a clock of another domain (the epoch, a skew, a boot-time clock after a suspend)
    would fall out of the sandwich. No elapsed-time bound."""
    for _ in range(100):
        a = native.now_ns()
        b = time.monotonic_ns()  # CLOCK_MONOTONIC on Linux: same domain
        c = native.now_ns()
        d = time.monotonic_ns()
        assert a <= b <= c <= d


def test_probe_runs_to_completion_without_cancel():
    t = native.CancelToken()
    aborted, start, end = native.probe_busy(t, 20_000, 1_000)
    assert not aborted
    assert end - start >= 20_000_000  # it busy-works for its whole duration
    # checked on its period: at most one check per 1 ms boundary (a late check catches up,
    # never adds one), at least the one at the end
    assert 1 <= t.polls <= 20


def test_probe_expected_return_is_the_first_check_at_or_after_the_set():
    expected = native.probe_expected_return_ns
    assert expected(0, 0, 2_000) == 2_000_000  # the first check is one period in
    assert expected(0, 1, 2_000) == 2_000_000
    assert expected(0, 2_000_000, 2_000) == 2_000_000  # a check exactly at the set sees it
    assert expected(0, 2_000_001, 2_000) == 4_000_000
    assert expected(10, 5_000_010, 1_000) == 5_000_010


def test_known_answer_probe_stops_at_the_first_check_after_the_set():
    """The token is set once the probe has made n checks (its own counter, not a delay);
    the probe stops at a later check, never checks before a period boundary, and returns
    after seeing the set. Every claim holds on an idle or a loaded host."""
    period_us, period_ns = 2_000, 2_000_000
    for n in (1, 2, 3, 5, 8):
        t = native.CancelToken()

        def setter(t=t, n=n):
            while t.polls < n:
                time.sleep(0.0002)
            t.set()

        th = threading.Thread(target=setter)
        th.start()
        aborted, start, end = native.probe_busy(t, 60_000_000, period_us)  # ends long before 60 s
        th.join()
        assert aborted
        assert t.polls >= n + 1  # it kept checking until after the set, and stopped at a check
        assert t.set_ns <= t.seen_ns <= end  # the stopping check saw the set, then the probe returned
        assert start + t.polls * period_ns <= t.seen_ns  # check k happens at or after boundary k
        expected = native.probe_expected_return_ns(start, t.set_ns, period_us)
        assert expected >= t.set_ns and (expected - start) % period_ns == 0


def _eval_reader():
    """The exported eval reader as the exact ggml_backend_sched_eval_callback shape."""
    return llama_cpp.ggml_backend_sched_eval_callback(native.eval_reader_address())


def test_eval_reader_slice_zero_asks_to_see_every_node_and_stops_once_set():
    fn, t = _eval_reader(), native.CancelToken()
    ud = ctypes.c_void_p(t.address)
    t.set_slice_us(0)
    for _ in range(5):
        assert fn(None, True, ud) is True   # "show me this node": a sync after every node
        assert fn(None, False, ud) is True  # not set: go on
    assert (t.polls, t.syncs) == (5, 5)
    t.set()
    assert fn(None, True, ud) is True and t.seen_ns >= t.set_ns > 0  # a set token is seen at the ask
    assert fn(None, False, ud) is False  # ... and stops the split after the range
    t.reset()
    assert (t.polls, t.syncs, t.seen_ns, t.max_range_ns) == (0, 0, 0, 0)
    assert t.slice_us == 0  # the slice is configuration, not trial state


def test_eval_reader_slice_groups_nodes_into_ranges():
    """With a slice the first range is one node (nothing learned yet); then the learned
    cost per unit of work makes a huge slice hold every node asked without a sync,
    until the token is set. set_slice_us forgets what was learned."""
    fn, t = _eval_reader(), native.CancelToken()
    ud = ctypes.c_void_p(t.address)
    t.set_slice_us(10_000_000)
    assert fn(None, True, ud) is True and fn(None, False, ud) is True
    assert t.ns_per_work > 0 and t.max_range_ns > 0 and t.syncs == 1
    assert not any(fn(None, True, ud) for _ in range(500))  # one range, no sync asked
    assert t.syncs == 1 and t.polls == 501
    t.set()
    assert fn(None, True, ud) is True and fn(None, False, ud) is False
    t.set_slice_us(10_000_000)
    assert t.ns_per_work == 0
    t.reset()
    assert fn(None, True, ud) is True  # nothing learned: one node


def test_eval_reader_weighs_nodes_by_shape_after_calibration():
    """Calibrated from real tensors of the loaded ggml (llama_runtime does it at backend init),
    a matrix product weighs its multiply-adds; without a tensor a node weighs 1."""
    from cancelbench.device_agents.engines import llama_runtime as rt

    assert rt.calibrate_eval_reader()
    assert native.node_work(0) == 1.0
