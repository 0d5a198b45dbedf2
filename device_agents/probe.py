"""Platform probe: metadata collected once per agent and carried on every row."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from cancelbench import __version__ as cancelbench_version

from .ggml_devices import cpu_model, llama_cpp_build_info

# What a trend groups sweeps by: the build the agent actually loaded and the host it ran on
# (record columns of the same names; see cancelbench.schema).
AGENT_BUILD_COLUMNS = ("cancelbench_git_describe", "llama_cpp_commit", "ggml_version", "ggml_backends",
                       "os_release", "kernel_version", "gpu_driver_version")


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


@lru_cache(maxsize=1)
def ggml_facts() -> dict:
    """llama.cpp commit, ggml version and the backends registered in this process."""
    out: dict = {}
    try:
        from .ggml_devices import _ggml, _s, llama_cpp_build_details, llama_cpp_lib_dir

        details = llama_cpp_build_details()
        out["llama_cpp_commit"] = details.get("ggml_commit") or None
        out["ggml_version"] = details.get("ggml_version") or None
        g = _ggml(str(llama_cpp_lib_dir()))
        names = [_s(g.reg_name(g.reg_get(i))) for i in range(g.reg_count())]
        out["ggml_backends"] = ",".join(n for n in names if n) or None
    except Exception:  # optional metadata: never fail an agent on it
        pass
    return out


def os_release() -> str | None:
    """``PRETTY_NAME`` of /etc/os-release on Linux, ``macOS <version>`` on macOS."""
    system = platform.system()
    if system == "Darwin":
        return f"macOS {platform.mac_ver()[0]}".strip()
    if system == "Linux":
        for path in ("/etc/os-release", "/usr/lib/os-release"):
            try:
                for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
                    key, _, value = line.partition("=")
                    if key == "PRETTY_NAME":
                        return value.strip().strip('"') or None
            except OSError:
                continue
        return None
    return platform.platform(terse=True) or None


def gpu_driver_version(device_id: str) -> str | None:
    """The driver of the agent's device: the Vulkan ``driverVersion`` of the physical device
    (``vulkan:N`` is physical index N), the NVIDIA kernel module for CUDA; None on CPU (and
    Metal, whose driver is the OS: ``os_release``)."""
    backend, _, index = device_id.partition(":")
    try:
        if backend == "vulkan":
            from .ggml_devices import vulkan_physical_devices

            phys = {d["index"]: d for d in vulkan_physical_devices()}.get(int(index or 0))
            if phys:
                return f"{phys['driver_version']} (Vulkan {phys['api_version']})"
        elif backend == "cuda":
            text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8", errors="replace")
            for word in text.split():
                if word[:1].isdigit() and word.count(".") >= 1:
                    return f"NVIDIA {word}"
    except (OSError, ValueError):
        pass
    return None


@lru_cache(maxsize=1)
def git_describe() -> str | None:
    """``git describe --always --dirty --tags`` of the source tree this cancelbench runs from
    (an editable install in a git checkout); None for an installed wheel."""
    src = Path(__file__).resolve().parent.parent
    if not (src / ".git").exists():
        return None
    try:
        proc = subprocess.run(["git", "-C", str(src), "describe", "--always", "--dirty", "--tags"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


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
        "cancelbench_git_describe": git_describe(),
        "llama_cpp_commit": None, "ggml_version": None, "ggml_backends": None,
        **(ggml_facts() if with_llama else {}),
        "os_release": os_release(),
        "kernel_version": platform.release() or None,
        "gpu_driver_version": gpu_driver_version(device_id),
        "pid": os.getpid(),
        "agent_niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "agent_switch_interval_us": round(sys.getswitchinterval() * 1e6, 3),
    }
