"""``--engine ray``: the report's aggregation on Ray Data, for datasets past
one machine.  It reuses the pandas path's per-group functions
(``tables.summarize_cell``/``summarize_hops``) inside ``map_groups``; those
are order-independent, so both engines give identical numbers (tested).

Ray is imported lazily: the pandas path never pulls it in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa

from cancelbench.sink import DatasetError

from .load import DEFECT_OUTCOMES, Filters, TABLE_COLUMNS, records_files
from .tables import (ALL_PHASES, CELL_KEYS, CELL_VALUE_COLUMNS, DEFECT_COLUMNS, HOPS, CellStats, HopStats, Report,
                     ReportSpec, defects_table, device_infos, prepare_table, sort_cells, summarize_cell,
                     summarize_hops)

_DEVICE_INFO_COLUMNS = ["device_key", "hostname", "device_name", "platform", "arch", "backend"]


def _ray_filter(filters: Filters):
    from ray.data.expressions import col

    expr = None
    for column, values in (("trial_kind", filters.trial_kinds), ("workload", filters.workloads),
                           ("backend", filters.backends), ("host", filters.hosts), ("outcome", filters.outcomes)):
        if values is None:
            continue
        term = col(column).is_in(list(values))
        expr = term if expr is None else expr & term
    return expr


def _read(paths: list[str], columns: list[str], filters: Filters):
    import ray.data

    data = ray.data.read_parquet(paths).select_columns(columns)  # projection is pushed into the read
    expr = _ray_filter(filters)
    return data.filter(expr=expr) if expr is not None else data


def _prepare_batch(batch: pa.Table) -> pa.Table:
    # Plain strings (no dictionaries): blocks from different files must concatenate.
    return prepare_table(batch, dictionary=False).select(
        list(CELL_KEYS) + CELL_VALUE_COLUMNS + ["end_to_end_ms", *HOPS] + _DEVICE_INFO_COLUMNS[1:])


def _cells_fn(group: pd.DataFrame, spec: ReportSpec, pooled: bool) -> pd.DataFrame:
    key = tuple(ALL_PHASES if pooled and k == "phase" else group[k].iloc[0] for k in CELL_KEYS)
    # JSON keeps floats exact (repr round-trips) and avoids nested Arrow types.
    return pd.DataFrame({"cell": [json.dumps(summarize_cell(key, group, spec).to_dict())]})


def _hops_fn(group: pd.DataFrame) -> pd.DataFrame:
    hop = summarize_hops(str(group["device_key"].iloc[0]), group)
    return pd.DataFrame({"hop": [json.dumps(hop.__dict__)]})


def _device_rows(batch: pd.DataFrame) -> pd.DataFrame:
    return batch[_DEVICE_INFO_COLUMNS].drop_duplicates()


def ensure_ray(address: str | None = None) -> None:
    """Connect to ``address`` (or RAY_ADDRESS); without one start a private
    local Ray on 127.0.0.1 -- never attach to whatever cluster happens to run
    on this machine; that one is loopback-only with token auth (raylocal)."""
    import os

    import ray

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            from cancelbench.raylocal import start_local

            start_local(log_to_driver=False)
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False


def build_report_ray(dirs: list[str | Path], spec: ReportSpec, filters: Filters = Filters(),
                     address: str | None = None) -> Report:
    paths = records_files(dirs)  # validates dirs and schema versions first: bad input never reaches Ray
    ensure_ray(address)
    import ray

    parts = max(2, int(ray.cluster_resources().get("CPU", 2)))  # the default 200 shuffle partitions is all overhead
    prepared = _read(paths, TABLE_COLUMNS, filters).map_batches(_prepare_batch, batch_format="pyarrow").materialize()
    def cells_of(keys: list[str], pooled: bool) -> list[CellStats]:
        rows = prepared.groupby(keys, num_partitions=parts).map_groups(
            _cells_fn, batch_format="pandas", fn_kwargs={"spec": spec, "pooled": pooled}).take_all()
        return sort_cells([CellStats(**json.loads(r["cell"])) for r in rows])

    cells = cells_of(list(CELL_KEYS), False)
    pooled = cells_of([k for k in CELL_KEYS if k != "phase"], True)
    if not cells:
        raise DatasetError(f"{', '.join(map(str, dirs))}: no cancel records (empty dataset or filters match nothing)")
    hop_rows = prepared.groupby("device_key", num_partitions=parts).map_groups(
        _hops_fn, batch_format="pandas").take_all()
    hops = sorted((HopStats(**json.loads(r["hop"])) for r in hop_rows), key=lambda h: h.device)
    devices = device_infos(prepared.map_batches(_device_rows, batch_format="pandas").to_pandas())
    defect_filters = Filters(workloads=filters.workloads, backends=filters.backends, hosts=filters.hosts,
                             trial_kinds=None, outcomes=DEFECT_OUTCOMES)
    raw_defects = _read(paths, DEFECT_COLUMNS, defect_filters).to_pandas()
    defects = defects_table(raw_defects.reindex(columns=DEFECT_COLUMNS))
    report = Report(spec=spec, dirs=[str(d) for d in dirs], cells=cells, pooled=pooled, hops=hops, devices=devices,
                    defects=defects, n_records=sum(c.n_trials for c in cells))
    from .legend import attach_builds

    attach_builds(report, dirs, filters)  # a narrow pyarrow scan of distinct values, on this machine
    return report
