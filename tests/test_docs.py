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
