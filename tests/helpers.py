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
