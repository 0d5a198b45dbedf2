"""Self-contained HTML report: the same sections as the Markdown form plus
plots rendered by matplotlib to inline SVG.

* Offline: no scripts, no external resources; a Content-Security-Policy
  forbids every fetch, so a stray reference would fail loudly (console error)
  in the browser test instead of silently phoning home.
* Every string from the data goes through ``html.escape``; plot labels have
  ``$`` escaped so matplotlib never parses data as mathtext, and text is drawn
  as glyph paths (svg.fonttype = path) so data never lands in SVG markup.
* Plots sample (deterministically) so a million records still render fast.
"""

from __future__ import annotations

import html
import io
import re

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from . import stats
from .format import headline, sections
from .tables import Report

MAX_ECDF_POINTS = 2000  # per device
MAX_SCATTER_POINTS = 20000
MAX_BOX_POINTS = 5000  # per device x phase
MAX_BOX_DEVICES = 12
PLOT_COLUMNS = ["device_key", "phase", "outcome", "latency_ms", "offset_actual_ms"]

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'none'"

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#111}
table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{border:1px solid #bbb;padding:.25em .5em;vertical-align:top;font-size:13px;text-align:left}
th{background:#eee}
td.cell{font-family:ui-monospace,monospace;white-space:nowrap}
.over{background:#fdd}
.verdict-ok{color:#060}.verdict-over_bound{color:#a60}.verdict-defects{color:#b00}
figure{margin:1em 0}
figcaption{font-weight:bold;margin-bottom:.3em}
svg{max-width:100%;height:auto}
"""


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def plot_label(text: object) -> str:
    """A data string made inert for matplotlib (no mathtext, no newlines)."""
    return re.sub(r"[\x00-\x1f\x7f]", "?", str(text)).replace("$", r"\$")


def _svg(fig: Figure, name: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": name, "text.usetex": False}):
        fig.savefig(buf, format="svg", dpi=110, bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: invalid inside HTML


def _even_sample(sorted_values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """At most k points of an ECDF, evenly spaced in rank (keeps its shape)."""
    n = len(sorted_values)
    idx = np.unique(np.linspace(0, n - 1, min(n, k)).round().astype(int))
    return sorted_values[idx], (idx + 1) / n


def samples_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Latency samples of a prepared frame (outcome cancelled, latency present)."""
    ok = (frame["outcome"] == "cancelled") & frame["latency_ms"].notna()
    out = frame.loc[ok, PLOT_COLUMNS].copy()
    for col in ("device_key", "phase"):  # plot in name order, not order of appearance
        s = out[col].astype("category")
        out[col] = s.cat.reorder_categories(sorted(s.cat.categories, key=str))
    return out


def plot_ecdf(samples: pd.DataFrame, bound_ms: float) -> str:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for device, g in samples.groupby("device_key", sort=True, observed=True):
        x, y = _even_sample(np.sort(g["latency_ms"].to_numpy(dtype=float)), MAX_ECDF_POINTS)
        ax.step(x, y, where="post", label=plot_label(f"{device} (n={len(g)})"))
    ax.axvline(bound_ms, color="red", linestyle="--", linewidth=1, label=plot_label(f"bound {bound_ms:g} ms"))
    if len(samples) and samples["latency_ms"].min() > 0:
        ax.set_xscale("log")
    ax.set_xlabel("latency_ms (cancel received -> engine stopped)")
    ax.set_ylabel("fraction of trials <= x")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _svg(fig, "ecdf")


def plot_scatter(samples: pd.DataFrame, seed: int = 0) -> str:
    if len(samples) > MAX_SCATTER_POINTS:
        samples = samples.sample(n=MAX_SCATTER_POINTS, random_state=seed)
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for phase, g in samples.groupby("phase", sort=True, observed=True):
        ax.scatter(g["offset_actual_ms"], g["latency_ms"], s=6, alpha=0.6, label=plot_label(phase),
                   rasterized=True)  # an embedded PNG: 20k vector markers would weigh megabytes
    ax.set_xlabel("cancel offset from hand-back (offset_actual_ms)")
    ax.set_ylabel("latency_ms")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, title="phase at receipt", title_fontsize=7)
    return _svg(fig, "scatter")


def plot_boxes(samples: pd.DataFrame, seed: int = 0) -> str:
    devices = sorted(map(str, samples["device_key"].unique()))[:MAX_BOX_DEVICES]
    phases = sorted(map(str, samples["phase"].unique()))
    fig = Figure(figsize=(8, 1.0 + 2.2 * max(1, len(devices))))
    axes = fig.subplots(max(1, len(devices)), 1, squeeze=False, sharex=True)[:, 0]
    for ax, device in zip(axes, devices):
        g = samples[samples["device_key"] == device]
        data = []
        for ph in phases:
            v = g.loc[g["phase"] == ph, "latency_ms"].to_numpy(dtype=float)
            if len(v) > MAX_BOX_POINTS:
                v = np.random.default_rng(seed).choice(v, MAX_BOX_POINTS, replace=False)
            data.append(v)
        ax.boxplot(data, showfliers=True, flierprops={"markersize": 2})
        ax.set_title(plot_label(device), fontsize=8)
        ax.set_ylabel("latency_ms", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[-1].set_xticks(range(1, len(phases) + 1), [plot_label(p) for p in phases], rotation=20, fontsize=8)
    return _svg(fig, "boxes")


def _table(headers: list[str], rows: list[list[str]], over_cells: set[tuple[int, int]] = frozenset()) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for r, row in enumerate(rows):
        tds = []
        for c, text in enumerate(row):
            cls = ["cell"] if "\n" in text else []
            if (r, c) in over_cells:
                cls.append("over")
            attr = f' class="{" ".join(cls)}"' if cls else ""
            tds.append(f"<td{attr}>" + "<br>".join(esc(line) for line in str(text).split("\n")) + "</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def to_html(report: Report, samples: pd.DataFrame, max_defects: int = 200) -> str:
    """The whole page.  ``samples`` comes from ``samples_frame``."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',  # a constant, not data
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>cancelbench report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>cancelbench report</h1>",
        f'<p id="verdict" class="verdict-{esc(report.verdict)}">{esc(headline(report))}</p>',
        "<p>Datasets: " + ", ".join(f"<code>{esc(d)}</code>" for d in report.dirs) + "</p>",
    ]
    over_keys = {(c.row_key, c.device) for c in report.over}
    for i, s in enumerate(sections(report, max_defects)):
        over_cells: set[tuple[int, int]] = set()
        if s.title.startswith("Cross-platform"):
            for r, row in enumerate(s.rows):
                for c in range(4, len(row)):
                    if (tuple(row[:4]), s.headers[c]) in over_keys:
                        over_cells.add((r, c))
        parts.append(f'<section id="section-{i}"><h2>{esc(s.title)}</h2>')
        if s.note:
            parts.append(f"<p>{esc(s.note)}</p>")
        parts.append(_table(s.headers, s.rows, over_cells) if s.rows else "<p>(none)</p>")
        parts.append("</section>")
    if len(samples):
        bl = stats.percentile_label(report.spec.bound_percentile)
        figures = [
            ("plot-ecdf", f"Latency ECDF per device (bound {report.spec.bound.default_ms:g} ms on {bl})",
             plot_ecdf(samples, report.spec.bound.default_ms)),
            ("plot-scatter", "Latency vs cancel offset, coloured by phase at receipt", plot_scatter(samples)),
            ("plot-boxes", "Latency per phase, per device", plot_boxes(samples)),
        ]
        for fid, caption, svg in figures:
            parts.append(f'<figure id="{fid}"><figcaption>{esc(caption)}</figcaption>{svg}</figure>')
    else:
        parts.append("<p>No latency samples to plot.</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
