"""The build and host facts of each device, for the device legend of report, diff and trend.

What the agent loaded and ran on (see ``cancelbench.schema``): the llama.cpp
build and commit, ggml version and backends, OS, kernel, GPU driver and the
cancelbench version/git describe.  Taken from the command's one scan (distinct values);
a device whose rows disagree (a resumed sweep on an upgraded host) shows every
value, joined by `` | ``.  Datasets written before these columns existed read
them as null and show nothing.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from .load import BUILD_COLUMNS, Filters, read_once  # noqa: F401 (BUILD_COLUMNS: re-exported)



def distinct_builds(table: pa.Table, key_columns: list[str]) -> dict[tuple, dict[str, str]]:
    """(key values) -> {build column: value(s)} of the rows of ``table`` (grouped first: the
    distinct combinations are few however many rows there are)."""
    cols = [c for c in BUILD_COLUMNS if c in table.column_names]
    rows = table.select(key_columns + cols).group_by(key_columns + cols).aggregate([]).to_pylist()
    out: dict[tuple, dict[str, list[str]]] = {}
    for r in rows:
        facts = out.setdefault(tuple("" if r[k] is None else str(r[k]) for k in key_columns), {})
        for c in cols:
            value = "" if r[c] is None else str(r[c])
            if value and value not in facts.setdefault(c, []):
                facts[c].append(value)
    return {k: {c: " | ".join(sorted(v)) for c, v in facts.items() if v} for k, facts in out.items()}


def builds_of(table: pa.Table) -> dict[str, dict[str, str]]:
    """device key (``host/device``, as the report's cells) -> build facts, from the rows of a scan."""
    table = table.select(["host", "device", *BUILD_COLUMNS])
    table = table.append_column("device_key", pc.binary_join_element_wise(
        pc.fill_null(table.column("host").cast(pa.string()), "(none)"),
        pc.fill_null(table.column("device").cast(pa.string()), "(none)"), "/"))
    return {k[0]: v for k, v in distinct_builds(table, ["device_key"]).items()}


def builds_by_class_of(table: pa.Table) -> dict[str, dict[str, str]]:
    """device class (``platform/arch/backend/device_name``, what diff and trend match on) -> build
    facts, from the rows of a scan."""
    table = table.select(["platform", "arch", "backend", "device_name", *BUILD_COLUMNS])
    parts = [pc.fill_null(table.column(c).cast(pa.string()), "(none)")
             for c in ("platform", "arch", "backend", "device_name")]
    cls = parts[0]
    for p in parts[1:]:
        cls = pc.binary_join_element_wise(cls, p, "/")
    table = table.append_column("device_class", cls)
    return {k[0]: v for k, v in distinct_builds(table, ["device_class"]).items()}


CLASS_COLUMNS = ["platform", "arch", "backend", "device_name"]


def load_builds(dirs: list[str | Path], filters: Filters = Filters()) -> dict[str, dict[str, str]]:
    """``builds_of`` the cancel and reference trials of ``dirs``, in a scan of its own."""
    return builds_of(read_once(dirs, ["host", "device", *BUILD_COLUMNS], filters).table)


def attach_builds(report, builds: dict[str, dict[str, str]]) -> None:
    """Fill ``DeviceInfo.build`` of every device of the report."""
    for info in report.devices:
        info.build = builds.get(info.device, {})


def builds_by_class(dirs: list[str | Path], filters: Filters = Filters()) -> dict[str, dict[str, str]]:
    """``builds_by_class_of`` the cancel and reference trials of ``dirs``, in a scan of its own."""
    return builds_by_class_of(read_once(dirs, [*CLASS_COLUMNS, *BUILD_COLUMNS], filters).table)


def builds_legend(sides: list[tuple[str, dict[str, dict[str, str]]]]):
    """A "Builds" section (one row per fact) for named sides, e.g. baseline and candidate."""
    from .section import Section

    rows = [[name, cls, k, v] for name, by_class in sides for cls, facts in sorted(by_class.items())
            for k, v in facts.items()]
    return Section("Builds", "what each device class's agents loaded and ran on",
                   ["side", "device class", "fact", "value"], rows, sid="builds")
