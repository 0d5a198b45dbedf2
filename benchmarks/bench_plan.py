"""Plan generation, hashing and the plan table for the largest plan a sweep allows (issue 17).

Times, on this machine, what the driver does before the first trial -- ``build_plan``, the plan's
sha256 and the ``plan.parquet`` table -- for the current code and for ``orchestrator/plan.py`` at a
given git revision (the code before, with its whole-plan JSON hash and ``from_pylist`` table), and
checks that both give the same plan and the same hash. Writes benchmarks/results/plan_scale.json.

    .venv/bin/python benchmarks/bench_plan.py [--before REV] [--trials N] [--repeat K]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa

from cancelbench.orchestrator import plan as current
from cancelbench.orchestrator.config import (MAX_PLAN_TRIALS, MAX_TRIALS_PER_CELL, SweepConfig, WorkloadSpec,
                                             trials_per_device)

ROOT = Path(__file__).resolve().parent.parent


def old_module(rev: str):
    """``orchestrator/plan.py`` at ``rev``, imported as a sibling of the current plan module."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:orchestrator/plan.py"], check=True,
                         capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("cancelbench.orchestrator._plan_before", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "cancelbench.orchestrator"
    sys.modules[spec.name] = mod
    exec(compile(src, f"{rev}:orchestrator/plan.py", "exec"), mod.__dict__)
    return mod


def largest_config(trials: int) -> SweepConfig:
    """One workload, every text mechanism, both deliveries: 4 * (3 + 2 * trials) trials per device."""
    return SweepConfig(trials_per_cell=trials, mechanisms=("between_calls", "abort_callback", "chunked", "graph_eval"),
                       workloads=(WorkloadSpec(name="text-prefill"),))


def timed(fn):
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(mod, config, devices, inputs, new: bool) -> dict:
    plan, t_build = timed(lambda: mod.build_plan(config, devices, inputs))
    if new:
        sha, t_hash = timed(lambda: mod.plan_sha256(plan))
        table, t_table = timed(lambda: mod.plan_table(plan))
        _, t_split = timed(lambda: plan.by_device(set()))
    else:
        sha, t_hash = timed(lambda: hashlib.sha256(
            json.dumps([t.to_dict() for t in plan], sort_keys=True).encode()).hexdigest())
        table, t_table = timed(lambda: pa.Table.from_pylist([t.to_dict() for t in plan]))

        def split():  # the runner's loop before: each device's trials to run
            by_device = {}
            for t in plan:
                by_device.setdefault(t.device, []).append(t)
            return by_device
        _, t_split = timed(split)
    total = t_build + t_hash + t_table + t_split
    return {"trials": len(plan), "build_s": round(t_build, 2), "hash_s": round(t_hash, 2),
            "table_s": round(t_table, 2), "split_by_device_s": round(t_split, 2), "total_s": round(total, 2),
            "sha256": sha, "_plan": plan, "_table": table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="6c69aaa", help="git revision of the code before (default: issue 17's base)")
    ap.add_argument("--trials", type=int, default=MAX_TRIALS_PER_CELL, help="trials_per_cell")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_scale.json"))
    args = ap.parse_args()
    config = largest_config(args.trials)
    devices = ["vm/cpu:0"]
    inputs = {"text-prefill": [f"p{i}" for i in range(8)]}
    results = {}
    pa.array([f"w{i}" for i in range(1000)], type=pa.string())  # warm pyarrow up (the driver has, by then)
    pa.Table.from_pylist([{"a": "b", "c": 1}])
    for label, mod, new in (("after", current, True), ("before", old_module(args.before), False)):
        runs = []
        for _ in range(args.repeat):
            r = measure(mod, config, devices, inputs, new)
            runs.append(r)
            print(label, {k: v for k, v in r.items() if not k.startswith("_")}, flush=True)
        best = min(runs, key=lambda r: r["total_s"])
        results[label] = best
    a, b = results["after"], results["before"]
    same_plan = [t.__dict__ for t in a["_plan"]] == [t.to_dict() for t in b["_plan"]]
    same_hash = current.legacy_plan_sha256(a["_plan"]) == b["sha256"]  # a resumed older dataset still matches
    same_table = a["_table"].to_pylist() == b["_table"].select(a["_table"].column_names).to_pylist()
    for r in results.values():
        for k in ("_plan", "_table"):
            r.pop(k)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {
        "what": "driver time before the first trial for the largest plan a sweep allows: build_plan, the plan "
                "sha256, the plan.parquet table, the split into each device's trials (one device, one workload, "
                "4 mechanisms, 2 deliveries). After: a columnar plan whose TrialSpec objects are made as the "
                "device threads read them (about 1 us each, beside trials of milliseconds).",
        "trials_per_cell": args.trials, "trials_per_device": trials_per_device(config),
        "max_plan_trials_per_sweep": MAX_PLAN_TRIALS,
        "before_rev": args.before, "before": results["before"], "after": results["after"],
        "speedup": round(b["total_s"] / a["total_s"], 1) if a["total_s"] else None,
        "same_plan": same_plan, "legacy_sha256_matches_before": same_hash, "same_table": same_table,
        "peak_rss_mib_process": round(peak_mib),
        "machine": {"nproc": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
                    "python": platform.python_version(), "platform": platform.platform(),
                    "cpu": platform.processor() or platform.machine()},
        "repeat": args.repeat, "note": "best of `repeat` runs; the machine is shared (see loadavg)",
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("what",)}, indent=1))


if __name__ == "__main__":
    main()
