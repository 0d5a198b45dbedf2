"""The eval reader's cost model keeps the properties whose absence made TTS generate's node
ranges overrun their estimate (issue 26; docs/mechanisms.md, "Why TTS generate's ranges
overran"): the code predictor graph is 6501 nodes, most of them tiny, with ~35 cost keys per
range and views of large weights among them.

* a node that moves no data (a view-type op, a node the graph does not compute) weighs its
  dispatch alone, whatever its size — on the real ggml too;
* a range ends after CB_RANGE_MAX_NODES nodes, so no graph runs whole without a sync;
* every key of a range is corrected by the range's cost, not the first 16, and the CPU unit
  the keys are counted in stays put;
* a wait for a CPU between two asks does not end a range, work between them does.

Counters, shapes and the reader's own log only: no wall-clock bound. The fake-tensor checks
run in a subprocess (calibration is process-wide), as in test_native_interface.py.
"""

from __future__ import annotations

import ctypes

from cancelbench import native
from cancelbench.device_agents.engines import llama_runtime as rt

from test_native_interface import FAKE_TENSORS, _python

NO_OP = FAKE_TENSORS + """
        VIEW = 40
        view_small = tensor((10, 1, 1, 1), VIEW, COMPUTE, (a,))
        view_big = tensor((1 << 20, 64, 1, 1), VIEW, COMPUTE, (a,))
        assert native.node_work(ctypes.addressof(view_big)) == (1 << 26) + 1024  # not known yet: elements
        assert native.calibrate_eval_reader_no_op(ctypes.addressof(a), ctypes.addressof(view_small))
        ev = native._lib().cb_token_eval_reader
"""


def test_nodes_that_move_no_data_weigh_their_dispatch_whatever_their_size():
    _python(NO_OP + """
        big, small = (native.node_work(ctypes.addressof(x)) for x in (view_big, view_small))
        assert big == small == 1024, (big, small)
        skipped = tensor((1 << 20, 64, 1, 1), 5, 0)  # a computed op's shape, not computed
        assert native.node_work(ctypes.addressof(skipped)) == 1024
        assert native.node_work(ctypes.addressof(tensor((1 << 20, 1, 1, 1), 5, COMPUTE))) == (1 << 20) + 1024
        assert not native.calibrate_eval_reader_no_op(ctypes.addressof(b), ctypes.addressof(view_small))  # src[0] is a
        """)


def test_views_of_the_loaded_ggml_weigh_their_dispatch():
    """The real ggml: the calibration finds its view ops, so a reshape / view / permute /
    transpose of a 4M-element tensor in a graph weighs what one of 8 elements does."""
    from llama_cpp._ggml import libggml

    rt.ensure_backend()
    assert rt.calibrate_eval_reader()
    p = ctypes.c_void_p
    ctx = libggml.ggml_init(rt._GgmlInitParams(1 << 20, None, True))
    try:
        graph = libggml.ggml_new_graph_custom(ctx, 64, False)
        work = {}
        for size in ((8, 1), (2048, 2048)):
            x = libggml.ggml_new_tensor_2d(ctx, 0, *size)
            views = {"reshape": libggml.ggml_reshape_1d(ctx, x, size[0] * size[1]),
                     "view": libggml.ggml_view_1d(ctx, x, size[0], 0),
                     "permute": libggml.ggml_permute(ctx, x, 1, 0, 2, 3), "transpose": libggml.ggml_transpose(ctx, x)}
            for name, v in views.items():
                libggml.ggml_build_forward_expand(graph, p(v))
                work[name, size] = native.node_work(v)
        assert all(w == 1024 for w in work.values()), work
    finally:
        libggml.ggml_free(ctx)


def test_a_range_ends_after_a_node_cap_whatever_its_estimate():
    """With a slice no estimate fills, tiny known nodes still end a range at 1024 nodes. (A
    pause between two Python-speed asks can start a range afresh, so not every stretch of
    1024 asks ends one here; native asks are ~50 ns.)"""
    _python(NO_OP + """
        import gc
        gc.disable()
        t = native.CancelToken()
        t.set_slice_us(10_000_000)
        node = ctypes.addressof(tensor((4, 1, 1, 1), 5, COMPUTE))
        assert ev(node, True, t.address) is True and ev(None, False, t.address) is True  # learns the cost
        t.log_enable(100000, 1000)
        shown = 0
        for _ in range(20000):  # without the cap no range of these would ever end
            if ev(node, True, t.address):
                shown += 1
                assert ev(None, False, t.address) is True
        synced = [row[1] for row in t.log_rows()[1] if row[5] >= 0]
        assert shown >= 1 and max(synced) == 1024, (shown, synced)
        """)


