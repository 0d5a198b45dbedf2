"""The build and host facts of each device, for the device legend of report, diff and trend.

What the agent loaded and ran on (see ``cancelbench.schema``): the llama.cpp
build and commit, ggml version and backends, OS, kernel, GPU driver and the
cancelbench version/git describe; for an external engine's rows its own name,
version and build facts (its hello) instead of the agent's llama.cpp.  Taken
from the command's one scan (distinct values); a device whose rows disagree (a
resumed sweep on an upgraded host) shows every value, joined by `` | ``.  Datasets written before these columns existed read
them as null and show nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from .load import BUILD_COLUMNS, Filters, read_once  # noqa: F401 (BUILD_COLUMNS: re-exported)



# The agent's llama.cpp facts: what a built-in engine ran on. An external engine is its own build
# (its hello's name, version and build facts, ENGINE_BUILD_COLUMNS); the agent's llama.cpp is not its.
LLAMA_COLUMNS = ("llama_cpp_python_version", "llama_cpp_build", "llama_cpp_commit", "ggml_version", "ggml_backends")
ENGINE_BUILD_COLUMNS = ("engine", "engine_name", "engine_version", "engine_build_json")


def _engine_facts(r: dict) -> list[tuple[str, str]]:
    """An external engine's row: ("engine NAME: version", ...), ("engine NAME: KEY", value) per build fact."""
    name = r.get("engine_name") or "external"
    facts = [(f"engine {name}: version", r.get("engine_version") or "")]
    raw = r.get("engine_build_json")
    if raw:
        try:
            build = json.loads(raw)
        except ValueError:
            build = None
        if isinstance(build, dict):
            facts += [(f"engine {name}: {k}", "" if v is None else str(v)) for k, v in sorted(build.items())]
        else:  # not the {key: value} the agent writes: shown as it is
            facts.append((f"engine {name}: build", str(raw)))
    return facts


def distinct_builds(table: pa.Table, key_columns: list[str]) -> dict[tuple, dict[str, str]]:
    """(key values) -> {build fact: value(s)} of the rows of ``table`` (grouped first: the
    distinct combinations are few however many rows there are). A row of an external engine
    gives the host facts and the engine's own (``engine NAME: version``, ``engine NAME: KEY``
    per fact of its hello's build), not the agent's llama.cpp build."""
    cols = [c for c in BUILD_COLUMNS if c in table.column_names]
    engine_cols = [c for c in ENGINE_BUILD_COLUMNS if c in table.column_names]
    group = key_columns + cols + engine_cols
    rows = table.select(group).group_by(group).aggregate([]).to_pylist()
    out: dict[tuple, dict[str, list[str]]] = {}
    for r in rows:
        facts = out.setdefault(tuple("" if r[k] is None else str(r[k]) for k in key_columns), {})
        external = r.get("engine_build_json") is not None  # its hello's build facts: not the agent's llama.cpp
        pairs = [(c, "" if r[c] is None else str(r[c])) for c in cols if not (external and c in LLAMA_COLUMNS)]
        for c, value in pairs + (_engine_facts(r) if external else []):
            if value and value not in facts.setdefault(c, []):
                facts[c].append(value)
    return {k: {c: " | ".join(sorted(facts[c])) for c in sorted(facts, key=_fact_order) if facts[c]}
            for k, facts in out.items()}


_COLUMN_ORDER = {c: i for i, c in enumerate(BUILD_COLUMNS)}


def _fact_order(fact: str) -> tuple:
    """The build columns in their order, then each engine's facts: its version, then its build's."""
    if fact in _COLUMN_ORDER:
        return (0, _COLUMN_ORDER[fact], "", "")
    engine, _, key = fact.partition(": ")  # an engine name holds no ": " (its hello's pattern)
    return (1, engine, key != "version", key)


def _with(table: pa.Table, columns: list[str]) -> list[str]:
    return [c for c in columns if c in table.column_names]


def builds_of(table: pa.Table) -> dict[str, dict[str, str]]:
    """device key (``host/device``, as the report's cells) -> build facts, from the rows of a scan."""
    table = table.select(["host", "device", *BUILD_COLUMNS, *_with(table, ENGINE_BUILD_COLUMNS)])
    table = table.append_column("device_key", pc.binary_join_element_wise(
        pc.fill_null(table.column("host").cast(pa.string()), "(none)"),
        pc.fill_null(table.column("device").cast(pa.string()), "(none)"), "/"))
    return {k[0]: v for k, v in distinct_builds(table, ["device_key"]).items()}


def builds_by_class_of(table: pa.Table) -> dict[str, dict[str, str]]:
    """device class (``platform/arch/backend/device_name``, what diff and trend match on) -> build
    facts, from the rows of a scan."""
    table = table.select(["platform", "arch", "backend", "device_name", *BUILD_COLUMNS,
                          *_with(table, ENGINE_BUILD_COLUMNS)])
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
    return builds_of(read_once(dirs, ["host", "device", *BUILD_COLUMNS, *ENGINE_BUILD_COLUMNS], filters).table)


def attach_builds(report, builds: dict[str, dict[str, str]]) -> None:
    """Fill ``DeviceInfo.build`` of every device of the report."""
    for info in report.devices:
        info.build = builds.get(info.device, {})


def builds_by_class(dirs: list[str | Path], filters: Filters = Filters()) -> dict[str, dict[str, str]]:
    """``builds_by_class_of`` the cancel and reference trials of ``dirs``, in a scan of its own."""
    return builds_by_class_of(read_once(dirs, [*CLASS_COLUMNS, *BUILD_COLUMNS, *ENGINE_BUILD_COLUMNS],
                                        filters).table)


def builds_legend(sides: list[tuple[str, dict[str, dict[str, str]]]]):
    """A "Builds" section (one row per fact) for named sides, e.g. baseline and candidate."""
    from .section import Section

    rows = [[name, cls, k, v] for name, by_class in sides for cls, facts in sorted(by_class.items())
            for k, v in facts.items()]
    return Section("Builds", "what each device class's agents loaded and ran on",
                   ["side", "device class", "fact", "value"], rows, sid="builds")
