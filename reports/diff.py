"""``cancelbench diff BASELINE CANDIDATE``: cell-by-cell regression check.

Cells match on (workload, phase, mechanism, delivery, device class), where the
device class is ``platform/arch/backend/device_name``: a Metal laptop is
compared with the same class of Metal laptop (any host name), never with a
CPU run unless ``class_map`` explicitly pairs the two classes.

Per matched cell the verdict is, first rule that applies:

* **regressed** -- any of: more dropped cancels or lost trials than the
  baseline; the cell newly over its latency bound; the chosen percentile went
  up significantly (the seeded bootstrap CI of the change lies above 0) *and*
  by more than ``rel_threshold`` of the baseline value.
* **insufficient** -- either side has fewer samples than the percentile needs
  (``stats.min_samples``).
* **improved** -- the mirror image of a percentile regression.
* **unchanged** -- otherwise (a pure noise change lands here: its CI
  straddles 0 or its size is below the threshold).

A candidate-only cell counts as regressed if it has dropped/lost trials or is
over the bound; a baseline-only cell is listed as missing.

Cells are compared only when their settings agree (every ``settings`` column
of the schema: model, sizes, graph slice, sampling, offset plan...): two sweeps
that differ in a setting are different experiments, and ``run_diff`` refuses
them with the settings that differ, unless each is named in
``DiffSpec.ignore_settings`` (``--ignore-setting``). A setting recorded on one
side only (a schema-1 dataset) is not a difference.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from cancelbench.sink import DatasetError

from . import noise, residue, stats
from .sections import Section, fmt_ms
from .legend import BUILD_COLUMNS, ENGINE_BUILD_COLUMNS, builds_by_class_of, builds_legend
from .load import TABLE_COLUMNS, Filters, frame_of, read_once, records_of
from .settings import CLASS_COLUMNS, SettingsByCell, check_settings, settings_by_cell
from .settings import COLUMNS as SETTINGS_COLUMNS
from .tables import (NONE_LABEL, ROW_KEYS, BoundSpec, ReportSpec, _Take, device_class_key, sample_mask,
                     summarize_cell_arrays)

# What diff (and trend) read of each side, in its one scan: the cells, the settings check, the builds legend.
DIFF_COLUMNS = list(dict.fromkeys([*TABLE_COLUMNS, *SETTINGS_COLUMNS, *CLASS_COLUMNS, *BUILD_COLUMNS,
                                   *ENGINE_BUILD_COLUMNS, *residue.COLUMNS, *noise.COLUMNS]))
SETTINGS_READ = ["workload", "mechanism", "delivery", *CLASS_COLUMNS, *SETTINGS_COLUMNS]


class DiffInputError(DatasetError):
    """Inputs that cannot be compared (bad datasets, no common device class)."""


@dataclass(frozen=True)
class DiffSpec:
    percentile: float = 0.99
    rel_threshold: float = 0.10
    confidence: float = stats.DEFAULT_CONFIDENCE
    n_boot: int = 4000
    seed: int = 0
    bound: BoundSpec = BoundSpec()
    class_map: tuple[tuple[str, str], ...] = ()  # (baseline class, candidate class) pairs compared across classes
    ignore_settings: tuple[str, ...] = ()  # settings columns allowed to differ between the two sides
    noise: noise.NoiseSpec = noise.NoiseSpec()  # when the two sides' hosts differ too much (reports/noise.py)

    def report_spec(self) -> ReportSpec:
        return ReportSpec(bound=self.bound, bound_percentile=self.percentile, confidence=self.confidence,
                          percentiles=tuple(sorted({0.5, self.percentile})))


@dataclass
class CellDiff:
    workload: str
    phase: str
    mechanism: str
    delivery: str
    device_class: str  # candidate's class (the baseline's if only in the baseline)
    baseline_class: str
    status: str  # matched | new | missing
    verdict: str  # regressed | improved | unchanged | insufficient | new | missing
    reasons: list[str]
    base_n: int = 0
    cand_n: int = 0
    base_p50: float | None = None
    cand_p50: float | None = None
    base_value: float | None = None  # chosen percentile; None if insufficient
    cand_value: float | None = None
    change_ms: float | None = None
    rel_change: float | None = None
    ci_low_ms: float | None = None
    ci_high_ms: float | None = None
    base_dropped: int = 0
    cand_dropped: int = 0
    base_lost: int = 0
    cand_lost: int = 0
    base_over: bool = False
    cand_over: bool = False
    cand_worst_trial_ids: list[str] = field(default_factory=list)
    # the residue split (reports/residue.py): work p50 and CPU-wait share; None without one
    base_work_p50: float | None = None
    cand_work_p50: float | None = None
    base_wait_share: float | None = None
    cand_wait_share: float | None = None

    @property
    def key(self) -> tuple:
        return (self.workload, self.phase, self.mechanism, self.delivery, self.device_class)


@dataclass
class DiffResult:
    spec: DiffSpec
    baseline: list[str]
    candidate: list[str]
    cells: list[CellDiff]
    baseline_only_classes: list[str]
    candidate_only_classes: list[str]
    # sorted latencies (baseline, candidate; None for a side without the cell) of the regressed and improved
    # cells, for the HTML page's overlaid ECDFs
    samples: dict[tuple, tuple[np.ndarray | None, np.ndarray | None]] = field(default_factory=dict)
    legend: list[Section] = field(default_factory=list)  # extra legend sections (builds), rendered last
    notes: list[str] = field(default_factory=list)  # datasets counted once; invalid records outside every cell
    invalid: int = 0  # invalid records on both sides (load.invalid_records): the diff fails
    noise: noise.NoiseCheck | None = None  # the two hosts compared (reports/noise.py)

    @property
    def regressed(self) -> list[CellDiff]:
        return [c for c in self.cells if c.verdict == "regressed"]

    @property
    def exit_code(self) -> int:
        if self.noise is not None and self.noise.refused:
            return noise.REFUSED_EXIT
        return 1 if self.regressed or self.invalid else 0

    def counts(self) -> dict[str, int]:
        return pd.Series([c.verdict for c in self.cells], dtype=object).value_counts().sort_index().to_dict()


@dataclass
class _Side:
    stats: object  # CellStats
    sorted_latency: np.ndarray


def _cells_by_class(frame: pd.DataFrame, spec: ReportSpec, class_map: dict[str, str]) -> dict[tuple, _Side]:
    """Cells keyed by (workload, phase, mechanism, delivery, device class):
    every host of one class pools into one cell."""
    f = frame.assign(device_class=_device_classes(frame, class_map))
    keys = list(ROW_KEYS) + ["device_class"]
    outcome = f["outcome"].astype(object).to_numpy()
    lat = f["latency_ms"].to_numpy(dtype=float, na_value=np.nan)
    cost = f["cost_ratio"].to_numpy(dtype=float, na_value=np.nan)
    # Stays one Arrow array: only the few over-bound ids ever become Python strings (as tables.aggregate_cells).
    ids = pa.Table.from_pandas(f[["trial_id"]], preserve_index=False).column(0).combine_chunks()
    out = {}
    for key, idx in f.groupby(keys, sort=True, observed=True).indices.items():
        cell = summarize_cell_arrays(key, outcome[idx], lat[idx], cost[idx], _Take(ids, idx), spec)
        out[tuple(map(str, key))] = _Side(cell, np.sort(lat[idx][sample_mask(outcome[idx], lat[idx])]))
    return out


def _device_classes(frame: pd.DataFrame, class_map: dict[str, str]) -> pd.Categorical:
    """Each row's device class (``tables.device_class_key``, mapped by ``class_map``), built per
    distinct (platform, arch, backend, device name), not per row."""
    codes = np.zeros(len(frame), dtype=np.int64)
    names: dict[str, int] = {}
    for key, idx in frame.groupby(CLASS_COLUMNS, observed=True, sort=True, dropna=False).indices.items():
        cls = device_class_key(*key)
        codes[idx] = names.setdefault(class_map.get(cls, cls), len(names))
    return pd.Categorical.from_codes(codes, categories=list(names)) if names else pd.Categorical([])


@dataclass
class SideData:
    """One side of a diff (or one sweep of a trend), from its one scan."""

    cells: dict[tuple, _Side]
    settings: SettingsByCell
    builds: dict[str, dict[str, str]]  # device class -> build facts
    invalid: dict[tuple, list[str]]  # cell key -> "trial id: why" of its invalid records
    dirs: list[str]
    repeats: list[str]
    residue: dict[tuple, residue.ResidueCell] = field(default_factory=dict)  # cell key -> its split
    noise: noise.NoiseFacts = noise.NoiseFacts()  # the side's host facts


def read_side(dirs: list[str | Path], spec: ReportSpec, filters: Filters, class_map: dict[str, str],
              extra: tuple[str, ...] = ()) -> tuple[SideData, pa.Table]:
    """Read ``dirs`` once (each dataset once) and derive a side's cells, settings, builds and
    invalid records; also returns the scanned rows (``extra`` columns: what a trend orders by)."""
    scan = read_once(dirs, list(dict.fromkeys([*DIFF_COLUMNS, *extra])), filters)
    frame = frame_of(records_of(scan, filters, TABLE_COLUMNS), scan.dirs, len(scan.invalid))
    cells = _cells_by_class(frame, spec, class_map)
    del frame
    settings = settings_by_cell(records_of(scan, filters, SETTINGS_READ), class_map)
    side = SideData(cells, settings, builds_by_class_of(scan.table),
                    _invalid_by_cell(scan.invalid, class_map), scan.dirs, scan.repeats)
    cancels = records_of(scan, filters)
    side.residue = residue.residue_by_class(cancels, class_map)
    side.noise = noise.noise_of(scan.rows(("cancel", "reference"), columns=noise.COLUMNS))
    return side, scan.table


def _invalid_by_cell(invalid: pd.DataFrame, class_map: dict[str, str]) -> dict[tuple, list[str]]:
    out: dict[tuple, list[str]] = {}
    for r in invalid.astype(object).where(invalid.notna(), None).to_dict("records") if len(invalid) else []:
        label = lambda c: NONE_LABEL if r.get(c) is None else str(r[c])  # noqa: E731
        cls = device_class_key(*(label(c) for c in CLASS_COLUMNS))
        key = (label("workload"), label("phase_at_receipt"), label("mechanism"), label("delivery"),
               class_map.get(cls, cls))
        out.setdefault(key, []).append(f"{r.get('trial_id')}: {r.get('error')}")
    return out


def _regressed(cell: CellDiff, said: str) -> None:
    cell.reasons.append(said)
    cell.verdict = "regressed"


def attach_invalid(cells: list, sides: list[tuple[str, dict[tuple, list[str]]]],
                   mark=_regressed) -> tuple[int, list[str]]:
    """Name each side's invalid records in the reasons of its cell, which then regressed (the
    comparison cannot be trusted): ``mark(cell, text)``; (how many there are, notes for those
    outside every cell)."""
    by_key = {c.key: c for c in cells}
    n, notes = 0, []
    for name, invalid in sides:
        for key, what in sorted(invalid.items()):
            n += len(what)
            said = f"{name}: {len(what)} invalid record(s) ({'; '.join(what[:3])}{' ...' if len(what) > 3 else ''})"
            cell = by_key.get(key)
            if cell is None:
                notes.append(f"{said} in {'/'.join(key)}")
                continue
            mark(cell, said)
    return n, notes


def _cell_seed(seed: int, key: tuple) -> int:
    """Per-cell seed from the cell key: a cell's CI does not depend on which other cells exist."""
    return (seed * 1_000_003 + zlib.crc32(json.dumps(list(key)).encode())) % 2**32


