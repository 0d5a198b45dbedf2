"""Test helpers (importable as `helpers` from test modules)."""

from __future__ import annotations

import threading
import time

from cancelbench import native


def cancel_when(ctl, predicate, timeout_s: float = 60.0, delay_s: float = 0.0) -> threading.Thread:
    """Request a cancel from another thread once ``predicate(ctl.progress)`` holds."""

    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(ctl.progress):
            if time.monotonic() > deadline:
                return
            time.sleep(0.0005)
        if delay_s:
            time.sleep(delay_s)
        ctl.request(native.now_ns())

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def cancel_inside_call(ctl, call_name: str) -> None:
    """Deterministically land the cancel while the native call ``call_name`` is in flight.

    The engine's own ``ctl.native_call`` context marks the call in flight; this
    wraps it on this one control so the cancel is received right after the
    call is marked and before it runs (no polling thread, no timing).
    """
    original = ctl.native_call

    def native_call(name: str):
        cm = original(name)
        if name != call_name:
            return cm

        class _Wrapped:
            def __enter__(self):
                out = cm.__enter__()
                ctl.request(native.now_ns())
                return out

            def __exit__(self, *exc):
                return cm.__exit__(*exc)

        return _Wrapped()

    ctl.native_call = native_call
