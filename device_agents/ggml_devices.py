"""ggml devices through ctypes: what the installed llama-cpp-python wheel can run on.

llama-cpp-python does not bind the ``ggml_backend_dev_*`` / ``ggml_backend_reg_*``
registry API, so it is declared here with ctypes against the ggml libraries that
ship inside the installed ``llama_cpp`` package (``llama_cpp/lib/libggml.so``,
``libggml-base.so``; ``LLAMA_CPP_LIB_PATH`` overrides the folder, as it does for
llama_cpp itself).

Device ids are ``<backend>:<index>``:

* ``cpu:0`` — always present (the ggml CPU backend).
* ``vulkan:N`` — N is the *physical* Vulkan device index (the order of
  ``vkEnumeratePhysicalDevices``, the index ``GGML_VK_VISIBLE_DEVICES`` takes).
  ggml-vulkan reads ``GGML_VK_VISIBLE_DEVICES`` once, when its registry is first
  touched; without it, it lists only discrete/integrated GPUs (a CPU-type device
  such as Mesa's lavapipe/llvmpipe is ignored); set to the empty string, it lists
  none. The probe therefore runs in a process whose environment is already
  final: use :func:`probe_devices_subprocess` from a process that must not
  initialise ggml-vulkan itself.
* ``cuda:N`` — N is the CUDA ordinal as seen without ``CUDA_VISIBLE_DEVICES``
  when the probe's own environment does not restrict it.
* ``metal:0`` — the Apple GPU.

This module imports only the standard library, so it can also run as a script
(``python device_agents/ggml_devices.py`` prints the probe as JSON); the
subprocess probe in ``backends.py`` runs it that way, and then it loads its one
sibling, ``vulkan_devices.py`` (the Vulkan loader's view), by path. Device ids,
per-device environments and the subprocess probe live in ``backends.py``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, Mapping

# The one home of the backend list (this file also runs as a stdlib-only script,
# so it cannot import it): the registry, config and agents command import it from
# here; the Makefile's LLAMA_VARIANT and native/build_llama_wheel.sh name the same four.
BACKENDS: tuple[str, ...] = ("cpu", "vulkan", "metal", "cuda")

BackendName = Literal["cpu", "vulkan", "metal", "cuda"]
DeviceType = Literal["cpu", "gpu", "igpu", "accel"]

# ggml registry name (ggml_backend_reg_name) -> our backend name.
# Registries we do not benchmark (BLAS, RPC, ...) are left out of the probe.
_REG_TO_BACKEND: dict[str, str] = {
    "cpu": "cpu",
    "vulkan": "vulkan",
    "metal": "metal",
    "mtl": "metal",
    "cuda": "cuda",
}

# enum ggml_backend_dev_type (ggml-backend.h); META (4) wraps other devices and is skipped
_DEV_TYPES: dict[int, str] = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}
_DEV_TYPE_META = 4

# shared-library name of each ggml backend inside llama_cpp/lib (for which_wheel_variant)
_VARIANT_LIBS: tuple[tuple[str, str], ...] = (
    ("cuda", "ggml-cuda"),
    ("metal", "ggml-metal"),
    ("vulkan", "ggml-vulkan"),
)


class BackendProbeError(RuntimeError):
    """The ggml libraries could not be found/loaded or a probe subprocess failed."""


@dataclass(frozen=True)
class BackendDevice:
    backend: BackendName
    index: int
    device_id: str  # "<backend>:<index>", e.g. "vulkan:0"
    name: str  # ggml device name, e.g. "CPU", "Vulkan0"
    description: str  # e.g. CPU model, "llvmpipe (LLVM 15.0.6, 256 bits)"
    type: DeviceType
    memory_total: int  # bytes, as ggml reports it (host RAM for the CPU device)
    memory_free: int = 0
    registry: str = ""  # raw ggml_backend_reg_name

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "BackendDevice":
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in fields})


# --------------------------------------------------------------------------- library location

def llama_cpp_lib_dir() -> Path:
    """Folder holding libllama/libggml of the llama_cpp package this interpreter would import."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llama_cpp")  # does not execute llama_cpp/__init__
    if spec is None or not spec.origin:
        raise BackendProbeError("llama_cpp (llama-cpp-python) is not installed for " + sys.executable)
    return Path(spec.origin).resolve().parent / "lib"


def _shared_lib(lib_dir: Path, base: str) -> Path | None:
    for suffix in (".so", ".dylib", ".dll"):
        for name in (f"lib{base}{suffix}", f"{base}{suffix}"):
            p = lib_dir / name
            if p.exists():
                return p
    return None


def which_wheel_variant(lib_dir: Path | None = None) -> str:
    """Which backend variant of llama-cpp-python is installed: cpu | vulkan | metal | cuda.

    Decided from the backend libraries shipped in ``llama_cpp/lib`` (the wheel
    file name is the same for every variant), without loading them.
    """
    lib_dir = lib_dir or llama_cpp_lib_dir()
    for variant, base in _VARIANT_LIBS:
        if _shared_lib(lib_dir, base) is not None:
            return variant
    return "cpu"


