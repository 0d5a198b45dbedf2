"""Residue split under load: graph_eval's residue per graph, split into engine work, CPU wait
and the rest, beside two busy loops (issue 26's acceptance).

Through the sweep path (``benchmarks/harness.py``): ``benchmarks/configs/residue.toml`` run by
``run_sweep`` into ``benchmarks/results/residue/``, summary in
``benchmarks/results/residue.json``, while ``--busy-loops`` (default 2) ``python3 -c 'while 1:
pass'`` processes run beside it (started by this script, each waited on until it has run on a
CPU, stopped after the sweep). One llama.cpp thread per engine, graph_eval at the default slice
(2000 us), agent delivery, cancels at a uniform point of a step call of the target phase
(``progress``): text decode (text ``generate``), the TTS code predictor step (tts
``generate``), the TTS step that runs code2wav (tts ``code2wav``), the STT clip encode (stt
``encode``).

Per graph, over its cancelled trials received inside a step call of that phase: the wall
residue (``latency_ms``) and its split (reports/residue.py: work = the trial thread's CPU,
wait = its run delay, rest = the remainder; additive per trial), each as p50 / max. Checks,
per trial:

* **work within the bound**: engine work <= slice + 2 x the graph's largest node, both CPU
  time. The largest node is a calibration, not a trial: bench_graph_eval.py's ``node_profiles``
  (the median over ``--node-profiles`` uncancelled slice-0 runs in this process, without the
  busy loops, of the longest eval-reader range inside that graph's step calls: one node + its
  sync; in the graph thread's CPU time for this bound, in wall time for the wall one), taken
  before the sweep with the same models, inputs and sizes. The wall residue is judged beside it
  against slice + 2 x the node's wall time (under two busy loops it is not expected to hold:
  that is the point).
* **additive**: |work + wait + rest - latency_ms| <= 1 ms (by construction; checked on the
  stored records), and **covered**: |latency_ms - cpu_window_ms| <= 1 ms (the trial thread's two
  reads span the wall residue: the split describes the residue it claims to).

Where the work went: ``trial_observe_cpu_ms`` (the trial thread's CPU from the receipt to the
eval reader's first sight of the token) and ``native_seen_where`` (``range_end``: the cancel came
while a range the reader asked to see was computed; ``next_ask``: it came where no node was polled,
a graph's unsynced tail or the engine's work between graphs) per graph, and for each trial over
the work bound.

Machine facts (cores, CPU model, load average at start and end, the host's runnable tasks and
load in the records) stand beside the numbers.

    python benchmarks/bench_residue.py [--trials 24] [--busy-loops 2] [--node-profiles 5] [--force]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
os.chdir(ROOT)  # the config's corpus paths are relative to the repository

import bench_graph_eval as bge  # noqa: E402  (llama_cpp first, as that module needs)
import harness  # noqa: E402

NAME = "residue"
# graph -> (workload, phase of its step calls, bench_graph_eval's engine kind)
GRAPHS = {"text_decode": ("text-decode", "generate", "text"), "tts_generate": ("tts", "generate", "tts"),
          "tts_code2wav": ("tts", "code2wav", "tts"), "stt_encode": ("stt", "encode", "stt")}
TOLERANCE_MS = 1.0


busy_loops = harness.busy_loops


def largest_nodes(profiles: int) -> dict:
    """graph -> bench_graph_eval's node profile of its phase (idle: before the busy loops)."""
    out: dict = {}
    kinds = sorted({k for _, _, k in GRAPHS.values()})
    for kind, (cls, wl, trial) in bge.graph_engines(kinds).items():
        phases = [ph for _, ph, k in GRAPHS.values() if k == kind]
        eng = cls({**wl, "graph_slice_us": bge.DEFAULT})
        try:
            for _ in range(2):  # warm: contexts built, costs learned at the slice
                eng.run(bge.TrialRequest(**trial, mechanism="graph_eval"), bge._ctl())
            prof = bge.node_profiles(eng, kind, trial, phases, profiles)
        finally:
            eng.close()
        for g, (_, ph, k) in GRAPHS.items():
            if k == kind:
                out[g] = prof[ph]
    return out


def _dist(values) -> dict:
    vals = sorted(float(v) for v in values)
    return {"p50": bge.percentile(vals, 0.5) if vals else None, "max": vals[-1] if vals else None}


