"""The build and host facts an agent carries on every record (what ``trend`` groups by):
where they live in the schema, that the agent's meta columns include them, and the
decoders behind them.  A real sweep's values are checked in tests/test_trend.py."""

from __future__ import annotations

from cancelbench import schema
from cancelbench.device_agents import probe
from cancelbench.device_agents.ggml_devices import vk_driver_version, vk_version


def test_columns_are_one_block_after_cancelbench_version_and_agent_owned():
    names = list(schema.COLUMNS)
    at = names.index("cancelbench_version") + 1
    assert tuple(names[at:at + len(probe.AGENT_BUILD_COLUMNS)]) == probe.AGENT_BUILD_COLUMNS
    assert set(probe.AGENT_BUILD_COLUMNS) <= schema.AGENT_COLUMNS
    schema.agent_half(**{c: "x" for c in probe.AGENT_BUILD_COLUMNS})  # the agent may fill them


def test_agent_meta_columns_carry_them():
    from cancelbench.device_agents.agent import DeviceAgent

    agent = DeviceAgent.__new__(DeviceAgent)  # no engine, no probe: only the column selection
    agent.meta = {c: f"v-{c}" for c in probe.AGENT_BUILD_COLUMNS}
    cols = agent._meta_columns()
    assert {c: cols[c] for c in probe.AGENT_BUILD_COLUMNS} == agent.meta


def test_probe_host_fills_what_this_host_has():
    meta = probe.probe_host("cpu:0")
    for key in ("llama_cpp_commit", "ggml_version", "ggml_backends", "kernel_version"):
        assert meta[key], key
    assert "CPU" in meta["ggml_backends"].split(",")
    assert meta["gpu_driver_version"] is None  # a CPU device has no GPU driver


def test_vulkan_driver_versions_decode_per_vendor():
    assert vk_version((1 << 22) | (3 << 12) | 278) == "1.3.278"
    nvidia = (535 << 22) | (104 << 14) | (5 << 6)
    assert vk_driver_version(0x10DE, nvidia) == "535.104.5.0"
    mesa = (24 << 22) | (2 << 12) | 8
    assert vk_driver_version(0x1002, mesa) == "24.2.8"


def test_os_release_reads_pretty_name(monkeypatch, tmp_path):
    import platform
    from pathlib import Path

    release = tmp_path / "os-release"
    release.write_text('NAME="Debian GNU/Linux"\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n', encoding="utf-8")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: real(release if str(self) == "/etc/os-release"
                                                                      else self, *a, **k))
    assert probe.os_release() == "Debian GNU/Linux 12 (bookworm)"
