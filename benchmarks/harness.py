"""The one benchmark harness: a sweep config in, a normal cancelbench dataset and
a JSON summary computed from its records out.

Every trial benchmark runs its trials through the sweep path
(``cancelbench.orchestrator.runner.run_sweep``), writes the dataset to
``benchmarks/results/<name>/`` and its summary to ``benchmarks/results/<name>.json``.
The summary's cell figures (n, p50 / p90 / p99 under the minimum-sample rule of
``cancelbench.reports.stats``, max) are the report's own (``build_report``), so

    cancelbench report benchmarks/results/<name>/ --format json

prints the same numbers under ``cells`` (per phase) and ``mechanisms`` (phases
pooled). Figures the report does not print (a percentile of another column,
reference-run durations) go under ``derived``, each naming its column and rows,
computed with the same ``stats`` functions from the same records.

Machine facts (cores, CPU model, load average at the start and the end, wall
time) stand in the JSON beside the numbers they qualify.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")  # before any `import ray`: a Ray we start has token auth on

from cancelbench.orchestrator.config import SweepConfig, load_config, with_trials  # noqa: E402
from cancelbench.reports import build_report  # noqa: E402
from cancelbench.reports import stats  # noqa: E402
from cancelbench.reports.tables import ReportSpec  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
CONFIGS = BENCH_DIR / "configs"
RESULTS = BENCH_DIR / "results"


class OutputExists(RuntimeError):
    """The results directory already holds a dataset and --force was not given."""


# ------------------------------------------------------------------ machine --
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_facts() -> dict:
    """What qualifies the numbers: the host as the benchmark saw it when it started."""
    return {"nproc": os.cpu_count(), "cpu_model": _cpu_model(), "platform": sys.platform,
            "arch": platform.machine(), "python": platform.python_version(), "hostname": platform.node()}


# ---------------------------------------------------------------------- run --
def arg_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The options every converted benchmark shares."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", type=Path, default=CONFIGS / f"{name}.toml", help="sweep TOML")
    ap.add_argument("--trials", type=int, default=None,
                    help="override the config's sweep.trials_per_cell (fewer: a smoke-scale run, said in the JSON)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"dataset directory (default benchmarks/results/{name}/; the JSON goes beside it)")
    ap.add_argument("--force", action="store_true", help="replace an existing dataset and JSON")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. why the run is small)")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted run's dataset (the sweep's --resume: every trial exactly once)")
    ap.add_argument("--resummarise", action="store_true",
                    help="summarise the existing dataset again (no sweep; the run facts come from its JSON)")
    return ap


def paths(name: str, out: Path | None) -> tuple[Path, Path]:
    """(dataset directory, JSON path): ``benchmarks/results/<name>/`` and ``<name>.json`` beside it."""
    out = Path(out) if out else RESULTS / name
    return out, out.with_name(out.name + ".json")


def run(config: SweepConfig, out: Path, *, force: bool = False, json_path: Path | None = None,
        resume: bool = False) -> dict:
    """Run ``config`` through ``run_sweep`` into ``out``; returns the run facts
    (sweep id, outcomes, exit code, load average at start and end, wall time).

    Refuses an ``out`` (or a ``json_path``) that exists unless ``force``; with
    it, ``out`` is replaced only if it is a cancelbench dataset (or empty). With
    ``resume``, an interrupted run in ``out`` is continued instead (the JSON is
    written anew). A local Ray this call starts is shut down before it returns.
    """
    import ray

    from cancelbench.orchestrator.runner import run_sweep

    out = Path(out)
    if json_path is not None and Path(json_path).exists() and not (force or resume):
        raise OutputExists(f"{json_path} exists; pass --force to replace it or --out to write elsewhere")
    if out.exists() and not resume:
        if not force:
            raise OutputExists(f"{out} exists; pass --force to replace it or --out to write elsewhere")
        from cancelbench.sink import MANIFEST, RECORDS_DIR

        if any(out.iterdir()) and not ((out / MANIFEST).exists() or (out / RECORDS_DIR).is_dir()):
            raise OutputExists(f"{out} is not a cancelbench dataset; --force replaces only a dataset")
        shutil.rmtree(out)
    started_ray = not ray.is_initialized()
    load_start, t0 = _loadavg(), time.monotonic()
    try:
        result = run_sweep(config, out, progress=False, resume=resume)
    finally:
        if started_ray and ray.is_initialized():
            ray.shutdown()
    return {"sweep_id": result.sweep_id, "planned": result.planned, "written": result.written,
            "outcomes": dict(sorted(result.outcomes.items())), "sweep_exit_code": result.exit_code,
            "not_run": len(result.not_run), "trials_per_cell": config.trials_per_cell, "resumed": resume,
            "load_average_start": load_start, "load_average_end": _loadavg(),
            "wall_s": round(time.monotonic() - t0, 1)}


def run_or_resummarise(name: str, args: argparse.Namespace, config: SweepConfig, out: Path,
                       json_path: Path) -> tuple[SweepConfig, dict]:
    """(config, run facts) of the dataset in ``out``: a fresh run of ``config`` (or its
    ``--resume``), or with ``--resummarise`` the config the dataset was run with and the
    earlier run's facts. An existing output without --force, or nothing to resummarise:
    one line, exit 2."""
    from cancelbench.sink import DatasetError

    try:
        if args.resummarise:
            return config_of(out), previous_run(json_path, out)
        return config, run(config, out, force=args.force, json_path=json_path, resume=args.resume)
    except (OutputExists, DatasetError, FileNotFoundError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def config_for(args: argparse.Namespace) -> SweepConfig:
    config = load_config(args.config)
    return with_trials(config, args.trials) if args.trials is not None else config


# ------------------------------------------------------------------ summary --
def _cell(c) -> dict:
    """One report cell in the benchmark's words (the report's own numbers)."""
    return {"workload": c.workload, "phase": c.phase, "mechanism": c.mechanism, "delivery": c.delivery,
            "device": c.device, "n": c.n, "n_trials": c.n_trials, "completed": c.completed,
            "dropped": c.dropped, "lost": c.lost, "errors": c.errors,
            "p50_ms": c.percentiles.get("p50"), "p90_ms": c.percentiles.get("p90"),
            "p99_ms": c.percentiles.get("p99"), "max_ms": c.max_ms, "insufficient": list(c.insufficient),
            "cost_ratio_p50": c.cost_ratio_p50}


def _shown(out: Path) -> str:
    """``out`` relative to the repository when inside it (the committed results), else as given."""
    try:
        return str(Path(out).resolve().relative_to(BENCH_DIR.parent))
    except ValueError:
        return str(out)


def summarise(out: Path, spec: ReportSpec = ReportSpec()) -> dict:
    """Per-cell figures of the dataset in ``out``, from the report (``build_report``).

    ``cells``: one per (workload, phase at receipt, mechanism, delivery, device);
    ``mechanisms``: the same with every phase pooled (phase ``*``). A percentile
    with fewer samples than ``stats.min_samples`` asks for is None and named in
    ``insufficient`` (``min_samples`` lists the counts).
    """
    report = build_report([out], spec)
    shown = _shown(out)
    return {
        "dataset": shown,
        "report_command": f"cancelbench report {shown}/ --format json",
        "n_records": report.n_records, "verdict": report.verdict,
        "confidence": spec.confidence, "min_samples": spec.min_counts(),
        "mechanisms": [_cell(c) for c in report.pooled],
        "cells": [_cell(c) for c in report.cells],
        "hops": [{"device": h.device, "n": h.n, "end_to_end_mean_ms": h.end_to_end_mean_ms, "means_ms": h.means_ms}
                 for h in report.hops],
        "defects": int(len(report.defects)),
    }


def find(cells: list[dict], **key) -> dict | None:
    """The one cell matching every ``key`` (None when absent)."""
    hits = [c for c in cells if all(c.get(k) == v for k, v in key.items())]
    if len(hits) > 1:
        raise ValueError(f"{key} matches {len(hits)} cells; name the device too")
    return hits[0] if hits else None


def high(cell: dict | None) -> tuple[float | None, str]:
    """The report's high statistic: p99 with enough samples, else the max (as the report's tables show)."""
    if not cell or not cell["n"]:
        return None, "none"
    return (cell["p99_ms"], "p99") if cell["p99_ms"] is not None else (cell["max_ms"], "max")


def column_values(records, columns: str | list[str], **where) -> list[float]:
    """One record column's values, or the sum of several (a null term counts 0; the last must be
    present), over the cancelled cancel rows of ``records`` (read_records) matching ``where``."""
    columns = [columns] if isinstance(columns, str) else list(columns)
    df = records
    sel = (df.trial_kind == "cancel") & (df.outcome == "cancelled") & df[columns[-1]].notna()
    for k, v in where.items():
        sel &= df[k] == v
    return df.loc[sel, columns].astype(float).fillna(0.0).sum(axis=1).tolist()


def column_distribution(out: Path, columns: str | list[str], *, records=None, **where) -> dict:
    """n / p50 / p99 (min-sample rule) / max of :func:`column_values` (the dataset in ``out``, or
    ``records`` already read from it): a figure the report does not print, with the report's
    nearest-rank statistics."""
    from cancelbench.sink import read_records

    columns = [columns] if isinstance(columns, str) else list(columns)
    vals = column_values(read_records(out) if records is None else records, columns, **where)
    n = len(vals)
    pct = {label: (stats.percentile(vals, p) if n >= stats.min_samples(p) else None)
           for label, p in (("p50_ms", 0.5), ("p99_ms", 0.99))}
    return {"columns": " + ".join(columns), "rows": {"trial_kind": "cancel", "outcome": "cancelled", **where},
            "n": n, **pct, "max_ms": max(vals) if vals else None}


def config_of(out: Path) -> SweepConfig:
    """The config a dataset was run with (its manifest's), validated again."""
    from cancelbench.orchestrator.config import parse_config
    from cancelbench.orchestrator.workloads import recorded_declaration, workload_table
    from cancelbench.sink import read_manifest

    c = read_manifest(out)["config"]
    sweep = {k: c[k] for k in ("seed", "trials_per_cell", "reference_runs", "mechanisms", "deliveries",
                               "ping_samples") if c.get(k) is not None}
    sweep.update({k: c[k] for k in ("input_seed", "offset_seed") if c.get(k) is not None})
    offsets = {k: v for k, v in c["offsets"].items() if not (k == "fixed_ms" and not v)}
    devices = {"backends": c["devices"]["backends"], "hosts": c["devices"]["hosts"],
               "labels": dict(c["devices"]["labels"])}
    workloads = [workload_table(w) for w in c["workloads"]]
    declared = {w["name"]: recorded_declaration(w) for w in c["workloads"]}
    config = parse_config({"sweep": sweep, "offsets": offsets, "devices": devices, "workload": workloads},
                          declare=lambda spec: declared[spec.name])
    if config.to_json() != c:
        raise ValueError(f"{out}: the manifest's config does not round-trip; re-run instead of --resummarise")
    return config


def previous_run(json_path: Path, out: Path | None = None) -> dict:
    """The run facts of an earlier benchmark JSON (re-summarising a dataset without re-running it).
    Without that JSON (the benchmark died after its sweep), what the dataset itself says:
    its manifest and the records' own time span, marked as such."""
    if Path(json_path).exists() or out is None:
        return json.loads(Path(json_path).read_text())["run"]
    from cancelbench.sink import outcome_counts, read_manifest, read_records

    manifest = read_manifest(out)
    t = read_records(out, columns=["t_handback_ns", "t_terminal_ns"])
    return {"sweep_id": manifest["sweep_id"], "planned": manifest["planned_trials"], "written": len(t),
            "outcomes": dict(sorted(outcome_counts(out).items())), "status": manifest["status"],
            "sweep_exit_code": 0 if manifest["status"] == "complete" else 1, "created": manifest["created"],
            "trial_window_s": round((t.t_terminal_ns.max() - t.t_handback_ns.min()) / 1e9, 1),
            "source": "the dataset's manifest and records: the benchmark's JSON was not written for this run"}


def reference_rows(out: Path) -> dict[tuple[str, str], list[dict]]:
    """(workload, mechanism) -> the reference (uncancelled) rows, for ``schema.reference_run``."""
    from cancelbench.sink import read_records

    df = read_records(out, columns=["trial_id", "trial_kind", "workload", "mechanism", "outcome", "duration_ms"])
    rows: dict[tuple[str, str], list[dict]] = {}
    for r in df[df.trial_kind == "reference"].to_dict("records"):
        rows.setdefault((str(r["workload"]), str(r["mechanism"])), []).append(r)
    return rows


# -------------------------------------------------------------------- write --
def write_json(path: Path, *, name: str, config: SweepConfig, run_facts: dict, summary: dict,
               machine: dict, extra: dict | None = None, note: str = "", default_trials: int | None = None) -> dict:
    """The benchmark's JSON: machine facts and run facts beside the numbers."""
    scale = "full"
    if default_trials is not None and config.trials_per_cell < default_trials:
        scale = (f"smoke: {config.trials_per_cell} trials per cell (the config's is {default_trials}); "
                 "percentiles below their minimum sample count are null")
    doc = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "scale": scale,
        "note": note,
        "machine": machine,
        "run": run_facts,
        "dataset": summary["dataset"],
        "reproduce": summary["report_command"],
        "config": config.to_json(),
        **(extra or {}),
        "summary": summary,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return doc


def print_cells(cells: list[dict], file=sys.stderr) -> None:
    fmt = lambda v: f"{v:9.2f}" if v is not None else f"{'-':>9}"  # noqa: E731
    print(f"{'workload':<22} {'phase':<10} {'mechanism':<15} {'delivery':<8} {'n':>4} {'p50 ms':>9} {'p99 ms':>9} "
          f"{'max ms':>9}", file=file)
    for c in cells:
        print(f"{c['workload']:<22} {c['phase']:<10} {c['mechanism']:<15} {c['delivery']:<8} {c['n']:>4} "
              f"{fmt(c['p50_ms'])} {fmt(c['p99_ms'])} {fmt(c['max_ms'])}", file=file)


# -------------------------------------------------------------------- load --
def _ran_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


@contextmanager
def busy_loops(n: int):
    """``n`` busy loops, each waited on until it has run 50 ms on a CPU (not a sleep); killed after."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        for p in procs:
            while _ran_ns(p.pid) < 50_000_000:
                if p.poll() is not None:
                    raise RuntimeError("a busy loop exited")
                os.sched_yield()
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
