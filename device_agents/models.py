"""Model resolution on the agent: fixtures are generated if missing, every file
is verified against its lock (size, sha256) and checked against its engine
(GGUF architecture, projector type) before llama.cpp sees it."""

from __future__ import annotations

from pathlib import Path

from cancelbench.datasets.locks import FileLock, LockError, verify_file

from .engines.registry import is_external
from .model_check import check_model

MODEL_KEYS = ("model", "mmproj")


def resolve_models(workload: dict) -> dict:
    """Return a copy of ``workload`` whose model paths are local, verified files.

    ``workload["locks"]`` maps file name -> {size, sha256, source}; the driver
    fills it from the lock file so an agent on another host needs no lock file.
    """
    from cancelbench.datasets.fixtures import ensure_fixture

    wl = dict(workload)
    locks = wl.get("locks") or {}
    for key in MODEL_KEYS:
        spec = wl.get(key)
        if not spec:
            continue
        if str(spec).startswith("fixture:"):
            path = ensure_fixture(str(spec).split(":", 1)[1], key)
        else:
            path = Path(spec).expanduser()
        entry = locks.get(path.name)
        if entry is None:
            raise LockError(f"no lock entry for {key} file {path.name}; add it to the workload's lock file")
        wl[key] = str(path)
        wl[f"{key}_sha256"] = verify_file(path, FileLock(path.name, int(entry["size"]), str(entry["sha256"]).lower(),
                                                         str(entry.get("source", ""))))
        if not is_external(wl.get("engine")):  # an external engine's models are its own business
            check_model(path, wl.get("engine", "text"), key)
    return wl
