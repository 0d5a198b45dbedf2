"""Platform probe: metadata collected once per agent and carried on every row."""

from __future__ import annotations

import os
import platform
import socket
from functools import lru_cache

from cancelbench import __version__ as cancelbench_version

from .ggml_devices import cpu_model, llama_cpp_build_info


@lru_cache(maxsize=1)
def llama_versions() -> tuple[str, str]:
    """(llama-cpp-python version, llama.cpp build id)."""
    import llama_cpp
    build = "unknown"
    try:
        build = llama_cpp_build_info()
    except Exception:  # backends probe is optional metadata; never fail a trial on it
        pass
    return llama_cpp.__version__, build


def probe_host(device_id: str = "cpu:0", device_name: str | None = None, n_threads: int | None = None,
               with_llama: bool = True) -> dict:
    """Host metadata; ``with_llama=False`` (a simulated device) leaves llama.cpp unloaded and its versions null."""
    lcp, build = llama_versions() if with_llama else (None, None)
    backend = device_id.split(":", 1)[0]
    return {
        "hostname": socket.gethostname(),
        "platform": platform.system().lower(),
        "arch": platform.machine(),
        "cpu_model": cpu_model(),
        "device": device_id,
        "backend": backend,
        "device_name": device_name or (cpu_model() if backend == "cpu" else device_id),
        "n_threads": n_threads or os.cpu_count() or 1,
        "llama_cpp_python_version": lcp,
        "llama_cpp_build": build,
        "cancelbench_version": cancelbench_version,
        "pid": os.getpid(),
    }
