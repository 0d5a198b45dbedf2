"""Record sink: an incrementally written, hive-partitioned Parquet dataset.

Layout of a results directory::

    DIR/manifest.json                        config, seeds, versions, schema version
    DIR/plan.parquet                         the whole pre-generated trial plan
    DIR/records/backend=cpu/host=H/part-*.parquet

Each flush writes a new small file to a temporary name and renames it into
place, so a driver killed mid-sweep leaves only complete files behind; a
resumed sweep reads the trial ids already present and skips them.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from .schema import FILE_SCHEMA, PARTITION_COLUMNS, RECORD_SCHEMA, SCHEMA_VERSION

RECORDS_DIR = "records"
MANIFEST = "manifest.json"
PLAN_FILE = "plan.parquet"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class DatasetError(ValueError):
    """A results directory that is not a readable cancelbench dataset."""


def sanitize_path_part(value: object) -> str:
    """Make a value safe as one path component (no separators, no dot-dirs)."""
    text = _UNSAFE.sub("_", str(value if value is not None else "unknown")).strip("._")
    return text[:64] or "unknown"


def records_dir(out_dir: Path) -> Path:
    return Path(out_dir) / RECORDS_DIR


def partitioning() -> ds.Partitioning:
    return ds.partitioning(pa.schema([RECORD_SCHEMA.field(c) for c in PARTITION_COLUMNS]), flavor="hive")


def open_dataset(out_dir: Path) -> ds.Dataset:
    """Open a results directory as a pyarrow dataset with the record schema."""
    rdir = records_dir(out_dir)
    if not rdir.is_dir():
        raise DatasetError(f"{out_dir}: not a cancelbench dataset (no {RECORDS_DIR}/ directory)")
    check_schema_version(out_dir)
    return ds.dataset(str(rdir), schema=RECORD_SCHEMA, format="parquet", partitioning=partitioning())


def read_manifest(out_dir: Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise DatasetError(f"{out_dir}: not a cancelbench dataset (no {MANIFEST})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: unreadable manifest ({exc})") from exc


def check_schema_version(out_dir: Path) -> int:
    version = int(read_manifest(out_dir).get("schema_version", -1))
    if version > SCHEMA_VERSION:
        raise DatasetError(
            f"{out_dir}: record schema version {version} is newer than this cancelbench "
            f"understands ({SCHEMA_VERSION}); upgrade cancelbench"
        )
    if version < 1:
        raise DatasetError(f"{out_dir}: manifest has no valid schema_version")
    return version


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def rows_to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in RECORD_SCHEMA.names} for r in rows], schema=RECORD_SCHEMA)


class RecordSink:
    """Buffers records and flushes them as new Parquet files (thread-safe)."""

    def __init__(self, out_dir: Path, flush_every: int = 16, flush_seconds: float = 2.0) -> None:
        self.out_dir = Path(out_dir)
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self._buf: list[dict] = []
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._writer_id = uuid.uuid4().hex[:8]
        self._seq = 0
        self.written = 0
        records_dir(self.out_dir).mkdir(parents=True, exist_ok=True)

    def add(self, row: dict) -> None:
        with self._lock:
            self._buf.append(row)
            due = len(self._buf) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            rows, self._buf = self._buf, []
            self._last_flush = time.monotonic()
            if not rows:
                return
            groups: dict[tuple[str, ...], list[dict]] = {}
            for r in rows:
                key = tuple(sanitize_path_part(r.get(c)) for c in PARTITION_COLUMNS)
                groups.setdefault(key, []).append(r)
            for key, group in groups.items():
                part_dir = records_dir(self.out_dir).joinpath(*(f"{c}={v}" for c, v in zip(PARTITION_COLUMNS, key)))
                part_dir.mkdir(parents=True, exist_ok=True)
                table = rows_to_table(group).select(FILE_SCHEMA.names).cast(FILE_SCHEMA)
                name = f"part-{self._writer_id}-{self._seq:06d}.parquet"
                self._seq += 1
                tmp = part_dir / f".{name}.tmp"
                pq.write_table(table, tmp)
                os.replace(tmp, part_dir / name)
                self.written += len(group)

    def close(self) -> None:
        self.flush()


def completed_trial_ids(out_dir: Path) -> set[str]:
    """Trial ids already on disk (any outcome): a resumed sweep skips them."""
    rdir = records_dir(out_dir)
    if not rdir.is_dir() or not any(rdir.rglob("*.parquet")):
        return set()
    table = open_dataset(out_dir).to_table(columns=["trial_id"])
    return set(table.column("trial_id").to_pylist())


def read_records(out_dir: Path, columns: list[str] | None = None):
    """Read records as a pandas DataFrame (only the requested columns)."""
    return open_dataset(out_dir).to_table(columns=columns).to_pandas()
