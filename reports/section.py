"""What a report section is: a titled table every renderer (terminal, Markdown, JSON,
HTML, JUnit) draws. Its own module so the modules that build sections (sections,
targeting, legend, diff, trend) import it without importing one another."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Section:
    """A titled table.  Columns before ``key_columns`` are labels (left
    aligned), the rest numbers (right aligned); ``groups`` label runs of the
    number columns (one device each).  Strings are raw: renderers escape."""

    title: str
    note: str
    headers: list[str]
    rows: list[list[str]]
    key_columns: int | None = None  # None: every column is a label
    groups: list[tuple[str, int]] = field(default_factory=list)
    sid: str = ""  # stable identifier: HTML anchor, truncation order
