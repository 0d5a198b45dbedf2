"""cancelbench reports: cross-platform tables, bound flags, defects, hop
decomposition (``report``) and sweep-to-sweep regression checks (``diff``).

``build_report`` is the one entry point both the CLI and the benchmarks use;
``engine="ray"`` runs the cell aggregation on Ray Data instead of pandas and
must give identical numbers.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .load import DEFECT_OUTCOMES, Filters, TABLE_COLUMNS, load_frame, scan_table
from .targeting import load_targeting
from .tables import (DEFECT_COLUMNS, Report, ReportSpec, aggregate_cells, aggregate_hops, defects_table,
                     device_infos)


def load_defects(dirs: list[str | Path], filters: Filters) -> pd.DataFrame:
    """Dropped/lost trials of any kind (a second, narrow scan: cheap)."""
    f = Filters(workloads=filters.workloads, backends=filters.backends, hosts=filters.hosts,
                trial_kinds=None, outcomes=DEFECT_OUTCOMES)
    return defects_table(scan_table(dirs, DEFECT_COLUMNS, f).to_pandas())


def simulated_engines(dirs: list[str | Path], filters: Filters) -> list[str]:
    """Engines among the filtered records that the registry marks as simulated (one narrow scan)."""
    from cancelbench.device_agents.engines.registry import ENGINES

    table = scan_table(dirs, ["engine"], filters)
    names = {str(e) for e in table.column("engine").unique().to_pylist() if e is not None}
    return sorted(n for n in names if n in ENGINES and ENGINES[n].simulated)


def build_report(dirs: list[str | Path], spec: ReportSpec = ReportSpec(), filters: Filters = Filters(),
                 engine: str = "pandas", with_samples: bool = False, address: str | None = None) -> Report:
    """``with_samples``: also keep the plots' latency samples (``Report.samples``), from the same scan.
    ``address``: the Ray cluster of ``engine="ray"`` (default: RAY_ADDRESS, else a local Ray)."""
    if engine == "ray":
        from .load import load_plot_samples
        from .raydata import build_report_ray

        report = build_report_ray(dirs, spec, filters, address=address)
        report.samples = load_plot_samples(dirs, filters) if with_samples else None
        report.simulated = simulated_engines(dirs, filters)
        report.targeting = load_targeting(dirs, filters)
        return report
    if engine != "pandas":
        raise ValueError(f"unknown engine {engine!r}")
    from .legend import attach_builds

    loaded = load_frame(dirs, TABLE_COLUMNS, filters, with_samples=with_samples)
    frame = loaded.frame
    report = Report(
        spec=spec, dirs=loaded.dirs, cells=aggregate_cells(frame, spec),
        pooled=aggregate_cells(frame, spec, pool_phases=True), hops=aggregate_hops(frame),
        devices=device_infos(frame), defects=load_defects(dirs, filters), n_records=len(frame),
        samples=loaded.samples, simulated=simulated_engines(dirs, filters), targeting=load_targeting(dirs, filters),
    )
    attach_builds(report, dirs, filters)
    return report


__all__ = ["Filters", "Report", "ReportSpec", "build_report", "load_defects"]
