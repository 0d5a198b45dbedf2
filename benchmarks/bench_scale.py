"""How many devices one driver holds: N simulated devices (``[devices] sim_per_host``)
on the local Ray (127.0.0.1), the sim engine (phases that wait, no CPU), driver-
delivered cancels.

Per N: driver CPU (process CPU time of this process, which is the driver, over the
trial window) as a share of one core, the agents' CPU and the rest of Ray's (the
driver's descendant processes, sampled from a separate process), driver RSS, records/s into the dataset, trial
throughput, and from the records ``deliver_ms`` (driver -> agent cancel hop) and
``schedule_lag_ms`` (how late the driver fired) p50/p99, plus the idle gap an agent
waits between one trial's end and its next hand-back (the driver's per-trial
overhead). Machine facts (nproc, load average at start and end of each run) go
with the numbers: this machine is shared and noisy.

The trial window is taken from the records (first hand-back to last terminal,
one CLOCK_MONOTONIC on this host), so agent start-up is not counted as trials.

With ``--netns-hosts K`` the devices are spread over K hosts in Linux network
namespaces (tests/netns.py: a real ``ray start`` per host, token auth), N/K per
host, and the driver runs in the head's namespace as on a head machine; the
agents' CPU is then that of every DeviceAgent process on this machine.

    python benchmarks/bench_scale.py [--devices 1 8 32 64] [--trials 4] [--label before] [--engine-process agent]
        [--phase-us 20000] [--netns-hosts 3] [--out benchmarks/results/scale.json]
    python benchmarks/bench_scale.py --plot benchmarks/results/scale.png --plot-labels L1 L2 ...

A run is appended under its ``--label`` (e.g. before / after a driver change). It exits 1 when
a sim row is ``dropped`` or ``lost``: the sim honours every cancel, so such a row is the
harness's defect (``--keep-defects DIR`` keeps their every column).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")

from cancelbench.outcome import DEFECT_OUTCOMES  # noqa: E402
from cancelbench.reports.stats import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class CpuSampler:
    """Process CPU time (all driver threads, Ray's core worker included) against
    CLOCK_MONOTONIC, so the share over any window can be read afterwards."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.samples: list[tuple[int, float, float]] = []  # (monotonic ns, cpu s, rss MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)

    def _loop(self, period_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic_ns(), time.process_time(), _rss_mb()))
            self._stop.wait(period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic_ns(), time.process_time(), _rss_mb()))

    def window(self, t0: int, t1: int) -> dict:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {"cpu_core_share": None, "rss_mb_max": None}
        (a, ca, _), (b, cb, _) = inside[0], inside[-1]
        return {"cpu_core_share": round((cb - ca) / ((b - a) / 1e9), 4),
                "rss_mb_max": round(max(s[2] for s in inside), 1)}


# Runs in its own process (so it costs the driver nothing): every 0.1 s, the CPU time
# (utime+stime, s) of the driver's descendants: the agents (DeviceAgent) and the rest
# of this Ray (gcs, raylet, dashboard, idle workers). One JSON line per sample.
_CHILD_SAMPLER = r"""
import json, os, sys, time
root = int(sys.argv[1]); tick = os.sysconf("SC_CLK_TCK")  # root 0: every agent on this machine
while True:
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            procs[int(d)] = (int(st[1]), (int(st[11]) + int(st[12])) / tick, b"DeviceAgent" in cmd)
    def under(pid):
        seen = 0
        while pid in procs and seen < 64:
            pid = procs[pid][0]; seen += 1
            if pid == root:
                return True
        return False
    agents = other = 0.0; n = 0
    for pid, (_, cpu, is_agent) in procs.items():
        if root == 0 and is_agent:
            agents += cpu; n += 1
        elif root and pid != root and under(pid):
            if is_agent:
                agents += cpu; n += 1
            else:
                other += cpu
    print(json.dumps([time.monotonic_ns(), agents, other, n]), flush=True)
    time.sleep(0.1)
"""


