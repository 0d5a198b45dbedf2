"""ctypes bindings for the native cancel token (native/cancel_token.c).

The C interface is declared in native/cancel_token.h; :data:`SIGNATURES` is
its ctypes mirror, checked against the header by tests/test_native_interface.py.

The shared library is built by the package build (setup.py) next to this file.
Importing this module is side-effect free: the library is found (or compiled
into a per-user cache) and loaded on first use, by :func:`_lib`. Environment
read at that first load, not at import:

* ``CANCELBENCH_NATIVE_LIB``: path of a prebuilt library to load instead.
* the clock-skew failpoint (``cancelbench.failpoints.clock_skew_ns``): a known
  skew (ns) added to the agent clock so clock-offset estimation can be checked;
  set it before the process's first native call.

Every agent-side timestamp goes through :func:`now_ns` so that Python and
native times share one clock domain (CLOCK_MONOTONIC on the agent's host).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from .locate import _HERE, LIB_BASENAME, SOURCES  # noqa: F401 (re-exported)
# graph_eval's default slice (setting graph_slice_us): declared with the settings, re-exported here
from cancelbench.engine_decls import DEFAULT_GRAPH_SLICE_US  # noqa: E402,F401

_P, _I64, _U64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
# (name, restype, argtypes) of every function cancel_token.h declares, in its order.
SIGNATURES: tuple[tuple[str, type | None, tuple[type, ...]], ...] = (
    ("cb_abi_version", ctypes.c_int, ()),
    ("cb_set_clock_skew_ns", None, (_I64,)),
    ("cb_now_ns", _I64, ()),
    ("cb_token_new", _P, ()),
    ("cb_token_free", None, (_P,)),
    ("cb_token_reset", None, (_P,)),
    ("cb_token_set", _I64, (_P,)),
    ("cb_token_is_set", ctypes.c_bool, (_P,)),
    ("cb_token_set_ns", _I64, (_P,)),
    ("cb_token_seen_ns", _I64, (_P,)),
    ("cb_token_seen_cpu_ns", _I64, (_P,)),
    ("cb_token_seen_where", ctypes.c_int, (_P,)),
    ("cb_token_polls", _U64, (_P,)),
    ("cb_token_reader", ctypes.c_bool, (_P,)),
    ("cb_token_eval_reader", ctypes.c_bool, (_P, ctypes.c_bool, _P)),
    ("cb_token_set_slice_ns", None, (_P, _I64)),
    ("cb_token_slice_ns", _I64, (_P,)),
    ("cb_token_forget_costs", None, (_P,)),
    ("cb_token_syncs", _U64, (_P,)),
    ("cb_token_max_range_ns", _I64, (_P,)),
    ("cb_token_take_max_range_ns", _I64, (_P,)),
    ("cb_token_ns_per_work", ctypes.c_double, (_P,)),
    ("cb_token_probes", _U64, (_P,)),
    ("cb_token_reprobes", _U64, (_P,)),
    ("cb_token_max_range_est_ns", _I64, (_P,)),
    ("cb_token_max_range_cpu_ns", _I64, (_P,)),
    ("cb_token_log_enable", ctypes.c_int, (_P, _I64, _I64)),
    ("cb_token_log_nodes", _I64, (_P, _P, _I64)),
    ("cb_token_log_ranges", _I64, (_P, _P, _I64)),
    ("cb_eval_calibrate", ctypes.c_int, (_P, _P, _P, _I64, _I64, _I64)),
    ("cb_eval_calibrate_flash_attn", ctypes.c_int, (_P, _P, _P)),
    ("cb_eval_calibrate_no_op", ctypes.c_int, (_P, _P)),
    ("cb_node_work", ctypes.c_double, (_P,)),
    ("cb_probe_busy", ctypes.c_int, (_P, _I64, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64))),
    ("cb_sim_wait", _I64, (_P, _I64, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64))),
    ("cb_word_map", _P, (ctypes.c_int,)),
    ("cb_word_load", _U64, (_P,)),
    ("cb_word_store", None, (_P, _U64)),
    ("cb_token_watch", None, (_P, _P, _U64)),
    ("cb_token_set_by_word", ctypes.c_int, (_P,)),
    ("cb_token_word_cpu_ns", _I64, (_P,)),
    ("cb_token_word_thread", _U64, (_P,)),
    ("cb_token_word_wait_ns", _I64, (_P,)),
    ("cb_thread_id", _U64, ()),
)


from .locate import NativeLibraryMissing, find_library as _find_library  # noqa: E402,F401 (re-exported)


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_find_library()), use_errno=True)
    for name, restype, argtypes in SIGNATURES:
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = list(argtypes)
    # Failpoint: a known agent-clock skew (ns), so clock-offset estimation can be checked.
    from cancelbench import failpoints
    skew = failpoints.clock_skew_ns()
    if skew:
        lib.cb_set_clock_skew_ns(skew)
    return lib


_LIB: ctypes.CDLL | None = None
_LOAD_LOCK = threading.Lock()


def _lib() -> ctypes.CDLL:
    """The loaded library: found, compiled if need be, and loaded on the first call, once."""
    global _LIB
    lib = _LIB
    if lib is None:
        with _LOAD_LOCK:
            if _LIB is None:
                _LIB = _load()
            lib = _LIB
    return lib


def loaded() -> bool:
    """Whether this process has loaded the native library yet."""
    return _LIB is not None


def now_ns() -> int:
    """Agent clock: CLOCK_MONOTONIC in ns, the same clock the token stamps use."""
    lib = _LIB  # the hot path skips the accessor's call once loaded
    return (lib if lib is not None else _lib()).cb_now_ns()


def reader_address() -> int:
    """Address of ``bool cb_token_reader(void *token)`` for llama_set_abort_callback."""
    return ctypes.cast(_lib().cb_token_reader, ctypes.c_void_p).value


def eval_reader_address() -> int:
    """Address of ``bool cb_token_eval_reader(ggml_tensor *, bool ask, void *token)``."""
    return ctypes.cast(_lib().cb_token_eval_reader, ctypes.c_void_p).value


def calibrate_eval_reader(a: int, b: int, mm: int, k: int, m: int, n: int) -> bool:
    """Teach the eval reader where ne[], op, flags and src[] lie in ``struct ggml_tensor``
    from three real tensors of the loaded ggml: a [k, m] (ggml_set_input), b [k, n],
    mm = ggml_mul_mat(a, b) (ggml_set_output).
    Until this succeeds the reader weighs every node alike."""
    return bool(_lib().cb_eval_calibrate(a, b, mm, k, m, n))


def calibrate_eval_reader_flash_attn(q: int, k: int, fa: int) -> bool:
    """After :func:`calibrate_eval_reader`: fa = ggml_flash_attn_ext(q, k, v, ...) teaches the
    reader the attention op, so it weighs n_kv multiply-adds per output element."""
    return bool(_lib().cb_eval_calibrate_flash_attn(q, k, fa))


def calibrate_eval_reader_no_op(src: int, view: int) -> bool:
    """After :func:`calibrate_eval_reader`: ``view`` = a reshape / view / permute / transpose of
    ``src`` teaches the reader that its op moves no data (a node of it weighs its dispatch)."""
    return bool(_lib().cb_eval_calibrate_no_op(src, view))


def node_work(tensor: int) -> float:
    """The eval reader's work estimate of one ggml tensor (1.0 when not calibrated)."""
    return _lib().cb_node_work(tensor)


