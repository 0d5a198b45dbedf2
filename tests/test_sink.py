"""The record sink on real Parquet files: when it flushes, what a failed flush keeps, and compaction."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from cancelbench.compaction import COMPACTED_FROM, COMPACTED_SUFFIX, PAUSE_MARKER, STEPS, compact
from cancelbench.failpoints import COMPACT_PAUSE as PAUSE_ENV
from cancelbench.schema import empty_row
from cancelbench.sink import (DatasetError, RecordSink, SinkError, completed_trial_ids, read_records, read_table, record_files,
                              write_json_atomic)


def dataset(path: Path) -> Path:
    write_json_atomic(path / "manifest.json", {"schema_version": 1, "sweep_id": "test"})
    return path


def row(trial_id: str, **kw) -> dict:
    return empty_row() | {"trial_id": trial_id, "trial_kind": "cancel", "outcome": "cancelled", "backend": "cpu",
                          "host": "h", "latency_ms": 1.0} | kw


def test_a_record_is_flushed_after_flush_seconds_even_if_no_other_record_arrives(tmp_path):
    sink = RecordSink(dataset(tmp_path), flush_every=1000, flush_seconds=0.1)
    sink.add(row("t1"))
    # Observable: a Parquet file appears while the sink is still open (polled, never a fixed sleep).
    deadline = time.monotonic() + 60
    while not any((tmp_path / "records").rglob("*.parquet")):
        assert time.monotonic() < deadline, "no timer flush: nothing on disk 60 s after the record"
        time.sleep(0.01)
    sink.close()
    assert read_records(tmp_path).trial_id.tolist() == ["t1"]


def test_a_failed_flush_loses_no_record(tmp_path):
    """A value the schema cannot hold (int32 overflow) used to lose every buffered record."""
    sink = RecordSink(dataset(tmp_path), flush_every=4)
    for i in range(3):
        sink.add(row(f"good{i}"))
    sink.add(row("bad", n_threads=2**40))  # the 4th record triggers the flush
    sink.add(row("later"))
    with pytest.raises(SinkError, match="1 record"):
        sink.close()
    assert sorted(read_records(tmp_path).trial_id) == ["good0", "good1", "good2", "later"]
    kept = [json.loads(line) for f in tmp_path.glob("unwritten-*.jsonl") for line in f.read_text().splitlines()]
    assert [(r["trial_id"], r["n_threads"]) for r in kept] == [("bad", 2**40)]


def small_files(path: Path, n: int = 12, start: int = 0) -> list[str]:
    """A dataset of one file per record over two partitions (the 2 s flush rule with slow trials)."""
    sink = RecordSink(path, flush_every=1)
    ids = [f"t{i:03d}" for i in range(start, start + n)]
    for i, tid in enumerate(ids):
        sink.add(row(tid, trial_index=start + n - i, host=f"h{i % 2}", latency_ms=i / 7, duration_ms=float(i),
                     phase_timeline_json=json.dumps({"i": i})))
    sink.close()
    return ids


def files_by_partition(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in sorted((path / "records").rglob("*")):
        if f.is_file():
            out.setdefault(f.parent.name, []).append(f.name)
    return out


def test_compaction_keeps_every_row_and_value_and_leaves_one_file_per_partition(tmp_path):
    ids = small_files(dataset(tmp_path))
    before = read_table(tmp_path)
    assert len(record_files(tmp_path)) == len(ids)
    assert compact(tmp_path / "records") == (len(ids), 2)
    after = read_table(tmp_path)
    assert after.schema == before.schema
    assert after.sort_by("trial_id").equals(before.sort_by("trial_id"))  # the whole table, every column
    assert {p: len(f) for p, f in files_by_partition(tmp_path).items()} == {"host=h0": 1, "host=h1": 1}
    # Within a file the rows are in plan order, whatever order they were flushed in.
    h0 = read_table(tmp_path, filter=pc.field("host") == "h0").column("trial_index").to_pylist()
    assert h0 == sorted(h0)
    # A resumed sweep adds small files; compacting again folds them into the compacted one.
    ids += small_files(tmp_path, n=4, start=len(ids))
    both = read_table(tmp_path)
    assert compact(tmp_path / "records") == (2 + 4, 2)
    assert read_table(tmp_path).sort_by("trial_id").equals(both.sort_by("trial_id"))
    assert sorted(read_records(tmp_path).trial_id) == ids
    assert compact(tmp_path / "records") == (2, 2)  # nothing left to do: nothing rewritten


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_at_any_step_of_compaction_loses_and_duplicates_nothing(tmp_path, step):
    """SIGKILL the compacting process at a named step (it waits there): every reader sees each
    record once in the state it left, and the recovery a resumed sweep runs finishes the job."""
    ids = small_files(dataset(tmp_path))
    before = read_table(tmp_path).sort_by("trial_id")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                             "from cancelbench.compaction import compact; compact(Path(sys.argv[1]))",
                             str(tmp_path / "records")], env={**os.environ, PAUSE_ENV: step})
    try:
        deadline = time.monotonic() + 120
        while not any((tmp_path / "records").rglob(PAUSE_MARKER)):  # observable: it reached the step
            assert proc.poll() is None, f"compaction ended (rc {proc.returncode}) before step {step}"
            assert time.monotonic() < deadline, f"compaction never reached step {step}"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    for marker in (tmp_path / "records").rglob(PAUSE_MARKER):
        marker.unlink()
    names = [n for files in files_by_partition(tmp_path).values() for n in files]
    compacted = [n for n in names if n.endswith(COMPACTED_SUFFIX)]
    tmp = [n for n in names if n.endswith(".tmp")]
    small = len(names) - len(compacted) - len(tmp)
    # The state each step leaves (so the checks below are not vacuous).
    assert (len(tmp), len(compacted), small) == {"written": (1, 0, len(ids)), "committed": (0, 1, len(ids)),
                                                 "removing": (0, 1, len(ids) - 1)}[step]
    assert read_table(tmp_path).sort_by("trial_id").equals(before)  # each record once, mid-compaction
    assert sorted(completed_trial_ids(tmp_path)) == ids
    assert compact(tmp_path / "records")[1] == 2  # what a resumed sweep does at its start and end
    assert read_table(tmp_path).sort_by("trial_id").equals(before)
    assert {p: len(f) for p, f in files_by_partition(tmp_path).items()} == {"host=h0": 1, "host=h1": 1}


def test_a_damaged_compaction_footer_is_a_dataset_error_not_a_guess(tmp_path):
    small_files(dataset(tmp_path), n=2)
    part = next((tmp_path / "records").rglob("*.parquet")).parent
    table = pa.table({"trial_id": ["x"]}).replace_schema_metadata({COMPACTED_FROM: b"{not json"})
    pq.write_table(table, part / f"part-bad{COMPACTED_SUFFIX}")
    with pytest.raises(DatasetError, match="not a list of file names"):
        completed_trial_ids(tmp_path)
