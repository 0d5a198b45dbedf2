"""Test helpers (importable as `helpers` from test modules)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

from cancelbench import native


def cancel_inside_call(ctl, call_name: str | None = None, when: Callable = lambda progress: True) -> dict:
    """Land the cancel inside the first native call named ``call_name`` (any call if None)
    that starts while ``when(ctl.progress)`` holds.

    The engine's own ``ctl.native_call`` context marks a call in flight; this wraps it on
    this one control so the cancel is received on the engine's thread right after the call
    is marked and before it runs: where it lands is decided by construction, the same on an
    idle or a loaded host (no polling thread, no timing). Returns ``{"call": name}`` once landed.
    """
    original = ctl.native_call
    landed: dict = {}

    @contextmanager
    def native_call(name: str):
        with original(name):
            if not landed and call_name in (None, name) and when(ctl.progress):
                landed["call"] = name
                ctl.request(native.now_ns())
            yield

    ctl.native_call = native_call
    return landed


def cancel_when(ctl, predicate: Callable) -> dict:
    """Land the cancel inside the first native call that starts while ``predicate(ctl.progress)`` holds."""
    return cancel_inside_call(ctl, None, predicate)
