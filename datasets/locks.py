"""Model locks: (name, size, sha256, source) verified before any model is loaded.

A lock file is JSON: ``{"name": ..., "files": {"<file name>": {"size": int,
"sha256": hex, "source": text}}}``. Fixture locks are committed next to this
module (``locks/``) so a changed recipe or a truncated file is caught; a user
writes one for real models (docs/cli.md, "`fixtures` and `lock`: models").
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cancelbench.fileio import write_json_atomic
from cancelbench.inputs import MAX_LOCK_BYTES, load_json_object, regular_file

LOCKS_DIR = Path(__file__).resolve().parent / "locks"


class LockError(ValueError):
    """A model file that does not match its lock (or has none)."""


@dataclass(frozen=True)
class FileLock:
    name: str
    size: int
    sha256: str
    source: str = ""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def load_lock(lock_path: Path) -> dict[str, FileLock]:
    """The entries of a lock file: a bounded regular JSON file, every field type-checked."""
    data = load_json_object(Path(lock_path), "lock file", MAX_LOCK_BYTES, LockError)
    files = data.get("files")
    if not isinstance(files, dict):
        raise LockError(f"{lock_path}: malformed lock file ('files' must be an object of file name -> "
                        f"{{size, sha256, source}}, got {files!r:.60})")
    out = {}
    for name, v in files.items():
        where = f"{lock_path}: malformed lock file (files.{name}"
        if not isinstance(v, dict):
            raise LockError(f"{where} must be an object)")
        size = v.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise LockError(f"{where}.size must be an integer >= 0, got {size!r})")
        sha = v.get("sha256")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", sha):
            raise LockError(f"{where}.sha256 must be 64 hex digits, got {sha!r:.80})")
        source = v.get("source", "")
        if not isinstance(source, str):
            raise LockError(f"{where}.source must be a string)")
        out[name] = FileLock(name, size, sha.lower(), source)
    return out


# Verified (path, size, mtime_ns) -> sha256, so a model is hashed once per process.
_verified: dict[tuple[str, int, int], str] = {}


def check_size(path: Path, lock: FileLock) -> os.stat_result:
    """The cheap half of :func:`verify_file` (exists, size), for a check before Ray starts."""
    path = regular_file(Path(path), "model file", LockError)  # not a directory, device or FIFO
    st = path.stat()
    if st.st_size != lock.size:
        raise LockError(f"{path}: size {st.st_size} does not match lock {lock.size} "
                        f"(truncated or a different file; lock sha256 {lock.sha256[:12]}…)")
    return st


def verify_file(path: Path, lock: FileLock) -> str:
    """Check size then sha256 of ``path`` against ``lock``; returns the sha256."""
    path = Path(path)
    st = check_size(path, lock)
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    digest = _verified.get(key) or sha256_file(path)
    if digest != lock.sha256:
        raise LockError(f"{path}: sha256 {digest[:12]}… does not match lock {lock.sha256[:12]}…")
    _verified[key] = digest
    return digest


def verify_against(path: Path, lock_path: Path) -> str:
    """Verify ``path`` against the entry with its file name in ``lock_path``."""
    locks = load_lock(lock_path)
    name = Path(path).name
    if name not in locks:
        raise LockError(f"{lock_path}: no entry for {name} (entries: {', '.join(sorted(locks)) or 'none'})")
    return verify_file(path, locks[name])


def write_lock(lock_path: Path, name: str, files: dict[str, Path], source: str) -> None:
    payload = {"name": name, "files": {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p), "source": source} for p in files.values()}}
    write_json_atomic(Path(lock_path), payload)
