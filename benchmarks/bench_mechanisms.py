"""Cancel mechanisms side by side, in one sweep, on the same model and workload.

Runs ``benchmarks/configs/mechanisms.toml`` through the sweep path (a local
Ray, one CPU agent, token auth, loopback): the text fixture (text-llama-57m,
2 threads, 256-token prefill + 4 tokens), the four mechanisms
(``between_calls``, ``chunked``, ``abort_callback``, ``graph_eval``), driver
and agent delivery, uniform offsets over the first 80% of each cell's
reference run. Writes the dataset to ``benchmarks/results/mechanisms/`` and
the summary to ``benchmarks/results/mechanisms.json``; every cell figure in it
is the report's:

    cancelbench report benchmarks/results/mechanisms/ --format json

The same workload runs twice, side by side in the one sweep: the engine in a
child process the agent supervises (its default) and in the agent's own
process (``text-prefill-256-in-process``, ``engine_process = "agent"``).

Target (listed under ``targets``, computed from the report's prefill cells,
per workload and delivery): ``abort_callback`` p99 at least 20x below ``between_calls`` p99.
Under the report's minimum-sample rule a p99 needs 299 samples per cell; with
fewer, the target is judged on the report's high statistic (the max, as the
report's tables show it), marked ``"statistic": "max"`` and ``met`` null
(indicative only).

No longer measured here, because they are not trials of the sweep path:
* the status quo of llama-cpp-python users (breaking out of
  ``Llama.create_completion(stream=True)``): it is not a mechanism of the
  engine registry, so a sweep cannot run it; the figure in
  ``docs/benchmarks.md`` is from the last run of the old loop and says so;
* the known-answer probe's error and the per-trial harness overhead: the probe
  engine's ``known_answer_error_ms`` column and the driver gap are measured by
  sweeps of the probe engine (``tests/test_sweep.py``, ``bench_driver.py``).

    python benchmarks/bench_mechanisms.py [--trials 40] [--out DIR] [--force] [--note TEXT] [--resummarise]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

NAME = "mechanisms"
TARGET_RATIO = 20.0


def ratio_target(cells: list[dict], workload: str, delivery: str) -> dict:
    """between_calls over abort_callback in one workload's prefill, on the report's high statistic."""
    bc = harness.find(cells, workload=workload, phase="prefill", mechanism="between_calls", delivery=delivery)
    ab = harness.find(cells, workload=workload, phase="prefill", mechanism="abort_callback", delivery=delivery)
    (b, b_stat), (a, a_stat) = harness.high(bc), harness.high(ab)
    ratio = b / a if b is not None and a else None
    statistic = "p99" if b_stat == a_stat == "p99" else "max"
    met = None if statistic != "p99" or ratio is None else bool(ratio >= TARGET_RATIO)
    return {"workload": workload, "delivery": delivery, "statistic": statistic, "between_calls_ms": b, "abort_callback_ms": a,
            "n": {"between_calls": bc["n"] if bc else 0, "abort_callback": ab["n"] if ab else 0},
            "ratio": ratio, "target": TARGET_RATIO, "met": met,
            "indicative": statistic != "p99"}


def main() -> int:
    args = harness.arg_parser(NAME, __doc__.splitlines()[0]).parse_args()
    out, json_path = harness.paths(NAME, args.out)
    config = harness.config_for(args)
    machine = harness.machine_facts()
    config, facts = harness.run_or_resummarise("bench_mechanisms", args, config, out, json_path)
    summary = harness.summarise(out)
    # per workload: the engine in a child process (its default) and in the agent's, side by side
    targets = {f"abort_p99_20x_below_between_calls_{d}" + ("" if w.process == "child" else f"_{w.name}"):
               ratio_target(summary["cells"], w.name, d) for w in config.workloads for d in config.deliveries}
    harness.write_json(json_path, name=NAME, config=config, run_facts=facts, summary=summary, machine=machine,
                       extra={"targets": targets}, note=args.note,
                       default_trials=harness.load_config(args.config).trials_per_cell)
    harness.print_cells(summary["cells"])
    for key, t in targets.items():
        verdict = {True: "met", False: "NOT met", None: "indicative only"}[t["met"]]
        ratio = f"{t['ratio']:.1f}x" if t["ratio"] else "-"
        print(f"target {key}: {verdict} ({t['statistic']}: {ratio})", file=sys.stderr)
    print(f"wrote {out}/ and {json_path}", file=sys.stderr)
    return facts["sweep_exit_code"]


if __name__ == "__main__":
    sys.exit(main())
