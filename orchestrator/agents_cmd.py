"""`cancelbench agents`: the devices the cluster offers, as a table."""

from __future__ import annotations



def cmd_agents(args) -> int:
    import ray

    from . import cluster
    from .config import BACKENDS, DeviceSelector

    cluster.connect(args.address)
    try:
        slots = cluster.discover_slots(DeviceSelector(backends=tuple(args.backend or BACKENDS)))
    except cluster.ClusterError:
        slots = [s for b in BACKENDS for s in _try(cluster, b)]
    agents = [cluster.start_agent(s, n_threads=1, max_restarts=0) for s in slots]
    try:
        probes = ray.get([a.probe.remote() for a in agents])
    finally:
        for a in agents:
            ray.kill(a)
    cols = ("host", "platform", "backend", "device", "device_name", "llama_cpp_build")
    rows = [[s.host, p["platform"], s.backend, s.device_id, p["device_name"], p["llama_cpp_build"]]
            for s, p in zip(slots, probes)]
    widths = [max(len(c), *(len(str(r[i])) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    return 0 if rows else 1


def _try(cluster, backend):
    from .config import DeviceSelector
    try:
        return cluster.discover_slots(DeviceSelector(backends=(backend,)))
    except cluster.ClusterError:
        return []


def add_agents_parser(sub) -> None:
    p = sub.add_parser("agents", help="list the devices the Ray cluster offers")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else local)")
    p.add_argument("--backend", action="append", help="only these backends")
    p.set_defaults(func=cmd_agents)
