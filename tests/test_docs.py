"""The documentation stays true to the code: the schema page is generated, the
README stays a front door, and no relative link points nowhere."""

from __future__ import annotations

import re
from pathlib import Path

from cancelbench.schema_doc import REGENERATE, schema_markdown

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

# [text](target) and ![alt](target); the target ends at the first space or ')'.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_schema_page_is_generated_from_the_schema():
    committed = (ROOT / "docs" / "schema.md").read_text(encoding="utf-8")
    assert committed == schema_markdown(), (
        f"docs/schema.md differs from cancelbench/schema.py; regenerate it with `{REGENERATE}`")


def test_schema_page_lists_every_column_once():
    from cancelbench import schema

    text = schema_markdown()
    for name in schema.COLUMNS:
        assert text.count(f"| `{name}` |") == 1, name


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference text into docs/")


def _links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    return _LINK.findall(text)


def test_relative_links_point_at_files():
    broken = []
    checked = 0
    for page in _pages():
        for target in _links(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor on the same page
            path = target.split("#", 1)[0]
            checked += 1
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert checked > 0, "no relative links found: the link pattern no longer matches"
    assert not broken, "relative links to missing files:\n" + "\n".join(broken)


def test_link_pattern_finds_links():
    assert _links("see [the schema](docs/schema.md#columns) and ![shot](a.png \"t\")\n"
                  "```\n[not](a link)\n```") == ["docs/schema.md#columns", "a.png"]


def test_cli_settings_tables_are_generated_from_the_engines_declarations():
    """docs/cli.md's settings tables are the built-in engines' declarations, rendered:
    a setting added to a declaration and not rendered into the docs fails here."""
    from cancelbench.engine_decls import DOCS_BEGIN, DOCS_END, settings_markdown

    text = (ROOT / "docs" / "cli.md").read_text()
    block = text[text.index(DOCS_BEGIN):text.index(DOCS_END) + len(DOCS_END)] + "\n"
    assert block == settings_markdown(), "run: .venv/bin/python -m cancelbench.engine_decls docs/cli.md"


def test_a_setting_added_to_a_declaration_reaches_validation_the_record_and_the_docs():
    """The one declaration drives everything: a new setting (added in a fresh interpreter
    before anything reads the declarations) is a config key with its bounds, a typed
    record column, and a row of the docs table, with no other file edited."""
    import subprocess
    import sys

    code = """
import dataclasses
import cancelbench.engine_decls as d
from cancelbench.sut.declaration import Setting
new = Setting("draft_tokens", "int", 4, 1, 64, "speculative draft length")
d.DECLARATIONS["text"] = dataclasses.replace(d.DECLARATIONS["text"], settings=d.DECLARATIONS["text"].settings + (new,))
from cancelbench import schema
from cancelbench.orchestrator.config import ConfigError, parse_config
assert "draft_tokens" in schema.SETTINGS_COLUMNS and str(schema.RECORD_SCHEMA.field("draft_tokens").type) == "int32"
wl = parse_config({"workload": [{"name": "t", "draft_tokens": 9}]}).workloads[0]
assert wl.resolved_settings()["draft_tokens"] == 9
assert parse_config({"workload": [{"name": "t"}]}).workloads[0].resolved_settings()["draft_tokens"] == 4
try:
    parse_config({"workload": [{"name": "t", "draft_tokens": 65}]})
    raise SystemExit("an out-of-bounds value was accepted")
except ConfigError as exc:
    assert "draft_tokens must be <= 64" in str(exc), exc
try:
    parse_config({"workload": [{"name": "s", "engine": "sim", "draft_tokens": 2}]})
    raise SystemExit("a setting of another engine was accepted")
except ConfigError as exc:
    assert "not a setting of the sim engine" in str(exc), exc
assert "| `draft_tokens` | int | 4 | 1..64 | speculative draft length |" in d.settings_markdown()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


PRODUCT_DIRS = ("cancelbench", "orchestrator", "device_agents", "native", "datasets", "reports")


def product_modules() -> list[Path]:
    return sorted(p for d in PRODUCT_DIRS for p in (ROOT / d).rglob("*.py") if p.name != "__init__.py")


def test_every_test_hook_lives_in_the_failpoints_module():
    """Failpoints have one home: a CANCELBENCH_TEST_ name anywhere else in product code is a hook
    that escaped it (and would be undocumented)."""
    from cancelbench import failpoints

    modules = product_modules()
    assert ROOT / "cancelbench" / "failpoints.py" in modules and len(modules) > 50  # product code was read
    stray = [str(p.relative_to(ROOT)) for p in modules
             if "CANCELBENCH_TEST" in p.read_text() and p.name != "failpoints.py"]
    assert stray == []
    text = (ROOT / "cancelbench" / "failpoints.py").read_text()
    assert all(f"``{name}" in text for name in failpoints.ALL)  # each documented in its table


def _strip_groups(text: str) -> tuple[str, dict[str, str]]:
    """``text`` without its parenthesized descriptions (nested ones too), and the lists of its
    sub-folders (``engines/ (registry, base, ...)``: folder -> what its parentheses hold)."""
    out, subs, depth, start, sub = [], {}, 0, 0, None
    for i, ch in enumerate(text):
        if ch == "(":
            if depth == 0:
                m = re.search(r"(\w+/)\s*$", "".join(out))
                sub, start = (m.group(1) if m else None), i + 1
                if sub:
                    del out[len(out) - len(m.group(0)):]
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
            if depth == 0 and sub:
                subs[sub] = text[start:i]
        elif depth == 0:
            out.append(ch)
    return "".join(out), subs


def _items(text: str) -> set[str]:
    """The names a listing gives: its pieces between , ; : + "and" " / ", each one word (a module
    name or a file name); prose (several words, a folder/) is no name."""
    pieces = re.split(r"[,;:]|\s\+\s|\sand\s|\s/\s", text)
    return {p.strip() for p in pieces if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)?", p.strip())}


def layout_listing(text: str) -> dict[str, set[str]]:
    """docs/layout.md's module listing (its first code block): folder -> the names listed on that
    folder's lines (a line starting at column 0 opens a folder, e.g. ``reports/``; indented lines
    continue it), descriptions in parentheses left out, a sub-folder's list its own folder."""
    block = re.search(r"^## Modules\n.*?^```\n(.*?)^```", text, re.S | re.M).group(1)
    sections: dict[str, str] = {}
    folder = None
    for line in block.splitlines():
        if line[:1].strip():
            head, _, rest = line.partition(" ")
            folder = head if head.endswith("/") else None
            if folder:
                sections[folder] = rest
        elif folder:
            sections[folder] += " " + line.strip()
    listing: dict[str, set[str]] = {}
    for folder, body in sections.items():
        flat, subs = _strip_groups(body)
        listing[folder] = _items(flat)
        for sub, inner in subs.items():
            listing[folder + sub] = _items(_strip_groups(inner)[0])
    return listing


