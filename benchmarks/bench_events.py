"""Engine events through the agent's reader: the JSON schema (before) against typed decoding (after).

The agent's real reader (``EngineProcess._read_stdout``, cancelbench/sut/client.py) reads a
real pipe: a ``cat`` child writes a stream of a fast-stepping engine's events (per trial: a
phase, step start/end pairs, a second phase, more steps, cancel_seen, done; 40,000 step
events in all by default), and a consumer thread takes them off the queue as a trial's
reader does. The reader stamps every line with the agent's clock when it has read it; with
the pipe always full (``cat`` is far ahead) the gap between two consecutive stamps is the
agent's cost of one event (read the line, decode and check it, queue it). Three readers,
interleaved over ``--rounds`` rounds on one stream:

* ``before``: the reader with ``protocol.decode_reference`` (``json.loads``, then
  ``jsonschema``'s Draft 2020-12 validator of the message's definition in schema.json:
  the decode path before typed decoding);
* ``after``: the reader as it is (``protocol.decode``: msgspec);
* ``floor``: the reader with a decode that returns a constant (what reading, stamping and
  queueing cost without any decoding).

Also ``decode`` alone, per message type (both directions: the engine side decodes the
agent's messages with the same module), each call timed on its own.

Writes ``benchmarks/results/events.json`` with the machine facts (CPU, cores, load average
at start and end, Python and library versions) beside the numbers.

Target: an event costs the agent under 20 us (p50 of ``after``).

    python benchmarks/bench_events.py [--steps 40000] [--rounds 3] [--out PATH] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

from cancelbench.sut import client, protocol  # noqa: E402

TARGET_US = 20.0
OUT = Path(__file__).resolve().parent / "results" / "events.json"
T0 = 81_220_333_017_000


def stream(steps: int, trials: int = 10) -> list[bytes]:
    """A fast-stepping engine's events as its server writes them (protocol.encode)."""
    lines, t = [], T0
    per_phase = steps // trials // 4  # step pairs per phase, two phases a trial
    for i in range(trials):
        trial = f"sw-1.cpu0.text-llama-57m.native_abort.cancel.{i:04d}"
        for phase in ("prefill", "generate"):
            t += 1000
            lines.append(protocol.encode({"type": "phase", "trial": trial, "phase": phase, "t": t}))
            for _ in range(per_phase):
                for edge in ("start", "end"):
                    t += 2500
                    lines.append(protocol.encode({"type": "step", "trial": trial, "phase": phase, "edge": edge, "t": t}))
        lines.append(protocol.encode({"type": "cancel_seen", "trial": trial, "t": t + 10}))
        lines.append(protocol.encode({"type": "done", "trial": trial, "outcome": "cancelled", "t": t + 20,
                                      "phase": "generate", "cancel_received_t": t + 5, "native_returned_t": t + 15,
                                      "counters": {"steps": per_phase * 2, "tokens": per_phase}}))
    return lines


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))] if s else float("nan")