def compare_cell(key: tuple, base: _Side, cand: _Side, spec: DiffSpec, base_class: str) -> CellDiff:
    b, c = base.stats, cand.stats
    plabel = stats.percentile_label(spec.percentile)
    d = CellDiff(*key, baseline_class=base_class, status="matched", verdict="unchanged", reasons=[],
                 base_n=b.n, cand_n=c.n, base_p50=b.percentiles.get("p50"), cand_p50=c.percentiles.get("p50"),
                 base_value=b.percentiles.get(plabel), cand_value=c.percentiles.get(plabel),
                 base_dropped=b.dropped, cand_dropped=c.dropped, base_lost=b.lost, cand_lost=c.lost,
                 base_over=b.over, cand_over=c.over, cand_worst_trial_ids=c.worst_trial_ids)
    if c.dropped > b.dropped:
        d.reasons.append(f"new dropped cancels: {b.dropped} -> {c.dropped}")
    if c.lost > b.lost:
        d.reasons.append(f"new lost trials: {b.lost} -> {c.lost}")
    if c.over and not b.over:
        d.reasons.append(f"newly over the {c.bound_ms:g} ms bound ({plabel} {fmt_ms(c.bound_stat_ms)} ms)")
    need = stats.min_samples(spec.percentile, spec.confidence)
    improved = insufficient = False
    if min(b.n, c.n) < need:
        insufficient = True
    else:
        d.change_ms = d.cand_value - d.base_value
        d.rel_change = d.change_ms / d.base_value if d.base_value > 0 else (float("inf") if d.change_ms > 0 else 0.0)
        d.ci_low_ms, d.ci_high_ms = stats.bootstrap_diff_ci(
            base.sorted_latency, cand.sorted_latency, spec.percentile, n_boot=spec.n_boot,
            confidence=spec.confidence, seed=_cell_seed(spec.seed, key))
        if d.ci_low_ms > 0 and d.rel_change > spec.rel_threshold:
            d.reasons.append(f"{plabel} {d.base_value:.2f} -> {d.cand_value:.2f} ms ({d.rel_change:+.0%}, "
                             f"CI [{d.ci_low_ms:+.2f}, {d.ci_high_ms:+.2f}] ms)")
        improved = d.ci_high_ms < 0 and d.rel_change < -spec.rel_threshold
    if d.reasons:
        d.verdict = "regressed"
    elif insufficient:
        d.verdict = "insufficient"
        d.reasons.append(f"{plabel} needs n >= {need} on both sides ({b.n} vs {c.n})")
    elif improved:
        d.verdict = "improved"
    return d


