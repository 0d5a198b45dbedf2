"""`cancelbench agents`: the devices the cluster offers, as a table."""

from __future__ import annotations

import sys

from cancelbench.textsafe import error_line, term_safe


def _error(message: object) -> None:
    """One ``cancelbench: error:`` line, its text made terminal-safe (cancelbench.textsafe)."""
    print(f"cancelbench: error: {error_line(message)}", file=sys.stderr)


def cmd_agents(args) -> int:
    import ray

    from . import cluster
    from .config import BACKENDS

    backends = tuple(args.backend or BACKENDS)
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        _error(f"unknown backend(s) {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
        return 2
    try:
        cluster.connect(args.address)
    except cluster.ClusterError as exc:
        _error(exc)
        return 2
    slots = _slots(cluster, backends)
    agents = [cluster.start_agent(s, n_threads=1, max_restarts=0) for s in slots]
    try:
        probes = ray.get([a.probe.remote() for a in agents])
    finally:
        for a in agents:
            ray.kill(a)
    cols = ("host", "platform", "backend", "device", "device_name", "llama_cpp_build")
    # what a probe says (a GPU driver's device name, a build string) is data: escaped like the report's cells
    rows = [[term_safe(v) for v in (s.host, p["platform"], s.backend, s.device_id, p["device_name"],
                                    p["llama_cpp_build"])]
            for s, p in zip(slots, probes)]
    widths = [max(len(c), *(len(str(r[i])) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    return 0 if rows else 1


def _slots(cluster, backends: tuple[str, ...]) -> list:
    """Slots for the requested backends; those no node offers are named on stderr and left out."""
    from .config import DeviceSelector

    try:
        return cluster.discover_slots(DeviceSelector(backends=backends))
    except cluster.ClusterError:
        pass
    slots, missing = [], []
    for backend in backends:
        try:
            slots.extend(cluster.discover_slots(DeviceSelector(backends=(backend,))))
        except cluster.ClusterError:
            missing.append(backend)
    print(f"cancelbench: no alive node offers {', '.join(missing)}", file=sys.stderr)
    return slots


def add_agents_parser(sub) -> None:
    p = sub.add_parser("agents", help="list the devices the Ray cluster offers")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else local)")
    p.add_argument("--backend", action="append", help="only these backends")
    p.set_defaults(func=cmd_agents)