def test_layout_listing_reads_names_not_prose():
    sample = ("## Modules\n\n```\n"
              "pkg/     the package: cli (the command, reads the schema), sink and outlock,\n"
              "         engines/ (base, sim (simulated: waits)), a / b; c.c + d.sh\n"
              "other/   stats\n```\n")
    assert layout_listing(sample) == {"pkg/": {"cli", "sink", "outlock", "a", "b", "c.c", "d.sh"},
                                      "pkg/engines/": {"base", "sim"}, "other/": {"stats"}}


def test_layout_names_every_product_module():
    """docs/layout.md's module listing names every product module on its own folder's lines (a
    module added without its name there fails here; its name as a word of another module's
    description, or on another folder's lines, does not count)."""
    listing = layout_listing((ROOT / "docs" / "layout.md").read_text())
    modules = product_modules()
    assert ROOT / "reports" / "residue.py" in modules and len(modules) > 50  # the listing is checked
    missing = [str(p.relative_to(ROOT)) for p in modules
               if p.stem not in listing.get(str(p.parent.relative_to(ROOT)) + "/", set())]
    assert missing == [], f"not in docs/layout.md's module listing, on its folder's lines: {missing}"


def test_make_demo_runs_every_mechanism_graph_eval_included():
    """A newcomer's first report (make demo) shows graph_eval, the mechanism that stops mid-graph
    on every backend, beside the other three."""
    from cancelbench.engine_decls import MECHANISM_NAMES
    from cancelbench.orchestrator.config import load_config

    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t(.*)$", makefile, re.M).group(1)
    config_path = re.search(r"--config (\S+)", demo).group(1)
    assert set(load_config(ROOT / config_path).mechanisms) == set(MECHANISM_NAMES)


# `path/to/file.py` (`Name`, `Class.method`, ...): a file of the one-cancel trace and what runs in it
_TRACE_NAMED = re.compile(r"`([\w/]+\.py)` \(([^()]*)\)")


def trace_names(text: str) -> list[tuple[str, list[str]]]:
    """docs/layout.md's "One cancel, file by file": each file it names with the functions after it in
    parentheses (backticked identifiers; prose and other backticked words in them are left out)."""
    section = re.search(r"^## One cancel, file by file\n(.*?)^## ", text, re.S | re.M).group(1)
    section = " ".join(section.split())
    out = []
    for path, inside in _TRACE_NAMED.findall(section):
        names = re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`", inside)
        if names and all(re.fullmatch(r"`[A-Za-z_][\w.]*`", n.strip()) for n in inside.split(",")):
            out.append((path, names))
    return out


def _defined(path: Path) -> dict[str, set[str]]:
    """Top-level names a module defines -> the methods of each (a function: empty)."""
    import ast

    tree = ast.parse(path.read_text())
    return {n.name: {m.name for m in n.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if isinstance(n, ast.ClassDef) else set()
            for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}


def test_trace_reads_files_and_their_functions():
    sample = ("## One cancel, file by file\n\n1. `a/b.py` (`Run.go`, `_help`) calls\n   `c.py` (`f`);"
              " `d.py` (`x`: the prose) and `e.py` (`g`, then more).\n## Next\n")
    assert trace_names(sample) == [("a/b.py", ["Run.go", "_help"]), ("c.py", ["f"])]


def test_every_function_the_one_cancel_trace_names_exists():
    """Each function docs/layout.md's one-cancel trace names after a file is defined there (a method:
    in its class, or, named alone after one, in one of the file's classes): a renamed or moved
    function fails here until the trace follows it."""
    pairs = trace_names((ROOT / "docs" / "layout.md").read_text())
    assert len(pairs) >= 8, pairs  # the trace was read
    modules = product_modules()
    for path, names in pairs:
        found = [p for p in modules if str(p.relative_to(ROOT)).endswith(path)]
        assert len(found) == 1, (path, found)
        defined = _defined(found[0])
        methods = set().union(*defined.values())
        for name in names:
            cls, _, method = name.rpartition(".")
            ok = method in defined.get(cls, set()) if cls else (name in defined or name in methods)
            assert ok, f"docs/layout.md's one-cancel trace names {name} in {path}, which defines no such function"
