"""Interrupting a `cancelbench sweep`: one sweep per --out, SIGINT leaves an interrupted (compacted)
dataset, and a SIGKILL mid-compaction loses nothing on --resume.

A real `cancelbench` process with its own local Ray, real Parquet files.
"""

import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from cancelbench.compaction import COMPACTED_SUFFIX, PAUSE_MARKER
from cancelbench.failpoints import COMPACT_PAUSE as PAUSE_ENV
from cancelbench.sink import LOCK_FILE, read_manifest, read_records
from helpers import probe_sweep
from test_cli import cancelbench, write


def start(*args) -> subprocess.Popen:
    """A `cancelbench` process in its own session, so a failed test can end it with its Ray (killpg)."""
    return subprocess.Popen([sys.executable, "-m", "cancelbench.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(predicate, what: str, proc: subprocess.Popen | None = None, timeout_s: float = 240.0) -> None:
    """Poll an observable state (never a fixed sleep); fail if the process ends first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"process ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


# A sweep still running when its records are on disk, by construction: after a quick workload whose
# records the timer flushes, the second workload's reference trials each take an hour.
LONG_PROBE_SWEEP = probe_sweep(4) + """
[[workload]]
name = "long"
engine = "probe"
duration_us = 3600000000
period_us = 1000
"""


def test_one_sweep_per_out_and_sigint_leaves_an_interrupted_dataset(tmp_path):
    """Independent of timing (the signal lands while an hour-long trial runs) and of the SIGINT
    disposition the test inherited: the command installs its handlers explicitly."""
    out = tmp_path / "out"
    cfg = write(tmp_path, LONG_PROBE_SWEEP)
    first = start("sweep", "--config", cfg, "--out", out, "--quiet", "--no-summary")
    try:
        lock = out / LOCK_FILE
        # Observable: the first sweep holds the lock once its pid is in the lock file.
        wait_for(lambda: lock.is_file() and lock.read_text() == str(first.pid), "the first sweep's lock", first)
        os.kill(first.pid, signal.SIGSTOP)  # frozen while holding it: the second run cannot race past it
        try:
            second = cancelbench("sweep", "--config", cfg, "--out", out, "--quiet", "--no-summary")
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "another cancelbench sweep" in lines[0] and str(first.pid) in lines[0]

        wait_for(lambda: any((out / "records").rglob("*.parquet")), "records on disk", first)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:  # the test failed mid-way: end the sweep and the Ray it started
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 130, err[-3000:]
    manifest = read_manifest(out)
    assert manifest["status"] == "interrupted"
    df = read_records(out)
    assert 0 < len(df) < manifest["planned_trials"]
    assert df.trial_id.is_unique and set(df.sweep_id) == {manifest["sweep_id"]}  # one sweep wrote here
    assert one_file_per_partition(out)  # compacted on the way out, too
    assert not lock.exists()
    report = cancelbench("report", out)
    assert f"partial dataset, {len(df)} of {manifest['planned_trials']} planned trials on disk" in report.stderr
    assert "interrupted" in report.stderr


def one_file_per_partition(out) -> bool:
    parts = {f.parent for f in (out / "records").rglob("*.parquet")}
    return bool(parts) and all(len([f for f in p.iterdir() if f.is_file()]) == 1 for p in parts)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_signal_mid_compaction_then_resume_leaves_every_trial_once(tmp_path, sig):
    """The driver is signalled at the sweep's end between writing the compacted file and removing
    the small ones (the compaction waits there: CANCELBENCH_TEST_COMPACT_PAUSE): SIGKILL, or SIGINT
    (which stops the compaction where it is). --resume then finishes the job: every planned trial
    exactly once, one file per partition."""
    out = tmp_path / "out"
    cfg = write(tmp_path, probe_sweep(40))  # 43 records: at least 3 flushes of 16
    proc = subprocess.Popen([sys.executable, "-m", "cancelbench.cli", "sweep", "--config", str(cfg), "--out",
                             str(out), "--quiet", "--no-summary"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, PAUSE_ENV: "committed"})
    try:
        wait_for(lambda: any(out.rglob(PAUSE_MARKER)), "compaction to pause", proc)
        proc.send_signal(sig)  # SIGKILL: the driver only, its Ray's watchdog ends the rest
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for marker in out.rglob(PAUSE_MARKER):
        marker.unlink()
    assert any(f.name.endswith(COMPACTED_SUFFIX) for f in out.rglob("*.parquet")) and not one_file_per_partition(out)
    manifest = read_manifest(out)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted by SIGINT" in err, err[-3000:]
        assert manifest["status"] == "interrupted"
    else:
        assert manifest["status"] == "running"  # killed: the sweep never said it ended
    df = read_records(out)
    assert len(df) == manifest["planned_trials"] and df.trial_id.is_unique  # mid-compaction: each once
    again = cancelbench("sweep", "--config", cfg, "--out", out, "--resume", "--quiet", "--no-summary")
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_manifest(out)["status"] == "complete"
    df = read_records(out)
    plan = pq.read_table(out / "plan.parquet", columns=["trial_id"]).column("trial_id").to_pylist()
    assert sorted(df.trial_id) == sorted(plan)  # every planned trial exactly once
    assert one_file_per_partition(out)
