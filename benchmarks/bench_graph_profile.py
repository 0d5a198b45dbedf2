"""graph_eval profile: the eval reader's estimate against what each node range cost, per graph.

For text decode, the TTS code predictor step (``generate``), the TTS step that also runs
code2wav and the STT encode (bench_graph_eval.GRAPHS, CPU fixtures, one thread), with the
reader's profiling log on (``CancelToken.log_enable``, cancel_token.h): every node range of
every step call of the graph, uncancelled, at ``--slice-us``:

* per range: the reader's estimate (its learned cost per work x the range's scaled work, in
  the graph thread's CPU ns) against the graph thread's CPU time of the range
  (``CLOCK_THREAD_CPUTIME_ID``: a wait for a CPU is not in it) and its wall time; the ratio
  CPU / estimate (p50 / p90 / p99 / max, ranges over 2x);
* per op (``ggml_op`` value and name where known): nodes per step call, their share of the
  ranges' estimates, and the same op's CPU cost per node measured alone (slice 0: every node
  its own range, ``--node-runs`` runs; the node's CPU ns includes one range's sync overhead);
* the worst ranges: what they held (nodes per op), estimate, CPU, wall;
* per step call: its CPU time and the part of it outside every synced range (``unpolled``: a
  graph's unsynced tail, the engine's own work between and before its graphs, such as building
  the next graph), where a cancel is seen only at the next node asked.

Machine facts and the load (load average, ``/proc/loadavg`` runnable count, the process's
CPU time against wall) stand beside the numbers: other work on the host is not controlled.

    python benchmarks/bench_graph_profile.py --variant=before|after|installed [--graphs tts_generate,...]
        [--runs 2] [--repeats 2] [--label NAME] [--out JSON]     # adds a run under NAME to the JSON
    python benchmarks/bench_graph_profile.py --table [--out JSON]  # its runs as docs/benchmarks.md's table
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# The eval reader before issue 26's fixes, built from the same source (cancel_token.c's build knobs)
LEGACY_FLAGS = ("-DCB_RANGE_KEYS=16", "-DCB_RANGE_MAX_NODES=1000000000", "-DCB_NO_OP_DISPATCH=0",
                "-DCB_GAP_WAIT_CHECK=0", "-DCB_CPU_UNIT_FIXED=0", "-DCB_KEY_STALE_SYNCS=4294967295u")


def use_variant(variant: str) -> list[str]:
    """Point cancelbench.native at a private build of cancel_token.c (``before``: LEGACY_FLAGS;
    ``after``: the defaults) before the library is first loaded; ``installed``: leave it."""
    if variant == "installed":
        return []

    flags = list(LEGACY_FLAGS) if variant == "before" else []
    out = Path(tempfile.mkdtemp(prefix="cb-profile-")) / f"cancel_token-{variant}.so"
    subprocess.run(["cc", "-O2", "-std=gnu11", "-fPIC", "-shared", "-fvisibility=hidden", *flags,
                    str(ROOT / "native" / "cancel_token.c"), "-o", str(out)], check=True)
    os.environ["CANCELBENCH_NATIVE_LIB"] = str(out)
    return flags


# before any import below: cancelbench.native loads its library at the first call (bench_speech's
# imports make one)
_VARIANT = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--variant=")), "installed")
BUILD_FLAGS = use_variant(_VARIANT)

import llama_cpp  # noqa: E402, F401, I001  (ggml before anything else, as bench_graph_eval)

from bench_graph_eval import GRAPHS, _step_ctl, graph_engines  # noqa: E402

from cancelbench import native  # noqa: E402
from cancelbench.reports.stats import percentile  # noqa: E402
from cancelbench.request import TrialRequest  # noqa: E402


def op_name(op: int) -> str:
    """``<ggml_op value>:<ggml_op_name>`` of the loaded ggml (0: NONE, or a node the graph does not
    compute: the reader logs both as 0)."""
    from llama_cpp._ggml import libggml

    libggml.ggml_op_name.restype = ctypes.c_char_p
    libggml.ggml_op_name.argtypes = [ctypes.c_int]
    return f"{op}:{'NONE/skipped' if op == 0 else libggml.ggml_op_name(op).decode()}"


def host_load() -> dict:
    la = os.getloadavg()
    try:
        running = Path("/proc/loadavg").read_text().split()[3]  # runnable/total scheduling entities
    except OSError:
        running = None
    return {"loadavg": [round(x, 2) for x in la], "proc_loadavg_running": running}


def profile_runs(eng, kind: str, trial: dict, runs: int) -> dict:
    """``runs`` uncancelled graph_eval runs with the log on: range and node rows of each phase's
    step calls (the log's row counts taken at each step call's start and end)."""
    token = eng.graph_token
    token.log_enable(3_000_000, 400_000)
    spans: list[tuple[str, int, int]] = []
    start: dict = {}

    def on_event(event: str, phase: str, t_ns: int) -> None:  # on the trial thread, around each step call
        n_ranges = token.log_ranges_count()
        if event == "step":
            start["r"], start["cpu"] = n_ranges, time.thread_time_ns()
        elif event == "step_end":
            spans.append((phase, start["r"], n_ranges, time.thread_time_ns() - start["cpu"]))
    cpu0, wall0 = time.process_time(), time.monotonic()
    for _ in range(runs):
        ctl = _step_ctl(kind)
        ctl.progress.listener = on_event
        r = eng.run(TrialRequest(**trial, mechanism="graph_eval"), ctl)
        assert r.outcome == "completed", r.outcome
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    nodes, ranges = token.log_rows()
    token.log_enable(0, 0)
    by_seq = defaultdict(list)
    for row in nodes:
        by_seq[int(row[0])].append(row)
    out: dict = defaultdict(lambda: {"ranges": [], "calls": 0, "steps": []})
    for phase, a, b, step_cpu in spans:
        out[phase]["calls"] += 1
        for rr in ranges[a:b]:
            out[phase]["ranges"].append((rr, by_seq.get(int(rr[0]), [])))
        # the step call's CPU (the graph thread's, which calls back) against its synced ranges' CPU: the
        # rest ran where no sync was due (graph tails, the engine's own work between and before graphs)
        out[phase]["steps"].append((step_cpu, sum(rr[3] for rr in ranges[a:b] if rr[5] != -1)))
    return {"phases": dict(out), "process_cpu_over_wall": round(cpu / wall, 3) if wall else None}


def node_costs(eng, kind: str, trial: dict, runs: int) -> dict:
    """phase -> op -> CPU ns per node measured alone (slice 0: one node per range), median."""
    keep = eng.graph_slice_us
    eng.graph_slice_us = 0
    try:
        prof = profile_runs(eng, kind, trial, runs)
    finally:
        eng.graph_slice_us = keep
    out = {}
    for phase, d in prof["phases"].items():
        per = defaultdict(list)
        for rr, nds in d["ranges"]:
            if rr[5] == 0 and len(nds) == 1 and rr[3] > 0:
                per[int(nds[0][1])].append(rr[3])
        out[phase] = {op: statistics.median(v) for op, v in per.items()}
    return out


def summarise(d: dict, alone: dict, slice_us: int) -> dict:
    """The estimate against the cost of every plain range (probes learn, they are not sized)."""
    plain = [(rr, nds) for rr, nds in d["ranges"] if rr[5] == 0 and rr[2] > 0]
    ratio = [rr[3] / rr[2] for rr, _ in plain]
    q = lambda v, p: None if not v else round(percentile(v, p), 3)  # noqa: E731
    ops = defaultdict(lambda: {"nodes": 0, "est_ns": 0.0, "work": 0.0})
    for rr, nds in plain:
        kest = rr[2] / max(sum(n[4] for n in nds), 1e-9)  # the range's CPU ns per scaled work
        for n in nds:
            o = ops[int(n[1])]
            o["nodes"] += 1
            o["est_ns"] += n[4] * kest
            o["work"] += n[3]
    calls = max(d["calls"], 1)
    total_est = sum(o["est_ns"] for o in ops.values()) or 1.0
    total_cpu = sum(rr[3] for rr, _ in plain) or 1.0
    op_rows = []
    for op, o in sorted(ops.items(), key=lambda kv: -(kv[1]["nodes"] * alone.get(kv[0], 0.0))):
        measured = alone.get(op)
        op_rows.append({"op": op_name(op), "nodes_per_call": round(o["nodes"] / calls, 1),
                        "est_ns_per_node": round(o["est_ns"] / o["nodes"], 1),
                        "est_share": round(o["est_ns"] / total_est, 4),
                        "alone_cpu_ns_per_node": None if measured is None else round(measured, 1),
                        "alone_share_of_range_cpu": None if measured is None else
                        round(measured * o["nodes"] / total_cpu, 4)})
    worst = sorted(plain, key=lambda x: -x[0][3] / x[0][2])[:5]
    unsynced = [int(rr[1]) for rr, _ in d["ranges"] if rr[5] == -1]
    keys = [len({(int(n[1]), max(0, int(n[2]) - 10)) for n in nds}) for _, nds in plain]
    steps = d.get("steps", [])
    unpolled = [(cpu - synced) / 1e6 for cpu, synced in steps]
    return {"calls": d["calls"],
            # per step call: its CPU, and the part outside every synced range (a graph's unsynced tail, the
            # engine's work between and before its graphs): a cancel there is seen at the next node asked
            "step_cpu_ms": {"p50": q([c / 1e6 for c, _ in steps], 0.5),
                            "max": max((round(c / 1e6, 3) for c, _ in steps), default=None)},
            "unpolled_cpu_ms": {"p50": q(unpolled, 0.5), "max": max((round(u, 3) for u in unpolled), default=None)},
            "unpolled_share": None if not steps else round(sum(unpolled) * 1e6 / max(sum(c for c, _ in steps), 1), 3),
            "ranges": len(plain), "probes": sum(1 for rr, _ in d["ranges"] if rr[5] in (1, 2)),
            # ranges the scheduler computed without calling back (a graph's or split's tail, or a whole
            # graph estimated under the slice): never measured, their nodes per range
            "unsynced": len(unsynced), "unsynced_nodes": {"p50": q(unsynced, 0.5), "max": max(unsynced, default=None)},
            "nodes_per_range": {"p50": q([rr[1] for rr, _ in plain], 0.5),
                                "max": max((int(rr[1]) for rr, _ in plain), default=None)},
            "keys_per_range": {"p50": q(keys, 0.5), "max": max(keys, default=None)},
            "cpu_over_est": {"p50": q(ratio, 0.5), "p90": q(ratio, 0.9), "p99": q(ratio, 0.99),
                             "max": None if not ratio else round(max(ratio), 3),
                             "over_2x": sum(1 for r in ratio if r > 2.0)},
            "range_cpu_ms": {"p50": q([rr[3] / 1e6 for rr, _ in plain], 0.5),
                             "max": max((round(rr[3] / 1e6, 3) for rr, _ in plain), default=None)},
            "range_est_ms": {"p50": q([rr[2] / 1e6 for rr, _ in plain], 0.5),
                             "max": max((round(rr[2] / 1e6, 3) for rr, _ in plain), default=None)},
            "range_wall_ms_max": max((round(rr[4] / 1e6, 3) for rr, _ in plain), default=None),
            "slice_ms": slice_us / 1e3, "ops": op_rows[:25],
            "worst_ranges": [{"cpu_ms": round(rr[3] / 1e6, 3), "est_ms": round(rr[2] / 1e6, 3),
                              "wall_ms": round(rr[4] / 1e6, 3), "nodes": int(rr[1]),
                              "held": dict(sorted(_count_ops(nds).items(), key=lambda kv: -kv[1])[:8])}
                             for rr, nds in worst]}


def _count_ops(nds) -> dict:
    c: dict = defaultdict(int)
    for n in nds:
        c[op_name(int(n[1]))] += 1
    return c


def profile(args) -> dict:
    wanted = [g for g in GRAPHS if g in args.graphs]
    out: dict = {}
    for kind, (cls, wl, trial) in graph_engines(sorted({GRAPHS[g][0] for g in wanted})).items():
        eng = cls({**wl, "graph_slice_us": args.slice_us})
        try:
            for _ in range(2):  # warm: contexts built, costs learned at the slice
                eng.run(TrialRequest(**trial, mechanism="graph_eval"), _step_ctl(kind))
            reps = []
            for rep in range(args.repeats):
                load0 = host_load()
                prof = profile_runs(eng, kind, trial, args.runs)
                alone = node_costs(eng, kind, trial, args.node_runs)
                for _ in range(2):  # slice 0 forgot the costs: learn them again before the next repeat
                    eng.run(TrialRequest(**trial, mechanism="graph_eval"), _step_ctl(kind))
                reps.append((prof, alone, load0, host_load()))
            for g in [g for g in wanted if GRAPHS[g][0] == kind]:
                ph = GRAPHS[g][1]
                out[g] = {"phase": ph, "repeats": [
                    {**summarise(prof["phases"].get(ph, {"ranges": [], "calls": 0}), alone.get(ph, {}), args.slice_us),
                     "load_start": l0, "load_end": l1, "process_cpu_over_wall": prof["process_cpu_over_wall"]}
                    for prof, alone, l0, l1 in reps]}
                r0 = out[g]["repeats"]
                print(f"{g}: cpu/est p50 {[r['cpu_over_est']['p50'] for r in r0]} max "
                      f"{[r['cpu_over_est']['max'] for r in r0]} over2x {[r['cpu_over_est']['over_2x'] for r in r0]}"
                      f" of {[r['ranges'] for r in r0]}; range cpu max ms {[r['range_cpu_ms']['max'] for r in r0]}",
                      file=sys.stderr, flush=True)
        finally:
            eng.close()
    return out


def table(path: Path) -> list[str]:
    """Markdown rows of every run stored in ``path``: per graph and repeat, the estimate's fit."""
    rows = ["graph | run (load avg 1 min) | ranges | CPU / estimate p50 / p99 / max | over 2x | range CPU "
            "max ms | nodes per range p50 / max | keys per range | unsynced ranges (nodes max)",
            "---|---|---|---|---|---|---|---|---"]
    runs = json.loads(path.read_text())
    for g in GRAPHS:
        for label, run in runs.items():
            for i, r in enumerate(run["graphs"].get(g, {}).get("repeats", [])):
                c = r["cpu_over_est"]
                rows.append(f"{g} | {label}.{i + 1} ({r['load_start']['loadavg'][0]}) | {r['ranges']} | {c['p50']} / "
                            f"{c['p99']} / {c['max']} | {c['over_2x']} | {r['range_cpu_ms']['max']} | "
                            f"{r['nodes_per_range']['p50']:.0f} / {r['nodes_per_range']['max']} | "
                            f"{r['keys_per_range']['max']} | {r['unsynced']} ({r['unsynced_nodes']['max']})")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graphs", type=lambda v: [x for x in v.split(",") if x], default=list(GRAPHS))
    ap.add_argument("--runs", type=int, default=2, help="uncancelled runs per profile at the slice")
    ap.add_argument("--node-runs", type=int, default=1, help="slice-0 runs per profile (per-node CPU cost)")
    ap.add_argument("--repeats", type=int, default=2, help="profiles per graph (the host is shared)")
    ap.add_argument("--slice-us", type=int, default=2000)
    ap.add_argument("--variant", choices=("installed", "before", "after"), default="installed",
                    help="the reader to profile: the installed library, or cancel_token.c built before / after "
                         "issue 26's fixes (LEGACY_FLAGS)")
    ap.add_argument("--label", default="", help="key of this run in the JSON (default: the variant)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "graph_eval_profile.json")
    ap.add_argument("--table", action="store_true", help="print --out's runs as a markdown table, run nothing")
    args = ap.parse_args()
    if args.table:
        print("\n".join(table(args.out)))
        return 0
    args.label = args.label or args.variant
    if args.variant != _VARIANT:
        ap.error("give the variant as --variant=NAME (it is read before the imports)")
    flags = BUILD_FLAGS
    import harness

    t0 = time.time()
    result = {"bench": "graph_eval_profile", "label": args.label, "variant": args.variant, "build_flags": flags,
              "machine": harness.machine_facts(), "native_lib": Path(native._lib()._name).name,
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_start": host_load(),
              "runs": args.runs, "node_runs": args.node_runs, "repeats": args.repeats, "n_threads": 1,
              "how": "uncancelled graph_eval runs with the eval reader's log on; per plain range (not a probe) "
                     "the reader's estimate (learned CPU ns per scaled work x the range's scaled work) against "
                     "the graph thread's CPU time of the range; per op its nodes' share of the estimates and its "
                     "CPU per node measured alone (slice 0, sync overhead included)",
              "graphs": profile(args)}
    result.update(wall_s=round(time.time() - t0, 1), load_end=host_load())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    old[args.label] = result
    args.out.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {args.out} [{args.label}] ({result['wall_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
