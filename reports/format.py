"""Report rendering: terminal table, Markdown (pull-request comment), JSON
(machine verdict).  Renderers share one section model (``sections.py``) so
the forms say the same thing in the same compact layout; every string that
came from the data is escaped for its medium (control characters for
terminals, Markdown/HTML syntax for Markdown).
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import replace

from cancelbench.textsafe import term_safe  # noqa: F401 (its one home; re-exported for the renderers)

from . import stats
from .sections import VERDICT_WORDS, Section, headline, sections
from .tables import Report

# ----------------------------------------------------------------- escape --
# "#", "(", "!" are harmless inside a table cell; escaping "#" would break "&#x27;".
_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def md_safe(text: object) -> str:
    """Markdown cell text: HTML escaped (GitHub renders HTML), Markdown
    punctuation backslash-escaped, no line breaks."""
    flat = term_safe(text)
    return _MD_SPECIAL.sub(r"\\\1", html.escape(flat, quote=True))


# --------------------------------------------------------------- terminal --
def _column_widths(s: Section, grid: list[list[str]]) -> list[int]:
    widths = [max(len(row[i]) for row in grid) for i in range(len(s.headers))]
    col = s.key_columns or 0
    for label, span in s.groups:  # a group label wider than its columns widens the group's last column
        spare = len(term_safe(label)) - (sum(widths[col:col + span]) + 2 * (span - 1))
        if spare > 0:
            widths[col + span - 1] += spare
        col += span
    return widths


def render_terminal_table(s: Section) -> list[str]:
    """Aligned columns, numbers right-aligned, device group labels on a line above."""
    grid = [[term_safe(h) for h in s.headers]] + [[term_safe(c) for c in row] for row in s.rows]
    widths = _column_widths(s, grid)
    keys = len(s.headers) if s.key_columns is None else s.key_columns

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(widths[i]) if i < keys else c.rjust(widths[i]) for i, c in enumerate(cells)).rstrip()

    lines = []
    if s.groups:
        parts, col = ["  ".join(" " * w for w in widths[:keys])] if keys else [], keys
        for label, span in s.groups:
            parts.append(term_safe(label).ljust(sum(widths[col:col + span]) + 2 * (span - 1)))
            col += span
        lines.append("  ".join(parts).rstrip())
    lines += [line(grid[0]), "  ".join("-" * w for w in widths)] + [line(row) for row in grid[1:]]
    return lines


def to_terminal(report: Report, max_defects: int = 50) -> str:
    out = ["cancelbench report", term_safe(headline(report))]
    for s in sections(report, max_defects):
        out += ["", f"== {term_safe(s.title)} =="]
        if s.note:
            out.append(term_safe(s.note))
        out += render_terminal_table(s) if s.rows else ["(none)"]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------- markdown --
def md_table(s: Section) -> list[str]:
    """A GitHub table: numbers right-aligned, a device group's name on its first column."""
    keys = len(s.headers) if s.key_columns is None else s.key_columns
    headers = [md_safe(h) for h in s.headers]
    col = keys
    for label, span in s.groups:
        headers[col] = f"**{md_safe(label)}**<br>{headers[col]}"
        col += span
    align = ["---" if i < keys else "---:" for i in range(len(headers))]
    return ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"] + \
        ["| " + " | ".join(md_safe(c) for c in row) + " |" for row in s.rows]


MARKDOWN_LIMIT = 60_000  # a GitHub comment holds 65,536 characters


def markdown_document(head: list[str], secs: list[Section], truncate_order: list[str],
                      limit: int = MARKDOWN_LIMIT) -> str:
    """Head lines plus sections; when over ``limit``, the sections whose
    ``sid`` is named in ``truncate_order`` lose trailing rows (first named,
    first cut) until the document fits, each saying how many rows it shows.
    Whatever still does not fit is cut with a closing note: never silently."""
    def render(parts: list[Section]) -> str:
        out = list(head)
        for s in parts:
            out += ["", f"### {md_safe(s.title)}"]
            if s.note:
                out += ["", md_safe(s.note)]
            out += [""] + (md_table(s) if s.rows else ["(none)"])
        return "\n".join(out) + "\n"

    def cut(s: Section, k: int) -> Section:
        note = f"{s.note}; " if s.note else ""
        return replace(s, note=f"{note}first {k} of {len(s.rows)} rows shown (the JSON output has all)",
                       rows=s.rows[:k])

    secs = list(secs)
    text = render(secs)
    for sid in truncate_order:
        if len(text) <= limit:
            break
        for i in (i for i, s in enumerate(secs) if s.sid == sid):
            full, lo, hi = secs[i], 0, len(secs[i].rows)
            while lo < hi:  # the most rows that still fit
                mid = (lo + hi + 1) // 2
                secs[i] = cut(full, mid)
                lo, hi = (mid, hi) if len(render(secs)) <= limit else (lo, mid - 1)
            secs[i] = cut(full, lo)
            text = render(secs)
    if len(text) > limit:
        note = f"\n\n**(truncated at {limit} characters; the JSON output has everything)**\n"
        text = text[:limit - len(note)].rsplit("\n", 1)[0] + note
    return text


def to_markdown(report: Report, max_defects: int = 50, limit: int = MARKDOWN_LIMIT) -> str:
    icon = VERDICT_WORDS[report.verdict]
    head = [f"## cancelbench report: {icon}", "", md_safe(headline(report))]
    secs = sections(report, max_defects)
    compare = [s.sid for s in secs if s.sid.startswith("compare-")]
    # the over-bound list goes first (the per-phase table marks the same cells), the defects last
    return markdown_document(head, secs, ["builds", "over", "residue", "phases", "targeting", "devices", "hops", *reversed(compare),
                                          "defects"], limit)


# ------------------------------------------------------------------- json --
def jsonable(value):
    """NaN/inf -> None so the output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def report_dict(report: Report) -> dict:
    spec = report.spec
    return jsonable({
        "verdict": report.verdict,
        "exit_code": report.exit_code,
        "datasets": report.dirs,
        "n_records": report.n_records,
        "simulated_engines": report.simulated,
        "bargein": {"cells": [c.__dict__ for c in report.bargein[0]],
                    "stops_by_phase": [p.__dict__ for p in report.bargein[1]]},
        "residue": [c.__dict__ for c in report.residue],  # the residue split per cell (reports/residue.py)
        "targeting": [{**t.__dict__, "missed": t.missed} for t in report.targeting],  # non-empty: rows of engines that wait instead of compute
        "bound": {
            "default_ms": spec.bound.default_ms,
            "overrides": [{"workload": w, "phase": p, "ms": ms} for w, p, ms in spec.bound.overrides],
            "percentile": stats.percentile_label(spec.bound_percentile),
        },
        "confidence": spec.confidence,
        "min_samples": spec.min_counts(),
        "defects": report.defects.to_dict(orient="records"),
        "over_bound": [{"workload": c.workload, "phase": c.phase, "mechanism": c.mechanism, "delivery": c.delivery,
                        "device": c.device, "value_ms": c.bound_stat_ms, "bound_ms": c.bound_ms,
                        "worst_trial_ids": c.worst_trial_ids} for c in report.over],
        "mechanisms": [c.to_dict() for c in report.pooled],
        "cells": [c.to_dict() for c in report.cells],
        "hops": [h.__dict__ for h in report.hops],
        "devices": [dict(i.__dict__, device_class=i.device_class) for i in report.devices],
    })


def to_json(report: Report) -> str:
    # Insertion order, not sorted: the verdict and the defects come first for a person reading it too.
    return json.dumps(report_dict(report), indent=2, allow_nan=False) + "\n"
