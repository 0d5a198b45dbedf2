"""Ray connection, device discovery and agent placement."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from device_agents.agent import remote_agent_class

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


def connect(address: str | None = None) -> None:
    """Connect to ``address``/RAY_ADDRESS, or start a local Ray bound to 127.0.0.1.

    Token authentication stays on: RAY_AUTH_MODE=token unless the caller chose a mode.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=AGENT_NAMESPACE, log_to_driver=True)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, namespace=AGENT_NAMESPACE,
                 log_to_driver=True, configure_logging=False)


def _node_backends(node: dict) -> list[str]:
    labels = node.get("Labels") or {}
    declared = labels.get(BACKENDS_LABEL)
    if declared:
        return [b.strip() for b in declared.split(",") if b.strip()]
    return ["cpu"]


def discover_slots(selector: DeviceSelector) -> list[DeviceSlot]:
    """Device slots on alive nodes matching the selector; one per (node, backend device).

    Backends a node offers come from its ``cancelbench.io/backends`` label (set
    with ``ray start --labels``); unlabelled nodes offer ``cpu``. Each agent
    then probes its real devices; a declared backend the build cannot see is
    reported by the agent, not guessed here.
    """
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
        for backend in _node_backends(node):
            if backend in selector.backends:
                slots.append(DeviceSlot(node_id=node["NodeID"], host=host, device_id=f"{backend}:0", labels=labels))
    wanted = set(selector.backends)
    found = {s.backend for s in slots}
    missing = wanted - found
    if missing:
        raise ClusterError(f"backend(s) {', '.join(sorted(missing))} requested but no alive node offers them "
                           f"(found: {', '.join(sorted(found)) or 'none'})")
    return sorted(slots, key=lambda s: s.key)


def start_agent(slot: DeviceSlot, n_threads: int, max_restarts: int = 3):
    """Start the agent actor pinned to its node, with the device's environment."""
    env = dict(slot.env)
    options = dict(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=slot.node_id, soft=False),
        num_cpus=0,  # agents pace themselves: one trial at a time per device
        max_restarts=max_restarts,
        max_task_retries=0,  # a trial is never silently repeated
        runtime_env={"env_vars": env} if env else None,
    )
    return remote_agent_class().options(**options).remote(
        device_id=slot.device_id, n_threads=n_threads, node_label=slot.host)
