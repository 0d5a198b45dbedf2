"""The report page as a reader meets it at 1400 px, in headless Chromium: no table
scrolls sideways (long worst-trial id lists wrap), the plots use the page's
width, and the per-phase table does not list a ``(none)`` row per mechanism and
delivery for cancels that never met a running engine (one note line instead).

Browser tests skip without Chromium unless CANCELBENCH_REQUIRE_BROWSER=1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import HeadlessChromium, cancel_row, demo_like_rows, write_dataset  # noqa: E402
from test_report_html import _require_browser  # noqa: E402

from cancelbench.reports import build_report  # noqa: E402
from cancelbench.reports.cli import main as reports_main  # noqa: E402
from cancelbench.reports.sections import detail_section  # noqa: E402

MECHANISMS = ("between_calls", "chunked", "abort_callback")


def demo_with_late_cancels() -> list[dict]:
    """The demo's shape plus what a real demo has: cancels that arrived after the engine had
    finished (outcome completed, no phase at receipt), four per mechanism and delivery, and
    long trial ids (the over-the-bound table lists the worst five)."""
    rows = []
    for r in demo_like_rows():
        if r["trial_kind"] == "cancel":
            r = dict(r, trial_id=f"{r['trial_id']}-0123456789abcdef0123456789abcdef")
        rows.append(r)
    for m in MECHANISMS:
        for d in ("driver", "agent"):
            rows += [cancel_row(f"{m}-{d}-late-{i}", None, host="vm", workload="text", phase=None, mechanism=m,
                                delivery=d, outcome="completed", engine="text", offset_ms=470.0) for i in range(4)]
    return rows


def test_rows_without_samples_fold_into_one_note_line(tmp_path):
    d = write_dataset(tmp_path / "demo", demo_with_late_cancels())
    s = detail_section(build_report([d]))
    assert all(row[1] != "(none)" for row in s.rows), s.rows
    assert len(s.rows) == 2 * 3 * 2  # prefill and generate x 3 mechanisms x 2 deliveries
    assert "not listed: 6 rows without a latency sample (phase (none): 24 trials, 24 completed" in s.note


def test_a_row_with_a_dropped_cancel_is_never_folded(tmp_path):
    rows = demo_with_late_cancels() + [cancel_row("drop-1", None, host="vm", workload="text", phase=None,
                                                  mechanism="chunked", delivery="agent", outcome="dropped")]
    s = detail_section(build_report([write_dataset(tmp_path / "d", rows)]))
    assert [r[:4] for r in s.rows if r[1] == "(none)"] == [["text", "(none)", "chunked", "agent"]]
    assert "5 rows without a latency sample" in s.note


LAYOUT = """JSON.stringify({
  width: document.documentElement.clientWidth,
  pageScroll: document.documentElement.scrollWidth,
  tables: [...document.querySelectorAll('table')].map(t => ({id: t.id, right: t.getBoundingClientRect().right,
                                                             scroll: t.scrollWidth, client: t.clientWidth})),
  svgs: [...document.querySelectorAll('figure svg')].map(s => s.getBoundingClientRect().width),
  phases: [...document.querySelectorAll('#table-phases tbody tr')].map(r => r.cells[1].textContent),
  note: document.querySelector('#section-phases .note').textContent,
  idLines: [...document.querySelectorAll('#table-over td.wrap .tok')].map(t => t.getClientRects().length),
})"""


@pytest.mark.browser
def test_report_page_fits_1400_px(tmp_path):
    page = tmp_path / "report.html"
    d = write_dataset(tmp_path / "demo", demo_with_late_cancels())
    assert reports_main(["report", str(d), "--html", str(page), "--format", "json", "--bound", "20"]) == 0
    browser = HeadlessChromium(_require_browser(), tmp_path / "profile")
    try:
        browser.open(page.resolve().as_uri())
        state = json.loads(browser.evaluate(LAYOUT))
        browser.screenshot(tmp_path / "shot.png")
        assert browser.console_problems() == []
    finally:
        browser.close()
    assert state["width"] == 1400 and state["pageScroll"] <= 1400  # nothing scrolls the page sideways
    over = next(t for t in state["tables"] if t["id"] == "table-over")  # five 50-character ids per row
    assert state["idLines"] and all(n == 1 for n in state["idLines"])  # an id is never split across lines
    assert all(t["right"] <= 1400 for t in state["tables"]), state["tables"]
    assert over["scroll"] <= over["client"] + 1
    # every plot uses most of the width (it was ~300 px of 1400 before)
    assert state["svgs"] and min(state["svgs"]) >= 1000, state["svgs"]
    assert "(none)" not in state["phases"] and len(state["phases"]) == 12
    assert "not listed: 6 rows without a latency sample" in state["note"]
