"""Signals as a process manager sends them (issue 17): SIGINT, SIGTERM and SIGHUP end a sweep alike --
one line naming the signal, exit 128 + signal, manifest "interrupted", no Ray crash dump -- even when
SIGINT was inherited as ignored; after SIGKILL of the driver no process of its Ray remains.

Each test runs a real sweep whose second workload's trials take an hour, so it is still running when
the signal lands (by construction, not by timing); the signal is sent once its first records are on disk.
"""

import signal
import subprocess
import sys
import time

import psutil
import pytest

from cancelbench.sink import read_manifest, read_records
from test_cli import write
from test_sweep_interrupt import LONG_PROBE_SWEEP, wait_for


def start_sweep(tmp_path, ignore_sigint: bool = False) -> tuple[subprocess.Popen, object]:
    out = tmp_path / "out"
    cfg = write(tmp_path, LONG_PROBE_SWEEP)
    # preexec_fn runs in the child before exec: an ignored disposition survives exec, as it does for a
    # job a non-interactive shell starts with `&`.
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    proc = subprocess.Popen([sys.executable, "-m", "cancelbench.cli", "sweep", "--config", str(cfg), "--out",
                             str(out), "--quiet", "--no-summary"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=preexec)
    try:
        wait_for(lambda: any((out / "records").rglob("*.parquet")), "records on disk", proc)
    except BaseException:
        end(proc)
        raise
    return proc, out


def end(proc: subprocess.Popen) -> None:
    """A failed test: end the sweep and the Ray it started (its own session)."""
    if proc.poll() is None:
        try:
            import os
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


CASES = [("SIGINT", signal.SIGINT, 130, False), ("SIGTERM", signal.SIGTERM, 143, False),
         ("SIGHUP", signal.SIGHUP, 129, False), ("SIGINT", signal.SIGINT, 130, True)]


@pytest.mark.parametrize("name, sig, code, ignore_sigint", CASES,
                         ids=["sigint", "sigterm", "sighup", "sigint-inherited-ignored"])
def test_a_signal_gives_one_line_its_exit_code_and_an_interrupted_manifest(tmp_path, name, sig, code,
                                                                           ignore_sigint):
    proc, out = start_sweep(tmp_path, ignore_sigint)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        end(proc)
    assert proc.returncode == code, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("cancelbench:")]
    assert len(ours) == 1 and f"interrupted by {name}" in ours[0] and "--resume" in ours[0], err[-3000:]
    assert "*** SIG" not in err and "PC: @" not in err, err[-3000:]  # Ray's C++ failure dump
    assert "agent gone" not in err and "Traceback" not in err, err[-3000:]
    manifest = read_manifest(out)
    assert manifest["status"] == "interrupted"
    df = read_records(out)
    assert 0 < len(df) < manifest["planned_trials"] and df.trial_id.is_unique
    assert not (out / ".cancelbench.lock").exists()


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigkill_of_the_driver_leaves_no_process_of_its_ray(tmp_path):
    """SIGKILL used to leave ray::DashboardAgent and ray::RuntimeEnvAgent running with ports open."""
    proc, out = start_sweep(tmp_path)
    try:
        ray_procs = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in ray_procs if not _gone(p))
        assert "raylet" in names and "gcs_server" in names, names
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60  # a generous bound on a loaded machine; the watchdog polls every 0.5 s
        while True:
            left = [p for p in ray_procs if not _gone(p)]
            if not left:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"Ray processes left after the driver's SIGKILL: "
                            f"{[(p.pid, ' '.join(p.cmdline())[:80]) for p in left]}")
            time.sleep(0.2)
    finally:
        end(proc)
        for p in ray_procs:
            try:
                if not _gone(p):
                    p.kill()
            except psutil.NoSuchProcess:
                pass
