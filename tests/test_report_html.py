"""The self-contained HTML report: escaping of hostile data, offline by
construction, and a real headless Chromium check (page renders, plots are
present, no console errors).

The browser test skips when no Chromium is installed, but fails instead when
CANCELBENCH_REQUIRE_BROWSER=1 (CI sets it; Debian package ``chromium``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import cancel_row, cell_rows, write_dataset  # noqa: E402

from cancelbench.reports import build_report  # noqa: E402
from cancelbench.reports.cli import main as reports_main  # noqa: E402
from cancelbench.reports.html import to_html  # noqa: E402
from cancelbench.reports.load import load_plot_samples  # noqa: E402

HOSTILE = '<script>alert("pwn")</script>"><img src=x onerror=alert(1)>$\\frac{1}{0}$&amp;'
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FIGURES = ("plot-ecdf", "plot-scatter", "plot-boxes")


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
    assert text.count("<svg") == 3


def test_mathtext_and_control_chars_in_labels_do_not_break_plots(tmp_path):
    rows = cell_rows("m", [1.0, 2.0, 3.0, 4.0, 5.0], host="hostB", phase="$x^{$", workload="w\nx")
    d = write_dataset(tmp_path / "m", rows)
    html = to_html(build_report([d]), load_plot_samples([d]))
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


def _run_browser(browser: str, page: Path, tmp_path: Path, *mode: str) -> subprocess.CompletedProcess:
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0", "--log-level=0",
            *mode, page.resolve().as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=180)


def _console_lines(stderr: str) -> list[str]:
    """Chromium logs every console message (errors, uncaught exceptions, CSP
    violations) as ``...:CONSOLE...`` lines with --enable-logging=stderr."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_console_error_detection_works(tmp_path):
    """Guard for the browser check itself: a page that does log an error is caught."""
    browser = _require_browser()
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><p>x</p><script>console.error("planted-error")</script></body></html>')
    proc = _run_browser(browser, bad, tmp_path, "--dump-dom")
    assert any("planted-error" in line for line in _console_lines(proc.stderr)), proc.stderr[-2000:]


def test_renders_in_headless_chromium(page, tmp_path):
    browser = _require_browser()
    proc = _run_browser(browser, page, tmp_path, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert _console_lines(proc.stderr) == [], _console_lines(proc.stderr)
    assert "cancelbench report" in dom and 'id="verdict"' in dom
    for fid in FIGURES:
        assert f'id="{fid}"' in dom
    assert dom.count("<svg") == 3 and dom.count("<path") > 50  # plots are present and drawn
    assert "<script" not in dom.lower() and "<img" not in dom.lower()  # the hostile string stayed text
    assert "&lt;script&gt;alert(\"pwn\")&lt;/script&gt;" in dom

    shot = tmp_path / "shot.png"
    proc = _run_browser(browser, page, tmp_path, "--window-size=1200,3000", f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    assert _console_lines(proc.stderr) == []
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.std() > 0.05  # not a blank page
