"""Compaction: at the end of a sweep each partition's small files become one.

The sink writes a new small file per flush (every 16 records, or 2 s after
the last flush, for crash safety), so a sweep of slow trials leaves about one
file per record. When the sweep ends -- complete, interrupted or resumed --
:func:`compact` rewrites each partition's files into one.

The crash-safety rule, kept here and nowhere else: a compacted file
(``part-*-compacted.parquet``) names the files it replaces in its own Parquet
footer (key ``cancelbench_compacted_from``) and appears by one rename, after
its bytes are on disk. A file named by a compacted file in the same directory
is *superseded*: :func:`live_files` leaves it out and :func:`recover` deletes
it. So before the rename readers see the small files, after it the compacted
one, and a driver killed anywhere in between loses and duplicates nothing --
no journal to keep in step. Temporary files (``.*.tmp``, hidden) are never
read; :func:`recover` removes those a killed writer left.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import failpoints
from .schema import FILE_SCHEMA

COMPACTED_SUFFIX = "-compacted.parquet"
COMPACTED_FROM = b"cancelbench_compacted_from"
SORT_KEYS = [("trial_index", "ascending"), ("trial_id", "ascending")]  # plan order, whatever the flush order
PAUSE_MARKER = ".compact-paused"
STEPS = ("written", "committed", "removing")


def _partition_listing(rdir: Path) -> dict[Path, frozenset[str]]:
    """Visible Parquet file names of every directory under ``rdir`` that holds any."""
    out: dict[Path, set[str]] = {}
    for path in rdir.rglob("*.parquet"):
        if not path.name.startswith((".", "_")):  # pyarrow's own rule for hidden files
            out.setdefault(path.parent, set()).add(path.name)
    return {d: frozenset(names) for d, names in out.items()}


def compacted_from(path: Path) -> list[str]:
    """The file names a compacted file replaces (its footer); [] for any other file."""
    if not path.name.endswith(COMPACTED_SUFFIX):
        return []
    metadata = pq.read_schema(path).metadata or {}
    try:
        names = json.loads(metadata.get(COMPACTED_FROM, b"[]"))
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        # an ArrowInvalid, so every reader reports it as the damaged record file it is
        raise pa.ArrowInvalid(f"{path}: its footer key {COMPACTED_FROM.decode()} is not a list of file names")
    return names


def _superseded(part: Path, names: frozenset[str]) -> set[str]:
    """Names in ``names`` that a compacted file among them replaces. The union over every
    compacted file present, so a compaction of a compacted file is covered too."""
    return {n for name in names for n in compacted_from(part / name)} & names


def live_files(rdir: Path, tries: int = 50) -> list[Path]:
    """Every record file to read, each record once: the visible files minus the superseded ones.

    Reads nothing but listings and the footers of compacted files. The listing is taken
    until two in a row agree, so a compaction running meanwhile (another process) cannot
    make one listing miss both a new compacted file and the sources it replaced.
    """
    rdir = Path(rdir)
    before = None
    for _ in range(tries):
        try:
            listing = _partition_listing(rdir)
            files = sorted(part / n for part, names in listing.items() for n in names - _superseded(part, names))
        except FileNotFoundError:  # a compacted file replaced meanwhile: list again
            before = None
            continue
        if listing == before:
            return files
        before = listing
    raise OSError(f"{rdir}: the record files kept changing while being listed")


def recover(rdir: Path) -> int:
    """Finish what a killed compaction or flush left: delete superseded files (roll forward)
    and temporary files (roll back). Only under the sweep lock; returns files deleted."""
    removed = 0
    for path in Path(rdir).rglob(".*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    for part, names in _partition_listing(Path(rdir)).items():
        for name in sorted(_superseded(part, names)):
            with contextlib.suppress(FileNotFoundError):
                (part / name).unlink()
                removed += 1
        _fsync_dir(part)
    return removed


def compact(rdir: Path) -> tuple[int, int]:
    """Rewrite every partition holding more than one record file into one (after :func:`recover`).
    Only under the sweep lock. Returns (files before, files after)."""
    rdir = Path(rdir)
    recover(rdir)
    before = after = 0
    for part, names in sorted(_partition_listing(rdir).items()):
        before += len(names)
        after += 1
        if len(names) > 1:
            _compact_partition(part, sorted(names))
    return before, after


def _compact_partition(part: Path, names: list[str]) -> None:
    table = pa.concat_tables([pq.read_table(part / n, schema=FILE_SCHEMA) for n in names]).sort_by(SORT_KEYS)
    metadata = {**(table.schema.metadata or {}), COMPACTED_FROM: json.dumps(names).encode()}
    table = table.replace_schema_metadata(metadata)
    final = part / f"part-{uuid.uuid4().hex[:12]}{COMPACTED_SUFFIX}"
    tmp = part / f".{final.name}.tmp"
    try:
        pq.write_table(table, tmp)
        _fsync(tmp)  # the bytes are on disk before the rename can make the sources superseded
        _pause("written", part)
        os.replace(tmp, final)  # the commit: from here the sources are superseded
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(part)  # the rename is durable before any source goes
    _pause("committed", part)
    for n, name in enumerate(names):
        with contextlib.suppress(FileNotFoundError):
            (part / name).unlink()
        if n == 0:
            _pause("removing", part)
    _fsync_dir(part)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        _fsync(path)


_paused: set[str] = set()


def _pause(step: str, part: Path) -> None:
    """Failpoint (cancelbench.failpoints.compact_pause): the first time compaction reaches
    that step, write ``.compact-paused`` (the step's name) in the partition directory and
    wait to be killed, so a test can SIGKILL the driver at exactly that point."""
    if failpoints.compact_pause() != step or step in _paused:
        return
    _paused.add(step)
    (part / PAUSE_MARKER).write_text(step)
    while True:
        time.sleep(1)
