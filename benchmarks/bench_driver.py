"""Driver throughput with many agents, on a trivial engine (the known-answer probe).

For 1, 4 and 16 agents on a local Ray (127.0.0.1): dispatch rate (trials per
second across all agents) and per-trial driver overhead (driver-observed wall
time minus the agent's own trial duration), to show the driver is not the
bottleneck; plus cancel delivery latency driver -> agent (``deliver_ms``)
p50/p99 on loopback. JSON on stdout and benchmarks/results/driver.json.

    python benchmarks/bench_driver.py [--trials 40] [--agents 1 4 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")

from cancelbench.reports.stats import percentile



def run(n_agents: int, trials: int) -> dict:
    import ray

    from cancelbench.orchestrator import cluster
    from cancelbench.orchestrator.cluster import DeviceSlot
    from cancelbench.orchestrator.config import OffsetSpec, SweepConfig, WorkloadSpec
    from cancelbench.orchestrator.runner import Sweep
    from cancelbench.sink import read_records

    # n agents on the one local node: the probe engine needs no model, so the
    # driver's own work dominates.
    original = cluster.discover_slots
    node = ray.get_runtime_context().get_node_id()
    cluster.discover_slots = lambda selector: [DeviceSlot(node, f"bench{i:02d}", "cpu:0") for i in range(n_agents)]
    probe = WorkloadSpec(name="probe", engine="probe", duration_us=20_000, period_us=200)
    cfg = SweepConfig(seed=1, trials_per_cell=trials, reference_runs=3, workloads=(probe,),
                      mechanisms=("abort_callback",), deliveries=("driver",),
                      offsets=OffsetSpec(plan="uniform", max_fraction=0.5), ping_samples=10)
    try:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.monotonic()
            result = Sweep(cfg, Path(d) / "out", progress=False).run()
            wall = time.monotonic() - t0
            df = read_records(Path(d) / "out")
    finally:
        cluster.discover_slots = original
    c = df[(df.trial_kind == "cancel")]
    done = c[c.outcome == "cancelled"]
    # All agents share this host's CLOCK_MONOTONIC: the trial span and the idle
    # gap between one trial's end and the next one's hand-back on the same agent
    # (the driver's per-trial overhead) come straight from the records.
    span_s = (df.t_terminal_ns.max() - df.t_handback_ns.min()) / 1e9
    gaps = []
    for _, g in df.sort_values("t_handback_ns").groupby("host"):
        gaps.extend(((g.t_handback_ns.values[1:] - g.t_terminal_ns.values[:-1]) / 1e6).tolist())
    return {
        "agents": n_agents,
        "trials": int(len(df)),
        "sweep_wall_s": wall,
        "trial_span_s": span_s,
        "dispatch_rate_trials_per_s": len(df) / span_s,
        "agent_busy_share": float(df.duration_ms.sum() / 1e3 / (span_s * n_agents)),
        "driver_gap_ms_p50": percentile(gaps, 0.5),
        "driver_gap_ms_p99": percentile(gaps, 0.99),
        "deliver_ms_p50": percentile(done.deliver_ms.dropna(), 0.5),
        "deliver_ms_p99": percentile(done.deliver_ms.dropna(), 0.99),
        "schedule_lag_ms_p50": percentile(done.schedule_lag_ms.dropna(), 0.5),
        "schedule_lag_ms_p99": percentile(done.schedule_lag_ms.dropna(), 0.99),
        "outcomes": {k: int(v) for k, v in df.outcome.value_counts().items()},
        "exit_code": result.exit_code,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=40, help="cancel trials per agent")
    ap.add_argument("--agents", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "driver.json")
    args = ap.parse_args()

    import ray

    from cancelbench.orchestrator import cluster

    cluster.connect(None)
    rows = [run(n, args.trials) for n in args.agents]
    ray.shutdown()
    result = {"benchmark": "driver", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": os.cpu_count(),
              "engine": "probe (20 ms busy, token checked every 200 us)", "runs": rows,
              "note": "all agents share this machine's cores; agent_busy_share = engine time / (wall x agents)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'agents':>6} {'trials':>6} {'trials/s':>9} {'busy':>6} {'gap p50 ms':>11} {'gap p99 ms':>11} "
          f"{'deliver p50':>12} {'deliver p99':>12}", file=sys.stderr)
    for r in rows:
        print(f"{r['agents']:>6} {r['trials']:>6} {r['dispatch_rate_trials_per_s']:>9.1f} "
              f"{r['agent_busy_share']:>6.2f} {r['driver_gap_ms_p50']:>11.2f} {r['driver_gap_ms_p99']:>11.2f} "
              f"{r['deliver_ms_p50']:>12.3f} {r['deliver_ms_p99']:>12.3f}", file=sys.stderr)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
