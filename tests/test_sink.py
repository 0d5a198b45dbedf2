"""The record sink on real Parquet files: when it flushes, and what a failed flush keeps."""

import json
import time
from pathlib import Path

import pytest

from cancelbench.schema import empty_row
from cancelbench.sink import RecordSink, SinkError, read_records, write_json_atomic


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
