"""Cell aggregation (the cross-platform table), latency bound flags, defect
listing and hop decomposition.

A *cell* is one (workload, phase, mechanism, delivery, device) combination of
cancel trials.  ``phase`` is ``phase_at_receipt``; ``device`` is
``"{host}/{device}"`` (device ids carry their backend, e.g. ``cpu:0``) (host = sanitized partition value).  Only
``trial_kind == "cancel"`` rows with outcome ``cancelled`` and a latency are
latency samples; the other outcomes are counted per cell.

Every per-group function here is order-independent (values are sorted, ties
broken by trial id, sums run over sorted values) so the pandas
path and the Ray Data path (``raydata.py``) give identical numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from cancelbench.schema import DEFECT_OUTCOMES

from . import stats
from .bounds import BoundSpec, parse_bound_for  # noqa: F401  (re-exported)

NONE_LABEL = "(none)"
ALL_PHASES = "*"  # the phase of a pooled cell (every phase at receipt together)
ROW_KEYS = ("workload", "phase", "mechanism", "delivery")
CELL_KEYS = ROW_KEYS + ("device_key",)
CELL_VALUE_COLUMNS = ["trial_id", "outcome", "latency_ms", "cost_ratio"]
HOPS = ("deliver_ms", "observe_ms", "return_ms", "settle_ms")
WORST_IDS = 5
INVALID = "invalid"  # the defect outcome of a record that cannot be trusted (load.invalid_records)


# ----------------------------------------------------------------- bounds --
@dataclass(frozen=True)
class ReportSpec:
    bound: BoundSpec = BoundSpec()
    bound_percentile: float = 0.99  # the percentile compared to the bound
    confidence: float = stats.DEFAULT_CONFIDENCE
    percentiles: tuple[float, ...] = stats.PERCENTILES

    def min_counts(self) -> dict[str, int]:
        return {stats.percentile_label(p): stats.min_samples(p, self.confidence) for p in self.percentiles}


# ------------------------------------------------------------------ cells --
@dataclass
class CellStats:
    workload: str
    phase: str
    mechanism: str
    delivery: str
    device: str
    n_trials: int  # cancel trials in the cell, any outcome
    n: int  # latency samples (outcome cancelled, latency present)
    dropped: int
    lost: int
    errors: int
    completed: int  # finished before the cancel took effect
    percentiles: dict[str, float | None]  # None = insufficient samples
    insufficient: list[str]
    max_ms: float | None
    cost_ratio_p50: float | None
    bound_ms: float
    bound_stat_ms: float | None  # nearest-rank bound percentile, even if insufficient
    n_over: int
    over: bool  # bound percentile > bound
    bound_proven: bool  # LoadGen early stopping: percentile <= bound at the confidence
    worst_trial_ids: list[str] = field(default_factory=list)

    @property
    def row_key(self) -> tuple[str, str, str, str]:
        return (self.workload, self.phase, self.mechanism, self.delivery)

    def to_dict(self) -> dict:
        return asdict(self)


def _labels(series: pd.Series) -> pd.Series:
    return series.astype(object).where(series.notna(), NONE_LABEL).astype(str)


LABEL_COLUMNS = ("workload", "mechanism", "delivery", "host", "backend", "device", "hostname", "device_name",
                 "platform", "arch")
DICT_COLUMNS = ("workload", "phase", "mechanism", "delivery", "device_key", "outcome",
                "hostname", "device_name", "platform", "arch", "backend")


def prepare_table(table: pa.Table, dictionary: bool = True) -> pa.Table:
    """Add the cell key columns (``phase``, ``device_key``) in Arrow, nulls
    labelled, low-cardinality strings dictionary-encoded (they become pandas
    categoricals: fast group-bys, small memory).  Both engines call this."""
    def label(name: str) -> pa.Array:
        return pc.fill_null(table.column(name).cast(pa.string()), NONE_LABEL)

    for name in LABEL_COLUMNS:
        if name in table.column_names:
            table = table.set_column(table.schema.get_field_index(name), name, label(name))
    table = table.append_column("phase", label("phase_at_receipt"))
    table = table.append_column("device_key", pc.binary_join_element_wise(
        table.column("host"), table.column("device"), "/"))
    for name in DICT_COLUMNS if dictionary else ():
        if name in table.column_names:
            col = table.column(name)
            if not pa.types.is_dictionary(col.type):
                table = table.set_column(table.schema.get_field_index(name), name, pc.dictionary_encode(col))
    return table


def prepare(frame: pd.DataFrame) -> pd.DataFrame:
    """``prepare_table`` for a DataFrame (small frames: defects, diff)."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    return prepare_table(table).to_pandas()