def word_map(fd: int) -> int:
    """Map the shared cancel word's region of ``fd`` read-only (the engine's side); its address.
    OSError if ``fd`` is not such a region."""
    addr = _lib().cb_word_map(fd)
    if not addr:
        err = ctypes.get_errno() or 22
        raise OSError(err, f"fd {fd} is not a shared cancel word region")
    return addr


def word_load(address: int) -> int:
    """The shared cancel word's value (acquire load; 0 = no cancel)."""
    return _lib().cb_word_load(address)


def word_store(address: int, seq: int) -> None:
    """Store ``seq`` in the shared cancel word (the agent's side; release store)."""
    _lib().cb_word_store(address, seq)


class CancelToken:
    """One atomic cancel byte plus first-seen time and poll counter, owned natively."""

    def __init__(self) -> None:
        self._ptr = _lib().cb_token_new()
        if not self._ptr:
            raise MemoryError("cb_token_new failed")
        self.watching: tuple[int, int] | None = None  # (word address, trial sequence number), see watch

    def watch(self, word: int | None, seq: int | None) -> None:
        """Count as set once the shared cancel word at ``word`` holds ``seq`` (cb_token_watch);
        None: stop. Cleared by :meth:`reset`: watch again for each trial."""
        self.watching = (word, seq) if word and seq else None
        _lib().cb_token_watch(self._ptr, word or None, seq or 0)

    @property
    def set_by_word(self) -> bool:
        """The flag was latched from the watched word (before any :meth:`set`)."""
        return bool(_lib().cb_token_set_by_word(self._ptr))

    @property
    def word_latch(self) -> tuple[int, int, int | None] | None:
        """(the CPU clock, cb_thread_id, run delay ns or None) of the thread whose reader latched the
        word, at the latch; None: not latched from the word (ABI 1.2; the run delay 1.3, None where
        that thread never watched a word or not on Linux)."""
        cpu = _lib().cb_token_word_cpu_ns(self._ptr)
        if not cpu:
            return None
        wait = _lib().cb_token_word_wait_ns(self._ptr)
        return cpu, _lib().cb_token_word_thread(self._ptr), (wait if wait >= 0 else None)

    @property
    def address(self) -> int:
        return self._ptr

    def set(self) -> int:
        """Set the flag; returns the (first) set time in agent ns."""
        return _lib().cb_token_set(self._ptr)

    def reset(self) -> None:
        """Clear the trial state (flag, stamps, polls, syncs, max range); keep the slice and
        the learned costs. Between trials, never while a native call polls the token, and
        serialized with :meth:`set` (cancel_token.h, the reset contract). Clears the watch."""
        self.watching = None
        _lib().cb_token_reset(self._ptr)

    def is_set(self) -> bool:
        return bool(_lib().cb_token_is_set(self._ptr))

    @property
    def set_ns(self) -> int:
        return _lib().cb_token_set_ns(self._ptr)

    @property
    def seen_ns(self) -> int:
        """First time a native reader saw the flag set (0 = never seen natively)."""
        return _lib().cb_token_seen_ns(self._ptr)

    @property
    def seen_cpu_ns(self) -> int:
        """The graph thread's CPU clock (CLOCK_THREAD_CPUTIME_ID) when the eval reader stamped
        ``seen_ns`` (0 = not stamped by the eval reader)."""
        return _lib().cb_token_seen_cpu_ns(self._ptr)

    @property
    def seen_where(self) -> str | None:
        """Where the eval reader saw the token: ``range_end`` (the sync of a range it asked to
        see: the cancel came while that range was computed), ``next_ask`` (a node's ask: the
        cancel came where no sync was due, a graph's unsynced tail or the caller's work between
        or before graphs); None when no eval reader stamped it."""
        return {1: "range_end", 2: "next_ask"}.get(_lib().cb_token_seen_where(self._ptr))

    @property
    def polls(self) -> int:
        """Abort-reader calls plus graph nodes the eval reader was asked about."""
        return _lib().cb_token_polls(self._ptr)

    @property
    def slice_us(self) -> float:
        """The eval reader's slice (0 = sync after every graph node)."""
        return _lib().cb_token_slice_ns(self._ptr) / 1e3

    def set_slice_us(self, slice_us: float) -> None:
        """Set the eval reader's slice; forgets the learned costs. Not while a graph runs."""
        _lib().cb_token_set_slice_ns(self._ptr, int(round(float(slice_us) * 1e3)))

    def forget_costs(self) -> None:
        """Forget what the eval reader learned about the model it polled (cost per unit of
        work, per-op scales), keeping the slice. Call when this token becomes the eval
        reader's user data of a new model/context. Not while a graph runs."""
        _lib().cb_token_forget_costs(self._ptr)

    @property
    def syncs(self) -> int:
        """Node ranges the eval reader asked to see (each computed, then synchronized)."""
        return _lib().cb_token_syncs(self._ptr)

    @property
    def max_range_ns(self) -> int:
        """Longest eval-reader range: its first node asked -> synchronized (slice 0: one node)."""
        return _lib().cb_token_max_range_ns(self._ptr)

    def take_max_range_ns(self) -> int:
        """max_range_ns, then set to 0 with max_range_cpu_ns (read that first): per-call profiles."""
        return _lib().cb_token_take_max_range_ns(self._ptr)

    @property
    def ns_per_work(self) -> float:
        """The eval reader's learned cost of one unit of node work (ns; 0 = not learned yet)."""
        return _lib().cb_token_ns_per_work(self._ptr)

    @property
    def probes(self) -> int:
        """Debug: eval-reader ranges ended to learn a first-seen cost key (op x work bucket)."""
        return _lib().cb_token_probes(self._ptr)

    @property
    def reprobes(self) -> int:
        """Debug: eval-reader ranges ended to learn a known key again (after a range overran 2x in CPU)."""
        return _lib().cb_token_reprobes(self._ptr)

    @property
    def max_range_est_ns(self) -> int:
        """Debug: the reader's estimate (ns) of the range that became max_range_ns."""
        return _lib().cb_token_max_range_est_ns(self._ptr)

    @property
    def max_range_cpu_ns(self) -> int:
        """Debug: the most graph-thread CPU time (ns) of one eval-reader range (slice 0: a node's)."""
        return _lib().cb_token_max_range_cpu_ns(self._ptr)

    def log_enable(self, max_nodes: int, max_ranges: int) -> None:
        """Debug: a fresh eval-reader profiling log (rows per node asked and per range,
        cancel_token.h); 0 turns it off. Between graphs."""
        if not _lib().cb_token_log_enable(self._ptr, max_nodes, max_ranges):
            raise MemoryError("no room for the eval-reader log")

    def log_ranges_count(self) -> int:
        """Debug: range rows logged so far (a cheap mark between graphs)."""
        return _lib().cb_token_log_ranges(self._ptr, None, 0)

    def log_rows(self) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
        """Debug: (node rows, range rows) of the profiling log, fields as in cancel_token.h."""
        out = []
        for fn, fields in ((_lib().cb_token_log_nodes, 6), (_lib().cb_token_log_ranges, 8)):
            n = fn(self._ptr, None, 0)
            buf = (ctypes.c_double * (n * fields))()
            fn(self._ptr, buf, n)
            out.append([tuple(buf[i * fields:(i + 1) * fields]) for i in range(n)])
        return out[0], out[1]

    def read(self) -> bool:
        """Call the native reader once (counts as a poll, stamps seen_ns)."""
        return bool(_lib().cb_token_reader(self._ptr))

    def close(self) -> None:
        if self._ptr:
            _lib().cb_token_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:  # pragma: no cover - interpreter teardown order
        try:
            self.close()
        except Exception:
            pass


