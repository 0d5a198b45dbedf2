"""Report rendering: terminal table, Markdown (pull-request comment), JSON
(machine verdict).  Renderers share one section model so the three forms say
the same thing; every string that came from the data is escaped for its
medium (control characters for terminals, Markdown/HTML syntax for Markdown).
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass

from . import stats
from .tables import CellStats, Report

# ----------------------------------------------------------------- escape --
# "#", "(", "!" are harmless inside a table cell; escaping "#" would break "&#x27;".
_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def term_safe(text: object) -> str:
    """No control characters (ANSI escapes, newlines) from data reach a terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


def md_safe(text: object) -> str:
    """Markdown cell text: HTML escaped (GitHub renders HTML), Markdown
    punctuation backslash-escaped, no line breaks."""
    flat = term_safe(text)
    return _MD_SPECIAL.sub(r"\\\1", html.escape(flat, quote=True))


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# --------------------------------------------------------------- sections --
@dataclass
class Section:
    """A titled table; cell strings may contain "\\n" for stacked lines.
    Strings are raw (unescaped): each renderer escapes them."""

    title: str
    note: str
    headers: list[str]
    rows: list[list[str]]


def cell_text(c: CellStats | None, spec) -> str:
    if c is None:
        return "-"
    lines = [f"n {c.n}/{c.n_trials}"]
    bound_label = stats.percentile_label(spec.bound_percentile)
    mins = spec.min_counts()
    for label, value in c.percentiles.items():
        text = f"{label} {fmt_ms(value)}" if value is not None else f"{label} insufficient (<{mins[label]})"
        if label == bound_label and c.over:
            text += f" OVER {c.bound_ms:g}"
        lines.append(text)
    if bound_label not in c.percentiles and c.over:
        lines.append(f"{bound_label} {fmt_ms(c.bound_stat_ms)} OVER {c.bound_ms:g}")
    # LoadGen-style early stopping: "met" only when the samples prove it at the confidence.
    verdict = "OVER" if c.over else (f"met ({spec.confidence:.0%})" if c.bound_proven else "unproven")
    lines.append(f"max {fmt_ms(c.max_ms)}")
    lines.append(f"bound {c.bound_ms:g}: {verdict}")
    lines.append(f"dropped {c.dropped}" + (f" lost {c.lost}" if c.lost else ""))
    lines.append(f"cost {c.cost_ratio_p50:.3f}" if c.cost_ratio_p50 is not None else "cost -")
    return "\n".join(lines)


def sections(report: Report, max_defects: int = 50) -> list[Section]:
    spec = report.spec
    out: list[Section] = []
    d = report.defects
    shown = d.head(max_defects)
    n_dropped, n_lost = int((d["outcome"] == "dropped").sum()), int((d["outcome"] == "lost").sum())
    out.append(Section(
        f"Defects: {n_dropped} dropped cancels, {n_lost} lost trials",
        "" if len(d) <= max_defects else f"first {max_defects} of {len(d)} shown; the JSON output lists all",
        ["outcome", "trial id", "device", "workload", "phase", "mechanism", "delivery", "error"],
        [[r.outcome, r.trial_id, r.device, r.workload, r.phase, r.mechanism, r.delivery, r.error]
         for r in shown.itertuples()],
    ))
    bl = stats.percentile_label(spec.bound_percentile)
    out.append(Section(
        f"Over the latency bound: {len(report.over)} cells",
        f"{bl} latency_ms (nearest rank) compared with the bound; worst trial ids first",
        ["device", "workload", "phase", "mechanism", "delivery", f"{bl} ms", "bound ms", "n over / n", "worst trials"],
        [[c.device, c.workload, c.phase, c.mechanism, c.delivery, fmt_ms(c.bound_stat_ms), f"{c.bound_ms:g}",
          f"{c.n_over}/{c.n}", " ".join(c.worst_trial_ids)] for c in report.over],
    ))
    devices = report.devices_in_cells()
    by_key: dict[tuple, dict[str, CellStats]] = {}
    for c in report.cells:
        by_key.setdefault(c.row_key, {})[c.device] = c
    mins = ", ".join(f"{k} n>={v}" for k, v in spec.min_counts().items())
    out.append(Section(
        "Cross-platform latency (latency_ms, cancel received -> engine stopped)",
        f"nearest-rank percentiles, shown only with enough samples ({mins}; confidence {spec.confidence:g}); "
        f"bound met = the {bl} is within the bound at that confidence (binomial early-stopping test); "
        f"cost = median latency / reference duration",
        ["workload", "phase", "mechanism", "delivery", *devices],
        [[*key, *(cell_text(row.get(dev), spec) for dev in devices)] for key, row in sorted(by_key.items())],
    ))
    out.append(Section(
        "Hop decomposition (mean ms, share of end_to_end_ms)",
        "end_to_end = deliver (issue -> agent) + observe (agent -> native reader) + return (native call returns) "
        "+ settle (engine reaches terminal state)",
        ["device", "n", "end_to_end", "deliver", "observe", "return", "settle"],
        [[h.device, str(h.n), fmt_ms(h.end_to_end_mean_ms),
          *(f"{fmt_ms(h.means_ms[k])} ({h.share[k]:.0%})" if h.share[k] is not None else fmt_ms(h.means_ms[k])
            for k in ("deliver_ms", "observe_ms", "return_ms", "settle_ms"))] for h in report.hops],
    ))
    out.append(Section(
        "Devices", "device class = platform/arch/backend/device_name (what diff matches on)",
        ["device", "hostname", "device name", "platform", "arch", "device class"],
        [[i.device, i.hostname, i.device_name, i.platform, i.arch, i.device_class] for i in report.devices],
    ))
    return out