def _obj(series: pd.Series) -> np.ndarray:
    return series.astype(object).to_numpy()


def summarize_cell(key: tuple, group: pd.DataFrame, spec: ReportSpec) -> CellStats:
    """Statistics of one cell given as a DataFrame (the Ray path)."""
    return summarize_cell_arrays(
        key, _obj(group["outcome"]), group["latency_ms"].to_numpy(dtype=float, na_value=np.nan),
        group["cost_ratio"].to_numpy(dtype=float, na_value=np.nan), group["trial_id"].to_numpy(), spec)


def sample_mask(outcome: np.ndarray, lat: np.ndarray) -> np.ndarray:
    """Latency samples: cancelled trials with a finite latency >= 0 (a cancelled trial
    without one is an invalid record, listed as a defect by ``load.invalid_records``)."""
    return (outcome == "cancelled") & np.isfinite(lat) & (lat >= 0)


def summarize_cell_arrays(key: tuple, outcome: np.ndarray, lat_all: np.ndarray, cost_all: np.ndarray,
                          trial_ids, spec: ReportSpec) -> CellStats:
    """Statistics of one cell (pure; independent of row order).  ``trial_ids``
    needs only integer-array indexing (numpy array or ``_Take``)."""
    workload, phase, mechanism, delivery, device = (str(k) for k in key)
    is_sample = sample_mask(outcome, lat_all)
    lat_s = lat_all[is_sample]
    lat = np.sort(lat_s)
    n = int(lat.size)
    bound = spec.bound.for_cell(workload, phase)
    pcts: dict[str, float | None] = {}
    insufficient = []
    for p in spec.percentiles:
        label = stats.percentile_label(p)
        if n >= stats.min_samples(p, spec.confidence):
            pcts[label] = stats.nearest_rank(lat, p)
        else:
            pcts[label] = None
            insufficient.append(label)
    cost = cost_all[is_sample]
    cost = np.sort(cost[~np.isnan(cost)])
    bound_stat = stats.nearest_rank(lat, spec.bound_percentile) if n else None
    n_over = int(np.count_nonzero(lat > bound))
    over = bound_stat is not None and bound_stat > bound
    worst: list[str] = []
    if n_over:
        sel = lat_s > bound
        ids = np.asarray(trial_ids[np.flatnonzero(is_sample)[sel]], dtype=object).astype(str)
        order = np.lexsort((ids, -lat_s[sel]))[:WORST_IDS]
        worst = [str(x) for x in ids[order]]
    count = lambda name: int(np.count_nonzero(outcome == name))  # noqa: E731
    return CellStats(
        workload=workload, phase=phase, mechanism=mechanism, delivery=delivery, device=device,
        n_trials=int(len(outcome)), n=n,
        dropped=count("dropped"), lost=count("lost"), errors=count("error"), completed=count("completed"),
        percentiles=pcts, insufficient=insufficient,
        max_ms=float(lat[-1]) if n else None,
        cost_ratio_p50=stats.nearest_rank(cost, 0.5) if cost.size else None,
        bound_ms=float(bound), bound_stat_ms=bound_stat, n_over=n_over, over=bool(over),
        bound_proven=stats.early_stop_ok(n, n_over, spec.bound_percentile, spec.confidence),
        worst_trial_ids=worst,
    )


class _Take:
    """Trial ids of one cell, ``values[idx]``, taken from the Arrow array only
    when indexed (positions are within idx)."""

    def __init__(self, values, idx: np.ndarray) -> None:
        self.values, self.idx = values, idx

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        return self.values.take(pa.array(self.idx[positions])).to_numpy(zero_copy_only=False)


