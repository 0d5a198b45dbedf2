"""Cancel mechanisms side by side, in one run, on the same model and offsets.

Reports (JSON on stdout, also benchmarks/results/mechanisms.json, and a table
on stderr):
* in-flight prefill cancel latency p50/p99/max per mechanism, plus the status
  quo of llama-cpp-python users: breaking out of
  ``Llama.create_completion(stream=True)``, which can only stop between evals;
* the known-answer probe's error (measured return minus the first check after
  the set), p50/p99;
* harness overhead per trial: driver-observed wall time of an uncancelled trial
  through Ray minus the agent's own duration, over that duration.

Targets (checked, listed under "targets"): abort_callback p99 at least 20x
below between_calls during prefill; probe error p99 under 1 ms; harness
overhead under 5% of the trial's duration.

    python benchmarks/bench_mechanisms.py [--trials 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")

import numpy as np

from cancelbench.request import TrialRequest
from cancelbench.reports.stats import percentile

from cancelbench import native
from cancelbench.datasets.fixtures import ensure_text_fixture
from cancelbench.device_agents.engines.base import CancelControl, Progress
from cancelbench.device_agents.engines.text import TextEngine

PROMPT = ("Explain to a new colleague how the test harness measures the time between pressing cancel and the "
          "engine going quiet, and which timestamps it records on the way.")
WORKLOAD = {"n_threads": 2, "n_batch": 256, "n_ubatch": 256, "prompt_tokens": 256, "max_tokens": 4,
            "chunk_tokens": 32}



def summary(values):
    return {"n": len(values), "p50_ms": percentile(values, 0.5), "p99_ms": percentile(values, 0.99),
            "max_ms": max(values) if values else None}


def cancel_at(ctl: CancelControl, t0_ns: int, offset_ms: float) -> threading.Thread:
    def fire():
        deadline = t0_ns + int(offset_ms * 1e6)
        while native.now_ns() < deadline:
            time.sleep(0.0002)
        ctl.request(native.now_ns())

    th = threading.Thread(target=fire, daemon=True)
    th.start()
    return th


def engine_trial(engine: TextEngine, mechanism: str, offset_ms: float) -> tuple[float | None, str]:
    ctl = CancelControl(native.CancelToken(), Progress())
    th = cancel_at(ctl, native.now_ns(), offset_ms)
    res = engine.run(TrialRequest(input=PROMPT, mechanism=mechanism), ctl)
    th.join()
    if res.outcome != "cancelled" or ctl.received_ns is None:
        return None, "completed"
    return (res.t_terminal_ns - ctl.received_ns) / 1e6, ctl.at_receipt.get("phase_at_receipt")


def status_quo_trial(llm, tokens: list[int], offset_ms: float) -> tuple[float | None, str]:
    """A llama-cpp-python user's cancel: set a flag, break out of the stream loop."""
    state = {"flag": False, "set_ns": None, "first_token": False}

    def fire(t0):
        deadline = t0 + int(offset_ms * 1e6)
        while native.now_ns() < deadline:
            time.sleep(0.0002)
        state["set_ns"] = native.now_ns()
        state["phase"] = "generate" if state["first_token"] else "prefill"
        state["flag"] = True

    llm.reset()
    th = threading.Thread(target=fire, args=(native.now_ns(),), daemon=True)
    th.start()
    stopped = None
    for _chunk in llm.create_completion(tokens, max_tokens=WORKLOAD["max_tokens"], stream=True, temperature=0.0):
        state["first_token"] = True
        if state["flag"]:
            stopped = native.now_ns()
            break
    th.join()
    if stopped is None:
        return None, "completed"
    return (stopped - state["set_ns"]) / 1e6, state["phase"]


def probe_errors(n: int, period_us: int = 1000) -> list[float]:
    rng = np.random.default_rng(7)
    errors = []
    for _ in range(n):
        t = native.CancelToken()
        delay = float(rng.uniform(0.002, 0.02))
        th = threading.Thread(target=lambda: (time.sleep(delay), t.set()), daemon=True)
        th.start()
        aborted, start, end = native.probe_busy(t, 200_000, period_us)
        th.join()
        if aborted:
            errors.append((end - native.probe_expected_return_ns(start, t.set_ns, period_us)) / 1e6)
    return errors


