"""How a diff reads: its section, headline and notes, and the terminal, Markdown and
JSON renderings of a :class:`~cancelbench.reports.diff.DiffResult` (the HTML page:
reports/html.py)."""

from __future__ import annotations

import json
from dataclasses import asdict

from . import stats
from .diff import DiffResult
from .format import MARKDOWN_LIMIT, jsonable, markdown_document, md_safe, render_terminal_table, term_safe
from .sections import Section, fmt_ms


def diff_section(result: DiffResult) -> Section:
    pl = stats.percentile_label(result.spec.percentile)
    rows = []
    for d in result.cells:
        ci = "-" if d.ci_low_ms is None else f"[{d.ci_low_ms:+.2f}, {d.ci_high_ms:+.2f}]"
        rel = "-" if d.rel_change is None else f"{d.rel_change:+.1%}"
        row = [d.verdict.upper() if d.verdict == "regressed" else d.verdict, d.device_class, d.workload,
               d.phase, d.mechanism, d.delivery, f"{d.base_n} -> {d.cand_n}",
               f"{fmt_ms(d.base_p50)} -> {fmt_ms(d.cand_p50)}",
               f"{fmt_ms(d.base_value)} -> {fmt_ms(d.cand_value)}",
               rel, ci, f"{d.base_dropped} -> {d.cand_dropped}",
               f"{fmt_ms(d.base_work_p50)} -> {fmt_ms(d.cand_work_p50)}",
               f"{_pct(d.base_wait_share)} -> {_pct(d.cand_wait_share)}", "; ".join(d.reasons),
               " ".join(d.cand_worst_trial_ids) if d.verdict == "regressed" else ""]
        rows.append(row if pl != "p50" else row[:8] + row[9:])  # --percentile 50: one p50 column
    columns = ["verdict", "device class", "workload", "phase", "mechanism", "delivery", "n", "p50 ms", f"{pl} ms",
               f"{pl} change", "CI (ms)", "dropped", "work p50 ms", "wait share", "why", "worst candidate trials"]
    return Section(
        "Cells", f"{pl} change with a {result.spec.confidence:g} bootstrap CI (seed {result.spec.seed}, "
        f"{result.spec.n_boot} replicates); regression = CI above 0 and > {result.spec.rel_threshold:.0%}, "
        "or new dropped/lost, or newly over the bound; work p50 and wait share: the residue split of the "
        "cancelled trials (engine work, and CPU wait over the summed residue; reports/residue.py)",
        columns if pl != "p50" else columns[:8] + columns[9:], rows, sid="cells")


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0%}"


def verdict_word(result: DiffResult) -> str:
    """REGRESSED / OK, said with the noisy side when the hosts differed (reports/noise.py)."""
    check = result.noise
    if check is not None and check.refused:
        return f"REFUSED: NOISY {' and '.join(check.noisy)}"
    word = "REGRESSED" if result.regressed or result.invalid else "OK"
    return f"{word}, NOISY {' and '.join(check.noisy)}" if check is not None and check.flagged else word


def diff_headline(result: DiffResult) -> str:
    counts = ", ".join(f"{v} {k}" for k, v in result.counts().items())
    return (f"verdict: {verdict_word(result)} (exit {result.exit_code}) - "
            f"{len(result.cells)} cells: {counts}")


def class_notes(result: DiffResult) -> list[str]:
    notes = [result.noise.line()] if result.noise is not None else []
    if result.baseline_only_classes:
        notes.append("not compared (baseline only): " + ", ".join(result.baseline_only_classes))
    if result.candidate_only_classes:
        notes.append("not compared (candidate only): " + ", ".join(result.candidate_only_classes))
    if result.spec.class_map:
        notes.append("compared across classes: " + ", ".join(f"{b} -> {c}" for b, c in result.spec.class_map))
    if result.spec.ignore_settings:
        notes.append("settings allowed to differ: " + ", ".join(result.spec.ignore_settings))
    return notes + result.notes


def diff_to_terminal(result: DiffResult) -> str:
    s = diff_section(result)
    out = ["cancelbench diff", term_safe(diff_headline(result)),
           term_safe(f"baseline: {', '.join(result.baseline)}  candidate: {', '.join(result.candidate)}"),
           *(term_safe(n) for n in class_notes(result)), "", term_safe(s.note)]
    out += render_terminal_table(s) if s.rows else ["(no cells)"]
    for extra in result.legend:
        out += ["", f"== {term_safe(extra.title)} ==", term_safe(extra.note), *render_terminal_table(extra)]
    return "\n".join(out) + "\n"


def diff_to_markdown(result: DiffResult, limit: int = MARKDOWN_LIMIT) -> str:
    """The CI comment; regressions come first, so size truncation cuts the
    unchanged cells."""
    head = [f"## cancelbench diff: {verdict_word(result)}", "", md_safe(diff_headline(result)),
            "", md_safe(f"baseline: {', '.join(result.baseline)}; candidate: {', '.join(result.candidate)}")]
    head += ["", *(f"- {md_safe(n)}" for n in class_notes(result))] if class_notes(result) else []
    return markdown_document(head, [diff_section(result), *result.legend], ["builds", "cells"], limit)


def diff_dict(result: DiffResult) -> dict:
    return jsonable({
        "verdict": "regressed" if result.regressed or result.invalid else "ok",
        "noise": result.noise.to_dict() if result.noise is not None else None,
        "exit_code": result.exit_code,
        "baseline": result.baseline,
        "candidate": result.candidate,
        "percentile": stats.percentile_label(result.spec.percentile),
        "rel_threshold": result.spec.rel_threshold,
        "confidence": result.spec.confidence,
        "seed": result.spec.seed,
        "n_boot": result.spec.n_boot,
        "min_samples": stats.min_samples(result.spec.percentile, result.spec.confidence),
        "counts": result.counts(),
        "baseline_only_classes": result.baseline_only_classes,
        "candidate_only_classes": result.candidate_only_classes,
        "class_map": [list(p) for p in result.spec.class_map],
        "ignore_settings": list(result.spec.ignore_settings),
        "cells": [asdict(c) for c in result.cells],
        "builds": [dict(zip(s.headers, r)) for s in result.legend for r in s.rows],
    })


def diff_to_json(result: DiffResult) -> str:
    return json.dumps(diff_dict(result), indent=2, sort_keys=True, allow_nan=False) + "\n"