def aggregate_cells(frame: pd.DataFrame, spec: ReportSpec, device_column: str = "device_key",
                    pool_phases: bool = False) -> list[CellStats]:
    """All cells of a prepared frame (pandas engine): group indices once, then
    slice plain numpy arrays (much faster than iterating sub-DataFrames).
    ``pool_phases`` puts every phase of a (workload, mechanism, delivery,
    device) into one cell whose phase is ``ALL_PHASES``."""
    keys = [k for k in ROW_KEYS if not (pool_phases and k == "phase")] + [device_column]
    outcome = _obj(frame["outcome"])
    lat = frame["latency_ms"].to_numpy(dtype=float, na_value=np.nan)
    cost = frame["cost_ratio"].to_numpy(dtype=float, na_value=np.nan)
    # Stays one Arrow array: only the few over-bound ids ever become Python strings.
    ids = pa.Table.from_pandas(frame[["trial_id"]], preserve_index=False).column(0).combine_chunks()
    groups = frame.groupby(keys, sort=True, observed=True, dropna=False).indices
    cells = [summarize_cell_arrays(pooled_key(key) if pool_phases else key, outcome[idx], lat[idx], cost[idx],
                                   _Take(ids, idx), spec) for key, idx in groups.items()]
    return sort_cells(cells)


def pooled_key(key: tuple) -> tuple:
    """(workload, mechanism, delivery, device) -> the cell key with phase ``ALL_PHASES``."""
    return (key[0], ALL_PHASES, *key[1:])


def sort_cells(cells: list[CellStats]) -> list[CellStats]:
    return sorted(cells, key=lambda c: (c.row_key, c.device))


# ------------------------------------------------------------------- hops --
@dataclass
class HopStats:
    """Where the end-to-end time of a device's cancels goes (means, ms).

    end_to_end = deliver + observe + return + settle for every sample
    (observe is 0 for mechanisms without a native observer); ``share`` is each
    hop's mean over the mean end-to-end time."""

    device: str
    n: int
    end_to_end_mean_ms: float | None
    means_ms: dict[str, float | None]
    share: dict[str, float | None]


def _exact_mean(values: np.ndarray) -> float:
    """Mean of the values summed in sorted order: the same multiset gives the
    same bits whatever order the rows arrived in (pandas vs Ray)."""
    return float(np.sum(np.sort(values))) / len(values)


def summarize_hops(device: str, group: pd.DataFrame) -> HopStats:
    ok = _obj(group["outcome"]) == "cancelled"
    e2e = group["end_to_end_ms"].to_numpy(dtype=float, na_value=np.nan)
    ok &= ~np.isnan(e2e)
    n = int(np.count_nonzero(ok))
    if not n:
        return HopStats(device, 0, None, {h: None for h in HOPS}, {h: None for h in HOPS})
    e2e_mean = _exact_mean(e2e[ok])
    means, share = {}, {}
    for hop in HOPS:
        values = group[hop].to_numpy(dtype=float, na_value=np.nan)[ok]
        means[hop] = _exact_mean(np.nan_to_num(values, nan=0.0))
        share[hop] = means[hop] / e2e_mean if e2e_mean else None
    return HopStats(device, n, e2e_mean, means, share)


def aggregate_hops(frame: pd.DataFrame) -> list[HopStats]:
    sub = frame[["device_key", "outcome", "end_to_end_ms", *HOPS]]
    hops = [summarize_hops(str(k), g) for k, g in sub.groupby("device_key", observed=True)]
    return sorted(hops, key=lambda h: h.device)  # by name: categorical group order is appearance order


# ---------------------------------------------------------------- devices --
@dataclass
class DeviceInfo:
    device: str
    hostname: str
    device_name: str
    platform: str
    arch: str
    backend: str
    build: dict = field(default_factory=dict)  # build and host facts (``legend.attach_builds``)

    @property
    def device_class(self) -> str:
        return device_class_key(self.platform, self.arch, self.backend, self.device_name)


def device_class_key(platform: object, arch: object, backend: object, device_name: object) -> str:
    """Device class for cross-sweep matching: same OS, architecture, backend
    and device model compare; host names do not matter."""
    return "/".join(str(x) for x in (platform, arch, backend, device_name))


def device_infos(frame: pd.DataFrame) -> list[DeviceInfo]:
    """One legend row per device key (first values in sorted order if a key
    somehow reported several)."""
    cols = ["device_key", "hostname", "device_name", "platform", "arch", "backend"]
    sub = frame[cols].drop_duplicates().astype(str).sort_values(cols)
    first = sub.groupby("device_key", sort=True).first()
    return [DeviceInfo(device=str(k), **{c: str(r[c]) for c in cols[1:]}) for k, r in first.iterrows()]


