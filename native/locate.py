"""Where the compiled cancel-token library is: next to the package (the package build,
setup.py), named by CANCELBENCH_NATIVE_LIB, or compiled from the sources next to this file
into a per-user cache (a copy of the package without its build products: a Ray job's
working_dir skips git-ignored files)."""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
LIB_BASENAME = "_cancelbench_native"
SOURCES = ("cancel_token.c", "cancel_token.h")


class NativeLibraryMissing(RuntimeError):
    """The compiled cancel-token library is not next to this module."""


def _built_library(directory: Path) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = directory / f"{LIB_BASENAME}{suffix}"
        if candidate.exists():
            return candidate
    return None


def _compile_into_cache() -> Path:
    """Build the library from the source next to this file into a per-user cache.

    A copy of the package without its build products (a Ray job's working_dir,
    which skips git-ignored files) still finds its native code this way.
    """
    import hashlib
    import shutil
    import subprocess
    import sys

    source = _HERE / "cancel_token.c"
    missing = [name for name in SOURCES if not (_HERE / name).exists()]
    if missing:
        raise NativeLibraryMissing(f"neither the compiled library nor {', '.join(missing)} in {_HERE} is available")
    digest = hashlib.sha256(b"".join((_HERE / name).read_bytes() for name in SOURCES)).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cancelbench"
    target = cache / f"{LIB_BASENAME}-{digest}{'.dylib' if sys.platform == 'darwin' else '.so'}"
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeLibraryMissing(f"{LIB_BASENAME} is not built and no C compiler was found; "
                                   "install the package (pip install -e .)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-std=gnu11", "-fPIC", "-shared", "-fvisibility=hidden", str(source), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise NativeLibraryMissing(f"compiling {source} failed: {result.stderr.strip()[-500:]}")
    os.replace(tmp, target)
    return target


def find_library() -> Path:
    override = os.environ.get("CANCELBENCH_NATIVE_LIB")
    if override:
        return Path(override)
    return _built_library(_HERE) or _compile_into_cache()
