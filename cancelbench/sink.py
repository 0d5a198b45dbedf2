"""Record sink: an incrementally written, hive-partitioned Parquet dataset.

Layout of a results directory::

    DIR/manifest.json                        config, seeds, versions, schema version
    DIR/plan.parquet                         the whole pre-generated trial plan
    DIR/records/backend=cpu/host=H/part-*.parquet

Each flush writes a new small file to a temporary name and renames it into
place, so a driver killed mid-sweep leaves only complete files behind; a
resumed sweep reads the trial ids already present and skips them. At the end
of a sweep each partition's files are compacted into one
(:mod:`cancelbench.compaction`); every reader here lists the files through
:func:`~cancelbench.compaction.live_files`, which sees each record once even
mid-compaction.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from .compaction import live_files
from .outlock import LOCK_FILE, locked_output  # noqa: F401  (the --out lock; re-exported)
from .inputs import MAX_MANIFEST_BYTES, DatasetError, load_json_object, safe_component  # noqa: F401
from .fileio import write_atomic, write_json_atomic  # noqa: F401  (re-exported)
from .schema import FILE_SCHEMA, PARTITION_COLUMNS, RECORD_SCHEMA, SCHEMA_VERSION

RECORDS_DIR = "records"
MANIFEST = "manifest.json"
PLAN_FILE = "plan.parquet"
RESERVE_FILE = ".cancelbench.reserve"  # space set aside for the manifest, freed when the disk fills up
RESERVE_BYTES = 64 * 1024
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)




def sanitize_path_part(value: object) -> str:
    """A value as one path component (no separators, no dot-dirs), injectively: a value that
    had to change carries a short hash of itself, so ``a/b`` and ``a_b`` never share a partition."""
    return "unknown" if value is None else safe_component(str(value), dots=True, max_chars=64)


def records_dir(out_dir: Path) -> Path:
    return Path(out_dir) / RECORDS_DIR


def partitioning() -> ds.Partitioning:
    return ds.partitioning(pa.schema([RECORD_SCHEMA.field(c) for c in PARTITION_COLUMNS]), flavor="hive")


def record_files(out_dir: Path) -> list[Path]:
    """The record files of a results directory, each record in exactly one (see compaction)."""
    rdir = records_dir(out_dir)
    if not rdir.is_dir():
        raise DatasetError(f"{out_dir}: not a cancelbench dataset (no {RECORDS_DIR}/ directory)")
    check_schema_version(out_dir)
    return live_files(rdir)


def open_dataset(out_dir: Path) -> ds.Dataset:
    """Open a results directory as a pyarrow dataset with the record schema (its live files)."""
    return ds.dataset([str(f) for f in record_files(out_dir)], schema=RECORD_SCHEMA, format="parquet",
                      partitioning=partitioning(), partition_base_dir=str(records_dir(out_dir)))


def read_table(out_dir: Path, columns: list[str] | None = None, filter: ds.Expression | None = None,
               tries: int = 5) -> pa.Table:
    """Read records as a pyarrow table. A file that vanished between the listing and the read
    (a compaction finishing in another process) means: list again and reread."""
    for _ in range(tries - 1):
        with contextlib.suppress(FileNotFoundError):
            return open_dataset(out_dir).to_table(columns=columns, filter=filter)
    return open_dataset(out_dir).to_table(columns=columns, filter=filter)


def read_manifest(out_dir: Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.exists() and not path.is_symlink():
        if records_dir(out_dir).is_dir():
            raise DatasetError(f"{out_dir} holds records/ but no {MANIFEST} (deleted?); they cannot be resumed or "
                               f"reported without it: restore {MANIFEST}, or move {records_dir(out_dir)} away (or "
                               "choose another --out) to start a new sweep")
        raise DatasetError(f"{out_dir}: not a cancelbench dataset (no {MANIFEST})")
    manifest = load_json_object(path, "manifest", MAX_MANIFEST_BYTES, DatasetError)
    for key, kind in (("status", str), ("planned_trials", int), ("not_run", list), ("config", dict)):
        if key in manifest and manifest[key] is not None and not isinstance(manifest[key], kind):
            raise DatasetError(f"{path}: manifest field {key!r} has the wrong type ({manifest[key]!r})")
    return manifest


def check_schema_version(out_dir: Path) -> int:
    path = Path(out_dir) / MANIFEST
    version = read_manifest(out_dir).get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise DatasetError(f"{path}: manifest has no valid schema_version (a positive integer), got {version!r}")
    if version > SCHEMA_VERSION:
        raise DatasetError(
            f"{out_dir}: record schema version {version} is newer than this cancelbench "
            f"understands ({SCHEMA_VERSION}); upgrade cancelbench"
        )
    return version


def rows_to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in RECORD_SCHEMA.names} for r in rows], schema=RECORD_SCHEMA)


class SinkError(RuntimeError):
    """Records that could not be written as Parquet (they are kept in a JSON-lines file)."""


class RecordSink:
    """Buffers records and flushes them as new Parquet files (thread-safe).

    A flush happens when ``flush_every`` records are buffered, or when
    ``flush_seconds`` have passed since the last one: a timer thread checks that
    even when no record arrives. A failed flush keeps its rows buffered and is
    retried; :meth:`close` writes what Parquet still refuses to a JSON-lines file
    (``DIR/unwritten-*.jsonl``) and raises :class:`SinkError`, so no record taken
    is ever lost.

    A full disk (ENOSPC, EDQUOT) sets :attr:`disk_full`: the sweep takes no
    more trials, the sink stops retrying and keeps its rows in memory, and
    :meth:`close` writes them as JSON lines on another filesystem (``$TMPDIR``,
    then the home directory) and frees the space reserved at start
    (``.cancelbench.reserve``), so the manifest can still say ``incomplete``.
    """

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
        self.last_error: BaseException | None = None
        self._rejected: list[dict] = []  # rows the record schema cannot hold (written as JSON at close)
        self.disk_full = False
        records_dir(self.out_dir).mkdir(parents=True, exist_ok=True)
        self._reserve()
        self._closed = threading.Event()
        self._timer = threading.Thread(target=self._tick, name="record-sink-timer", daemon=True)
        self._timer.start()

    def _reserve(self) -> None:
        """Set real blocks aside (not a sparse file) for the manifest written after a full disk."""
        path = self.out_dir / RESERVE_FILE
        try:
            with open(path, "wb") as f:
                f.write(b"\0" * RESERVE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.unlink()
            if exc.errno in _FULL_ERRNOS:
                raise SinkError(f"{self.out_dir}: no space left for the records ({exc.strerror}); free space "
                                "and run the same command again (with --resume if the sweep had started)") from None
            raise

    def _release(self) -> None:
        with contextlib.suppress(OSError):
            (self.out_dir / RESERVE_FILE).unlink()

    def _tick(self) -> None:
        while not self._closed.wait(self.flush_seconds / 4):
            with self._lock:
                due = bool(self._buf) and time.monotonic() - self._last_flush >= self.flush_seconds
            if due:
                self.flush()

    def add(self, row: dict) -> None:
        with self._lock:
            self._buf.append(row)
            due = len(self._buf) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds
        if due:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows. Rows whose write fails stay buffered (retried on the next
        flush, unless the disk is full); a row the schema cannot hold is set aside for :meth:`close`."""
        with self._lock:
            if self.disk_full:
                return  # kept in memory for close(): a retry would only fail again
            rows, self._buf = self._buf, []
            self._last_flush = time.monotonic()
            groups = list(_by_partition(rows).items())
            for n, (key, group) in enumerate(groups):
                try:
                    self._write_group(key, group)
                except Exception as exc:  # disk full, a value the schema cannot hold...
                    self.last_error = exc
                    if _is_disk_full(exc):
                        self.disk_full = True
                        self._buf[:0] = [r for _, g in groups[n:] for r in g]
                        return
                    self._buf[:0] = self._set_aside_bad_rows(key, group)

    def _set_aside_bad_rows(self, key: tuple[str, ...], group: list[dict]) -> list[dict]:
        """After a failed write: rows that cannot become a table go to ``_rejected``; the
        others are written now if that was the cause, else returned to be buffered."""
        good = []
        for r in group:
            try:
                _file_table([r])
                good.append(r)
            except Exception as exc:
                self.last_error = exc
                self._rejected.append(r)
        if good and len(good) < len(group):
            try:
                self._write_group(key, good)
                return []
            except Exception as exc:
                self.last_error = exc
        return good

    def _write_group(self, key: tuple[str, ...], group: list[dict]) -> None:
        part_dir = records_dir(self.out_dir).joinpath(*(f"{c}={v}" for c, v in zip(PARTITION_COLUMNS, key)))
        part_dir.mkdir(parents=True, exist_ok=True)
        table = _file_table(group)
        name = f"part-{self._writer_id}-{self._seq:06d}.parquet"
        self._seq += 1
        write_atomic(part_dir / name, lambda tmp: pq.write_table(table, tmp))
        self.written += len(group)

    def close(self) -> None:
        """Flush everything; what Parquet still refuses is kept as JSON lines and reported."""
        self._closed.set()
        if self._timer is not threading.current_thread():
            self._timer.join()
        self.flush()
        with self._lock:  # a last try for what failed (or arrived) since: the rest is kept as JSON lines
            rows, unwritten, self._buf, self._rejected = self._buf, self._rejected, [], []
            if self.disk_full:
                unwritten.extend(rows)
                rows = []
            for key, group in _by_partition(rows).items():
                try:
                    self._write_group(key, group)
                except Exception as exc:
                    self.last_error = exc
                    self.disk_full = self.disk_full or _is_disk_full(exc)
                    unwritten.extend(group)
        if not unwritten:
            self._release()
            return
        text = "".join(json.dumps(r, default=str) + "\n" for r in unwritten)
        path, tried = self._write_fallback(text)
        self._release()  # the manifest's write needs the reserved space now
        error = " ".join(str(self.last_error).split())
        if path is None:
            raise SinkError(f"{len(unwritten)} record(s) could not be written anywhere ({error}; tried "
                            f"{', '.join(tried)}); their trials run again on --resume")
        if self.disk_full:
            raise SinkError(f"no space left in {self.out_dir}: {self.written} record(s) written there, the "
                            f"other {len(unwritten)} kept in {path}; no more trials were taken. Free space, then "
                            "run the same command with --resume (their trials run again)")
        raise SinkError(f"{len(unwritten)} record(s) could not be written as Parquet ({error}); "
                        f"they are kept in {path}")

    def _write_fallback(self, text: str) -> tuple[Path | None, list[str]]:
        """Write the unwritten records as JSON lines: next to the dataset, or after a full disk on
        another filesystem ($TMPDIR, then the home directory). Returns (path or None, places tried)."""
        name = f"cancelbench-unwritten-{sanitize_path_part(self.out_dir.resolve().name)}-{self._writer_id}.jsonl"
        places = [self.out_dir / f"unwritten-{self._writer_id}.jsonl"]
        if self.disk_full:
            try:
                own = os.stat(self.out_dir).st_dev
            except OSError:
                own = None
            places = []
            for d in (os.environ.get("TMPDIR") or "/tmp", os.path.expanduser("~")):
                with contextlib.suppress(OSError):
                    if Path(d).is_dir() and os.stat(d).st_dev != own:
                        places.append(Path(d) / name)
            places.append(self.out_dir / f"unwritten-{self._writer_id}.jsonl")  # last: the same full disk
        tried = []
        for path in places:
            tried.append(str(path))
            try:
                write_atomic(path, lambda tmp: tmp.write_text(text))
                return path, tried
            except OSError as exc:
                self.last_error = self.last_error or exc
        return None, tried


