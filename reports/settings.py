"""Two sweeps' cells compare only when their settings agree: every ``settings``
column of the schema (model, sizes, graph slice, sampling, offset plan...).
Cells that differ in a setting are different experiments; ``check_settings``
refuses them with the settings that differ, unless each is named in
``ignore`` (``--ignore-setting``). A setting recorded on one side only (a
schema-1 dataset) is not a difference.

The settings come from the rows ``diff`` read anyway (its one scan per side):
reduced to their distinct combinations in Arrow first, so a million records
cost one hash grouping, not a Python loop over rows."""

from __future__ import annotations

import pyarrow as pa

from cancelbench.schema import SETTINGS_COLUMNS
from cancelbench.sink import DatasetError

from .tables import NONE_LABEL, device_class_key


class SettingsDiffer(DatasetError):
    """The sweeps differ in a setting (an input error: exit 2)."""


# Settings that identify a cell rather than shape it (the cell key holds them).
_KEY_SETTINGS = ("workload",)
CLASS_COLUMNS = ["platform", "arch", "backend", "device_name"]
CELL_COLUMNS = ["workload", "mechanism", "delivery"]
COLUMNS = [c for c in SETTINGS_COLUMNS if c not in _KEY_SETTINGS]  # what diff's scan reads for the check
SettingsByCell = dict  # (workload, mechanism, delivery, device class) -> settings column -> frozenset of values


def settings_by_cell(table: pa.Table, class_map: dict[str, str]) -> SettingsByCell:
    """(workload, mechanism, delivery, device class) -> settings column -> the set of
    non-null values its cancel trials (the rows of ``table``) carried, as text."""
    keys = CELL_COLUMNS + CLASS_COLUMNS
    cols = [c for c in COLUMNS if c in table.column_names and table.column(c).null_count < table.num_rows]
    distinct = table.select(keys + cols).group_by(keys + cols).aggregate([]).to_pylist()  # a few rows per cell
    out: dict[tuple, dict[str, set]] = {}
    for row in distinct:
        row.update({k: NONE_LABEL if row[k] is None else str(row[k]) for k in keys})  # as tables.prepare_table
        cls = device_class_key(*(row[c] for c in CLASS_COLUMNS))
        cell = out.setdefault((*(row[c] for c in CELL_COLUMNS), class_map.get(cls, cls)), {c: set() for c in COLUMNS})
        for c in cols:
            if row[c] is not None:
                cell[c].add(str(row[c]))
    return {k: {c: frozenset(v) for c, v in cell.items()} for k, cell in out.items()}


def settings_differences(base: SettingsByCell, cand: SettingsByCell,
                         ignore: tuple[str, ...]) -> dict[str, tuple[set, set]]:
    """Settings columns whose values differ between cells both sides have:
    column -> (baseline values, candidate values). Ignored columns are left out."""
    diffs: dict[str, tuple[set, set]] = {}
    for key in base.keys() & cand.keys():
        for col, bvals in base[key].items():
            cvals = cand[key].get(col, frozenset())
            if col in ignore or not bvals or not cvals or bvals == cvals:
                continue
            b, c = diffs.setdefault(col, (set(), set()))
            b.update(bvals)
            c.update(cvals)
    return diffs


def check_ignore(ignore: tuple[str, ...]) -> None:
    unknown = [s for s in ignore if s not in SETTINGS_COLUMNS]
    if unknown:
        raise SettingsDiffer(f"--ignore-setting {unknown[0]!r} is not a settings column "
                             f"(settings: {', '.join(SETTINGS_COLUMNS)})")


def check_settings(base: SettingsByCell, cand: SettingsByCell, ignore: tuple[str, ...]) -> None:
    """Refuse to compare cells whose settings differ (they are different experiments)."""
    check_ignore(ignore)
    diffs = settings_differences(base, cand, ignore)
    if diffs:
        said = "; ".join(f"{col}: {', '.join(sorted(b))} -> {', '.join(sorted(c))}"
                         for col, (b, c) in sorted(diffs.items()))
        raise SettingsDiffer(f"the sweeps differ in settings, so their cells are different experiments: {said}; "
                             f"pass {' '.join(f'--ignore-setting {c}' for c in sorted(diffs))} to compare anyway")
