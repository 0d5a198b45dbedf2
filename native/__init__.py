"""ctypes bindings for the native cancel token (native/cancel_token.c).

The shared library is built by the package build (setup.py) next to this file.
Every agent-side timestamp goes through :func:`now_ns` so that Python and
native times share one clock domain (CLOCK_MONOTONIC on the agent's host).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
LIB_BASENAME = "_cancelbench_native"


class NativeLibraryMissing(RuntimeError):
    """The compiled cancel-token library is not next to this module."""


def _built_library(directory: Path) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = directory / f"{LIB_BASENAME}{suffix}"
        if candidate.exists():
            return candidate
    return None


def _compile_into_cache() -> Path:
    """Build the library from the source next to this file into a per-user cache.

    A copy of the package without its build products (a Ray job's working_dir,
    which skips git-ignored files) still finds its native code this way.
    """
    import hashlib
    import shutil
    import subprocess
    import sys

    source = _HERE / "cancel_token.c"
    if not source.exists():
        raise NativeLibraryMissing(f"neither the compiled library nor {source} is available")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cancelbench"
    target = cache / f"{LIB_BASENAME}-{digest}{'.dylib' if sys.platform == 'darwin' else '.so'}"
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeLibraryMissing(f"{LIB_BASENAME} is not built and no C compiler was found; "
                                   "install the package (pip install -e .)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-std=gnu11", "-fPIC", "-shared", "-fvisibility=hidden", str(source), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise NativeLibraryMissing(f"compiling {source} failed: {result.stderr.strip()[-500:]}")
    os.replace(tmp, target)
    return target


def _find_library() -> Path:
    override = os.environ.get("CANCELBENCH_NATIVE_LIB")
    if override:
        return Path(override)
    return _built_library(_HERE) or _compile_into_cache()


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_find_library()))
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    lib.cb_now_ns.restype = i64
    lib.cb_now_ns.argtypes = []
    lib.cb_set_clock_skew_ns.restype = None
    lib.cb_set_clock_skew_ns.argtypes = [i64]
    lib.cb_token_new.restype = p
    lib.cb_token_new.argtypes = []
    lib.cb_token_free.restype = None
    lib.cb_token_free.argtypes = [p]
    lib.cb_token_reset.restype = None
    lib.cb_token_reset.argtypes = [p]
    lib.cb_token_set.restype = i64
    lib.cb_token_set.argtypes = [p]
    lib.cb_token_is_set.restype = ctypes.c_bool
    lib.cb_token_is_set.argtypes = [p]
    lib.cb_token_set_ns.restype = i64
    lib.cb_token_set_ns.argtypes = [p]
    lib.cb_token_seen_ns.restype = i64
    lib.cb_token_seen_ns.argtypes = [p]
    lib.cb_token_polls.restype = ctypes.c_uint64
    lib.cb_token_polls.argtypes = [p]
    lib.cb_token_reader.restype = ctypes.c_bool
    lib.cb_token_reader.argtypes = [p]
    lib.cb_probe_busy.restype = ctypes.c_int
    lib.cb_probe_busy.argtypes = [p, i64, i64, ctypes.POINTER(i64), ctypes.POINTER(i64)]
    return lib


_lib = _load()
# Test hook: a known agent-clock skew (ns), so clock-offset estimation can be checked.
if os.environ.get("CANCELBENCH_TEST_CLOCK_SKEW_NS"):
    _lib.cb_set_clock_skew_ns(int(os.environ["CANCELBENCH_TEST_CLOCK_SKEW_NS"]))


def library_path() -> str:
    return str(_find_library())


def now_ns() -> int:
    """Agent clock: CLOCK_MONOTONIC in ns, the same clock the token stamps use."""
    return _lib.cb_now_ns()


def reader_address() -> int:
    """Address of ``bool cb_token_reader(void *token)`` for llama_set_abort_callback."""
    return ctypes.cast(_lib.cb_token_reader, ctypes.c_void_p).value


def eval_reader_address() -> int:
    """Address of ``bool cb_token_eval_reader(ggml_tensor *, bool ask, void *token)``."""
    return ctypes.cast(_lib.cb_token_eval_reader, ctypes.c_void_p).value


class CancelToken:
    """One atomic cancel byte plus first-seen time and poll counter, owned natively."""

    def __init__(self) -> None:
        self._ptr = _lib.cb_token_new()
        if not self._ptr:
            raise MemoryError("cb_token_new failed")

    @property
    def address(self) -> int:
        return self._ptr

    def set(self) -> int:
        """Set the flag; returns the (first) set time in agent ns."""
        return _lib.cb_token_set(self._ptr)

    def reset(self) -> None:
        _lib.cb_token_reset(self._ptr)

    def is_set(self) -> bool:
        return bool(_lib.cb_token_is_set(self._ptr))

    @property
    def set_ns(self) -> int:
        return _lib.cb_token_set_ns(self._ptr)

    @property
    def seen_ns(self) -> int:
        """First time a native reader saw the flag set (0 = never seen natively)."""
        return _lib.cb_token_seen_ns(self._ptr)

    @property
    def polls(self) -> int:
        return _lib.cb_token_polls(self._ptr)

    def read(self) -> bool:
        """Call the native reader once (counts as a poll, stamps seen_ns)."""
        return bool(_lib.cb_token_reader(self._ptr))

    def close(self) -> None:
        if self._ptr:
            _lib.cb_token_free(self._ptr)
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
    aborted = _lib.cb_probe_busy(token.address, int(duration_us), int(period_us),
                                 ctypes.byref(start), ctypes.byref(end))
    return bool(aborted), start.value, end.value


def probe_expected_return_ns(start_ns: int, set_ns: int, period_us: int) -> int:
    """The known answer: the first probe check at or after ``set_ns``."""
    period_ns = max(1, int(period_us)) * 1000
    k = max(1, -(-(set_ns - start_ns) // period_ns))
    return start_ns + k * period_ns