def judge(out: Path, nodes: dict) -> dict:
    """Per graph: the split of its in-call cancelled trials and the per-trial checks."""
    from cancelbench.reports.residue import split
    from cancelbench.sink import read_records

    df = read_records(out)
    df = df[(df.trial_kind == "cancel") & (df.outcome == "cancelled") & df.native_call_at_receipt.notna()]
    result = {}
    for g, (workload, phase, _) in GRAPHS.items():
        d = df[(df.workload == workload) & (df.phase_at_receipt == phase)]
        # a receipt latched from the shared word has no run delay reading (docs/schema.md): its wait
        # counts as 0 and goes to the rest, as in the report (reports/residue.py split_frame), and is counted
        work, wait, rest = split(d.latency_ms, d.trial_cpu_ms, d.trial_cpu_wait_ms.fillna(0.0))
        bound = bge.DEFAULT / 1e3 + 2 * nodes[g]["largest_node_cpu_ms"]  # work is CPU time: the node's CPU
        wall_bound = bge.DEFAULT / 1e3 + 2 * nodes[g]["largest_node_ms"]  # the wall residue: the node's wall
        additive = (work + wait + rest - d.latency_ms).abs()
        covered = (d.latency_ms - d.cpu_window_ms).abs()
        result[g] = {
            "workload": workload, "phase": phase, "n": int(len(d)),
            "wall_ms": _dist(d.latency_ms), "work_ms": _dist(work), "wait_ms": _dist(wait), "rest_ms": _dist(rest),
            "wait_raw_over_cap": int((d.trial_cpu_wait_ms > wait + 1e-9).sum()),
            "wait_unknown": int(d.trial_cpu_wait_ms.isna().sum()),
            "engine_process": sorted(d.engine_process.dropna().astype(str).unique()) if "engine_process" in d else [],
            "largest_node": nodes[g], "slice_us": bge.DEFAULT, "bound_ms": round(bound, 3),
            "wall_bound_ms": round(wall_bound, 3),
            "work_within_bound": bool(len(d)) and bool((work <= bound).all()),
            "work_over_bound": int((work > bound).sum()),
            "wall_within_bound": bool(len(d)) and bool((d.latency_ms <= wall_bound).all()),
            "wall_over_bound": int((d.latency_ms > wall_bound).sum()),
            "additive_max_error_ms": float(additive.max()) if len(d) else None,
            "covered_max_gap_ms": float(covered.max()) if len(d) else None,
            "additive_within_1ms": bool(len(d)) and bool((additive <= TOLERANCE_MS).all()),
            "covered_within_1ms": bool(len(d)) and bool((covered <= TOLERANCE_MS).all()),
            "covered_over_1ms": int((covered > TOLERANCE_MS).sum()),
            "host_procs_running_p50": float(d.host_procs_running.median()) if len(d) else None,
            "host_loadavg_1m_max": float(d.host_loadavg_1m.max()) if len(d) else None,
            "cpu_snapshot_us": _dist(d.cpu_snapshot_us.dropna()),
            **_before_seen(d, work, bound)}
    return result


def _before_seen(d, work, bound: float) -> dict:
    """Engine work before / after the eval reader saw the token (``trial_observe_cpu_ms``), where it
    saw it (``native_seen_where``), and each over-bound trial with both: a cancel seen at a node's
    ask came where no node was polled (the engine's work between graphs), not in a range."""
    if "trial_observe_cpu_ms" not in d:
        return {}
    before = d.trial_observe_cpu_ms
    where = d.native_seen_where.fillna("(none)").astype(str)
    over = d[work > bound]
    return {
        "before_seen_ms": _dist(before.dropna()), "after_seen_ms": _dist((work - before).dropna()),
        "seen_where": {k: int(v) for k, v in where.value_counts().items()},
        "work_over_bound_where": {k: int(v) for k, v in where[work > bound].value_counts().items()},
        "over_bound_trials": [{"trial_id": str(r.trial_id), "work_ms": round(float(w), 3),
                               "before_seen_ms": None if r.trial_observe_cpu_ms != r.trial_observe_cpu_ms
                               else round(float(r.trial_observe_cpu_ms), 3),
                               "seen_where": None if not isinstance(r.native_seen_where, str) else r.native_seen_where}
                              for r, w in zip(over.itertuples(), work[work > bound])]}


