"""SIGINT, SIGTERM and SIGHUP handled alike by the commands that run for long.

:func:`install` sets a Python handler for each, whatever the process
inherited (a job a non-interactive shell starts with ``&`` inherits SIGINT as
ignored, and Python then installs no handler of its own). The handler raises
:class:`Interrupted` -- a ``KeyboardInterrupt``, so every ``finally`` and
``except BaseException`` that already handles Ctrl-C handles the others -- in
the main thread, once; a second signal while the first is being handled is
noted and otherwise ignored, so the cleanup (flush the records, write the
manifest, stop Ray) runs to its end.

``ray.init`` installs Ray's C++ failure handler for SIGTERM (it prints
``*** SIGTERM received ... PC: @`` and aborts): :func:`reassert` puts ours
back after Ray started.
"""

from __future__ import annotations

import signal
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}  # 128 + signal number

_installed = False
_received: list[int] = []


class Interrupted(KeyboardInterrupt):
    """A handled signal arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + self.signum)


def _handler(signum: int, frame) -> None:
    _received.append(signum)
    if len(_received) == 1:
        raise Interrupted(signum)
    # a later one: the first is being handled; its cleanup must finish


def install() -> None:
    """Handle SIGINT, SIGTERM and SIGHUP in this (main) thread's Python code."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        signal.signal(sig, _handler)
    _installed = True


def reassert() -> None:
    """After a library (Ray) replaced our handlers: put them back, if :func:`install` ran."""
    if _installed:
        install()


def first_received() -> int | None:
    return _received[0] if _received else None
