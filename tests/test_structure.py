"""The code's shape, kept: no import cycle among the product's modules (a lazy import
counts too; one under ``if TYPE_CHECKING`` does not), no engine-name branch outside the declarations."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"cancelbench": "cancelbench", "orchestrator": "cancelbench.orchestrator",
            "device_agents": "cancelbench.device_agents", "native": "cancelbench.native",
            "datasets": "cancelbench.datasets", "reports": "cancelbench.reports"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports, wherever in the module the import is."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                target = (".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                          if node.level else node.module or "")
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                found = subs or [target]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name].update(f for f in found if f in mods and f != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "cancelbench.reports.tables" in graph["cancelbench.reports.sections"]  # it reads real imports


def test_no_import_cycle_among_product_modules():
    assert cycles(import_graph()) == []


def test_no_product_module_over_400_lines_or_function_over_60():
    """The structure limits: a module or function that outgrows them is split by concern."""
    long_modules, long_functions = [], []
    for path in modules().values():
        src = path.read_text()
        rel = path.relative_to(ROOT)
        if src.count("\n") > 400:
            long_modules.append(f"{rel} ({src.count(chr(10))})")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{rel}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert long_modules == [] and long_functions == []


# Issue 34: behaviour follows from what an engine declares (input kind, streams audio, simulated),
# never from its name. The declarations' home (the registry, the declarations) may name engines;
# an engine module looks up its own spec by its name; nothing else compares one.
DECLARATION_HOMES = {ROOT / "device_agents" / "engines" / "registry.py", ROOT / "cancelbench" / "engine_decls.py"}
ENGINE_MODULES = ROOT / "device_agents" / "engines"
NAME_SUBJECT = re.compile(r"engine|\bname\b|spec")  # what an engine name would be compared with


def _names(node: ast.AST, names: set[str]) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & names
    if isinstance(node, ast.Name) and node.id == "EXTERNAL":
        return {"external"}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(set(), *(_names(e, names) for e in node.elts))
    return set()


def engine_name_branches(source: str, names: set[str], own_lookups: bool = False) -> list[str]:
    """Where ``source`` compares an engine name (==, !=, in, a match case) or looks one up by a
    literal (``ENGINES["tts"]``, ``engine_spec("tts")``) unless ``own_lookups``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            subjects = [ast.unparse(s) for s in sides if not _names(s, names)]
            if any(_names(s, names) for s in sides) and any(NAME_SUBJECT.search(s) for s in subjects):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.MatchValue) and _names(node.value, names):
            found.append(f"{node.lineno}: case {ast.unparse(node.value)}")
        elif own_lookups:
            continue
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("ENGINES") \
                and _names(node.slice, names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("engine_spec") \
                and any(_names(a, names) for a in node.args):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _engine_names() -> set[str]:
    from cancelbench.device_agents.engines.registry import ENGINES, EXTERNAL

    return {*ENGINES, EXTERNAL}


def test_the_checker_finds_an_engine_name_branch():
    names = _engine_names()
    for wrong in ('if row.engine == "external":\n    pass', 'x = spec.name in ("tts", "stt")',
                  'match engine:\n    case "sim":\n        pass', 'spec = ENGINES["tts"]', 'engine != EXTERNAL',
                  'engine_spec("probe")'):
        assert engine_name_branches(wrong, names), wrong
    # what an engine declares is not its name: an input kind "text", a report engine "ray"
    for right in ('if declaration.input == "text":\n    pass', 'if engine == "ray":\n    pass'):
        assert not engine_name_branches(right, names), right


def test_no_product_module_outside_the_declarations_compares_an_engine_name():
    names, found = _engine_names(), {}
    for path in modules().values():
        if path in DECLARATION_HOMES:
            continue
        hits = engine_name_branches(path.read_text(), names, own_lookups=path.parent == ENGINE_MODULES)
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found
