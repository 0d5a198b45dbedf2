"""Device ids, per-device process environments and the subprocess device probe.

Device ids are ``<backend>:<index>`` (see :mod:`.ggml_devices` for what each
index means). The probe itself runs in a fresh interpreter whose environment
is already final, because ggml-vulkan reads ``GGML_VK_VISIBLE_DEVICES`` once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from .ggml_devices import (BACKENDS, BackendDevice, BackendProbeError, llama_cpp_build_info,
                           probe_devices, vulkan_physical_devices, which_wheel_variant)

_SCRIPT = Path(__file__).resolve().parent / "ggml_devices.py"

# The ggml layer's public names are part of this module's API too.
__all__ = ["BACKENDS", "BackendDevice", "BackendProbeError", "backend_env", "devices_from_payload",
           "llama_cpp_build_info", "parse_device_id", "probe_all_devices", "probe_devices",
           "probe_devices_subprocess", "vulkan_physical_devices", "which_wheel_variant"]


# --------------------------------------------------------------------------- per-device process setup

def parse_device_id(device_id: str) -> tuple[str, int]:
    backend, sep, idx = device_id.partition(":")
    backend = backend.strip().lower()
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend in device id {device_id!r} (known: {', '.join(BACKENDS)})")
    try:
        index = int(idx) if sep else 0
    except ValueError:
        raise ValueError(f"bad device index in {device_id!r}") from None
    if index < 0:
        raise ValueError(f"bad device index in {device_id!r}")
    return backend, index


def backend_env(device_id: str) -> dict[str, str]:
    """Environment an agent process needs so that ggml sees exactly ``device_id``.

    Set these *before* llama_cpp/ggml is loaded in that process (ggml-vulkan reads
    ``GGML_VK_VISIBLE_DEVICES`` once, at registry init).

    * ``cpu:0``: ``GGML_VK_VISIBLE_DEVICES=""`` — set-but-empty makes ggml-vulkan
      select no device (unset would select every discrete/integrated GPU);
      ``CUDA_VISIBLE_DEVICES=""`` likewise hides CUDA devices. The Vulkan
      instance is still created (the loader scans its drivers); nothing runs on it.
    * ``vulkan:N``: ``GGML_VK_VISIBLE_DEVICES=N`` (physical index; also how a
      CPU-type device like lavapipe is made visible at all), CUDA hidden.
    * ``cuda:N``: ``CUDA_VISIBLE_DEVICES=N`` and Vulkan hidden.
    * ``metal:0``: nothing to set (one Apple GPU).
    """
    backend, index = parse_device_id(device_id)
    if backend == "cpu":
        return {"GGML_VK_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": ""}
    if backend == "vulkan":
        return {"GGML_VK_VISIBLE_DEVICES": str(index), "CUDA_VISIBLE_DEVICES": ""}
    if backend == "cuda":
        return {"CUDA_VISIBLE_DEVICES": str(index), "GGML_VK_VISIBLE_DEVICES": ""}
    return {}  # metal


# --------------------------------------------------------------------------- subprocess probe

_MARK = "CANCELBENCH_PROBE_JSON:"


def probe_devices_subprocess(env: Mapping[str, str | None] | None = None, *,
                             python: str | None = None, timeout: float = 120.0,
                             inherit_env: bool = True) -> dict:
    """Run :func:`probe_devices` in a fresh interpreter and return its JSON payload:
    ``{"ok", "devices": [BackendDevice dicts], "build", "lib_dir", "python", "env"}``.

    ``env`` is overlaid on this process's environment (``inherit_env``); a value of
    ``None`` removes the variable (e.g. ``{"GGML_VK_VISIBLE_DEVICES": None}``).
    Use ``PYTHONPATH``/``LLAMA_CPP_LIB_PATH`` in ``env`` to probe another install.
    Raises :class:`BackendProbeError` when the probe fails.
    """
    full = _overlay_env(env, inherit_env)
    code = ("import json, runpy, sys\n"
            f"m = runpy.run_path({str(_SCRIPT)!r})\n"
            f"sys.stdout.write({_MARK!r} + json.dumps(m['_probe_payload']()) + '\\n')\n")
    try:
        cp = subprocess.run([python or sys.executable, "-c", code], env=full, capture_output=True,
                            text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise BackendProbeError(f"device probe timed out after {timeout}s") from e
    line = next((ln for ln in cp.stdout.splitlines() if ln.startswith(_MARK)), None)
    if line is None:
        raise BackendProbeError(f"device probe exited {cp.returncode} without a result; "
                                f"stderr: {cp.stderr.strip()[-2000:]}")
    payload = json.loads(line[len(_MARK):])
    if not payload.get("ok"):
        raise BackendProbeError(f"device probe failed: {payload.get('error')}")
    payload["stderr"] = cp.stderr
    return payload


def devices_from_payload(payload: Mapping) -> list[BackendDevice]:
    return [BackendDevice.from_dict(d) for d in payload.get("devices", [])]


def probe_all_devices(env: Mapping[str, str | None] | None = None, *,
                      python: str | None = None, timeout: float = 120.0) -> list[BackendDevice]:
    """Every device an agent could be pointed at, each with its stable id.

    The CPU device and default-visible GPUs come from one probe with the caller's
    environment; every physical Vulkan device (CPU-type ones included) from a probe
    with ``GGML_VK_VISIBLE_DEVICES`` listing all of them. All probes run in
    subprocesses, so this process never initialises ggml-vulkan itself.
    """
    base = devices_from_payload(probe_devices_subprocess(env, python=python, timeout=timeout))
    n_vk = _vulkan_count_subprocess(env, python=python, timeout=timeout)
    out = [d for d in base if d.backend != "vulkan"]
    vk: dict[int, BackendDevice] = {d.index: d for d in base if d.backend == "vulkan"}
    if n_vk:
        env_all = dict(env or {})
        env_all["GGML_VK_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n_vk))
        try:
            for d in devices_from_payload(probe_devices_subprocess(env_all, python=python, timeout=timeout)):
                if d.backend == "vulkan":
                    vk.setdefault(d.index, d)
        except BackendProbeError:
            pass
    return out + [vk[i] for i in sorted(vk)]


def _overlay_env(env: Mapping[str, str | None] | None, inherit: bool = True) -> dict[str, str]:
    """This process's environment (if ``inherit``) with ``env`` on top; None values remove."""
    full = dict(os.environ) if inherit else {}
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return full


def _vulkan_count_subprocess(env, *, python, timeout) -> int:
    full = _overlay_env(env)
    code = ("import runpy\n"
            f"m = runpy.run_path({str(_SCRIPT)!r})\n"
            "print(len(m['vulkan_physical_devices']()))\n")
    try:
        cp = subprocess.run([python or sys.executable, "-c", code], env=full, capture_output=True,
                            text=True, timeout=timeout)
        return int(cp.stdout.strip().splitlines()[-1]) if cp.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


