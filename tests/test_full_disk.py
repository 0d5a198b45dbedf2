"""A full disk (issue 17), on a small tmpfs: no taken record is lost, the sweep stops taking trials,
says in one line where the records went (another filesystem), leaves the manifest "incomplete",
exits 1; `--resume` after space is freed completes the plan with every trial exactly once.

Needs root (mount); skipped elsewhere.
"""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cancelbench.sink import read_manifest, read_records
from report_fixtures import cell_rows, write_dataset
from helpers import probe_sweep
from test_cli import write

FULL_SWEEP = probe_sweep(400, duration_us=1000)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cancelbench.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=900, env=env)


def test_a_full_disk_loses_no_record_and_resume_completes_exactly_once(tmp_path):
    cfg = write(tmp_path, FULL_SWEEP)
    # $TMPDIR: another filesystem than the tmpfs; a short path, as Ray's Unix sockets may go under it
    spare = Path(tempfile.mkdtemp(prefix="cbfull-", dir="/tmp"))
    env = os.environ | {"TMPDIR": str(spare)}
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, spare, ignore_errors=True)
        fs = cleanup.enter_context(tmpfs(tmp_path / "fs", "300k"))
        out = fs / "out"
        r = run("sweep", "--config", cfg, "--out", out, "--quiet", "--no-summary", env=env)
        ours = [line for line in r.stderr.splitlines() if line.startswith("cancelbench:")]
        assert r.returncode == 1, r.stderr[-3000:]
        assert len(ours) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        m = re.search(r"no space left in .*: (\d+) record\(s\) written there, the other (\d+) kept in (\S+);",
                      ours[0])
        assert m, ours[0]
        written, kept, fallback = int(m.group(1)), int(m.group(2)), Path(m.group(3))
        assert fallback.parent == spare and kept > 0
        on_disk = set(read_records(out, columns=["trial_id"]).trial_id)
        spilled = [json.loads(line)["trial_id"] for line in fallback.read_text().splitlines()]
        assert len(on_disk) == written and len(spilled) == kept  # every taken record is somewhere
        assert not on_disk & set(spilled)
        manifest = read_manifest(out)
        assert manifest["status"] == "incomplete" and written + kept < manifest["planned_trials"]

        # Free space, resume: every planned trial exactly once.
        subprocess.run(["mount", "-o", "remount,size=64m", str(fs)], check=True)
        r = run("sweep", "--config", cfg, "--out", out, "--resume", "--quiet", "--no-summary", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        manifest = read_manifest(out)
        assert manifest["status"] == "complete"
        ids = read_records(out, columns=["trial_id"]).trial_id
        planned = set(pq.read_table(out / "plan.parquet", columns=["trial_id"]).column("trial_id").to_pylist())
        assert ids.is_unique and set(ids) == planned and len(planned) == manifest["planned_trials"]


def test_a_report_that_does_not_fit_is_one_line_and_leaves_no_partial_file(tmp_path):
    data = write_dataset(tmp_path / "data", cell_rows("c", [10.0 + i for i in range(12)]))
    with tmpfs(tmp_path / "fs", "64k") as fs:
        fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            with contextlib.suppress(OSError):  # until the tmpfs is full
                while os.write(fd, b"\0" * 4096):
                    pass
        finally:
            os.close(fd)
        r = run("report", data, "--html", fs / "report.html")
        lines = r.stderr.strip().splitlines()
        assert r.returncode in (1, 2) and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "No space left" in lines[0] or "no space left" in lines[0]
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]
