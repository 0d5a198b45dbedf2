"""``python -m cancelbench.sut.reaper PGID [MARK]``: kill an engine's process group, and every
process carrying its mark (``cancelbench.sut.leftovers.MARK_ENV``: what it started in another session),
once the process that started it is gone.

The agent starts one per engine, with a pipe as this process's stdin; it never writes
to it. End of stdin means the agent closed the pipe (it shut the engine down itself)
or died (the kernel closed it): either way, whatever is left of the group gets SIGTERM,
then SIGKILL. SIGINT and SIGHUP are ignored (a terminal's Ctrl-C must not leave the
engine behind the reaper); SIGTERM acts like end of stdin.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def reap(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)


def reap_all(pgid: int, mark: str | None) -> None:
    reap(pgid)
    if mark:
        from cancelbench.sut.leftovers import end_leftovers
        end_leftovers(mark)


def main() -> int:
    pgid = int(sys.argv[1])
    mark = sys.argv[2] if len(sys.argv) > 2 else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: (reap_all(pgid, mark), os._exit(0)))
    while os.read(0, 4096):
        pass
    reap_all(pgid, mark)
    return 0


if __name__ == "__main__":
    sys.exit(main())