def headline(report: Report) -> str:
    spec = report.spec
    overrides = "; ".join(f"{w or '*'}:{p or '*'}={ms:g}" for w, p, ms in spec.bound.overrides)
    return (f"verdict: {report.verdict.upper()} (exit {report.exit_code}) - {report.n_records} cancel records "
            f"from {len(report.dirs)} dataset(s); bound {spec.bound.default_ms:g} ms on "
            f"{stats.percentile_label(spec.bound_percentile)}" + (f" (overrides {overrides})" if overrides else ""))


# --------------------------------------------------------------- terminal --
def render_terminal_table(s: Section) -> list[str]:
    grid = [[term_safe(h) for h in s.headers]] + [[term_safe_lines(c) for c in row] for row in s.rows]
    split = [[c.split("\n") for c in row] for row in grid]
    widths = [max(len(line) for row in split for line in row[i]) for i in range(len(s.headers))]
    lines = []
    for r, row in enumerate(split):
        height = max(len(c) for c in row)
        for k in range(height):
            lines.append("  ".join((c[k] if k < len(c) else "").ljust(widths[i]) for i, c in enumerate(row)).rstrip())
        if r == 0:
            lines.append("  ".join("-" * w for w in widths))
        elif height > 1 and r < len(split) - 1:
            lines.append("")
    return lines


def term_safe_lines(text: str) -> str:
    return "\n".join(term_safe(line) for line in str(text).split("\n"))


def to_terminal(report: Report, max_defects: int = 50) -> str:
    out = ["cancelbench report", headline(report)]
    for s in sections(report, max_defects):
        out += ["", f"== {s.title} =="]
        if s.note:
            out.append(term_safe(s.note))
        out += render_terminal_table(s) if s.rows else ["(none)"]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------- markdown --
def md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    def cell(text: str) -> str:
        return "<br>".join(md_safe(line) for line in str(text).split("\n"))

    return ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)] + \
        ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


MARKDOWN_LIMIT = 60_000  # a GitHub comment holds 65,536 characters


def markdown_document(head: list[str], secs: list[Section], truncate_order: list[int],
                      limit: int = MARKDOWN_LIMIT) -> str:
    """Head lines plus sections; when over ``limit``, the sections named in
    ``truncate_order`` lose trailing rows (first named, first cut) until the
    document fits, each saying how many rows it shows."""
    def render(parts: list[Section]) -> str:
        out = list(head)
        for s in parts:
            out += ["", f"### {md_safe(s.title)}"]
            if s.note:
                out += ["", md_safe(s.note)]
            out += [""] + (md_table(s.headers, s.rows) if s.rows else ["(none)"])
        return "\n".join(out) + "\n"

    def cut(s: Section, k: int) -> Section:
        note = f"{s.note}; " if s.note else ""
        return Section(s.title, f"{note}first {k} of {len(s.rows)} rows shown (the JSON output has all)",
                       s.headers, s.rows[:k])

    secs = list(secs)
    text = render(secs)
    for i in truncate_order:
        if len(text) <= limit:
            break
        full, lo, hi = secs[i], 0, len(secs[i].rows)
        while lo < hi:  # the most rows that still fit
            mid = (lo + hi + 1) // 2
            secs[i] = cut(full, mid)
            lo, hi = (mid, hi) if len(render(secs)) <= limit else (lo, mid - 1)
        secs[i] = cut(full, lo)
        text = render(secs)
    return text


def to_markdown(report: Report, max_defects: int = 50, limit: int = MARKDOWN_LIMIT) -> str:
    icon = {"ok": "PASS", "over_bound": "WARN", "defects": "FAIL"}[report.verdict]
    head = [f"## cancelbench report: {icon}", "", md_safe(headline(report))]
    # sections: 0 defects, 1 over bound, 2 cross-platform, 3 hops, 4 devices; defects are cut last
    return markdown_document(head, sections(report, max_defects), [2, 4, 3, 1, 0], limit)


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
        "cells": [c.to_dict() for c in report.cells],
        "hops": [h.__dict__ for h in report.hops],
        "devices": [dict(i.__dict__, device_class=i.device_class) for i in report.devices],
    })


def to_json(report: Report) -> str:
    # Insertion order, not sorted: the verdict and the defects come first for a person reading it too.
    return json.dumps(report_dict(report), indent=2, allow_nan=False) + "\n"
