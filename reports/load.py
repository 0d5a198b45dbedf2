"""Reading sweep datasets for reports: only the columns a report needs,
filters pushed down to pyarrow (partition pruning on backend/host), any
number of result directories concatenated.

Every command reads each dataset **once** (``read_once``): one scan of the
union of the columns it needs, into one Arrow table, from which the cells,
defects, targeting, build facts, plot samples and reference runs are all
derived. A dataset is counted once however it is named: two directories
whose manifests carry the same sweep id (the same path twice, a symlink, a
copy) are one dataset, read from the first given. Records that cannot be
trusted are *invalid* and listed as defects (``INVALID``): every record of a
trial id that occurs more than once in a dataset (a copied part file; none of
its copies counts), and a cancelled trial whose ``latency_ms`` is missing,
NaN, infinite or negative."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from cancelbench.schema import DEFECT_OUTCOMES  # noqa: F401 (re-exported for the reports)
from cancelbench.schema import RECORD_SCHEMA, SETTINGS_COLUMNS
from cancelbench.sink import DatasetError, partitioning, read_manifest, read_table, record_files, records_dir

from .tables import HOPS, INVALID

# Columns that group cancel rows into cells (before derivation).
KEY_SOURCE_COLUMNS = ["workload", "phase_at_receipt", "mechanism", "delivery", "host", "backend", "device"]
# Device identity carried for the legend and for diff's device class.
DEVICE_COLUMNS = ["hostname", "device_name", "platform", "arch"]
VALUE_COLUMNS = ["trial_id", "sweep_id", "outcome", "latency_ms", "cost_ratio"]
HOP_COLUMNS = ["end_to_end_ms", *HOPS]

TABLE_COLUMNS = sorted(set(KEY_SOURCE_COLUMNS + DEVICE_COLUMNS + VALUE_COLUMNS + HOP_COLUMNS))
# What the agent loaded and ran on, per device (the legend's build facts; ``legend.py``).
BUILD_COLUMNS = ("llama_cpp_python_version", "llama_cpp_build", "llama_cpp_commit", "ggml_version", "ggml_backends",
                 "gpu_driver_version", "os_release", "kernel_version", "cancelbench_version",
                 "cancelbench_git_describe")
# Read as dictionaries (``read_dataset``): the build facts and the string settings but the cell keys.
DICTIONARY_COLUMNS = frozenset([*BUILD_COLUMNS, *(c for c in SETTINGS_COLUMNS if c not in ("workload", "engine")
                                                  and pa.types.is_string(RECORD_SCHEMA.field(c).type))])
DATASET = "__dataset"  # the position of a row's dataset among the distinct datasets (added by read_once)


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

    def widened(self, trial_kinds: tuple[str, ...] | None = None) -> Filters:
        """The same workload/backend/host selection over other trial kinds, any outcome."""
        return Filters(workloads=self.workloads, backends=self.backends, hosts=self.hosts, trial_kinds=trial_kinds)


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


def dataset_identity(path: Path) -> str:
    """What makes two directories one dataset: the manifest's sweep id, else the resolved path."""
    sweep_id = read_manifest(path).get("sweep_id")
    return f"sweep:{sweep_id}" if isinstance(sweep_id, str) and sweep_id else f"path:{os.path.realpath(path)}"


def distinct_datasets(dirs: list[str | Path]) -> tuple[list[Path], list[str]]:
    """The directories, each dataset once (the first name given), and a note per repeat
    ("B is A (sweep S): counted once")."""
    kept: dict[str, Path] = {}
    notes = []
    for path in check_dirs(dirs):
        ident = dataset_identity(path)
        if ident in kept:
            what = f"sweep {ident[6:]}" if ident.startswith("sweep:") else "the same directory"
            notes.append(f"{path} is {kept[ident]} ({what}): counted once")
        else:
            kept[ident] = path
    return list(kept.values()), notes