def through_reader(path: Path, decode) -> dict:
    """The real reader on a pipe fed by ``cat path``, with ``decode`` as its decode function."""
    ep = client.EngineProcess(["cat", str(path)])
    taken: list = []

    def consume() -> None:
        while True:
            got = ep.messages.get()
            taken.append(got)
            if got.msg is None:
                return

    saved = client.decode
    client.decode = decode
    try:
        ep.proc = subprocess.Popen(["cat", str(path)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        consumer = threading.Thread(target=consume)
        consumer.start()
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
        ep._read_stdout()  # the reader thread's loop, run here until end of stream
        cpu, wall = time.thread_time_ns() - cpu0, time.perf_counter_ns() - wall0
        consumer.join()
        ep.proc.wait()
    finally:
        client.decode = saved
    errors = [r.error for r in taken if r.error is not None]
    assert not errors, errors[:3]
    stamps = [r.t_read_ns for r in taken if r.msg is not None]
    gaps = [(b - a) / 1000 for a, b in zip(stamps, stamps[1:])]
    return {"events": len(stamps), "wall_s": wall / 1e9, "reader_cpu_s": cpu / 1e9,
            "events_per_s": len(stamps) / (wall / 1e9), "us_per_event_mean": wall / 1000 / len(stamps),
            "gap_us_p50": pct(gaps, 50), "gap_us_p99": pct(gaps, 99), "gap_us_max": max(gaps)}


def per_call(decode, line: bytes, allowed: tuple[str, ...], n: int) -> dict:
    clock = time.perf_counter_ns
    times = []
    for _ in range(n):
        a = clock()
        decode(line, allowed, True)
        times.append((clock() - a) / 1000)
    return {"us_p50": pct(times, 50), "us_p99": pct(times, 99)}


def decode_table(calls: int) -> list[dict]:
    engine = {k: protocol.encode(m) for k, m in {
        "phase": {"type": "phase", "trial": "sw-1.cpu0.t.0001", "phase": "generate", "t": T0},
        "step": {"type": "step", "trial": "sw-1.cpu0.t.0001", "phase": "generate", "edge": "start", "t": T0},
        "cancel_seen": {"type": "cancel_seen", "trial": "sw-1.cpu0.t.0001", "t": T0},
        "done": {"type": "done", "trial": "sw-1.cpu0.t.0001", "outcome": "cancelled", "t": T0, "phase": "generate",
                 "cancel_received_t": T0, "native_returned_t": T0, "counters": {"steps": 40, "tokens": 20}},
        "pong": {"type": "pong", "id": 7, "t": T0},
    }.items()}
    agent = {k: protocol.encode(m) for k, m in {
        "ping": {"type": "ping", "id": 7, "t": T0},
        "cancel": {"type": "cancel", "trial": "sw-1.cpu0.t.0001"},
        "run": {"type": "run", "trial": "sw-1.cpu0.t.0001", "mechanism": "native_abort", "input": "The quick brown fox",
                "settings": {"n_threads": 2}, "output_path": None},
    }.items()}
    rows = []
    for side, lines, allowed in (("engine -> agent", engine, protocol.ENGINE_TYPES),
                                 ("agent -> engine", agent, protocol.AGENT_TYPES)):
        for kind, line in lines.items():
            before = per_call(protocol.decode_reference, line, allowed, max(200, calls // 20))
            after = per_call(protocol.decode, line, allowed, calls)
            rows.append({"direction": side, "type": kind, "bytes": len(line), "before": before, "after": after,
                         "speedup_p50": before["us_p50"] / after["us_p50"]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40_000, help="step events in the stream (default 40,000)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of before / after / floor")
    ap.add_argument("--calls", type=int, default=20_000, help="decode calls per message type (after; before: 1/20)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--note", default="")
    args = ap.parse_args()

    machine = harness.machine_facts()
    machine["load_average_start"] = os.getloadavg()
    machine["libraries"] = {name: version(name) for name in ("msgspec", "jsonschema")}
    lines = stream(args.steps)
    const = {"type": "step"}
    readers = {"before": protocol.decode_reference, "after": protocol.decode,
               "floor": lambda line, allowed, skip_unknown=False: const}
    runs: dict[str, list[dict]] = {k: [] for k in readers}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.jsonl"
        path.write_bytes(b"".join(lines))
        for name, decode in readers.items():  # warm: validators built, caches filled
            through_reader(path, decode)
        for r in range(args.rounds):
            for name, decode in readers.items():
                runs[name].append(through_reader(path, decode))
                print(f"round {r + 1} {name}: {runs[name][-1]['events_per_s']:,.0f} events/s", file=sys.stderr)
    decode_rows = decode_table(args.calls)
    machine["load_average_end"] = os.getloadavg()

    reader = {}
    for name, rs in runs.items():
        best = min(rs, key=lambda x: x["wall_s"])
        reader[name] = {"rounds": rs, "events": rs[0]["events"],
                        "events_per_s_median": statistics.median(x["events_per_s"] for x in rs),
                        "us_per_event_mean_median": statistics.median(x["us_per_event_mean"] for x in rs),
                        "gap_us_p50_median": statistics.median(x["gap_us_p50"] for x in rs),
                        "gap_us_p99_median": statistics.median(x["gap_us_p99"] for x in rs),
                        "best_round_wall_s": best["wall_s"]}
    after = reader["after"]["gap_us_p50_median"]
    doc = {"benchmark": "events", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "note": args.note,
           "machine": machine,
           "stream": {"lines": len(lines), "step_events": sum(b'"step"' in x for x in lines),
                      "bytes": sum(map(len, lines)), "trials": 10},
           "method": "the real EngineProcess._read_stdout on a pipe fed by cat, a consumer thread draining its "
                     "queue; per event: the gap between consecutive read stamps (the pipe always full)",
           "reader": reader, "decode": decode_rows, "target_us_p50": TARGET_US, "met": bool(after < TARGET_US),
           "reproduce": "python benchmarks/bench_events.py"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")

    print(f"{'reader':8} {'events/s':>12} {'us/event':>9} {'p50 us':>8} {'p99 us':>8}")
    for name, r in reader.items():
        print(f"{name:8} {r['events_per_s_median']:>12,.0f} {r['us_per_event_mean_median']:>9.2f} "
              f"{r['gap_us_p50_median']:>8.2f} {r['gap_us_p99_median']:>8.2f}")
    print(f"\n{'direction':16} {'type':12} {'before p50/p99 us':>20} {'after p50/p99 us':>18} {'x':>6}")
    for row in decode_rows:
        b, a = row["before"], row["after"]
        print(f"{row['direction']:16} {row['type']:12} {b['us_p50']:>11.1f} / {b['us_p99']:<6.1f} "
              f"{a['us_p50']:>9.2f} / {a['us_p99']:<6.2f} {row['speedup_p50']:>6.0f}")
    print(f"\ntarget: p50 under {TARGET_US} us per event: {'met' if doc['met'] else 'NOT met'}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
