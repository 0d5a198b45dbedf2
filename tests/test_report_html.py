"""The self-contained HTML report: escaping of hostile data (page and SVG
text), offline by construction, and a real headless Chromium check driven
over the DevTools protocol: the first 1400x900 screen holds the verdict and
the mechanism comparison, the ECDF small multiples have one line per
mechanism, no console errors.

The browser tests (marker ``browser``) skip when no Chromium is installed,
but fail instead when CANCELBENCH_REQUIRE_BROWSER=1 (CI sets it; Debian
package ``chromium``).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import (HeadlessChromium, cancel_row, cell_rows, demo_like_rows, speech_rows,  # noqa: E402
                             write_dataset)

from cancelbench.reports import build_report  # noqa: E402
from cancelbench.reports.cli import main as reports_main  # noqa: E402
from cancelbench.reports.html import to_html  # noqa: E402
from cancelbench.reports.load import load_plot_samples, load_references  # noqa: E402

HOSTILE = '<script>alert("pwn")</script>"><img src=x onerror=alert(1)>$\\frac{1}{0}$&amp;'
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FIGURES = ("plot-ecdf", "plot-dots", "plot-offsets")


@pytest.fixture(scope="module")
def hostile_dataset(tmp_path_factory) -> Path:
    """Hostile host name (unsanitized ``hostname``), device name, workload,
    phase and error message: all end up in the page."""
    kw = dict(hostname=HOSTILE, device_name=HOSTILE)
    rows = cell_rows("x", [float(v) for v in range(1, 41)], workload=HOSTILE, phase=HOSTILE, **kw)
    rows += cell_rows("y", [5.0] * 30 + [70.0] * 3, phase="decode", offset_ms=250.0, **kw)
    rows += cell_rows("z", [2.0, 3.0, 4.0, 5.0, 6.0], host="hostB", phase="prefill", offset_ms=20.0)
    rows.append(cancel_row("lost-1", None, outcome="lost", error=HOSTILE, **kw))
    return write_dataset(tmp_path_factory.mktemp("html") / "sweep", rows)


@pytest.fixture(scope="module")
def page(hostile_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("page") / "report.html"
    assert reports_main(["report", str(hostile_dataset), "--html", str(out), "--format", "json"]) == 1
    return out


def test_every_data_string_is_escaped(page):
    text = page.read_text(encoding="utf-8")
    assert "<script" not in text.lower()  # no injected (or any) script element
    assert "<img" not in text.lower()
    assert "onerror=alert(1)&gt;" in text  # shown as text, attribute quote escaped
    assert "&lt;script&gt;alert(&quot;pwn&quot;)&lt;/script&gt;" in text
    assert "&amp;amp;" in text  # an entity in the data stays literal text


def test_page_is_self_contained(page):
    text = page.read_text(encoding="utf-8")
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    # no fetchable references: every src/href is a fragment or a data: URI
    refs = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', text)
    assert all(r.startswith(("#", "data:")) for r in refs), [r for r in refs if not r.startswith(("#", "data:"))]
    assert "<link" not in text and "@import" not in text and "url(http" not in text
    for fid in FIGURES:
        assert f'<figure id="{fid}">' in text
    assert text.count("<svg") == 3  # no speech workload: no uninterruptible-share bars


def test_plot_text_stays_searchable_text_and_escaped(page):
    text = page.read_text(encoding="utf-8")
    svg = text[text.index("<svg"):]
    assert "<text" in svg and "glyph" not in svg  # svg.fonttype none: labels are text, not glyph paths
    assert "hostB/vulkan:0" in svg  # a device name can be found in the plots
    assert "&lt;script&gt;" in svg and "<script" not in svg.lower()


def test_plot_samples_from_the_report_scan_equal_a_separate_scan(hostile_dataset, tmp_path):
    import pandas as pd

    d = write_dataset(tmp_path / "speech", speech_rows(n=6))
    for data in (d, hostile_dataset):
        one_scan = build_report([data], with_samples=True).samples
        assert len(one_scan) > 0 and one_scan["residue_ms"].notna().any() == (data == d)
        pd.testing.assert_frame_equal(one_scan, load_plot_samples([data]))


def test_plots_that_show_part_of_the_data_say_so(tmp_path):
    hosts = ["hostA", "hostB", "mac1", "mac2", "hostE"]  # five devices: the ECDF grid shows four
    rows = [r for h in hosts for r in cell_rows(h, [1.0, 2.0, 3.0, 4.0, 5.0], host=h)]
    d = write_dataset(tmp_path / "five", rows)
    page = to_html(build_report([d]), load_plot_samples([d]), load_references([d]))
    assert "(first 4 of 5 devices; the tables have all)" in page
    assert "hostE/cpu:0" in page.split('id="plot-ecdf"')[0]  # ... and the comparison table has the fifth
    assert "of 5 workload x device panels" not in page  # five offset panels fit (at most six)


def test_mathtext_and_control_chars_in_labels_do_not_break_plots(tmp_path):
    rows = cell_rows("m", [1.0, 2.0, 3.0, 4.0, 5.0], host="hostB", phase="$x^{$", workload="w\nx")
    d = write_dataset(tmp_path / "m", rows)
    html = to_html(build_report([d]), load_plot_samples([d]), load_references([d]))
    assert html.count("<svg") == 3


def _browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def _require_browser() -> str:
    path = _browser()
    if path is None:
        if os.environ.get("CANCELBENCH_REQUIRE_BROWSER") == "1":
            pytest.fail("CANCELBENCH_REQUIRE_BROWSER=1 but no Chromium found (apt-get install chromium)")
        pytest.skip("no Chromium installed (apt-get install chromium); CI sets CANCELBENCH_REQUIRE_BROWSER=1")
    return path


def test_missing_browser_fails_when_required(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CANCELBENCH_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="CANCELBENCH_REQUIRE_BROWSER=1"):
        _require_browser()
    monkeypatch.delenv("CANCELBENCH_REQUIRE_BROWSER")
    with pytest.raises(pytest.skip.Exception):
        _require_browser()


@pytest.fixture
def chromium(tmp_path):
    browser = HeadlessChromium(_require_browser(), tmp_path / "profile")
    yield browser
    browser.close()


def test_console_error_detection_works(chromium, tmp_path):
    """Guard for the browser check itself: a page that does log an error is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><p>x</p><script>console.error("planted-error")</script></body></html>')
    chromium.open(bad.as_uri())
    assert any("planted-error" in p for p in chromium.console_problems())


