"""What the engine protocol adds: the text engine in process and out of process, in one sweep.

Runs ``benchmarks/configs/protocol.toml`` through the sweep path (a local Ray, one
CPU agent): the same text workload (text-llama-57m, 2 threads, 128-token prompt in
batches of 64, 8 generated tokens) twice, once as the built-in in-process engine and
once as an external engine (``python -m cancelbench.sut.builtin text``, the same
engine code behind the protocol), under ``abort_callback`` and ``between_calls``,
both deliveries, interleaved on one device, cancels uniform over 80% of each cell's
reference run. Writes ``benchmarks/results/protocol/`` (the dataset) and
``benchmarks/results/protocol.json``: per mechanism and delivery, latency p50 / p99
(``latency_ms``: cancel received on the agent -> engine stopped; out of process the
stop is the engine's own ``done.t``) of both workloads from the report, their
difference, and the protocol hop itself (``protocol_hop_ms``: the agent took the
cancel -> the engine process read it).

Target: the protocol adds under 0.2 ms to latency p50, per mechanism and delivery.

    python benchmarks/bench_protocol.py [--trials 60] [--out DIR] [--force] [--note TEXT] [--resummarise]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

NAME = "protocol"
IN, OUT = "text-in-process", "text-out-of-process"
TARGET_P50_MS = 0.2


def side_by_side(summary: dict, out: Path, mechanism: str, delivery: str) -> dict:
    cells = summary["mechanisms"]
    a = harness.find(cells, workload=IN, mechanism=mechanism, delivery=delivery)
    b = harness.find(cells, workload=OUT, mechanism=mechanism, delivery=delivery)
    pa, pb = (a or {}).get("p50_ms"), (b or {}).get("p50_ms")
    qa, qb = (a or {}).get("p99_ms"), (b or {}).get("p99_ms")
    added = None if pa is None or pb is None else pb - pa
    return {"mechanism": mechanism, "delivery": delivery,
            "n": {IN: (a or {}).get("n", 0), OUT: (b or {}).get("n", 0)},
            "p50_ms": {IN: pa, OUT: pb}, "p99_ms": {IN: qa, OUT: qb},
            "max_ms": {IN: (a or {}).get("max_ms"), OUT: (b or {}).get("max_ms")},
            "added_p50_ms": added, "added_p99_ms": None if qa is None or qb is None else qb - qa,
            "protocol_hop_ms": harness.column_distribution(out, "protocol_hop_ms", workload=OUT,
                                                           mechanism=mechanism, delivery=delivery),
            "target_p50_ms": TARGET_P50_MS, "met": None if added is None else bool(added < TARGET_P50_MS)}


def main() -> int:
    args = harness.arg_parser(NAME, __doc__.splitlines()[0]).parse_args()
    out, json_path = harness.paths(NAME, args.out)
    config = harness.config_for(args)
    machine = harness.machine_facts()
    config, facts = harness.run_or_resummarise("bench_protocol", args, config, out, json_path)
    summary = harness.summarise(out)
    rows = [side_by_side(summary, out, m, d) for m in config.mechanisms for d in config.deliveries]
    harness.write_json(json_path, name=NAME, config=config, run_facts=facts, summary=summary, machine=machine,
                       extra={"side_by_side": rows}, note=args.note,
                       default_trials=harness.load_config(args.config).trials_per_cell)
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{r['mechanism']:15s} {r['delivery']:6s} p50 in {fmt(r['p50_ms'][IN])} out {fmt(r['p50_ms'][OUT])} "
              f"added {fmt(r['added_p50_ms'])} ms; p99 added {fmt(r['added_p99_ms'])} ms; target "
              f"{'met' if r['met'] else 'NOT met' if r['met'] is False else '-'}", file=sys.stderr)
    print(f"wrote {out}/ and {json_path}", file=sys.stderr)
    return facts["sweep_exit_code"]


if __name__ == "__main__":
    sys.exit(main())