def read_dataset(path: Path, columns: list[str], filter: ds.Expression | None = None, tries: int = 5) -> pa.Table:
    """The one reader of records for reports: ``columns`` of the rows ``filter`` keeps. Build facts
    and string settings (a handful of distinct values, stored dictionary-encoded) come back as
    dictionaries: a million rows of them are small and cheap to read (their consumers group
    them or cast them to text). A file that vanished between the listing and the read (a
    compaction finishing in another process) means: list again and reread."""
    as_dict = [c for c in columns if c in DICTIONARY_COLUMNS]
    if not as_dict:
        return read_table(path, columns=columns, filter=filter)
    schema = pa.schema([pa.field(f.name, pa.dictionary(pa.int32(), f.type)) if f.name in as_dict else f
                        for f in RECORD_SCHEMA], metadata=RECORD_SCHEMA.metadata)
    fmt = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(dictionary_columns=as_dict))
    for attempt in range(tries):
        try:
            files = [str(f) for f in record_files(path)]
            return ds.dataset(files, schema=schema, format=fmt, partitioning=partitioning(),
                              partition_base_dir=str(records_dir(path))).to_table(columns=columns, filter=filter)
        except FileNotFoundError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def scan_table(dirs: list[str | Path], columns: list[str], filters: Filters = Filters()) -> pa.Table:
    """Concatenate the selected columns of the filtered rows of every dataset (each once),
    with the dataset's position in ``DATASET``."""
    expr = filters.expression()
    tables = []
    for i, path in enumerate(distinct_datasets(dirs)[0]):
        try:
            t = read_dataset(path, columns, expr)
        except (pa.ArrowInvalid, OSError) as exc:  # corrupt or foreign parquet files
            raise DatasetError(f"unreadable records: {exc}") from exc
        tables.append(t.append_column(DATASET, pa.array(np.full(t.num_rows, i, dtype=np.int32))))
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    return table.unify_dictionaries()  # one dictionary per column: Arrow groups by them


# ------------------------------------------------------------ invalid records --
def _str(table: pa.Table, name: str) -> pa.ChunkedArray:
    return table.column(name).cast(pa.string())


def latency_valid(table: pa.Table) -> pa.ChunkedArray:
    """A usable latency: present, finite and >= 0 (never null)."""
    lat = table.column("latency_ms")
    return pc.fill_null(pc.and_(pc.is_finite(lat), pc.greater_equal(lat, 0.0)), False)


def _invalid_latency(table: pa.Table) -> pa.ChunkedArray:
    """Cancelled trials without a usable latency."""
    cancelled = pc.fill_null(pc.equal(_str(table, "outcome"), "cancelled"), False)
    return pc.and_(cancelled, pc.invert(latency_valid(table)))


def _duplicated(table: pa.Table) -> pa.ChunkedArray:
    """Rows whose (dataset, trial id) another row has too."""
    flags = np.zeros(table.num_rows, dtype=bool)
    ids = table.select([DATASET, "trial_id"])
    if pc.count_distinct(ids["trial_id"]).as_py() < table.num_rows:  # else every id is unique: done
        counts = ids.group_by([DATASET, "trial_id"]).aggregate([([], "count_all")])
        dup = counts.filter(pc.greater(counts["count_all"], 1))
        if dup.num_rows:
            rows = ids.append_column("_row", pa.array(np.arange(table.num_rows))).join(
                dup, [DATASET, "trial_id"], join_type="inner")["_row"].to_numpy()
            flags[rows] = True
    return pa.chunked_array([pa.array(flags)])


def _why_latency(value) -> str:
    if value is None:
        return "cancelled without latency_ms"
    if np.isnan(value):
        return "latency_ms is NaN"
    return f"latency_ms is {value:g}"