def _one_sided(key: tuple, side: _Side, status: str, base_class: str, spec: DiffSpec) -> CellDiff:
    s = side.stats
    plabel = stats.percentile_label(spec.percentile)
    d = CellDiff(*key, baseline_class=base_class, status=status, verdict=status, reasons=[])
    if status == "new":
        d.cand_n, d.cand_p50, d.cand_value = s.n, s.percentiles.get("p50"), s.percentiles.get(plabel)
        d.cand_dropped, d.cand_lost, d.cand_over, d.cand_worst_trial_ids = s.dropped, s.lost, s.over, s.worst_trial_ids
        if s.dropped or s.lost:
            d.reasons.append(f"new cell with {s.dropped} dropped cancels, {s.lost} lost trials")
        if s.over:
            d.reasons.append(f"new cell over the {s.bound_ms:g} ms bound ({plabel} {fmt_ms(s.bound_stat_ms)} ms)")
        if d.reasons:
            d.verdict = "regressed"
    else:
        d.base_n, d.base_p50, d.base_value = s.n, s.percentiles.get("p50"), s.percentiles.get(plabel)
        d.base_dropped, d.base_lost, d.base_over = s.dropped, s.lost, s.over
    return d


def parse_class_map(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for text in pairs:
        base, sep, cand = text.partition("=")
        if not sep or not base or not cand:
            raise DiffInputError(f"bad --map-class {text!r}: expected BASELINE_CLASS=CANDIDATE_CLASS")
        out.append((base, cand))
    return tuple(out)


def run_diff(baseline: list[str | Path], candidate: list[str | Path], spec: DiffSpec = DiffSpec(),
             filters: Filters = Filters()) -> DiffResult:
    """Each side read once (``read_side``); the builds legend is filled from the same scans."""
    rspec = spec.report_spec()
    base_side, _ = read_side(baseline, rspec, filters, dict(spec.class_map))
    cand_side, _ = read_side(candidate, rspec, filters, {})
    base, cand = base_side.cells, cand_side.cells
    base_classes = {k[-1] for k in base}
    cand_classes = {k[-1] for k in cand}
    common = base_classes & cand_classes
    if not common:
        raise DiffInputError(
            f"no common device class: baseline has {sorted(base_classes)}, candidate has {sorted(cand_classes)}; "
            "pass --map-class BASELINE_CLASS=CANDIDATE_CLASS to compare across classes")
    check_settings(base_side.settings, cand_side.settings, spec.ignore_settings)
    reverse = {c: b for b, c in spec.class_map}
    cells = []
    for key in sorted(set(base) | set(cand)):
        cls = key[-1]
        if cls not in common:
            continue
        base_class = reverse.get(cls, cls)
        if key in base and key in cand:
            cells.append(compare_cell(key, base[key], cand[key], spec, base_class))
        elif key in cand:
            cells.append(_one_sided(key, cand[key], "new", base_class, spec))
        else:
            cells.append(_one_sided(key, base[key], "missing", base_class, spec))
    n_invalid, invalid_notes = attach_invalid(cells, [("baseline", base_side.invalid),
                                                      ("candidate", cand_side.invalid)])
    for d in cells:
        attach_residue(d, base_side.residue.get(d.key), cand_side.residue.get(d.key))
    order = {"regressed": 0, "insufficient": 2, "improved": 3, "new": 4, "missing": 5, "unchanged": 6}
    cells.sort(key=lambda d: (order.get(d.verdict, 9), d.key))
    samples = {d.key: (base[d.key].sorted_latency if d.key in base else None,
                       cand[d.key].sorted_latency if d.key in cand else None)
               for d in cells if d.verdict in ("regressed", "improved")}
    legend = builds_legend([("baseline", base_side.builds), ("candidate", cand_side.builds)])
    return DiffResult(spec, base_side.dirs, cand_side.dirs, cells,
                      sorted(reverse.get(c, c) for c in base_classes - common), sorted(cand_classes - common),
                      samples, [legend] if legend.rows else [], base_side.repeats + cand_side.repeats + invalid_notes,
                      n_invalid, noise.compare_noise(base_side.noise, cand_side.noise, spec.noise))


def attach_residue(d, base: residue.ResidueCell | None, cand: residue.ResidueCell | None) -> None:
    """A cell's engine work p50 and CPU-wait share of its residue, each side that has a split."""
    if base is not None:
        d.base_work_p50, d.base_wait_share = base.work_p50, base.wait_share
    if cand is not None:
        d.cand_work_p50, d.cand_wait_share = cand.work_p50, cand.wait_share


# ------------------------------------------------------------- rendering --
