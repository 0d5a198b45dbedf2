"""What is left of an engine process when it stops: its process group, and what it started outside it
(a child in its own session, a daemon). Every engine gets ``MARK_ENV`` in its environment, a value per
engine process, which what it starts inherits; the agent (cancelbench.sut.client), the reaper and
``sut-check`` end and name what carries it. A process that clears its environment and leaves the engine's
process tree before the stop is not found (docs/sut-protocol.md)."""

from __future__ import annotations

import os

MARK_ENV = "CANCELBENCH_ENGINE_MARK"
GRACE_S = 2.0  # how long a SIGKILLed leftover may take to go


def descendants(pid: int) -> list:
    """The live processes below ``pid`` (psutil.Process), whatever group or session they are in."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def marked(mark: str) -> list:
    """Live processes (not zombies) whose environment carries this engine's mark: the engine and what it
    started, also those that left its group and lost their parent. Only processes this user may read."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARK_ENV) == mark:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def end_leftovers(mark: str, strays: list = ()) -> list[str]:
    """SIGKILL what is left of an engine outside its process group (a child in its own session, a daemon
    it started): its descendants found before it went and every process carrying its mark. What was left,
    as 'pid command' (sut-check reports them)."""
    import psutil

    left = {p.pid: p for p in [*strays, *marked(mark)]}
    named = []
    for p in left.values():
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            named.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(list(left.values()), timeout=GRACE_S)
    return named


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