def invalid_records(table: pa.Table) -> tuple[pa.Table, pd.DataFrame, dict[int, set[str]]]:
    """(the table without the duplicated records, the invalid records as raw defect rows
    with ``outcome = INVALID`` and the reason in ``error``, the duplicated trial ids per
    dataset position): one defect row per duplicated trial id, one per cancelled trial
    without a usable latency."""
    dup = _duplicated(table)
    bad_lat = _invalid_latency(table)
    parts = []
    excluded: dict[int, set[str]] = {}
    if pc.any(dup).as_py():
        d = table.filter(dup).to_pandas()
        for i, g in d.groupby(DATASET):
            excluded[int(i)] = set(map(str, g["trial_id"]))
        n = d.groupby([DATASET, "trial_id"], sort=False)["trial_id"].transform("size")
        d = d.assign(error=[f"trial id in {k} records (a copied part file?): none counts" for k in n])
        cols = [c for c in d.columns if c != DATASET]
        d = d.astype({c: object for c in cols}).sort_values(cols, key=lambda s: s.astype(str), kind="stable")
        parts.append(d.drop_duplicates([DATASET, "trial_id"]))
        table = table.filter(pc.invert(dup))
        bad_lat = _invalid_latency(table)
    if pc.any(bad_lat).as_py():
        bad = table.filter(bad_lat)  # null and NaN stay apart in Arrow, not in pandas
        parts.append(bad.to_pandas().assign(error=[_why_latency(v) for v in bad.column("latency_ms").to_pylist()]))
    if not parts:
        return table, pd.DataFrame(), excluded
    out = pd.concat(parts, ignore_index=True).assign(outcome=INVALID)
    return table, out.drop(columns=[DATASET]), excluded


# ------------------------------------------------------------------ read once --
@dataclass
class Scan:
    """Every record a command reads from its datasets, read once: ``table`` holds the
    union of the columns it asked for (duplicated records removed), ``invalid`` the
    records that cannot be trusted (raw defect rows, see ``invalid_records``)."""

    table: pa.Table
    invalid: pd.DataFrame
    dirs: list[str]
    repeats: list[str]  # "B is A (sweep S): counted once"
    excluded: dict[int, set[str]] = field(default_factory=dict)  # dataset position -> duplicated trial ids

    def mask(self, kinds: tuple[str, ...] | None = ("cancel",), outcomes: tuple[str, ...] | None = None,
             valid_latency: bool = False) -> pa.ChunkedArray | None:
        """Which rows have one of ``kinds`` and ``outcomes`` (None: any), and a usable latency
        when asked; None: every row."""
        t, mask = self.table, None
        for name, values in (("trial_kind", kinds), ("outcome", outcomes)):
            if values is not None:
                term = pc.fill_null(pc.is_in(_str(t, name), pa.array(list(values))), False)
                mask = term if mask is None else pc.and_(mask, term)
        if valid_latency:
            mask = latency_valid(t) if mask is None else pc.and_(mask, latency_valid(t))
        return mask

    def rows(self, kinds: tuple[str, ...] | None = ("cancel",), outcomes: tuple[str, ...] | None = None,
             valid_latency: bool = False, columns: list[str] | None = None) -> pa.Table:
        """Those rows, only ``columns`` of them when given (selected before the filter copies them)."""
        mask = self.mask(kinds, outcomes, valid_latency)
        t = self.table if columns is None else self.table.select([c for c in columns if c in self.table.column_names])
        return t if mask is None else t.filter(mask)


def read_once(dirs: list[str | Path], columns: list[str], filters: Filters = Filters(),
              kinds: tuple[str, ...] = ("cancel", "reference")) -> Scan:
    """One scan per dataset (each dataset once) of ``columns`` plus what the invalid-record
    check needs, over the trial ``kinds`` under ``filters``'
    workload/backend/host selection."""
    distinct, repeats = distinct_datasets(dirs)
    need = ["trial_id", "trial_kind", "outcome", "latency_ms", "sweep_id"]
    cols = list(dict.fromkeys([*need, *columns]))
    unknown = [c for c in cols if c not in RECORD_SCHEMA.names]
    if unknown:
        raise ValueError(f"not record columns: {unknown}")
    table = scan_table(distinct, cols, filters.widened(kinds))
    table, invalid, excluded = invalid_records(table)
    return Scan(table, invalid, [str(d) for d in distinct], repeats, excluded)


def records_of(scan: Scan, filters: Filters = Filters(), columns: list[str] | None = None) -> pa.Table:
    """The cancel rows a report's cells aggregate (``filters.trial_kinds``, default cancel): their
    ``columns`` (default all read)."""
    return scan.rows(filters.trial_kinds, filters.outcomes, columns=columns)


def require_rows(table: pa.Table, dirs: list[str], invalid: int = 0) -> None:
    """No cell rows is an error (a report over nothing would pass CI silently), unless
    invalid records took them (then the report fails on those)."""
    if table.num_rows == 0 and not invalid:
        raise DatasetError(f"{', '.join(map(str, dirs))}: no cancel records (empty dataset or filters match nothing)")


