"""Ray connection, device discovery and agent placement."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cancelbench.device_agents.agent import remote_agent_class

from .config import DeviceSelector

HOST_LABEL = "cancelbench.io/host"  # optional Ray node label naming the device host
BACKENDS_LABEL = "cancelbench.io/backends"  # optional: comma list the host offers, e.g. "cpu,vulkan"
AGENT_NAMESPACE = "cancelbench"


class ClusterError(RuntimeError):
    """The cluster cannot serve the sweep (no such backend, no nodes...)."""


@dataclass(frozen=True)
class DeviceSlot:
    """One agent to start: a device on a node."""

    node_id: str
    host: str  # node label or node address: the name shown in reports
    device_id: str  # cpu:0, vulkan:0, ...
    labels: dict = field(default_factory=dict, hash=False, compare=False)
    env: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def key(self) -> str:
        return f"{self.host}/{self.device_id}"

    @property
    def backend(self) -> str:
        return self.device_id.split(":", 1)[0]


def use_auth_mode(mode: str) -> None:
    """Set Ray's auth mode for this process and the Ray processes it starts.

    Ray caches the mode in its RayConfig when it is imported; re-initializing
    that config after changing the variable is what Ray itself does when it
    turns token auth on (ray._private.authentication.authentication_token_setup).
    Called where Ray is started or connected, never at import.
    """
    os.environ["RAY_AUTH_MODE"] = mode
    from ray._raylet import Config

    Config.initialize("")


def connect(address: str | None = None) -> None:
    """Connect to ``address``/RAY_ADDRESS, or start a local Ray bound to 127.0.0.1.

    Token authentication stays on: RAY_AUTH_MODE=token unless the caller chose a mode.
    """
    if ray.is_initialized():
        return
    use_auth_mode(os.environ.get("RAY_AUTH_MODE") or "token")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        host = address.split("://")[-1].rsplit(":", 1)[0]
        if host in ("127.0.0.1", "localhost"):
            _init_loopback(address)
        else:
            ray.init(address=address, namespace=AGENT_NAMESPACE, log_to_driver=True)
    else:
        # address="local": always a new instance, never another session's cluster.
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, namespace=AGENT_NAMESPACE,
                 log_to_driver=True, configure_logging=False)


def _init_loopback(address: str) -> None:
    """Join a cluster bound to 127.0.0.1 without leaving loopback.

    ray.init rewrites a loopback bootstrap address to the host's primary IP
    (ray-project/ray#59110), which a loopback-only cluster does not listen on.
    Keep the address as given and bind the driver to loopback too.
    """
    from ray._private import services

    original = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda h: "127.0.0.1" if h in ("127.0.0.1", "localhost") else original(h)
    try:
        ray.init(address=address, namespace=AGENT_NAMESPACE, log_to_driver=True, _node_ip_address="127.0.0.1")
    finally:
        services.resolve_ip_for_localhost = original


@ray.remote(num_cpus=0)
def _probe_node_devices() -> list[str]:
    """Runs on one node: every device its llama.cpp build and hardware offer."""
    from cancelbench.device_agents.backends import probe_all_devices

    return [d.device_id for d in probe_all_devices()]


def _declared_devices(labels: dict) -> list[str] | None:
    declared = labels.get(BACKENDS_LABEL)
    if not declared:
        return None
    out = []
    for item in declared.split(","):
        item = item.strip()
        if item:
            out.append(item if ":" in item else f"{item}:0")
    return out


def _node_devices(node: dict, labels: dict) -> list[str]:
    declared = _declared_devices(labels)
    if declared is not None:
        return declared
    strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
    return ray.get(_probe_node_devices.options(scheduling_strategy=strategy).remote(), timeout=300)


def discover_slots(selector: DeviceSelector) -> list[DeviceSlot]:
    """Device slots on alive nodes matching the selector; one per (node, device).

    A node's devices come from its ``cancelbench.io/backends`` label when set
    (``ray start --labels``; e.g. ``cpu,vulkan:0``), else from a probe task run
    on that node. Each agent probes its own device again at start, so a label
    that claims a device the build cannot see is caught before any trial.
    """
    from cancelbench.device_agents.backends import backend_env

    slots: list[DeviceSlot] = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        labels = dict(node.get("Labels") or {})
        host = labels.get(HOST_LABEL) or node.get("NodeManagerHostname") or node["NodeManagerAddress"]
        if selector.hosts and host not in selector.hosts:
            continue
        if any(labels.get(k) != v for k, v in selector.labels):
            continue
        for device_id in _node_devices(node, labels):
            if device_id.split(":", 1)[0] in selector.backends:
                slots.append(DeviceSlot(node_id=node["NodeID"], host=host, device_id=device_id, labels=labels,
                                        env=backend_env(device_id)))
    wanted = set(selector.backends)
    found = {s.backend for s in slots}
    missing = wanted - found
    if missing:
        raise ClusterError(f"backend(s) {', '.join(sorted(missing))} requested but no alive node offers them "
                           f"(found: {', '.join(sorted(found)) or 'none'})")
    return sorted(slots, key=lambda s: s.key)


def start_agent(slot: DeviceSlot, n_threads: int, max_restarts: int = 3, name: str | None = None):
    """Start the agent actor pinned to its node, with the device's environment."""
    env = dict(slot.env)
    options = dict(
        name=name,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=slot.node_id, soft=False),
        num_cpus=0,  # agents pace themselves: one trial at a time per device
        max_restarts=max_restarts,
        max_task_retries=0,  # a trial is never silently repeated
        runtime_env={"env_vars": env} if env else None,
    )
    return remote_agent_class().options(**options).remote(
        device_id=slot.device_id, n_threads=n_threads, node_label=slot.host)


def check_agents(slots: list[DeviceSlot], probes: list[dict]) -> None:
    """Every agent must see the device it was started for (labels can claim too much)."""
    bad = [f"{s.key} (its llama.cpp build sees: {', '.join(p.get('devices_seen') or ['nothing'])})"
           for s, p in zip(slots, probes) if not p.get("device_present")]
    if bad:
        raise ClusterError("device(s) not available on their host: " + "; ".join(bad))
