"""Report scale benchmark: N synthetic cancel records (default 1,000,000) in
the real dataset layout, then time each stage of ``cancelbench report``, and
``report``, ``diff`` and ``trend`` as fresh processes.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_report.py [--records N] [--keep DIR] [--ray]

Prints a JSON object and writes it to benchmarks/results/report_scale.json.
Targets, each as a fresh process on a 2-core machine: the whole report
(tables, Markdown, JSON and the HTML page with its plots), ``diff`` of the
dataset against itself and against a second one, and ``trend`` over the two,
each < 10 s. Each report stage is also timed in process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
LOAD_AT_START = [round(x, 2) for x in os.getloadavg()]  # other work on the host (the figures are wall time)
sys.path.insert(0, str(ROOT))

from cancelbench.schema import FILE_SCHEMA, SCHEMA_VERSION  # noqa: E402
from cancelbench.sink import MANIFEST, records_dir, write_json_atomic  # noqa: E402

DEVICES = [("mac1", "metal", "metal:0", "Apple M2", "darwin", "arm64"),
           ("lin1", "cpu", "cpu:0", "AMD EPYC", "linux", "x86_64"),
           ("lin1", "vulkan", "vulkan:0", "Radeon 780M", "linux", "x86_64"),
           ("lin2", "cuda", "cuda:0", "RTX 4090", "linux", "x86_64"),
           ("win1", "cpu", "cpu:0", "Intel i7", "windows", "amd64")]
WORKLOADS = ["tts-short", "tts-long", "stt"]
PHASES = ["prefill", "decode", "code2wav", "encode", "idle"]
MECHANISMS = ["between_calls", "abort_callback", "chunked", "graph_eval"]
DELIVERIES = ["driver", "agent"]
# A real sweep's records carry their settings and build facts (diff checks the one, the legend shows the other).
SETTINGS = {"model": "qwen3-tts-0.6b-q8_0.gguf", "mmproj": "tokenizer-12hz.gguf", "corpus": "speech-en",
            "n_threads": 4, "n_ctx": 0, "n_batch": 512, "n_ubatch": 512, "chunk_tokens": 32, "n_gpu_layers": 99,
            "use_extra_bufts": True, "graph_slice_us": 2000, "max_tokens": 256, "top_k": 50, "temp": 0.9,
            "reference_runs": 3, "offset_max_fraction": 0.9}
BUILDS = {"llama_cpp_python_version": "0.3.36", "llama_cpp_build": "b7000", "ggml_version": "0.9.4",
          "ggml_backends": "CPU,Vulkan", "os_release": "Debian GNU/Linux 12", "kernel_version": "6.1.0",
          "cancelbench_version": "0.1.0"}
ROWS_PER_FILE = 50_000
REFERENCES = 300  # per device


def synth(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Columns of n cancel records (only what reports read is realistic)."""
    pick = lambda values: np.asarray(values, dtype=object)[rng.integers(0, len(values), n)]  # noqa: E731
    latency = rng.lognormal(1.5, 0.8, n)
    deliver = rng.lognormal(-1.0, 0.5, n)
    observe = np.where(rng.random(n) < 0.5, rng.lognormal(-2, 0.5, n), np.nan)
    settle = latency * 0.1
    ret = latency - np.nan_to_num(observe) - settle
    outcome = np.where(rng.random(n) < 0.0005, "dropped", np.where(rng.random(n) < 0.02, "completed", "cancelled"))
    nan_unless = lambda x: np.where(cancelled, x, np.nan)  # noqa: E731
    workload = pick(WORKLOADS)
    # the first REFERENCES rows are uncancelled reference runs with a phase timeline (the plots' phase bands)
    kind = np.where(np.arange(n) < REFERENCES, "reference", "cancel").astype(object)
    outcome = np.where(kind == "reference", "completed", outcome)
    cancelled = outcome == "cancelled"
    timeline = json.dumps([[p, 400.0 * i, 400.0 * (i + 1)] for i, p in enumerate(PHASES)])
    durations = json.dumps({p: 400.0 for p in PHASES})
    is_ref = kind == "reference"
    return {
        "trial_id": np.char.add("t", np.arange(n).astype(str)).astype(object),
        "trial_kind": kind, "engine": np.where(np.char.startswith(workload.astype(str), "tts"), "tts", "stt"
                                               ).astype(object),
        "native_call_at_receipt": np.where(rng.random(n) < 0.5, "graph", None).astype(object),
        "phase_timeline_json": np.where(is_ref, timeline, None).astype(object),
        "phase_durations_json": np.where(is_ref, durations, None).astype(object),
        "duration_ms": np.where(is_ref, 2000.0 + rng.random(n), np.nan),
        "sweep_id": np.full(n, "bench", dtype=object),
        "workload": workload, "phase_at_receipt": pick(PHASES),
        "mechanism": pick(MECHANISMS), "delivery": pick(DELIVERIES), "outcome": outcome.astype(object),
        "latency_ms": nan_unless(latency), "deliver_ms": nan_unless(deliver), "observe_ms": nan_unless(observe),
        "return_ms": nan_unless(ret), "settle_ms": nan_unless(settle),
        "end_to_end_ms": nan_unless(deliver + latency), "cost_ratio": nan_unless(latency / 800.0),
        "offset_actual_ms": rng.uniform(0, 2000, n),
        **{c: np.full(n, v, dtype=object) for c, v in SETTINGS.items()},
        **{c: np.full(n, v, dtype=object) for c, v in BUILDS.items()},
    }


