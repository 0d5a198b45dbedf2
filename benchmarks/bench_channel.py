"""What the engine protocol costs the agent's process a trial, by where the sim engine runs: called
directly (``agent``, the path issue 34 retires), over the in-process channel (``channel``, its default:
cancelbench.sut.channel) and in a child process (``child``: the agent's side only; the child's CPU is
its own). The agent's own engine classes and control, no Ray: per trial, a cancel 15 ms into a sim run
of 20 ms phases (abort_callback, 1 ms checks), the record's columns taken, as the agent does.

Per mode, side by side in one run (interleaved rounds, so drift in the machine falls on all three):
this process's CPU time per trial, and its split by thread (the agent's trial thread, the engine's
trial thread and stdin thread on the channel, the agent's stdout reader), wall time per trial, and the
outcomes. A trial whose cancel came after it completed (the timer late on a loaded host) costs
about what a cancelled one does, so it is counted and said; a mode with under 90% of its trials
cancelled fails the run (its trials would no longer be the same work).

    python benchmarks/bench_channel.py [--trials 200] [--rounds 3] [--out benchmarks/results/channel.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

MODES = ("agent", "channel", "child")
SETTINGS = {"sim_phase_us": 20_000, "sim_granularity_us": 1_000, "sim_steps": 4}
CANCEL_AFTER_S = 0.015


def _thread_cpu() -> dict[str, int]:
    """CPU ns of each live thread of this process, summed by thread name."""
    from cancelbench.device_agents.cpu_account import thread_cpu_ns

    out: dict[str, int] = {}
    for th in threading.enumerate():
        try:
            out[th.name] = out.get(th.name, 0) + thread_cpu_ns(th.native_id)
        except (OSError, TypeError):
            pass
    return out


def measure(mode: str, trials: int, warmup: int = 20) -> dict:
    from cancelbench import native
    from cancelbench.device_agents.engines.base import CancelControl, Progress
    from cancelbench.device_agents.engines.registry import make_engine
    from cancelbench.request import TrialRequest

    engine = make_engine({"engine": "sim", "engine_process": mode, **SETTINGS})
    outcomes: dict[str, int] = {}

    def trial(i: int) -> str:
        ctl = CancelControl(native.CancelToken(), Progress())
        timer = threading.Timer(CANCEL_AFTER_S, lambda: ctl.request(native.now_ns()))
        timer.start()
        result = engine.run(TrialRequest("abort_callback", "", trial_id=f"{mode}.{i}", trial_kind="cancel",
                                         delivery="agent"), ctl)
        if hasattr(engine, "trial_columns"):
            engine.trial_columns()
        timer.join()
        return result.outcome

    try:
        for i in range(warmup):
            trial(i)
        threads0, cpu0, wall0 = _thread_cpu(), time.process_time_ns(), time.monotonic_ns()
        for i in range(trials):
            out = trial(warmup + i)
            outcomes[out] = outcomes.get(out, 0) + 1
        threads1, cpu1, wall1 = _thread_cpu(), time.process_time_ns(), time.monotonic_ns()
    finally:
        engine.close()
    by_thread = {k: round((v - threads0.get(k, 0)) / 1e6 / trials, 3) for k, v in threads1.items()
                 if k in threads0 and v > threads0[k]}
    return {"mode": mode, "trials": trials, "outcomes": outcomes,
            "cpu_ms_per_trial": round((cpu1 - cpu0) / 1e6 / trials, 3),
            "wall_ms_per_trial": round((wall1 - wall0) / 1e6 / trials, 3),
            "cpu_ms_per_trial_by_thread": by_thread}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "channel.json")
    args = ap.parse_args()
    if args.trials < 1 or args.rounds < 1:
        print("bench_channel: --trials and --rounds must be at least 1", file=sys.stderr)
        return 2
    machine = {**harness.machine_facts(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    runs = []
    for r in range(args.rounds):
        for mode in MODES:
            run = {"round": r, **measure(mode, args.trials)}
            print(json.dumps(run), file=sys.stderr, flush=True)
            if run["outcomes"].get("cancelled", 0) < 0.9 * args.trials:
                print(f"bench_channel: {mode}: under 90% of its trials cancelled: {run['outcomes']}", file=sys.stderr)
                return 1
            runs.append(run)
    summary = {mode: {"cpu_ms_per_trial_median": statistics.median(r["cpu_ms_per_trial"] for r in runs
                                                                     if r["mode"] == mode),
                      "wall_ms_per_trial_median": statistics.median(r["wall_ms_per_trial"] for r in runs
                                                                      if r["mode"] == mode)}
               for mode in MODES}
    for mode in MODES:
        summary[mode]["cpu_vs_agent"] = round(summary[mode]["cpu_ms_per_trial_median"]
                                              / summary["agent"]["cpu_ms_per_trial_median"], 2)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "bench_channel", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": head.stdout.strip(),
        "machine": machine, "settings": SETTINGS, "cancel_after_ms": CANCEL_AFTER_S * 1e3,
        "summary": summary, "runs": runs, "reproduce": "python benchmarks/bench_channel.py"}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