def _is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT, raised as OSError or wrapped by pyarrow (which keeps only the message)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        text = str(exc)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _by_partition(rows: list[dict]) -> dict[tuple[str, ...], list[dict]]:
    groups: dict[tuple[str, ...], list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(sanitize_path_part(r.get(c)) for c in PARTITION_COLUMNS), []).append(r)
    return groups


def _file_table(rows: list[dict]) -> pa.Table:
    return rows_to_table(rows).select(FILE_SCHEMA.names).cast(FILE_SCHEMA)


def _column_on_disk(out_dir: Path, column: str) -> list:
    """One column of every record on disk ([] when there are none); a damaged file is a DatasetError."""
    rdir = records_dir(out_dir)
    if not rdir.is_dir() or not any(rdir.rglob("*.parquet")):
        return []
    try:
        return read_table(out_dir, columns=[column]).column(column).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{out_dir}: unreadable records ({' '.join(str(exc).split())[:300]}); "
                           "move the damaged file away, its trials then run again on --resume") from None


def completed_trial_ids(out_dir: Path) -> set[str]:
    """Trial ids already on disk (any outcome): a resumed sweep skips them."""
    return set(_column_on_disk(out_dir, "trial_id"))


def read_records(out_dir: Path, columns: list[str] | None = None):
    """Read records as a pandas DataFrame (only the requested columns)."""
    return read_table(out_dir, columns=columns).to_pandas()


def outcome_counts(out_dir: Path) -> collections.Counter:
    """Outcomes of the records on disk (a resumed sweep's exit code counts them too)."""
    return collections.Counter(_column_on_disk(out_dir, "outcome"))


def partial_reason(out_dir: Path) -> str | None:
    """Why a dataset holds only part of its plan (None when its sweep completed)."""
    manifest = read_manifest(out_dir)
    status = manifest.get("status")
    if status not in ("interrupted", "running", "incomplete"):
        return None  # complete (or a dataset written without a status)
    planned = manifest.get("planned_trials")
    on_disk = len(_column_on_disk(out_dir, "trial_id"))
    why = {"interrupted": "the sweep was interrupted (use --resume)",
           "running": "its sweep is still running, or its driver died (use --resume)",
           "incomplete": f"{len(manifest.get('not_run') or [])} trial(s) could not run"}[status]
    return f"{out_dir}: partial dataset, {on_disk} of {planned} planned trials on disk; {why}"