def frame_of(table: pa.Table, dirs: list[str], invalid: int = 0) -> pd.DataFrame:
    """The *prepared* DataFrame of cell rows (``tables.prepare_table``); none is an error
    (``require_rows``)."""
    from .tables import prepare_table

    require_rows(table, dirs, invalid)
    cols = [c for c in TABLE_COLUMNS if c in table.column_names]
    # self_destruct frees each Arrow column once converted: peak memory ~ one copy, not two
    return prepare_table(table.select(cols)).to_pandas(split_blocks=True, self_destruct=True)


def load_frame(dirs: list[str | Path], columns: list[str] | None = None, filters: Filters = Filters(),
               with_samples: bool = False) -> Loaded:
    """Read the report columns as a *prepared* DataFrame (cell key columns added, see
    ``tables.prepare_table``) in one scan; ``with_samples`` also returns the plots'
    latency samples from the same scan (``Loaded.samples``)."""
    cols = list(columns or TABLE_COLUMNS) + (PLOT_SOURCE_COLUMNS if with_samples else [])
    scan = read_once(dirs, cols, filters, kinds=filters.trial_kinds or ("cancel", "reference"))
    samples = samples_of(records_of(scan, filters, PLOT_SOURCE_COLUMNS)) if with_samples else None
    frame = frame_of(records_of(scan, filters, TABLE_COLUMNS), scan.dirs, len(scan.invalid))
    return Loaded(frame=frame, dirs=scan.dirs, samples=samples)


def samples_of(table: pa.Table) -> pd.DataFrame:
    """The plots' latency samples (cancelled, a usable latency) of cancel rows."""
    from .plots import samples_frame
    from .tables import prepare_table

    t = table.select([c for c in PLOT_SOURCE_COLUMNS if c in table.column_names])
    return samples_frame(prepare_table(t.filter(latency_valid(t)), dictionary=False))


def references_of(scan: Scan) -> pd.DataFrame:
    """Completed reference (uncancelled) runs with their phase timelines: the phase bands
    behind the offset plot and the phase durations of the uninterruptible-share bars."""
    from .tables import prepare_table

    t = scan.rows(("reference",), ("completed",), columns=REFERENCE_COLUMNS)
    return prepare_table(t, dictionary=False).to_pandas()


def records_files(dirs: list[str | Path]) -> list[list[str]]:
    """The live record files of each distinct dataset (each record once, also mid-compaction),
    validated (exists, schema version, at least one Parquet file) so bad input fails
    before Ray starts."""
    files = [[str(f) for f in record_files(path)] for path in distinct_datasets(dirs)[0]]
    if not any(files):
        raise DatasetError(f"{', '.join(map(str, dirs))}: no cancel records (empty dataset)")
    return files


PLOT_SOURCE_COLUMNS = ["workload", "engine", "phase_at_receipt", "mechanism", "delivery", "host", "backend",
                       "device", "outcome", "latency_ms", "offset_actual_ms", "settle_ms", "native_call_at_receipt"]
REFERENCE_COLUMNS = ["workload", "phase_at_receipt", "mechanism", "host", "backend", "device", "trial_id",
                     "duration_ms", "t_handback_ns", "t_start_ns", "phase_timeline_json", "phase_durations_json"]


def load_plot_samples(dirs: list[str | Path], filters: Filters = Filters()) -> pd.DataFrame:
    """Latency samples for the HTML plots (one narrow scan of cancelled trials)."""
    scan = read_once(dirs, PLOT_SOURCE_COLUMNS, filters, kinds=("cancel",))
    return samples_of(scan.rows(("cancel",), ("cancelled",), columns=PLOT_SOURCE_COLUMNS))


def load_references(dirs: list[str | Path], filters: Filters = Filters()) -> pd.DataFrame:
    """``references_of`` in a scan of its own (``build_report(with_samples=True)`` keeps them
    from its one scan in ``Report.references``)."""
    return references_of(read_once(dirs, REFERENCE_COLUMNS, filters, kinds=("reference",)))