def test_every_key_of_a_range_is_corrected_by_its_cost():
    """40 keys (20 ops x 2 work buckets) in one range that cost far over its estimate (the
    thread burns 8x the estimate in CPU before the sync): every key's scale moves up, as the
    reader's log shows in each key's scaled work, except the biggest, which is re-probed.
    (A pause between two Python asks can split the range, and on a busy host the asks' own cost
    can send a key to be learned again: then it is tried again.)"""
    _python(NO_OP + """
        import gc, time
        gc.disable()
        t = native.CancelToken()
        t.set_slice_us(10_000_000)
        nodes = [ctypes.addressof(tensor((n, 1, 1, 1), op, COMPUTE)) for op in range(50, 70) for n in (100, 100000)]
        assert ev(nodes[0], True, t.address) is True and ev(None, False, t.address) is True
        for x in nodes[1:]:  # each key first ends a range of its own (a probe) and is learned
            assert ev(x, True, t.address) is True and ev(None, False, t.address) is True

        def ask_all():
            # Every node asked once; one that ends a range (a key that the last range's overrun,
            # or on a busy host the cost of Python's asks, sent to be learned again) is synced
            # there. True if none did: the asks are one range.
            clean = True
            for x in nodes:
                if ev(x, True, t.address):
                    clean = False
                    ev(None, False, t.address)
            return clean

        def overrun():
            t.log_enable(1000, 100)
            if not ask_all():
                return ev(None, False, t.address) and None  # not one range: tried again
            assert ev(None, False, t.address) is True
            est = t.log_rows()[1][-1][2]  # the reader's estimate of that range, CPU ns
            if not ask_all():
                return ev(None, False, t.address) and None
            t0 = time.thread_time_ns()
            while time.thread_time_ns() - t0 < 8 * max(est, 1e5):
                pass
            assert ev(None, False, t.address) is True
            for x in nodes:  # the re-probed key ends its range; the rest are logged as counted
                if ev(x, True, t.address):
                    ev(None, False, t.address)
            rows, ranges = t.log_rows()
            return rows[len(nodes):2 * len(nodes)], rows[2 * len(nodes):], rows, ranges

        # A range's estimate is counted in the CPU unit only where the thread had the CPU for at
        # least a twentieth of its wall time (cpu_live: a CPU backend computing) and the unit was
        # set (by the first such range: one preempted on a busy host leaves it unset); else it is
        # in wall time (the log's estimate then equals its wall estimate), which follows the load.
        # (range row: seq, nodes, estimate, cpu, wall, kind, wall estimate, polls)
        live = lambda r: r[5] == 0 and r[3] * 20 >= r[4] and r[2] != r[6]  # noqa: E731
        for _ in range(20):
            tried = overrun()
            if tried and len({row[0] for row in tried[0]}) == 1 and sum(map(live, tried[3])) >= 2:
                break  # the overrun was one range, and CPU-timed ranges to compare
        assert tried, "no attempt of 20 asked the nodes as one range"
        during, after, rows, ranges = tried
        grew = [i for i, (x, y) in enumerate(zip(during, after)) if y[4] > x[4]]
        assert len(grew) >= len(nodes) - 1, f"keys not corrected: {sorted(set(range(len(nodes))) - set(grew))}"
        # the CPU unit the scales are counted in (a range's estimate over its scaled work) stays put:
        # the keys alone follow the cost (a unit moved too drifted against them, toward 0)
        unit = [r[2] / sum(n[4] for n in rows if n[0] == r[0]) for r in ranges if live(r)]
        assert len(unit) >= 2 and max(unit) <= min(unit) * (1 + 1e-9), (unit, ranges)
        """)


def test_a_wait_between_asks_keeps_the_range_work_between_them_ends_it():
    """Nodes asked, then a 2 ms sleep (a wait: no CPU), then more: one range. Nodes asked, then
    2 ms of CPU (a graph's tail or the caller's work), then more: a new range (the log's
    range numbers)."""
    _python(NO_OP + """
        import time
        t = native.CancelToken()
        t.set_slice_us(10_000_000)
        node = ctypes.addressof(tensor((4, 1, 1, 1), 5, COMPUTE))
        assert ev(node, True, t.address) is True and ev(None, False, t.address) is True
        for _ in range(20):
            t.log_enable(100, 100)
            c0 = time.thread_time_ns()
            ev(node, True, t.address)
            time.sleep(0.002)
            ev(node, True, t.address)
            if time.thread_time_ns() - c0 < 50_000:  # the thread's CPU across the sleep: a wait's
                break
            # a busy host made Python's own work around the sleep cost the thread more CPU than
            # the reader's rule allows a wait (100 us): that gap was work; tried again
            ev(None, False, t.address)
        else:
            raise AssertionError("no sleep of 20 cost the thread under 50 us of CPU")
        t0 = time.thread_time_ns()
        while time.thread_time_ns() - t0 < 2_000_000:
            pass
        ev(node, True, t.address)
        seqs = [row[0] for row in t.log_rows()[0]]
        assert seqs[0] == seqs[1] != seqs[2], seqs
        """)


def test_the_profiling_log_is_off_until_enabled_and_reads_back_rows():
    t = native.CancelToken()
    try:
        assert t.log_rows() == ([], [])
        t.log_enable(10, 10)
        assert t.log_ranges_count() == 0
        t.log_enable(0, 0)
        assert t.log_rows() == ([], [])
    finally:
        t.close()


def test_a_key_no_synced_range_measured_lately_is_learned_again():
    """A key met only where no range is synced (a graph's tail) goes stale: once 256 ranges have
    synced without it, its next node ends a range to learn it again (``reprobes``)."""
    _python(NO_OP + """
        import gc
        gc.disable()
        t = native.CancelToken()
        t.set_slice_us(10_000_000)
        a = ctypes.addressof(tensor((4, 1, 1, 1), 5, COMPUTE))
        b = ctypes.addressof(tensor((4, 1, 1, 1), 6, COMPUTE))
        assert ev(a, True, t.address) is True and ev(None, False, t.address) is True
        assert ev(b, True, t.address) is True and ev(None, False, t.address) is True  # b: probed, learned
        assert ev(b, True, t.address) is False  # known: the range stays open
        assert ev(None, False, t.address) is True
        t.reset()
        for _ in range(2_000_000):  # ranges of a alone (they end at the node cap) until 257 synced
            if ev(a, True, t.address):
                assert ev(None, False, t.address) is True
                if t.syncs > 256:
                    break
        assert t.syncs > 256 and t.reprobes == 0
        assert ev(b, True, t.address) is True, "a stale key did not end its range"
        assert ev(None, False, t.address) is True and t.reprobes == 1
        assert ev(b, True, t.address) is False  # measured again: known
        """)
