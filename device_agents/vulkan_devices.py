"""Vulkan physical devices straight from the Vulkan loader, independent of ggml.

Standard library only (ctypes), like its sibling ``ggml_devices.py``, which loads
it by path when that one runs as a script.
"""

from __future__ import annotations

import ctypes
import sys


def _s(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b else ""


class VkInstanceCreateInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.c_void_p), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


class VkPhysicalDevicePropertiesHead(ctypes.Structure):
    # leading members of VkPhysicalDeviceProperties; the buffer the caller passes is large
    # enough for the whole struct (limits + sparse properties, < 1 KiB)
    _fields_ = [("apiVersion", ctypes.c_uint32), ("driverVersion", ctypes.c_uint32),
                ("vendorID", ctypes.c_uint32), ("deviceID", ctypes.c_uint32),
                ("deviceType", ctypes.c_int), ("deviceName", ctypes.c_char * 256)]


_VK_TYPES = {0: "other", 1: "igpu", 2: "gpu", 3: "virtual", 4: "cpu"}


def vk_version(v: int) -> str:
    """A VK_MAKE_API_VERSION number as major.minor.patch."""
    return f"{(v >> 22) & 0x7F}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def vk_driver_version(vendor_id: int, v: int) -> str:
    """``driverVersion`` is vendor-encoded: NVIDIA packs 10.8.8.6 bits, Intel on Windows 18.14;
    Mesa and most others use the API version encoding."""
    if vendor_id == 0x10DE:
        return f"{(v >> 22) & 0x3FF}.{(v >> 14) & 0xFF}.{(v >> 6) & 0xFF}.{v & 0x3F}"
    if vendor_id == 0x8086 and sys.platform == "win32":
        return f"{v >> 14}.{v & 0x3FFF}"
    return vk_version(v)


def vulkan_physical_devices() -> list[dict]:
    """Physical Vulkan devices straight from the loader (``vkEnumeratePhysicalDevices``):
    ``[{index, name, vk_type}]`` in the order ``GGML_VK_VISIBLE_DEVICES`` indexes.
    Empty when there is no Vulkan loader or no driver. Independent of ggml."""
    names = ("libvulkan.so.1", "libvulkan.so", "libvulkan.1.dylib", "libMoltenVK.dylib", "vulkan-1.dll")
    vk = None
    for n in names:
        try:
            vk = ctypes.CDLL(n)
            break
        except OSError:
            continue
    if vk is None:
        return []

    create = vk.vkCreateInstance
    create.restype, create.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    enum = vk.vkEnumeratePhysicalDevices
    enum.restype, enum.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32),
                                                 ctypes.c_void_p]
    props_fn = vk.vkGetPhysicalDeviceProperties
    props_fn.restype, props_fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p]
    destroy = vk.vkDestroyInstance
    destroy.restype, destroy.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p]

    info = VkInstanceCreateInfo(sType=1)  # VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
    inst = ctypes.c_void_p()
    if create(ctypes.byref(info), None, ctypes.byref(inst)) != 0:
        return []
    try:
        count = ctypes.c_uint32(0)
        if enum(inst, ctypes.byref(count), None) != 0 or count.value == 0:
            return []
        handles = (ctypes.c_void_p * count.value)()
        if enum(inst, ctypes.byref(count), handles) not in (0, 5):  # VK_SUCCESS, VK_INCOMPLETE
            return []
        out = []
        for i in range(count.value):
            buf = ctypes.create_string_buffer(4096)
            props_fn(handles[i], buf)
            head = VkPhysicalDevicePropertiesHead.from_buffer(buf)
            out.append({"index": i, "name": _s(head.deviceName),
                        "vk_type": _VK_TYPES.get(head.deviceType, "other"),
                        "driver_version": vk_driver_version(head.vendorID, head.driverVersion),
                        "api_version": vk_version(head.apiVersion)})
        return out
    finally:
        destroy(inst, None)