# What the DOM says about the first screen and the ECDF panels (run by DevTools, not by the page).
FIRST_SCREEN = """JSON.stringify((() => {
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const tables = [...document.querySelectorAll('table[id^="table-compare-"]')];
  return {
    viewport: [innerWidth, innerHeight],
    verdict: box(document.getElementById('verdict')),
    verdictText: document.getElementById('verdict').textContent,
    compare: tables.map(t => ({box: box(t), title: t.closest('section').querySelector('h2').textContent,
                               rows: [...t.tBodies[0].rows].map(r => [...r.cells].map(c => c.textContent))})),
    ecdf: [...document.querySelectorAll('#plot-ecdf g[id^="ecdf-"]')].map(g => g.id),
    ecdfText: document.getElementById('plot-ecdf').textContent,
  };
})())"""


def _first_screen(chromium, tmp_path: Path, rows: list[dict], workloads: list[str]) -> tuple[dict, Path]:
    """Write the dataset, render report.html through the CLI, open it at
    1400x900, check the first screen; the DOM state and the page for more checks."""
    import json

    import matplotlib.image

    page, shot = tmp_path / "report.html", tmp_path / "first-screen.png"
    assert reports_main(["report", str(write_dataset(tmp_path / "data", rows)), "--html", str(page),
                         "--format", "json"]) == 0
    chromium.open(page.resolve().as_uri())
    state = json.loads(chromium.evaluate(FIRST_SCREEN))
    chromium.screenshot(shot)
    assert chromium.console_problems() == []
    assert state["viewport"] == [1400, 900]
    left, top, right, bottom = state["verdict"]
    assert 0 <= top and bottom <= 900 and right <= 1400
    # the mechanism comparison of the first workload lies wholly on the first screen
    assert [c["title"] for c in state["compare"]] == [f"Mechanism comparison: {w}" for w in workloads]
    left, top, right, bottom = state["compare"][0]["box"]
    assert 0 <= top and bottom <= 900 and right <= 1400, state["compare"][0]["box"]
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (900, 1400) and pixels.std() > 0.05  # a real, non-blank screen
    return state, page


def _lines_per_panel(ids: list[str]) -> dict[str, list[str]]:
    panels: dict[str, list[str]] = {}
    for gid in ids:
        panel, mech = gid.rsplit("-", 1)
        panels.setdefault(panel, []).append(mech)
    return panels


def test_demo_report_first_screen_in_chromium(chromium, tmp_path):
    state, _ = _first_screen(chromium, tmp_path, demo_like_rows(), ["text"])
    assert state["verdictText"].startswith("WARN: no dropped cancels or lost trials")
    rows = state["compare"][0]["rows"]
    assert [r[:2] for r in rows] == [[m, d] for m in ("abort_callback", "between_calls", "chunked")
                                     for d in ("agent", "driver")]
    # one device, one workload: one panel, one line per mechanism (m0, m1, m2), each named in the legend
    assert _lines_per_panel(state["ecdf"]) == {"ecdf-w0-d0": ["m0", "m1", "m2"]}
    for m in ("abort_callback", "between_calls", "chunked"):
        assert m in state["ecdfText"]


def test_two_device_speech_report_first_screen_in_chromium(chromium, tmp_path):
    state, page = _first_screen(chromium, tmp_path, speech_rows(), ["stt-fixture", "tts-fixture"])
    assert [r[:2] for r in state["compare"][0]["rows"]] == [["abort_callback", "agent"], ["between_calls", "agent"],
                                                            ["graph_eval", "agent"]]
    # 2 workloads x 2 devices, each panel one line per mechanism
    panels = _lines_per_panel(state["ecdf"])
    assert panels == {f"ecdf-w{w}-d{d}": ["m0", "m1", "m2"] for w in (0, 1) for d in (0, 1)}
    assert "graph_eval" in state["ecdfText"] and "hostB/vulkan:0" in state["ecdfText"]
    assert 'id="plot-uninterruptible"' in page.read_text(encoding="utf-8")


def test_hostile_page_renders_in_chromium(chromium, page, tmp_path):
    import json

    chromium.open(page.resolve().as_uri())
    state = json.loads(chromium.evaluate(
        "JSON.stringify({scripts: document.scripts.length, imgs: document.images.length, "
        "svgs: document.querySelectorAll('svg').length, text: document.body.textContent})"))
    assert chromium.console_problems() == []
    assert (state["scripts"], state["imgs"], state["svgs"]) == (0, 0, 3)  # the hostile strings stayed text
    assert '<script>alert("pwn")</script>' in state["text"]