def write_synthetic(out: Path, n: int, seed: int = 0, sweep_id: str = "bench") -> None:
    rng = np.random.default_rng(seed)
    per_device = n // len(DEVICES)
    for d, (host, backend, device, name, plat, arch) in enumerate(DEVICES):
        m = per_device if d < len(DEVICES) - 1 else n - per_device * (len(DEVICES) - 1)
        cols = synth(m, rng)
        cols["sweep_id"] = np.full(m, sweep_id, dtype=object)
        cols["trial_id"] = np.char.add(f"{host}-{backend}-", cols["trial_id"].astype(str)).astype(object)
        cols.update(hostname=np.full(m, host, dtype=object), device=np.full(m, device, dtype=object),
                    device_name=np.full(m, name, dtype=object), platform=np.full(m, plat, dtype=object),
                    arch=np.full(m, arch, dtype=object))
        arrays = {}
        for f in FILE_SCHEMA:
            if f.name in cols:
                v = cols[f.name]
                mask = None if v.dtype == object else np.isnan(v)
                arrays[f.name] = pa.array(v.tolist() if v.dtype == object else v, type=f.type, mask=mask,
                                          from_pandas=True)
            elif f.name == "schema_version":
                arrays[f.name] = pa.array(np.full(m, SCHEMA_VERSION, dtype=np.int32))
            else:
                arrays[f.name] = pa.nulls(m, f.type)
        table = pa.table(arrays, schema=FILE_SCHEMA)
        part = records_dir(out) / f"backend={backend}" / f"host={host}"
        part.mkdir(parents=True, exist_ok=True)
        for i in range(0, m, ROWS_PER_FILE):
            pq.write_table(table.slice(i, ROWS_PER_FILE), part / f"part-bench-{i // ROWS_PER_FILE:06d}.parquet")
    write_json_atomic(out / MANIFEST, {"schema_version": SCHEMA_VERSION, "sweep_id": sweep_id})


def _timed(fn):
    t = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t


