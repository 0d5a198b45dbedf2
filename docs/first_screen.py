"""Regenerate docs/report-first-screen.png: the first 1400x900 screen of a
real sweep's report.html in headless Chromium.

    .venv/bin/cancelbench sweep --out /tmp/rep-demo --trials 10
    .venv/bin/python docs/first_screen.py /tmp/rep-demo/report.html
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from report_fixtures import HeadlessChromium  # noqa: E402


def main(page: str, out: str = str(ROOT / "docs" / "report-first-screen.png")) -> int:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if browser is None:
        print("no Chromium found (apt-get install chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as profile:
        chrome = HeadlessChromium(browser, Path(profile))
        try:
            chrome.open(Path(page).resolve().as_uri())
            chrome.screenshot(Path(out))
        finally:
            chrome.close()
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
