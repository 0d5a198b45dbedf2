"""The end of a sweep: the report is built once, written next to the records
(``report.txt``, ``report.html``), and its headline part -- the verdict and
the mechanism comparison per workload -- is what the sweep prints.

Same aggregation, minimum counts and layout as ``cancelbench report``.
"""

from __future__ import annotations

from pathlib import Path

from cancelbench.fileio import write_atomic

from . import build_report
from .format import render_terminal_table, term_safe, to_terminal
from .sections import comparison_sections, headline
from .tables import Report


def summary_text(report: Report) -> str:
    lines = ["== Summary ==", term_safe(headline(report))]
    for s in comparison_sections(report):
        lines += ["", f"-- {term_safe(s.title)} --", term_safe(s.note), *render_terminal_table(s)]
    return "\n".join(lines) + "\n"


def write_sweep_reports(out_dir: str | Path, sweep_failures: list[str] | tuple = ()) -> str:
    """Write report.txt and report.html into ``out_dir``; return the summary to print.

    ``sweep_failures``: what failed the sweep besides the defects its records show (error trials,
    planned trials not run, devices stopped early; ``runner.SweepResult.failure_reasons``): the
    verdict and exit code these files and the summary state are the sweep's own, never ``exit 0``
    for a sweep that exits 1."""
    from .html import to_html

    out = Path(out_dir)
    report = build_report([out], with_samples=True)
    report.sweep_failures = list(sweep_failures)
    write_atomic(out / "report.txt", lambda tmp: tmp.write_text(to_terminal(report), encoding="utf-8"))
    page = to_html(report, report.samples, report.references)
    write_atomic(out / "report.html", lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return (summary_text(report) + f"\nfull report (per phase, defects, hops): {out / 'report.txt'} "
            f"(cancelbench report {out}); plots: {out / 'report.html'}\n")