def harness_overhead(model: str, n: int) -> dict:
    """Uncancelled trials through a real local Ray agent: driver wall vs agent duration."""
    import ray

    from cancelbench.orchestrator import cluster
    from cancelbench.orchestrator.cluster import DeviceSlot

    cluster.connect(None)
    node = ray.get_runtime_context().get_node_id()
    agent = cluster.start_agent(DeviceSlot(node_id=node, host="local", device_id="cpu:0"), n_threads=2)
    from cancelbench.datasets.fixtures import fixture_lock_entries
    ray.get(agent.load.remote({**WORKLOAD, "engine": "text", "model": "fixture:text-llama-57m",
                               "locks": fixture_lock_entries("text-llama-57m")}))
    ratios, walls = [], []
    for i in range(n):
        t0 = time.monotonic_ns()
        row = ray.get(agent.run_trial.remote(TrialRequest(trial_id=f"oh{i}", input=PROMPT,
                                                           mechanism="between_calls")))
        wall = (time.monotonic_ns() - t0) / 1e6
        dur = (row.t_terminal_ns - row.t_handback_ns) / 1e6
        walls.append(wall)
        ratios.append((wall - dur) / dur)
    ray.kill(agent)
    ray.shutdown()
    return {"n": n, "overhead_ratio_p50": percentile(ratios, 0.5), "overhead_ratio_p90": percentile(ratios, 0.9),
            "trial_wall_ms_p50": percentile(walls, 0.5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mechanisms.json")
    args = ap.parse_args()

    model = str(ensure_text_fixture("text-llama-57m"))
    engine = TextEngine({**WORKLOAD, "model": model})
    refs = []
    for _ in range(3):
        ctl = CancelControl(native.CancelToken(), Progress())
        r = engine.run(TrialRequest(input=PROMPT, mechanism="between_calls"), ctl)
        refs.append(r.phase_durations_ms["prefill"])
    prefill_ms = float(np.median(refs))
    offsets = np.random.default_rng(2026).uniform(0.1, 0.85, args.trials) * prefill_ms

    from llama_cpp import Llama
    llm = Llama(model_path=model, n_ctx=512, n_batch=256, n_ubatch=256, n_threads=2, verbose=False)
    tokens = engine.prompt_for(PROMPT)

    lat: dict[str, list[float]] = {m: [] for m in ("between_calls", "chunked", "abort_callback", "graph_eval",
                                                   "status_quo_stream")}
    missed: dict[str, int] = {m: 0 for m in lat}
    for off in offsets:  # interleaved: every mechanism gets the same offset back to back
        for mech in lat:
            if mech == "status_quo_stream":
                ms, phase = status_quo_trial(llm, tokens, off)
            else:
                ms, phase = engine_trial(engine, mech, off)
            if ms is None or phase != "prefill":
                missed[mech] += 1
                continue
            lat[mech].append(ms)
    engine.close()
    del llm

    errors = probe_errors(200)
    overhead = harness_overhead(model, 15)

    result = {
        "benchmark": "mechanisms",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "model": Path(model).name, "workload": WORKLOAD, "reference_prefill_ms": prefill_ms,
        "offsets_ms": [float(o) for o in offsets],
        "prefill_cancel_latency": {m: summary(v) for m, v in lat.items()},
        "not_in_prefill_or_completed": missed,
        "known_answer_probe": {"period_us": 1000, **{k.replace("_ms", "_error_ms"): v
                                                     for k, v in summary([abs(e) for e in errors]).items()}},
        "harness_overhead": overhead,
    }
    bc, ab = result["prefill_cancel_latency"]["between_calls"], result["prefill_cancel_latency"]["abort_callback"]
    ratio = (bc["p99_ms"] / ab["p99_ms"]) if bc["p99_ms"] and ab["p99_ms"] else None
    result["targets"] = {
        "abort_p99_20x_below_between_calls": {"ratio": ratio, "met": bool(ratio and ratio >= 20)},
        "probe_error_p99_under_1ms": {"value_ms": result["known_answer_probe"]["p99_error_ms"],
                                      "met": bool(result["known_answer_probe"]["p99_error_ms"] < 1.0)},
        "harness_overhead_under_5pct": {"value": overhead["overhead_ratio_p50"],
                                        "met": bool(overhead["overhead_ratio_p50"] < 0.05)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mechanism':<20} {'n':>3} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}", file=sys.stderr)
    for m, s in result["prefill_cancel_latency"].items():
        fmt = lambda v: f"{v:9.2f}" if v is not None else f"{'-':>9}"
        print(f"{m:<20} {s['n']:>3} {fmt(s['p50_ms'])} {fmt(s['p99_ms'])} {fmt(s['max_ms'])}", file=sys.stderr)
    for name, t in result["targets"].items():
        print(f"target {name}: {'met' if t['met'] else 'NOT met'} ({json.dumps({k: v for k, v in t.items() if k != 'met'})})",
              file=sys.stderr)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
