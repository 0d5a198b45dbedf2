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
import pyarrow.compute as pc

from cancelbench.schema import FILE_SCHEMA
from cancelbench.sink import DatasetError

from .load import TABLE_COLUMNS, Filters, Scan, records_files
from .tables import (ALL_PHASES, CELL_KEYS, CELL_VALUE_COLUMNS, HOPS, CellStats, HopStats, Report, ReportSpec,
                     device_infos, prepare_table, sort_cells, summarize_cell, summarize_hops)

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

    # The record schema (less the partition columns, which come from the paths): a part file that
    # lacks a column reads it as null, as pyarrow's reader does for the pandas engine.
    data = ray.data.read_parquet(paths, schema=FILE_SCHEMA).select_columns(columns)  # projection pushed down
    expr = _ray_filter(filters)
    return data.filter(expr=expr) if expr is not None else data


def _prepare_batch(batch: pa.Table, exclude: frozenset[str] = frozenset()) -> pa.Table:
    # Plain strings (no dictionaries): blocks from different files must concatenate.
    if exclude:  # the duplicated trial ids of this dataset (load.invalid_records): none of their records counts
        batch = batch.filter(pc.invert(pc.is_in(batch.column("trial_id"), pa.array(sorted(exclude)))))
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
    import logging
    import os

    import ray

    _quiet_worker_count_warning()
    if not ray.is_initialized():  # quiet: Ray's INFO lines are not the report's (a failure still says why)
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        else:
            from cancelbench.raylocal import start_local

            start_local(log_to_driver=False, logging_level=logging.WARNING)
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # per-dataset INFO lines, "progress bars disabled"


_NOISE = "PYTHON worker processes have been started on node"


def _quiet_worker_count_warning() -> None:
    """The raylet's "N PYTHON worker processes have been started ... Kx the maximum expected startup
    concurrency" reaches the driver on Ray's error channel, which Ray prints to stdout whatever
    ``log_to_driver`` says: in the middle of the report (CI: Ray Data's tasks and actors started 8-12
    workers on a 2-CPU node). That one message goes to the log at DEBUG; every other raylet message
    (a worker killed, out of memory) is still printed, on stderr, never in the report."""
    import logging
    import sys

    from ray._private import worker

    printer = worker.print_to_stdstream
    if getattr(printer, "cancelbench_quiet", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        if data.get("pid") != "raylet":
            return printer(data, ignore_prefix)
        for line in data.get("lines", ()):
            if _NOISE in line:
                logging.getLogger("ray").debug("%s", line)
            else:
                print(f"(raylet) {line}", file=sys.stderr)
        return None

    print_to_stdstream.cancelbench_quiet = True
    worker.print_to_stdstream = print_to_stdstream  # looked up at each message by listen_error_messages


def build_report_ray(scan: Scan, spec: ReportSpec, filters: Filters = Filters(),
                     address: str | None = None) -> Report:
    """Cells, hops and devices of the datasets ``scan`` read (each once, its duplicated trial
    ids left out), aggregated on Ray; the caller adds what it derives from ``scan`` itself."""
    files = records_files(scan.dirs)  # validates dirs and schema versions first: bad input never reaches Ray
    ensure_ray(address)
    import ray

    parts = max(2, int(ray.cluster_resources().get("CPU", 2)))  # the default 200 shuffle partitions is all overhead
    reads = [_read(paths, TABLE_COLUMNS, filters).map_batches(
        _prepare_batch, batch_format="pyarrow", fn_kwargs={"exclude": frozenset(scan.excluded.get(i, ()))})
        for i, paths in enumerate(files) if paths]
    prepared = (reads[0].union(*reads[1:]) if len(reads) > 1 else reads[0]).materialize()

    def cells_of(keys: list[str], pooled: bool) -> list[CellStats]:
        rows = prepared.groupby(keys, num_partitions=parts).map_groups(
            _cells_fn, batch_format="pandas", fn_kwargs={"spec": spec, "pooled": pooled}).take_all()
        return sort_cells([CellStats(**json.loads(r["cell"])) for r in rows])

    cells = cells_of(list(CELL_KEYS), False)
    pooled = cells_of([k for k in CELL_KEYS if k != "phase"], True)
    if not cells and not len(scan.invalid):  # none left after the invalid records: the report fails on those
        raise DatasetError(f"{', '.join(scan.dirs)}: no cancel records (empty dataset or filters match nothing)")
    hop_rows = prepared.groupby("device_key", num_partitions=parts).map_groups(
        _hops_fn, batch_format="pandas").take_all()
    hops = sorted((HopStats(**json.loads(r["hop"])) for r in hop_rows), key=lambda h: h.device)
    devices = device_infos(prepared.map_batches(_device_rows, batch_format="pandas").to_pandas())
    return Report(spec=spec, dirs=scan.dirs, cells=cells, pooled=pooled, hops=hops, devices=devices,
                  defects=pd.DataFrame(), n_records=sum(c.n_trials for c in cells))
