"""Behaviour follows from what an engine declares, never from its name (issue 34, item 4): no
product module outside the declarations (cancelbench/engine_decls.py,
device_agents/engines/registry.py) compares an engine name or looks one up in a table of its
own. What an engine is (external, speech, its model files, its synthetic input) is a field or
property of its EngineSpec; a module asks that."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cancelbench.device_agents.engines.registry import ENGINES, EXTERNAL

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("cancelbench", "orchestrator", "device_agents", "reports", "datasets")
DECLARATIONS = {ROOT / "cancelbench" / "engine_decls.py", ROOT / "device_agents" / "engines" / "registry.py"}
NAMES = set(ENGINES) | {EXTERNAL}
NAME_CONSTANTS = {"EXTERNAL"}  # the registry's name of the external engine
LOOKUP_TABLES = {"ENGINES", "DECLARATIONS"}  # the declarations' own tables


def _engineish(node: ast.AST) -> bool:
    """An expression that holds an engine's name: a name or attribute that says engine, or the
    record column "engine" (``row.get("engine")``, ``df["engine"]``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and "engine" in sub.id.lower():
            return True
        if isinstance(sub, ast.Attribute) and "engine" in sub.attr.lower():
            return True
        if isinstance(sub, ast.Constant) and sub.value == "engine":
            return True
    return False


def _names_in(node: ast.AST) -> bool:
    return any(isinstance(s, ast.Constant) and s.value in NAMES or isinstance(s, ast.Name) and s.id in NAME_CONSTANTS
               for s in ast.walk(node))


def _table(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def name_branches(source: str) -> list[tuple[int, str]]:
    """(line, code) of each comparison of an engine name, and each lookup keyed by one in a table
    that is not the declarations'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(_engineish, sides)) and any(map(_names_in, sides)):
                found.append((node.lineno, ast.unparse(node)))
        key = table = None
        if isinstance(node, ast.Subscript):
            key, table = node.slice, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            key, table = node.args[0], node.func.value
        if key is not None and isinstance(key, (ast.Name, ast.Attribute)) and _engineish(key) \
                and _table(table) not in LOOKUP_TABLES:
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("code, branches", [
    ('if workload.engine == "tts":\n    pass', 1),
    ('x = row.get("engine") in ("text", "stt")', 1),
    ('x = wl.get("engine") != EXTERNAL', 1),
    ('x = IDS.get(wl.engine, "x")', 1),
    ('x = ENGINES[workload.engine].keeps_audio', 0),
    ('x = spec.external and kind == "text"', 0),  # an input kind, not an engine
])
def test_the_scan_finds_what_it_looks_for(code, branches):
    assert len(name_branches(code)) == branches, name_branches(code)


def test_no_product_module_outside_the_declarations_branches_on_an_engine_name():
    files = [p for d in PRODUCT for p in sorted((ROOT / d).rglob("*.py")) if p not in DECLARATIONS]
    assert len(files) > 50  # the product's modules, not an empty glob
    found = [f"{p.relative_to(ROOT)}:{line}: {code}" for p in files for line, code in name_branches(p.read_text())]
    assert not found, "\n".join(found)