def probe_busy(token: CancelToken, duration_us: int, period_us: int) -> tuple[bool, int, int]:
    """Run the known-answer probe; returns (aborted, start_ns, end_ns) on the agent clock.

    The GIL is released for the duration (ctypes foreign call), so a cancel can be
    served by another thread while it runs.
    """
    start = ctypes.c_int64(0)
    end = ctypes.c_int64(0)
    aborted = _lib().cb_probe_busy(token.address, int(duration_us), int(period_us),
                                 ctypes.byref(start), ctypes.byref(end))
    return bool(aborted), start.value, end.value


def probe_expected_return_ns(start_ns: int, set_ns: int, period_us: int) -> int:
    """The known answer: the first probe check at or after ``set_ns``."""
    period_ns = max(1, int(period_us)) * 1000
    k = max(1, -(-(set_ns - start_ns) // period_ns))
    return start_ns + k * period_ns


def sim_wait(token: CancelToken | None, duration_us: int, granularity_us: int) -> tuple[int, int, int]:
    """The sim engine's native wait: sleeps ``duration_us``, checking ``token`` every
    ``granularity_us`` (None or granularity 0: no check inside the wait). Returns
    (k, start_ns, end_ns): k >= 1 is the check that found the token set (scheduled at
    start + k * granularity), 0 a wait that ran to its end. Releases the GIL."""
    start = ctypes.c_int64(0)
    end = ctypes.c_int64(0)
    k = _lib().cb_sim_wait(token.address if token is not None else None, int(duration_us), int(granularity_us),
                           ctypes.byref(start), ctypes.byref(end))
    return int(k), start.value, end.value


def sim_expected_check(start_ns: int, set_ns: int, granularity_us: int) -> int:
    """The known answer of a cancelled :func:`sim_wait`: the index k of its first check
    scheduled at or after ``set_ns``. The wait stops at this check or, when an earlier
    check woke late (after the set), at that one; never at a later one."""
    step = max(1, int(granularity_us)) * 1000
    return max(1, -(-(set_ns - start_ns) // step))


def sut_text_engine_path() -> Path:
    """The C protocol engine (native/sut_text_engine.c) built by native/build_sut_engine.sh
    (``make setup``): <repository root>/build/sut/cancelbench-text-engine."""
    return _HERE.parent / "build" / "sut" / "cancelbench-text-engine"