# --------------------------------------------------------------------------- ctypes declarations

class _Ggml:
    """ctypes view of the ggml backend registry API (ggml-backend.h)."""

    def __init__(self, lib_dir: Path):
        mode = getattr(ctypes, "RTLD_GLOBAL", 0)
        base_path = _shared_lib(lib_dir, "ggml-base")
        ggml_path = _shared_lib(lib_dir, "ggml")
        if ggml_path is None:
            raise BackendProbeError(f"libggml not found in {lib_dir}")
        # libggml-base first: libggml (the registry) depends on it
        self.base = ctypes.CDLL(str(base_path), mode=mode) if base_path else None
        self.ggml = ctypes.CDLL(str(ggml_path), mode=mode)
        self.lib_dir = lib_dir
        vp, sz, cs = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p

        def fn(name: str, restype, argtypes):
            for lib in (self.ggml, self.base):
                if lib is not None and hasattr(lib, name):
                    f = getattr(lib, name)
                    f.restype, f.argtypes = restype, argtypes
                    return f
            raise BackendProbeError(f"symbol {name} not found in {ggml_path} / {base_path}")

        def opt(name: str, restype, argtypes):
            try:
                return fn(name, restype, argtypes)
            except BackendProbeError:
                return None

        # registry (libggml)
        self.load_all_from_path = opt("ggml_backend_load_all_from_path", None, [cs])
        self.load_all = opt("ggml_backend_load_all", None, [])
        self.reg_count = fn("ggml_backend_reg_count", sz, [])
        self.reg_get = fn("ggml_backend_reg_get", vp, [sz])
        self.dev_count = fn("ggml_backend_dev_count", sz, [])
        self.dev_get = fn("ggml_backend_dev_get", vp, [sz])
        # device/reg accessors (libggml-base)
        self.dev_name = fn("ggml_backend_dev_name", cs, [vp])
        self.dev_description = fn("ggml_backend_dev_description", cs, [vp])
        self.dev_type = fn("ggml_backend_dev_type", ctypes.c_int, [vp])
        self.dev_memory = fn("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])
        self.dev_backend_reg = fn("ggml_backend_dev_backend_reg", vp, [vp])
        self.reg_name = fn("ggml_backend_reg_name", cs, [vp])
        self.version = opt("ggml_version", cs, [])
        self.commit = opt("ggml_commit", cs, [])

    def ensure_loaded(self) -> None:
        """Backends linked into libggml register themselves on first use; a wheel
        built with GGML_BACKEND_DL ships them as loadable modules instead."""
        if self.reg_count() == 0 or self.dev_count() == 0:
            if self.load_all_from_path is not None:
                self.load_all_from_path(str(self.lib_dir).encode())
            elif self.load_all is not None:
                self.load_all()


@lru_cache(maxsize=None)
def _ggml(lib_dir: str) -> _Ggml:
    g = _Ggml(Path(lib_dir))
    g.ensure_loaded()
    return g


def _s(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b else ""


# Vulkan physical devices: their own stdlib-only module (vulkan_devices.py), a sibling file
# this one loads by path when it runs as a script.
try:
    from .vulkan_devices import vk_driver_version, vk_version, vulkan_physical_devices  # noqa: F401
except ImportError:  # run by path (backends.py's subprocess probe): no package to import from
    _vk_spec = importlib.util.spec_from_file_location("cancelbench_vulkan_devices",
                                                      Path(__file__).with_name("vulkan_devices.py"))
    _vk = importlib.util.module_from_spec(_vk_spec)
    _vk_spec.loader.exec_module(_vk)
    vk_driver_version, vk_version, vulkan_physical_devices = (_vk.vk_driver_version, _vk.vk_version,
                                                              _vk.vulkan_physical_devices)


def _parse_index_list(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(t) for t in value.replace(",", " ").split()]
    except ValueError:
        return None


# --------------------------------------------------------------------------- probe

def probe_devices(lib_dir: Path | None = None) -> list[BackendDevice]:
    """Devices ggml sees *in this process* (its environment decides which; see module doc).

    ``cpu:0`` is always in the result. Registries other than CPU/Vulkan/Metal/CUDA are skipped.
    """
    lib_dir = lib_dir or llama_cpp_lib_dir()
    g = _ggml(str(lib_dir))
    vk_visible = _parse_index_list(os.environ.get("GGML_VK_VISIBLE_DEVICES"))
    cuda_visible = _parse_index_list(os.environ.get("CUDA_VISIBLE_DEVICES"))
    vk_physical: list[dict] | None = None
    per_backend: dict[str, int] = {}
    devices: list[BackendDevice] = []
    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        if not dev:
            continue
        reg = g.dev_backend_reg(dev)
        reg_name = _s(g.reg_name(reg)) if reg else ""
        backend = _REG_TO_BACKEND.get(reg_name.lower())
        dtype = g.dev_type(dev)
        if backend is None or dtype == _DEV_TYPE_META:
            continue
        k = per_backend.get(backend, 0)  # ggml's own per-backend ordinal ("Vulkan<k>")
        per_backend[backend] = k + 1
        name, desc = _s(g.dev_name(dev)), _s(g.dev_description(dev))
        index = k
        if backend == "vulkan":
            if vk_visible is not None and k < len(vk_visible):
                index = vk_visible[k]
            else:
                # default selection (GPUs only): recover the physical index by name
                if vk_physical is None:
                    vk_physical = vulkan_physical_devices()
                used = {d.index for d in devices if d.backend == "vulkan"}
                match = [p["index"] for p in vk_physical if p["name"] and p["name"] in desc
                         and p["index"] not in used]
                if match:
                    index = match[0]
        elif backend == "cuda" and cuda_visible is not None and k < len(cuda_visible):
            index = cuda_visible[k]
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        devices.append(BackendDevice(
            backend=backend,  # type: ignore[arg-type]
            index=index,
            device_id=f"{backend}:{index}",
            name=name,
            description=desc,
            type=_DEV_TYPES.get(dtype, "accel"),  # type: ignore[arg-type]
            memory_total=int(total.value),
            memory_free=int(free.value),
            registry=reg_name,
        ))
    if not any(d.backend == "cpu" for d in devices):
        # every llama.cpp build has the CPU backend; keep the contract even if the
        # registry hides it (e.g. a DL build that failed to load it)
        devices.append(BackendDevice("cpu", 0, "cpu:0", "CPU", cpu_model(), "cpu", _host_memory(), 0, ""))
    # stable order: cpu, vulkan, metal, cuda; then by index (ggml registers CPU last)
    devices.sort(key=lambda d: (BACKENDS.index(d.backend), d.index))
    return devices


def cpu_model() -> str:
    """The host's CPU model string (Linux /proc/cpuinfo, macOS sysctl)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                 text=True, timeout=5).stdout.strip()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or "unknown"


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def llama_cpp_build_details(lib_dir: Path | None = None) -> dict[str, str]:
    """Version facts of the installed llama.cpp build.

    What this llama.cpp exposes: ``llama_version()`` (e.g. "0.5.0-dev", libllama),
    ``ggml_version()``/``ggml_commit()`` (libggml-base; the commit is the
    ``git rev-parse --short`` of the vendored llama.cpp submodule, whose .git
    data the llama-cpp-python sdist ships, e.g. "0c1e570-dirty"; "unknown" when
    built outside git).
    ``LLAMA_BUILD_NUMBER``/``LLAMA_COMMIT`` live in llama.cpp's ``common`` library,
    which llama-cpp-python does not ship, so they are not available.
    """
    lib_dir = lib_dir or llama_cpp_lib_dir()
    out: dict[str, str] = {"variant": which_wheel_variant(lib_dir)}
    try:
        from importlib.metadata import version
        out["llama_cpp_python"] = version("llama_cpp_python")
    except Exception:
        pass
    try:
        g = _ggml(str(lib_dir))
        if g.version is not None:
            out["ggml_version"] = _s(g.version())
        if g.commit is not None:
            out["ggml_commit"] = _s(g.commit())
    except (OSError, BackendProbeError):
        pass
    llama_path = _shared_lib(lib_dir, "llama")
    if llama_path is not None:
        try:
            lib = ctypes.CDLL(str(llama_path), mode=getattr(ctypes, "RTLD_GLOBAL", 0))
            for sym, key in (("llama_version", "llama_version"), ("llama_print_system_info", "system_info")):
                if hasattr(lib, sym):
                    f = getattr(lib, sym)
                    f.restype, f.argtypes = ctypes.c_char_p, []
                    out[key] = _s(f()).strip()
        except OSError:
            pass
    return out


def llama_cpp_build_info(lib_dir: Path | None = None) -> str:
    """One-line build id, e.g. ``"llama.cpp 0.5.0-dev ggml 0.25.3 (0c1e570) vulkan"``."""
    d = llama_cpp_build_details(lib_dir)
    parts = []
    if "llama_version" in d:
        parts.append(f"llama.cpp {d['llama_version']}")
    if "ggml_version" in d:
        parts.append(f"ggml {d['ggml_version']}" + (f" ({d['ggml_commit']})" if d.get("ggml_commit") else ""))
    parts.append(d["variant"])
    return " ".join(parts)


# --------------------------------------------------------------------------- probe payload (script mode)

def _probe_payload() -> dict:
    try:
        lib_dir = llama_cpp_lib_dir()
        devices = [d.to_dict() for d in probe_devices(lib_dir)]
        return {"ok": True, "devices": devices, "build": llama_cpp_build_details(lib_dir),
                "lib_dir": str(lib_dir), "python": sys.executable,
                "env": {k: os.environ.get(k) for k in ("GGML_VK_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}}
    except Exception as e:  # reported to the parent, which raises
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    json.dump(_probe_payload(), sys.stdout, indent=2)
    sys.stdout.write("\n")
