"""A process that ends the local Ray a driver started once that driver is gone.

``ray.init(address="local")`` starts the GCS, the raylet and, under it, the
dashboard and runtime-env agents and the workers. A driver that exits
normally stops them; one killed with SIGKILL (or by the OOM killer) cannot,
and some of them (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) then run
on with their ports open. :func:`start` launches this module beside the
driver: it records the driver's descendants every half second and, when the
driver is gone (or a zombie), terminates those still running, kills what
ignores SIGTERM after a few seconds, removes the private Ray temp directory
if it was given one, and exits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

POLL_S = 0.5


def start(temp_dir: str | None = None) -> subprocess.Popen:
    """Watch this process; launched in its own session so a Ctrl-C to the terminal does not end it first."""
    argv = [sys.executable, "-m", "cancelbench.watchdog", str(os.getpid())] + ([temp_dir] if temp_dir else [])
    return subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True)


def _gone(proc) -> bool:
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def watch(driver_pid: int, temp_dir: str | None = None) -> None:
    import psutil

    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    while not _gone(driver):
        try:
            for child in driver.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        time.sleep(POLL_S)
    victims: dict[int, psutil.Process] = {}
    for proc in known.values():
        try:
            if proc.is_running():  # same pid and start time: not a reused pid
                victims[proc.pid] = proc
                for sub in proc.children(recursive=True):
                    victims.setdefault(sub.pid, sub)
        except psutil.NoSuchProcess:
            pass
    victims.pop(me, None)
    for proc in victims.values():
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(victims.values()), timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    if temp_dir and os.path.basename(temp_dir).startswith("cancelbench-ray-"):
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