# ---------------------------------------------------------------- defects --
DEFECT_COLUMNS = ["trial_id", "sweep_id", "trial_kind", "outcome", "workload", "phase_at_receipt", "mechanism",
                  "delivery", "host", "backend", "device", "hostname", "error"]


def defects_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Dropped cancels, lost trials and invalid records (``load.INVALID``: the reason in
    ``error``), in that order, each in a stable order."""
    if frame.empty:
        return pd.DataFrame(columns=["outcome", "trial_id", "device", "workload", "phase", "mechanism", "delivery",
                                     "trial_kind", "sweep_id", "hostname", "error"])
    f = prepare(frame)
    f = f[f["outcome"].isin([*DEFECT_OUTCOMES, INVALID])]
    # Plain strings, not categoricals: sorting must be by value, not by category order.
    out = pd.DataFrame({
        "outcome": f["outcome"].astype(str),
        "trial_id": f["trial_id"].astype(str),
        "device": f["device_key"].astype(str),
        "workload": f["workload"].astype(str),
        "phase": f["phase"].astype(str),
        "mechanism": f["mechanism"].astype(str),
        "delivery": f["delivery"].astype(str),
        "trial_kind": _labels(f["trial_kind"]),
        "sweep_id": _labels(f["sweep_id"]),
        "hostname": _labels(f["hostname"]),
        "error": f["error"].astype(object).where(f["error"].notna(), ""),
    })
    rank = out["outcome"].map({"dropped": 0, "lost": 1, INVALID: 2})
    return out.assign(_r=rank).sort_values(["_r", "device", "workload", "trial_id", "sweep_id"]).drop(columns="_r") \
        .reset_index(drop=True)


# ----------------------------------------------------------------- report --
@dataclass
class Report:
    spec: ReportSpec
    dirs: list[str]
    cells: list[CellStats]
    pooled: list[CellStats]  # phases pooled: the mechanism comparison
    hops: list[HopStats]
    devices: list[DeviceInfo]
    defects: pd.DataFrame
    n_records: int
    samples: pd.DataFrame | None = None  # latency samples for the plots, when built with them
    simulated: list[str] = field(default_factory=list)  # simulated engines among the records (registry flag)
    targeting: list = field(default_factory=list)  # targeting.Targeting per cell: did cancels land as planned
    references: pd.DataFrame | None = None  # completed reference runs (``load.references_of``), with the samples
    repeats: list[str] = field(default_factory=list)  # datasets named more than once: "B is A (...): counted once"
    residue: list = field(default_factory=list)  # residue.ResidueCell per cell: the residue split (reports/residue.py)
    bargein: tuple = ([], [])  # barge-in sweeps: (cells, per-phase stops), reports/bargein.py
    # The sweep's own failures that no record shows as a defect ("2 trial(s) ended in error", "3 planned
    # trial(s) not run"): set by the sweep for the summary and report files it writes at its end, so their
    # verdict and exit code are the sweep's (runner.SweepResult.exit_code); empty for `cancelbench report`.
    sweep_failures: list[str] = field(default_factory=list)

    @property
    def over(self) -> list[CellStats]:
        """Cells over their bound, worst first."""
        return sorted((c for c in self.cells if c.over), key=lambda c: (-(c.bound_stat_ms or 0.0), c.row_key, c.device))

    @property
    def exit_code(self) -> int:
        """1 when dropped or lost trials or invalid records exist (defects), or the sweep that writes
        this report failed otherwise (``sweep_failures``), else 0."""
        return 1 if len(self.defects) or self.sweep_failures else 0

    @property
    def verdict(self) -> str:
        if len(self.defects) or self.sweep_failures:
            return "defects"
        return "over_bound" if self.over else "ok"

    def over_pooled(self) -> set[tuple[str, str, str, str]]:
        """(workload, mechanism, delivery, device) of pooled cells with a phase over its bound."""
        return {(c.workload, c.mechanism, c.delivery, c.device) for c in self.cells if c.over}

    def devices_in_cells(self) -> list[str]:
        return sorted({c.device for c in self.cells})