def table(graphs: dict) -> list[str]:
    r = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    pair = lambda d: f"{r(d['p50'])} / {r(d['max'])}"  # noqa: E731
    where = lambda c, k: (f"{c[k].get('range_end', 0)} / {c[k].get('next_ask', 0)}" if k in c else "-")  # noqa: E731
    rows = ["graph | n | wall p50 / max | work p50 / max | wait p50 / max | rest p50 / max | largest node CPU / wall "
            "| work bound (within) | wall bound (within) | additive / covered (max ms) | work before seen p50 / max "
            "| seen at range end / next ask | over bound: at range end / next ask",
            "---|---|---|---|---|---|---|---|---|---|---|---|---"]
    for g, c in graphs.items():
        n = c["n"]
        add = "-" if c["additive_max_error_ms"] is None else f"{c['additive_max_error_ms']:.4f}"
        cov = "-" if c["covered_max_gap_ms"] is None else f"{c['covered_max_gap_ms']:.3f}"
        unknown = f" ({c['wait_unknown']} wait unknown)" if c.get("wait_unknown") else ""
        rows.append(f"{g} | {n}{unknown} | {pair(c['wall_ms'])} | {pair(c['work_ms'])} | {pair(c['wait_ms'])} | "
                    f"{pair(c['rest_ms'])} | {r(c['largest_node']['largest_node_cpu_ms'])} / "
                    f"{r(c['largest_node']['largest_node_ms'])} | {r(c['bound_ms'])} ({n - c['work_over_bound']}/{n}) | "
                    f"{r(c['wall_bound_ms'])} ({n - c['wall_over_bound']}/{n}) | {add} / {cov} | "
                    f"{pair(c['before_seen_ms']) if 'before_seen_ms' in c else '-'} | {where(c, 'seen_where')} | "
                    f"{where(c, 'work_over_bound_where')}")
    return rows


def main() -> int:
    ap = harness.arg_parser(NAME, __doc__.splitlines()[0])
    ap.add_argument("--busy-loops", type=int, default=2, help="busy loops beside the sweep (default 2)")
    ap.add_argument("--node-profiles", type=int, default=5, help="slice-0 profiles per largest node (default 5)")
    args = ap.parse_args()
    out, json_path = harness.paths(NAME, args.out)
    config = harness.config_for(args)
    machine = {**harness.machine_facts(), "load_average_before_calibration": harness._loadavg()}
    t0 = time.monotonic()
    if args.resummarise and json_path.exists():  # the run's own calibration, not a new one
        old = json.loads(json_path.read_text())
        nodes, machine = {g: c["largest_node"] for g, c in old["graphs"].items()}, old["machine"]
        calibration_s, busy = old["calibration_s"], old["busy_loops"]
        config, facts = harness.run_or_resummarise("bench_residue", args, config, out, json_path)
    else:
        nodes = largest_nodes(args.node_profiles)
        calibration_s = round(time.monotonic() - t0, 1)
        print(f"largest nodes: { {g: n['largest_node_ms'] for g, n in nodes.items()} }", file=sys.stderr, flush=True)
        with busy_loops(args.busy_loops) as pids:
            config, facts = harness.run_or_resummarise("bench_residue", args, config, out, json_path)
        busy = {"n": len(pids), "command": "python3 -c 'while 1: pass'",
                "started": "before the sweep, each waited on until it had run 50 ms on a CPU"}
    summary = harness.summarise(out)
    graphs = judge(out, nodes)
    doc = harness.write_json(
        json_path, name=NAME, config=config, run_facts=facts, summary=summary, machine=machine, note=args.note,
        default_trials=harness.load_config(args.config).trials_per_cell,
        extra={"busy_loops": busy, "calibration_s": calibration_s, "graphs": graphs, "table": table(graphs),
               "all_work_within_bound": all(c["work_within_bound"] for c in graphs.values()),
               # the cancels a node reader can see in flight: those that came while a range was computed
               "all_range_end_within_bound": all(c.get("work_over_bound_where", {}).get("range_end", 0) == 0
                                                 for c in graphs.values()),
               "all_additive_and_covered": all(c["additive_within_1ms"] and c["covered_within_1ms"]
                                               for c in graphs.values())})
    print("\n".join(doc["table"]), file=sys.stderr)
    print(f"wrote {out}/ and {json_path}", file=sys.stderr)
    return facts["sweep_exit_code"]


if __name__ == "__main__":
    sys.exit(main())