class ChildCpu:
    """CPU of the agents and of the rest of Ray (the driver's descendants), from a sampler process;
    ``everywhere``: of every agent process on this machine (a cluster's agents are not the driver's)."""

    def __init__(self, everywhere: bool = False) -> None:
        self.root = 0 if everywhere else os.getpid()

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD_SAMPLER, str(self.root)],
                                     stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        self.samples = [json.loads(line) for line in out.splitlines() if line.startswith("[")]

    def window(self, t0: int, t1: int) -> dict:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {"agents_cpu_core_share": None, "ray_other_cpu_core_share": None}
        a, b = inside[0], inside[-1]
        dt = (b[0] - a[0]) / 1e9
        return {"agents_cpu_core_share": round((b[1] - a[1]) / dt, 3),
                "ray_other_cpu_core_share": round((b[2] - a[2]) / dt, 3) if self.root else None,
                "agents_seen": b[3]}


def _pcts(values) -> dict:
    v = [float(x) for x in values if x == x]
    if not v:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {"n": len(v), "p50": round(percentile(v, 0.5), 3), "p99": round(percentile(v, 0.99), 3),
            "max": round(max(v), 3)}


def run(n: int, trials: int, phase_us: int, granularity_us: int, address: str | None = None,
        hosts: int = 1, engine_process: str | None = None, keep_defects: Path | None = None) -> dict:
    from cancelbench.orchestrator.config import DeviceSelector, OffsetSpec, SweepConfig, WorkloadSpec
    from cancelbench.orchestrator.runner import Sweep
    from cancelbench.sink import read_records

    wl = WorkloadSpec(name="sim", engine="sim", sim_phase_us=phase_us, sim_granularity_us=granularity_us,
                      sim_steps=4, engine_process=engine_process)
    cfg = SweepConfig(seed=1, trials_per_cell=trials, reference_runs=3, workloads=(wl,),
                      mechanisms=("abort_callback",), deliveries=("driver",),
                      offsets=OffsetSpec(plan="uniform", max_fraction=0.8), ping_samples=5,
                      devices=DeviceSelector(sim_per_host=n // hosts))
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as d, CpuSampler() as cpu, ChildCpu(everywhere=hosts > 1) as children:
        t0 = time.monotonic()
        result = Sweep(cfg, Path(d) / "out", address=address, progress=False).run()
        wall = time.monotonic() - t0
        df = read_records(Path(d) / "out")
        defects = df[df.outcome.isin(DEFECT_OUTCOMES)]
        if keep_defects is not None and len(defects):  # the dataset is a temporary one: their every column kept
            keep_defects.mkdir(parents=True, exist_ok=True)
            defects.to_parquet(keep_defects / f"defects-{n}-devices.parquet")
    load_end = os.getloadavg()
    t_first, t_last = int(df.t_handback_ns.min()), int(df.t_terminal_ns.max())
    span_s = (t_last - t_first) / 1e9
    gaps = []
    for _, g in df.sort_values("t_handback_ns").groupby(["host", "device"]):  # sim:i is on every host
        h, t = g.t_handback_ns.to_numpy(), g.t_terminal_ns.to_numpy()
        gaps.extend(((h[1:] - t[:-1]) / 1e6).tolist())
    c = df[df.trial_kind == "cancel"]
    planned = n * (3 + trials)
    return {
        "devices": n, "engine_process": wl.process, "cancels_per_device": trials, "hosts": hosts, "hosts_seen": int(df.host.nunique()), "planned": planned, "written": int(len(df)), "unique_trials": int(df.trial_id.nunique()),
        "exit_code": result.exit_code, "outcomes": {k: int(v) for k, v in df.outcome.value_counts().items()},
        # an error row's own words (the dataset is a temporary one): the first five, one line each
        "errors": [f"{r.trial_id}: {' '.join(str(r.error).split())[:300]}" for r in df[df.outcome == "error"].head(5).itertuples()],
        "sweep_wall_s": round(wall, 2), "trial_window_s": round(span_s, 3),
        "trials_per_s": round(len(df) / span_s, 2), "records_per_s": round(len(df) / span_s, 2),
        **cpu.window(t_first, t_last), **children.window(t_first, t_last),
        "deliver_ms": _pcts(c.deliver_ms), "schedule_lag_ms": _pcts(c.schedule_lag_ms),
        "anchor_hop_ms": _pcts(c.anchor_hop_ms), "gap_between_trials_ms": _pcts(gaps),
        "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in load_end],
    }


def trials_for(n: int, args) -> int:
    """Cancels per device at N devices: --trials, or more so that N x it >= --min-cancels."""
    return max(args.trials, -(-args.min_cancels // n))


def _run_local(args) -> list[dict]:
    import ray

    from cancelbench.orchestrator import cluster

    cluster.connect(None)
    runs = []
    try:
        for n in args.devices:
            r = run(n, trials_for(n, args), args.phase_us, args.granularity_us, engine_process=args.engine_process,
                    keep_defects=args.keep_defects)
            print(json.dumps(r), file=sys.stderr, flush=True)
            runs.append(r)
    finally:
        ray.shutdown()
    return runs


def _run_netns(args) -> list[dict]:
    """A cluster of ``--netns-hosts`` namespaces; this script again, in the head's, per N."""
    sys.path.insert(0, str(ROOT / "tests"))
    import netns

    why = netns.netns_unavailable()
    if why:
        raise SystemExit(f"bench_scale: --netns-hosts: {why}")
    names = ["head"] + [f"host-{chr(ord('a') + i)}" for i in range(args.netns_hosts - 1)]
    c = netns.NetnsCluster([(h, "cpu") for h in names]).start()
    runs = []
    try:
        for n in args.devices:
            r = c.run(c.head, [sys.executable, str(Path(__file__).resolve()), "--address", c.address,
                               "--netns-hosts", str(args.netns_hosts), "--devices", str(n), "--trials",
                               str(trials_for(n, args)), "--min-cancels", "0", "--phase-us", str(args.phase_us), "--granularity-us",
                               str(args.granularity_us), *(["--engine-process", args.engine_process]
                                                           if args.engine_process else []),
                               *(["--keep-defects", str(args.keep_defects.resolve())] if args.keep_defects else [])],
                      timeout=3600)
            if r.returncode:
                raise SystemExit(f"bench_scale: the run of {n} devices failed: {r.stderr[-2000:]}")
            # Ray may print on stdout too: the result is the one line this script's inner run prints
            line = json.loads(next(x for x in reversed(r.stdout.splitlines()) if x.startswith('{"devices"')))
            print(json.dumps(line), file=sys.stderr, flush=True)
            runs.append(line)
    finally:
        c.teardown()
    return runs


PLOTTED = (("schedule_lag_ms", "p99", "cancel schedule lag p99 (ms)"),
           ("deliver_ms", "p99", "driver -> agent cancel hop p99 (ms)"),
           ("cpu_core_share", None, "driver CPU (share of one core)"),
           ("trials_per_s", None, "trials per second"))


def _f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def table(data: dict, label: str) -> str:
    """The entry labelled ``label`` as a markdown table (docs/scale.md is built from these)."""
    e = next((e for e in data["entries"] if e["label"] == label), None)
    if e is None:
        raise SystemExit(f"bench_scale: no entry labelled {label} in the JSON")
    rows = ["| N | hosts | cancels landed | trials/s | driver CPU | agents CPU | driver RSS MB | deliver_ms p50 / p99 "
            "| schedule_lag_ms p50 / p99 | anchor_hop_ms p50 / p99 | outcomes | load 1m start→end |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in e["runs"]:
        d, lag, hop = r["deliver_ms"], r["schedule_lag_ms"], r["anchor_hop_ms"]
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
        rows.append(f"| {r['devices']} | {r.get('hosts', 1)} | {d['n']} | {r['trials_per_s']:.0f} | "
                    f"{_f(r['cpu_core_share'])} | {_f(r.get('agents_cpu_core_share'))} | {_f(r['rss_mb_max'], 0)} | "
                    f"{_f(d['p50'])} / {_f(d['p99'])} | {_f(lag['p50'])} / {_f(lag['p99'])} | "
                    f"{_f(hop['p50'])} / {_f(hop['p99'])} | {outcomes} | "
                    f"{r['loadavg_start'][0]:.1f} → {r['loadavg_end'][0]:.1f} |")
    return "\n".join(rows)


def plot(data: dict, labels: list[str], out: Path) -> None:
    """One panel per measure, one line per labelled entry, devices on a log axis (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for label in labels for e in data["entries"] if e["label"] == label]
    missing = set(labels) - {e["label"] for e in entries}
    if missing:
        raise SystemExit(f"bench_scale: no entry labelled {', '.join(sorted(missing))} in the JSON")
    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4.2 * len(PLOTTED), 3.6))
    for ax, (key, pct, title) in zip(axes, PLOTTED):
        for e in entries:
            xs = [r["devices"] for r in e["runs"]]
            ys = [(r[key] or {}).get(pct) if pct else r[key] for r in e["runs"]]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o",
                    label=f"{e['label']} ({e['commit']})")
        ax.set_xscale("log", base=2)
        top = max(r["devices"] for e in entries for r in e["runs"])
        ticks = [2 ** i for i in range(top.bit_length() + 1) if 2 ** i <= top * 1.1]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        if key.endswith("_ms"):
            ax.set_yscale("log")  # from tens of microseconds to hundreds of milliseconds
        ax.set_xlabel("simulated devices")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"one driver, sim engine, {entries[0]['nproc']} cores ({data['engine']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--trials", type=int, default=20, help="driver-delivered cancels per device (plus 3 references)")
    ap.add_argument("--min-cancels", type=int, default=300,
                    help="at least this many cancels per N (more trials per device at small N), so a p99 "
                         "rests on enough samples (the reports' rule: 299 for a p99)")
    ap.add_argument("--phase-us", type=int, default=20_000)
    ap.add_argument("--granularity-us", type=int, default=1_000)
    ap.add_argument("--label", default="run")
    ap.add_argument("--engine-process", choices=("channel", "agent"),
                    help="where the sim engine runs (default: its default, the in-process channel; agent: called "
                         "directly, the path issue 34 retires)")
    ap.add_argument("--keep-defects", type=Path, metavar="DIR",
                    help="write every column of each dropped or lost row here (defects-N-devices.parquet; "
                         "the sweep's own dataset is a temporary one)")
    ap.add_argument("--netns-hosts", type=int, default=1,
                    help="spread the devices over this many network-namespace hosts (root; N divisible by it)")
    ap.add_argument("--plot", type=Path, help="draw the --plot-labels entries of --out as a PNG here, run nothing")
    ap.add_argument("--plot-labels", nargs="+", default=[])
    ap.add_argument("--table", metavar="LABEL", help="print the entry LABEL of --out as a markdown table, run nothing")
    ap.add_argument("--address", help=argparse.SUPPRESS)  # inside the head's namespace: the cluster to attach to
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale.json")
    args = ap.parse_args()

    if args.table:
        print(table(json.loads(args.out.read_text()), args.table))
        return 0
    if args.plot:
        plot(json.loads(args.out.read_text()), args.plot_labels, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
        return 0
    bad = [n for n in args.devices if n % args.netns_hosts]
    if args.netns_hosts < 1 or bad:
        print(f"bench_scale: --devices {bad} not divisible by --netns-hosts {args.netns_hosts}", file=sys.stderr)
        return 2
    if args.address:  # the inner run, in the head's namespace: one JSON line per N on stdout
        for n in args.devices:
            print(json.dumps(run(n, trials_for(n, args), args.phase_us, args.granularity_us, args.address,
                                 args.netns_hosts, args.engine_process, args.keep_defects)), flush=True)
        return 0
    runs = _run_netns(args) if args.netns_hosts > 1 else _run_local(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    entry = {"label": args.label, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": commit,
             "nproc": os.cpu_count(), "mem_total_gb": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                                                            / 2**30, 1),
             "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             "netns_hosts": args.netns_hosts, "sim_phase_us": args.phase_us, "sim_granularity_us": args.granularity_us,
             "cancels_per_device": args.trials, "min_cancels": args.min_cancels, "runs": runs}
    data = json.loads(args.out.read_text()) if args.out.exists() else {
        "benchmark": "bench_scale", "engine": "sim (simulated: waits, not compute)",
        "note": "one local Ray on 127.0.0.1; N agents on this host; driver delivery; numbers under the stated load",
        "entries": []}
    data["entries"].append(entry)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(entry, indent=1))
    # The sim engine honours every cancel it is handed: a dropped or lost row is the harness's own defect
    # (a verdict that convicts the engine for the harness's delay, or a record lost). The figures are
    # written, and the run fails.
    defects = {f"{r['devices']} devices": {o: r["outcomes"][o] for o in DEFECT_OUTCOMES if r["outcomes"].get(o)}
               for r in runs}
    defects = {k: v for k, v in defects.items() if v}
    if defects:
        print(f"bench_scale: the sim engine's rows hold defects, which it cannot make: {defects}"
              f"{'' if args.keep_defects else ' (--keep-defects DIR keeps their rows)'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
