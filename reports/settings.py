"""Two sweeps' cells compare only when their settings agree: every ``settings``
column of the schema (model, sizes, graph slice, sampling, offset plan...).
Cells that differ in a setting are different experiments; ``check_settings``
refuses them with the settings that differ, unless each is named in
``ignore`` (``--ignore-setting``). A setting recorded on one side only (a
schema-1 dataset) is not a difference."""

from __future__ import annotations

from pathlib import Path

from cancelbench.schema import SETTINGS_COLUMNS
from cancelbench.sink import DatasetError

from .load import Filters, scan_table

class SettingsDiffer(DatasetError):
    """The sweeps differ in a setting (an input error: exit 2)."""


# Settings that identify a cell rather than shape it (the cell key holds them).
_KEY_SETTINGS = ("workload",)
_CLASS_COLUMNS = ["platform", "arch", "backend", "device_name"]


def _settings_by_cell(dirs: list[str | Path], filters: Filters, class_map: dict[str, str]) -> dict[tuple, dict]:
    """(workload, mechanism, delivery, device class) -> settings column -> the set of
    non-null values its cancel trials carried."""
    cols = [c for c in SETTINGS_COLUMNS if c not in _KEY_SETTINGS]
    frame = scan_table(dirs, ["workload", "mechanism", "delivery", *_CLASS_COLUMNS, *cols], filters).to_pandas()
    cls = frame[_CLASS_COLUMNS].astype(str).agg("/".join, axis=1).map(lambda c: class_map.get(c, c))
    out: dict[tuple, dict] = {}
    for key, g in frame.assign(device_class=cls).groupby(["workload", "mechanism", "delivery", "device_class"]):
        out[tuple(map(str, key))] = {c: frozenset(map(str, g[c].dropna().unique())) for c in cols}
    return out


def settings_differences(baseline: list[str | Path], candidate: list[str | Path], ignore: tuple[str, ...],
                         class_map: dict[str, str], filters: Filters) -> dict[str, tuple[set, set]]:
    """Settings columns whose values differ between cells both sides have:
    column -> (baseline values, candidate values). Ignored columns are left out."""
    base = _settings_by_cell(baseline, filters, class_map)
    cand = _settings_by_cell(candidate, filters, {})
    diffs: dict[str, tuple[set, set]] = {}
    for key in base.keys() & cand.keys():
        for col, bvals in base[key].items():
            cvals = cand[key][col]
            if col in ignore or not bvals or not cvals or bvals == cvals:
                continue
            b, c = diffs.setdefault(col, (set(), set()))
            b.update(bvals)
            c.update(cvals)
    return diffs


def check_settings(baseline: list[str | Path], candidate: list[str | Path], ignore: tuple[str, ...],
                   class_map: dict[str, str], filters: Filters) -> None:
    """Refuse to compare cells whose settings differ (they are different experiments)."""
    unknown = [s for s in ignore if s not in SETTINGS_COLUMNS]
    if unknown:
        raise SettingsDiffer(f"--ignore-setting {unknown[0]!r} is not a settings column "
                             f"(settings: {', '.join(SETTINGS_COLUMNS)})")
    diffs = settings_differences(baseline, candidate, ignore, class_map, filters)
    if diffs:
        said = "; ".join(f"{col}: {', '.join(sorted(b))} -> {', '.join(sorted(c))}"
                         for col, (b, c) in sorted(diffs.items()))
        raise SettingsDiffer(f"the sweeps differ in settings, so their cells are different experiments: {said}; "
                             f"pass {' '.join(f'--ignore-setting {c}' for c in sorted(diffs))} to compare anyway")


