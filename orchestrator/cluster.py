"""Ray connection, device discovery and agent placement."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cancelbench.device_agents.agent import remote_agent_class
from cancelbench import signals
from cancelbench.raylocal import LOOPBACK, loopback_node_ip, start_local, use_auth_mode

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

    A Ray cancelbench starts itself always has token auth on. An existing
    cluster is joined in its own mode (:func:`cluster_auth_mode`): a mismatch
    is a :class:`ClusterError` naming what to set, an unauthenticated cluster
    a one-line warning on stderr.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    check_address(address)
    if not address:
        start_local(namespace=AGENT_NAMESPACE, log_to_driver=True, configure_logging=False)
        return
    mode = cluster_auth_mode(address)
    use_auth_mode(mode)
    if mode == "disabled":
        print(f"cancelbench: warning: the Ray cluster at {address} has token authentication off "
              "(anyone who reaches it can run code on it)", file=sys.stderr)
    if _host_of(address) in LOOPBACK:
        with loopback_node_ip():
            ray.init(address=address, namespace=AGENT_NAMESPACE, log_to_driver=True, _node_ip_address="127.0.0.1")
    else:
        ray.init(address=address, namespace=AGENT_NAMESPACE, log_to_driver=True)
    signals.reassert()  # ray.init put its C++ SIGTERM handler in place of ours


def check_address(address: str | None) -> None:
    """Refuse, before anything starts, an address cancelbench cannot use: a Ray Client ``ray://``
    address (the driver must run on a node of the cluster; the client would time out after 30 s)."""
    if address and "://" in address:
        raise ClusterError(f"Ray address {address!r}: Ray Client (ray://) and other URL addresses are not "
                           "supported; run cancelbench on a node of the cluster and give its GCS as "
                           "--address HOST:PORT (or 'auto')")


def _host_of(address: str) -> str:
    return address.split("://")[-1].rsplit(":", 1)[0]


def cluster_auth_mode(address: str, timeout_s: float = 15.0) -> str:
    """The auth mode of the running cluster at ``address``: "token" or "disabled".

    Asks its GCS (GetClusterId, the first call ray.init makes) without a token:
    a token-auth GCS answers UNAUTHENTICATED. For such a cluster the local
    token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) is tried
    too, so a missing or wrong token is one clear line instead of ray.init
    retrying for a minute. An explicit RAY_AUTH_MODE that disagrees with the
    cluster is an error: the user asked for something the cluster does not do.
    """
    if address == "auto":
        from ray._private import services
        address = services.get_ray_address_from_environment("auto", None) or address
    target = address.split("://")[-1]
    code = _gcs_call(target, (), timeout_s)
    wanted = os.environ.get("RAY_AUTH_MODE")
    if code is None:
        if wanted == "token":
            raise ClusterError(f"the Ray cluster at {address} has token authentication off but RAY_AUTH_MODE=token "
                               "is set: unset RAY_AUTH_MODE to use it unauthenticated, or restart it with token auth")
        return "disabled"
    if code != "UNAUTHENTICATED":
        raise ClusterError(f"cannot reach the Ray cluster at {address} ({code})")
    if wanted == "disabled":
        raise ClusterError(f"the Ray cluster at {address} requires token authentication but RAY_AUTH_MODE=disabled "
                           "is set: unset it and provide the cluster's token (RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)")
    token = _local_token()
    where = ("set RAY_AUTH_TOKEN_PATH to a copy of the head's ~/.ray/auth_token (or put it in ~/.ray/auth_token)")
    if token is None:
        raise ClusterError(f"the Ray cluster at {address} requires token authentication and no token was found: "
                           + where)
    if _gcs_call(target, (("authorization", f"Bearer {token}"),), timeout_s) is not None:
        raise ClusterError(f"the Ray cluster at {address} rejected this machine's auth token: " + where)
    return "token"


def _local_token() -> str | None:
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # the environment may have changed since Ray was imported
    if not loader.has_token(ignore_auth_mode=True):
        return None
    return loader.get_raw_token(ignore_auth_mode=True)


def _gcs_call(target: str, metadata: tuple, timeout_s: float) -> str | None:
    """One GetClusterId call to the GCS at host:port: None if it succeeded, else the gRPC status name."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata,
                              wait_for_ready=True)
        except grpc.RpcError as exc:
            return exc.code().name
    return None


@ray.remote(num_cpus=0)
def _probe_node_devices() -> list[str]:
    """Runs on one node: every device its llama.cpp build and hardware offer."""
    from cancelbench.device_agents.backends import probe_all_devices

    return [d.device_id for d in probe_all_devices()]


def _declared_devices(labels: dict) -> list[str] | None:
    """Devices a node declares in its backends label, as ``backend:index``.

    Ray label values allow only ``[A-Za-z0-9_.-]`` (``ray start --labels`` also
    splits on commas), so ``cpu_vulkan-1`` is the form a real node can carry;
    ``cpu,vulkan:1`` is accepted too (labels set from Python).
    """
    declared = labels.get(BACKENDS_LABEL)
    if not declared:
        return None
    out = []
    for item in re.split(r"[,_.]", declared):
        item = item.strip()
        if item:
            backend, _, index = item.replace("-", ":").partition(":")
            out.append(f"{backend}:{index or 0}")
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
    from cancelbench.device_agents.agent import SIM_BACKEND
    from cancelbench.device_agents.backends import backend_env

    sim = selector.sim_per_host
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
        if sim:  # simulated devices: no probe, no ggml; one agent per sim:i
            slots.extend(DeviceSlot(node_id=node["NodeID"], host=host, device_id=f"{SIM_BACKEND}:{i}", labels=labels)
                         for i in range(sim))
            continue
        for device_id in _node_devices(node, labels):
            if device_id.split(":", 1)[0] in selector.backends:
                slots.append(DeviceSlot(node_id=node["NodeID"], host=host, device_id=device_id, labels=labels,
                                        env=backend_env(device_id)))
    check_host_names(slots)
    if sim:
        if not slots:
            raise ClusterError("devices.sim_per_host: no alive node matches the device selector")
        return sorted(slots, key=lambda s: (s.host, int(s.device_id.split(":", 1)[1])))
    wanted = set(selector.backends)
    found = {s.backend for s in slots}
    missing = wanted - found
    if missing:
        raise ClusterError(f"backend(s) {', '.join(sorted(missing))} requested but no alive node offers them "
                           f"(found: {', '.join(sorted(found)) or 'none'})")
    return sorted(slots, key=lambda s: s.key)


def check_host_names(slots: list[DeviceSlot]) -> None:
    """Distinct hosts must give distinct ``host=`` partitions and trial-id parts (injective by
    construction: a sanitized name carries a hash of the raw one; checked here all the same)."""
    from cancelbench.sink import sanitize_path_part

    from .plan import device_id_part

    for what, fn in (("partition", sanitize_path_part), ("trial-id part", lambda h: device_id_part(f"{h}/cpu:0"))):
        seen: dict[str, str] = {}
        for host in sorted({s.host for s in slots}):
            other = seen.setdefault(fn(host), host)
            if other != host:
                raise ClusterError(f"hosts {other!r} and {host!r} give the same {what} {fn(host)!r}; "
                                   f"give one a distinct {HOST_LABEL} label")


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
