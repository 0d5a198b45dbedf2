"""Reading sweep datasets for reports: only the columns a report needs,
filters pushed down to pyarrow (partition pruning on backend/host), any
number of result directories concatenated."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from cancelbench.schema import DEFECT_OUTCOMES  # noqa: F401 (re-exported for the reports)
from cancelbench.sink import DatasetError, read_table, record_files

from .tables import HOPS

# Columns that group cancel rows into cells (before derivation).
KEY_SOURCE_COLUMNS = ["workload", "phase_at_receipt", "mechanism", "delivery", "host", "backend", "device"]
# Device identity carried for the legend and for diff's device class.
DEVICE_COLUMNS = ["hostname", "device_name", "platform", "arch"]
VALUE_COLUMNS = ["trial_id", "sweep_id", "outcome", "latency_ms", "cost_ratio"]
HOP_COLUMNS = ["end_to_end_ms", *HOPS]

TABLE_COLUMNS = sorted(set(KEY_SOURCE_COLUMNS + DEVICE_COLUMNS + VALUE_COLUMNS + HOP_COLUMNS))


@dataclass(frozen=True)
class Filters:
    """Row filters pushed down to the Parquet scan (None = no filter)."""

    workloads: tuple[str, ...] | None = None
    backends: tuple[str, ...] | None = None
    hosts: tuple[str, ...] | None = None
    trial_kinds: tuple[str, ...] | None = ("cancel",)
    outcomes: tuple[str, ...] | None = None

    def expression(self) -> ds.Expression | None:
        expr = None
        for column, values in (
            ("trial_kind", self.trial_kinds),
            ("workload", self.workloads),
            ("backend", self.backends),
            ("host", self.hosts),
            ("outcome", self.outcomes),
        ):
            if values is None:
                continue
            term = pc.field(column).isin(list(values))
            expr = term if expr is None else expr & term
        return expr


@dataclass
class Loaded:
    frame: pd.DataFrame
    dirs: list[str] = field(default_factory=list)
    samples: pd.DataFrame | None = None  # plot samples (``plots.samples_frame``) when asked for


def check_dirs(dirs: list[str | Path]) -> list[Path]:
    """Every directory as a Path, failing with a DatasetError naming the bad one."""
    if not dirs:
        raise DatasetError("no dataset directories given")
    for d in dirs:
        path = Path(d)
        if not path.exists():
            raise DatasetError(f"{d}: no such directory")
        if not path.is_dir():
            raise DatasetError(f"{d}: not a directory (expected a cancelbench results directory)")
    return [Path(d) for d in dirs]


def scan_table(dirs: list[str | Path], columns: list[str], filters: Filters = Filters()) -> pa.Table:
    """Concatenate the selected columns of the filtered rows of every dataset."""
    expr = filters.expression()
    tables = []
    for path in check_dirs(dirs):
        try:
            tables.append(read_table(path, columns=columns, filter=expr))
        except (pa.ArrowInvalid, OSError) as exc:  # corrupt or foreign parquet files
            raise DatasetError(f"unreadable records: {exc}") from exc
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def load_frame(dirs: list[str | Path], columns: list[str] | None = None, filters: Filters = Filters(),
               with_samples: bool = False) -> Loaded:
    """Read the report columns as a *prepared* DataFrame (cell key columns
    added, see ``tables.prepare_table``); an empty selection is an error (a
    report over nothing would pass CI silently).  ``with_samples`` also
    reads the plot columns and returns the plots' latency samples from the
    same scan (``Loaded.samples``)."""
    from .plots import samples_frame
    from .tables import prepare_table

    columns = list(columns or TABLE_COLUMNS)
    if with_samples:
        columns += [c for c in PLOT_SOURCE_COLUMNS if c not in columns]
    table = scan_table(dirs, columns, filters)
    if table.num_rows == 0:
        raise DatasetError(f"{', '.join(map(str, dirs))}: no cancel records (empty dataset or filters match nothing)")
    table = prepare_table(table)
    samples = samples_frame(table) if with_samples else None
    # self_destruct frees each Arrow column once converted: peak memory ~ one copy, not two
    frame = table.to_pandas(split_blocks=True, self_destruct=True)
    del table
    return Loaded(frame=frame, dirs=[str(d) for d in dirs], samples=samples)


def records_files(dirs: list[str | Path]) -> list[str]:
    """The live record files of every dataset (each record once, also mid-compaction),
    validated (exists, schema version, at least one Parquet file) so bad input fails
    before Ray starts."""
    files = [str(f) for path in check_dirs(dirs) for f in record_files(path)]
    if not files:
        raise DatasetError(f"{', '.join(map(str, dirs))}: no cancel records (empty dataset)")
    return files


PLOT_SOURCE_COLUMNS = ["workload", "engine", "phase_at_receipt", "mechanism", "delivery", "host", "backend",
                       "device", "outcome", "latency_ms", "offset_actual_ms", "settle_ms", "native_call_at_receipt"]
REFERENCE_COLUMNS = ["workload", "phase_at_receipt", "mechanism", "host", "backend", "device", "trial_id",
                     "duration_ms", "t_handback_ns", "t_start_ns", "phase_timeline_json", "phase_durations_json"]


def load_plot_samples(dirs: list[str | Path], filters: Filters = Filters()) -> pd.DataFrame:
    """Latency samples for the HTML plots (a narrow scan of cancelled trials)."""
    from .plots import samples_frame
    from .tables import prepare_table

    f = Filters(workloads=filters.workloads, backends=filters.backends, hosts=filters.hosts,
                trial_kinds=("cancel",), outcomes=("cancelled",))
    return samples_frame(prepare_table(scan_table(dirs, PLOT_SOURCE_COLUMNS, f), dictionary=False))


def load_references(dirs: list[str | Path], filters: Filters = Filters()) -> pd.DataFrame:
    """Completed reference (uncancelled) runs with their phase timelines: the
    phase bands behind the offset plot and the phase durations of the
    uninterruptible-share bars."""
    from .tables import prepare_table

    f = Filters(workloads=filters.workloads, backends=filters.backends, hosts=filters.hosts,
                trial_kinds=("reference",), outcomes=("completed",))
    return prepare_table(scan_table(dirs, REFERENCE_COLUMNS, f), dictionary=False).to_pandas()
