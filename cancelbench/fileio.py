"""Atomic file writes: a temporary name in the target's directory, then one rename.

A reader (or a resumed sweep) sees either the old file or the whole new one,
never a partial write; a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` if the block succeeds."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to produce the file, then rename it onto ``path``."""
    with atomic_path(path) as tmp:
        write(tmp)
    return Path(path)


def write_json_atomic(path: Path, payload: object) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(
        json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n"))