def _run_cli(*argv: str) -> tuple[int, float | None, float, float | None]:
    """A fresh ``cancelbench`` process: exit code, peak RSS (MiB), wall seconds and CPU seconds (user +
    system: what the process itself cost, whoever else shared the host)."""
    # GNU time reports the child's own peak RSS (getrusage of children would count the forked parent).
    timer = ["/usr/bin/time", "-f", "maxrss_kib=%M cpu_s=%U+%S"] if Path("/usr/bin/time").exists() else []
    t = time.perf_counter()
    cli = subprocess.run([*timer, sys.executable, "-m", "cancelbench.cli", *map(str, argv)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.perf_counter() - t
    rss = [ln for ln in cli.stderr.splitlines() if ln.startswith("maxrss_kib=")]
    if cli.returncode not in (0, 1):
        raise RuntimeError(f"cancelbench {' '.join(map(str, argv))}: exit {cli.returncode}: {cli.stderr[-2000:]}")
    facts = dict(kv.split("=") for kv in rss[-1].split()) if rss else {}
    cpu = round(sum(float(x) for x in facts["cpu_s"].split("+")), 2) if "cpu_s" in facts else None
    return (cli.returncode, round(int(facts["maxrss_kib"]) / 1024, 1) if facts else None, round(wall, 3), cpu)


def _fresh_processes(out: Path, other: Path, tmp: Path) -> dict:
    """report (Markdown to stdout, JSON and HTML files), diff against itself and against ``other``,
    trend over the two: each a fresh process."""
    runs = {
        "report_markdown_json_html": ("report", out, "--format", "markdown", "--json", tmp / "r.json",
                                      "--html", tmp / "r.html"),
        "diff_dataset_against_itself": ("diff", out, out, "--format", "markdown"),
        "diff_against_another_dataset": ("diff", out, other, "--format", "markdown"),
        "trend_two_datasets": ("trend", out, other, "--by", "given", "--format", "markdown"),
    }
    return {name: dict(zip(("exit_code", "peak_rss_mib", "seconds", "cpu_seconds"), _run_cli(*argv)))
            for name, argv in runs.items()}


def _time_ray(out: Path, spec, pandas_json: str) -> tuple[float, bool]:
    """``--engine ray`` on a local 2-CPU Ray: seconds, and whether it equals the pandas report."""
    from cancelbench.reports import build_report
    from cancelbench.reports.format import to_json

    import ray

    from cancelbench.raylocal import start_local

    start_local(num_cpus=2, log_to_driver=False)
    try:
        ray_report, t_ray = _timed(lambda: build_report([out], spec, engine="ray"))
        return t_ray, to_json(ray_report) == pandas_json
    finally:
        ray.shutdown()


def _in_process(out: Path) -> tuple[dict, dict]:
    """Each stage of a report timed in this process: (seconds, facts)."""
    from cancelbench.reports import Filters, ReportSpec, build_report, load_defects
    from cancelbench.reports.diff import run_diff
    from cancelbench.reports.format import to_json, to_markdown, to_terminal
    from cancelbench.reports.html import to_html
    from cancelbench.reports.load import TABLE_COLUMNS, load_frame
    from cancelbench.reports.tables import aggregate_cells, aggregate_hops, device_infos

    spec = ReportSpec()
    loaded, t_load = _timed(lambda: load_frame([out], TABLE_COLUMNS, Filters()))
    frame = loaded.frame
    cells, t_cells = _timed(lambda: aggregate_cells(frame, spec))
    _, t_hops = _timed(lambda: (aggregate_hops(frame), device_infos(frame)))
    _, t_defects = _timed(lambda: load_defects([out], Filters()))
    del loaded, frame
    report, t_total = _timed(lambda: build_report([out], spec))
    _, t_render = _timed(lambda: (to_terminal(report), to_markdown(report), to_json(report)))
    _, t_diff = _timed(lambda: run_diff([out], [out]))
    # as the CLI does: the tables, the plots' samples and the reference runs from one scan
    with_samples, t_samples = _timed(lambda: build_report([out], spec, with_samples=True))
    page, t_html = _timed(lambda: to_html(with_samples, with_samples.samples, with_samples.references))
    seconds = {
        "load_and_prepare_columns": t_load, "aggregate_cells": t_cells, "hops_and_devices": t_hops,
        "defects_scan": t_defects, "report_tables_end_to_end": t_total, "render_text_md_json": t_render,
        "report_tables_with_plot_samples_and_references": t_samples, "html_plots": t_html,
        "report_with_html_in_process": t_samples + t_html + t_render, "diff_dataset_against_itself_in_process": t_diff,
    }
    facts = {"cells": len(cells), "html_bytes": len(page.encode()),
             "html_has_speech_bars": 'id="plot-uninterruptible"' in page, "json": to_json(report), "spec": spec}
    return {k: round(v, 3) for k, v in seconds.items()}, facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="write the dataset here (and a second one beside it) and keep them")
    ap.add_argument("--ray", action="store_true", help="also time --engine ray (local cluster, 2 CPUs)")
    ap.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "report_scale.json")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="cb-bench-"))
    out = args.keep or tmp / "sweep"
    other = (args.keep.parent / f"{args.keep.name}-2") if args.keep else tmp / "sweep-2"
    try:
        _, t_write = _timed(lambda: write_synthetic(out, args.records))
        write_synthetic(other, args.records, seed=1, sweep_id="bench-2")  # diff and trend need a second sweep
        seconds, facts = _in_process(out)
        fresh = _fresh_processes(out, other, tmp)
        result = {
            "records": args.records, "cells": facts["cells"], "devices": len(DEVICES),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(), "load_average_at_start": LOAD_AT_START},
            "seconds": {"write_dataset": round(t_write, 3), **seconds},
            "fresh_process": fresh,
            "cli_exit_code": fresh["report_markdown_json_html"]["exit_code"],
            "cli_peak_rss_mib": fresh["report_markdown_json_html"]["peak_rss_mib"],
            "html_bytes": facts["html_bytes"],
            "bench_process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "html_has_speech_bars": facts["html_has_speech_bars"],
            "target_s": 10.0,
            "within_target": {name: run["seconds"] < 10.0 for name, run in fresh.items()},
        }
        if args.ray:
            t_ray, equal = _time_ray(out, facts["spec"], facts["json"])
            result["seconds"]["report_tables_ray"] = round(t_ray, 3)
            result["ray_equal_to_pandas"] = equal
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(result, indent=2)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
