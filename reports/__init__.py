"""cancelbench reports: cross-platform tables, bound flags, defects, hop
decomposition (``report``) and sweep-to-sweep regression checks (``diff``).

``build_report`` is the one entry point both the CLI and the benchmarks use;
``engine="ray"`` runs the cell aggregation on Ray Data instead of pandas and
must give identical numbers.  Either way each dataset is read once
(``load.read_once``) and everything else is derived from that scan.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa

from .bargein import COLUMNS as BARGEIN_COLUMNS
from .bargein import bargein_of
from .legend import BUILD_COLUMNS, ENGINE_BUILD_COLUMNS, attach_builds, builds_of
from .residue import COLUMNS as RESIDUE_COLUMNS
from .residue import residue_of
from .load import (DEFECT_OUTCOMES, PLOT_SOURCE_COLUMNS, REFERENCE_COLUMNS, TABLE_COLUMNS, Filters, Scan, frame_of,
                   read_once, records_of, references_of, require_rows, samples_of)
from .targeting import COLUMNS as TARGETING_COLUMNS
from .targeting import targeting_of
from .tables import (DEFECT_COLUMNS, Report, ReportSpec, aggregate_cells, aggregate_hops, defects_table,
                     device_infos)

# Everything a report derives besides the cells (Ray reads the cells' columns itself).
SIDE_COLUMNS = list(dict.fromkeys([*DEFECT_COLUMNS, "engine", *TARGETING_COLUMNS, *BUILD_COLUMNS, *ENGINE_BUILD_COLUMNS,
                                   *BARGEIN_COLUMNS]))
PLOT_COLUMNS = list(dict.fromkeys([*PLOT_SOURCE_COLUMNS, *REFERENCE_COLUMNS]))
SIDE_COLUMNS += [c for c in RESIDUE_COLUMNS if c not in SIDE_COLUMNS]  # the residue split


def defects_of(scan: Scan) -> pd.DataFrame:
    """Dropped/lost trials of any kind and the invalid records of one scan."""
    raw = scan.rows(kinds=None, outcomes=DEFECT_OUTCOMES, columns=DEFECT_COLUMNS).to_pandas()
    if len(scan.invalid):
        raw = pd.concat([raw, scan.invalid.reindex(columns=DEFECT_COLUMNS)], ignore_index=True)
    return defects_table(raw)


def load_defects(dirs: list[str | Path], filters: Filters) -> pd.DataFrame:
    """``defects_of`` a scan of its own."""
    return defects_of(read_once(dirs, DEFECT_COLUMNS, filters))


def simulated_of(table: pa.Table) -> list[str]:
    """Engines among the rows that the registry marks as simulated."""
    from cancelbench.device_agents.engines.registry import ENGINES

    names = {str(e) for e in table.column("engine").unique().to_pylist() if e is not None}
    return sorted(n for n in names if n in ENGINES and ENGINES[n].simulated)


def build_report(dirs: list[str | Path], spec: ReportSpec = ReportSpec(), filters: Filters = Filters(),
                 engine: str = "pandas", with_samples: bool = False, address: str | None = None) -> Report:
    """``with_samples``: also keep the plots' latency samples (``Report.samples``) and the
    reference runs (``Report.references``), from the same scan.
    ``address``: the Ray cluster of ``engine="ray"`` (default: RAY_ADDRESS, else a local Ray)."""
    if engine not in ("pandas", "ray"):
        raise ValueError(f"unknown engine {engine!r}")
    # pandas: one scan for everything; Ray: this scan for all but the cells, which Ray reads
    columns = [*(TABLE_COLUMNS if engine == "pandas" else []), *SIDE_COLUMNS, *(PLOT_COLUMNS if with_samples else [])]
    scan = read_once(dirs, list(dict.fromkeys(columns)), filters)
    rows = lambda cols: records_of(scan, filters, cols)  # noqa: E731 (the cell rows, only these columns)
    require_rows(rows(["trial_id"]), scan.dirs, len(scan.invalid))  # none: an error (before Ray starts)
    if engine == "ray":
        from .raydata import build_report_ray

        report = build_report_ray(scan, spec, filters, address=address)
    else:
        frame = frame_of(rows(TABLE_COLUMNS), scan.dirs, len(scan.invalid))
        report = Report(
            spec=spec, dirs=scan.dirs, cells=aggregate_cells(frame, spec),
            pooled=aggregate_cells(frame, spec, pool_phases=True), hops=aggregate_hops(frame),
            devices=device_infos(frame), defects=pd.DataFrame(), n_records=len(frame))
        del frame
    report.defects = defects_of(scan)
    report.simulated = simulated_of(rows(["engine"]))
    report.targeting = targeting_of(rows(TARGETING_COLUMNS))
    report.residue = residue_of(rows(RESIDUE_COLUMNS))
    report.bargein = bargein_of(rows(BARGEIN_COLUMNS))
    report.repeats = scan.repeats
    if with_samples:
        report.samples = samples_of(rows(PLOT_SOURCE_COLUMNS))
        report.references = references_of(scan)
    attach_builds(report, builds_of(scan.table))
    return report


__all__ = ["Filters", "Report", "ReportSpec", "build_report", "load_defects"]
