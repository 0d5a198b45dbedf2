"""Self-contained HTML pages: the report (verdict, mechanism comparison,
comparison plots, then the detail tables) and the diff (table plus baseline
vs candidate ECDFs of every changed cell).

* Offline: no scripts, no external resources; a Content-Security-Policy
  forbids every fetch, so a stray reference would fail loudly (console error)
  in the browser test instead of silently phoning home.
* Every string from the data goes through ``html.escape`` (its control characters
  escaped first, ``cancelbench.textsafe.term_safe``); plots keep their
  text as SVG text, which matplotlib escapes (see ``plots.py``).
"""

from __future__ import annotations

import html

import pandas as pd

from cancelbench.textsafe import term_safe

from . import plots, stats
from .sections import NA, OVER, Section, headline, sections
from .tables import Report

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'none'"

CSS = """
body{font-family:system-ui,sans-serif;margin:1em 1.5em;color:#111;max-width:1500px}
h1{font-size:18px;margin:0 0 .3em}h2{font-size:16px;margin:1.2em 0 .3em}
#verdict{font-size:17px;font-weight:600;margin:.2em 0 .4em}
.meta,.note{color:#555;font-size:12px;margin:.2em 0 .4em}
table{border-collapse:collapse;margin:.2em 0 1em}
th,td{border-bottom:1px solid #ddd;padding:.15em .55em;font-size:13px;text-align:left;white-space:nowrap}
th{background:#f3f3f3;font-weight:600}
th.grp{text-align:center;border-left:2px solid #bbb}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;font-family:ui-monospace,monospace}
td.g0,th.g0{border-left:2px solid #bbb}
.na{color:#aaa}
td.over{background:#fde2e2}.mark{color:#b00}
.verdict-ok{color:#060}.verdict-over_bound{color:#a60}.verdict-defects{color:#b00}
figure{margin:.8em 0}
figcaption{font-weight:600;margin-bottom:.3em}
td.wrap{white-space:normal;overflow-wrap:anywhere;min-width:8em;max-width:40em}
td.wrap .tok{white-space:nowrap}
svg{max-width:100%;height:auto}
figure svg{width:100%}
"""


def esc(text: object) -> str:
    """Data as HTML text: its control characters escaped first (an engine's version may carry ESC,
    BEL, NUL: not characters an HTML document may hold), then HTML's syntax."""
    return html.escape(term_safe(text), quote=True)


MAX_UNBROKEN = 64  # characters of one word kept on one line in a wrapping column
# Columns of free text (trial id lists, reasons, errors): they wrap, so no table scrolls sideways.
WRAP_HEADERS = frozenset({"worst trials", "worst candidate trials", "why", "error", "value", "cell", "device class",
                          "sweep"})


def _td(text: str, number: bool, first_of_group: bool, wrap: bool = False) -> str:
    cls = [c for c, on in (("num", number), ("g0", first_of_group), ("over", OVER in text), ("wrap", wrap))
           if on]
    body = esc(text)
    if text == NA:
        body = f'<span class="na" title="too few samples">{esc(NA)}</span>'
    elif OVER in text:
        body = body.replace(esc(OVER), f'<span class="mark" title="over the bound">{esc(OVER)}</span>')
    elif wrap:  # lines break between words (trial ids), not at a hyphen inside one; very long words still may
        body = " ".join(f'<span class="tok">{esc(w)}</span>' if len(w) <= MAX_UNBROKEN else esc(w)
                        for w in text.split(" "))
    return f'<td class="{" ".join(cls)}">{body}</td>' if cls else f"<td>{body}</td>"


def table_html(s: Section) -> str:
    keys = len(s.headers) if s.key_columns is None else s.key_columns
    starts = set()
    col = keys
    for _, span in s.groups:
        starts.add(col)
        col += span
    if s.groups:
        head = "".join(f'<th rowspan="2">{esc(h)}</th>' for h in s.headers[:keys])
        head += "".join(f'<th class="grp" colspan="{span}">{esc(label)}</th>' for label, span in s.groups)
        leaf = "".join(f'<th class="num{" g0" if i in starts else ""}">{esc(h)}</th>'
                       for i, h in enumerate(s.headers) if i >= keys)
        thead = f"<tr>{head}</tr><tr>{leaf}</tr>"
    else:
        thead = "<tr>" + "".join(f'<th{" class=num" if i >= keys else ""}>{esc(h)}</th>'
                                 for i, h in enumerate(s.headers)) + "</tr>"
    wrap = {i for i, h in enumerate(s.headers) if h in WRAP_HEADERS}
    body = "".join("<tr>" + "".join(_td(str(t), i >= keys, i in starts, i in wrap) for i, t in enumerate(row))
                   + "</tr>" for row in s.rows)
    return f'<table id="table-{esc(s.sid)}"><thead>{thead}</thead><tbody>{body}</tbody></table>'


def section_html(s: Section) -> str:
    parts = [f'<section id="section-{esc(s.sid)}"><h2>{esc(s.title)}</h2>']
    if s.note:
        parts.append(f'<p class="note">{esc(s.note)}</p>')
    parts.append(table_html(s) if s.rows else "<p>(none)</p>")
    return "".join(parts) + "</section>"


def page(title: str, body: list[str]) -> str:
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',  # a constant, not data
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>",
        f"<style>{CSS}</style></head><body>", *body, "</body></html>"]) + "\n"


def figure(fid: str, caption: str, svg: str) -> str:
    return f'<figure id="{esc(fid)}"><figcaption>{esc(caption)}</figcaption>{svg}</figure>'


def _cap(shown: int, total: int, what: str) -> str:
    """A caption's note when a plot shows only part of the data (never silently)."""
    return f" (first {shown} of {total} {what}; the tables have all)" if total > shown else ""


def report_figures(report: Report, samples: pd.DataFrame, refs: pd.DataFrame | None) -> list[str]:
    if samples is None or not len(samples):
        return ["<p>No latency samples to plot.</p>"]
    spec = report.spec
    bl = stats.percentile_label(spec.bound_percentile)
    n_w, n_d = samples["workload"].nunique(), samples["device_key"].nunique()
    n_rows = len(samples.groupby(["workload", "device_key", "mechanism"], observed=True).size())
    n_pairs = len(samples.groupby(["workload", "device_key"], observed=True).size())
    out = [
        figure("plot-ecdf", f"Latency ECDF per mechanism, one panel per device (rows: workload; dashed: the "
               f"{spec.bound.default_ms:g} ms bound)" + _cap(min(n_d, plots.MAX_PANEL_COLUMNS), n_d, "devices")
               + _cap(min(n_w, plots.MAX_PANEL_ROWS), n_w, "workloads"), plots.plot_ecdf(samples, spec)),
        figure("plot-dots", f"p50 and {bl} (or max) per device and mechanism, 95% bootstrap intervals"
               + _cap(min(n_rows, plots.MAX_DOT_ROWS), n_rows, "rows"), plots.plot_dots(samples, spec)),
        figure("plot-offsets", "Latency vs cancel offset, coloured by mechanism; shaded: the reference run's phases"
               + _cap(min(n_pairs, plots.MAX_OFFSET_PANELS), n_pairs, "workload x device panels"),
               plots.plot_offsets(samples, refs)),
    ]
    shares = plots.uninterruptible_shares(samples, refs)
    if len(shares):
        n_bars = len(shares.groupby(["workload", "device_key"]).size())
        out.append(figure("plot-uninterruptible", "Speech: uninterruptible share per phase and mechanism (mean "
                          "residue of the native call in flight / half the phase's reference duration; 1 = the "
                          "cancel waits the phase out)" + _cap(min(n_bars, plots.MAX_BAR_PANELS), n_bars,
                                                               "workload x device panels"),
                          plots.plot_uninterruptible(shares, plots.mechanism_colors(samples))))
    return out


def bargein_first(report: Report, rest: list) -> list[str]:
    """A barge-in sweep's section and its picture open the page (taken out of ``rest``)."""
    from .bargein import plot_bargein

    cells = report.bargein[0]
    if not cells:
        return []
    first = [s for s in rest if s.sid.startswith("bargein")]
    rest[:] = [s for s in rest if not s.sid.startswith("bargein")]
    shown = f" (first 24 of {len(cells)})" if len(cells) > 24 else ""
    return [section_html(first[0]), figure("plot-bargein", f"Barge-in: median hops from the user's first word to "
                                           f"silence{shown}", plot_bargein(cells)), *map(section_html, first[1:])]


def to_html(report: Report, samples: pd.DataFrame, refs: pd.DataFrame | None = None, max_defects: int = 200) -> str:
    """The report page.  ``samples`` comes from ``load.load_plot_samples``,
    ``refs`` (phase bands, phase durations) from ``load.load_references``."""
    secs = sections(report, max_defects)
    compare = [s for s in secs if s.sid.startswith("compare-")]
    rest = [s for s in secs if not s.sid.startswith("compare-")]
    body = [
        "<h1>cancelbench report</h1>",
        f'<p id="verdict" class="verdict-{esc(report.verdict)}">{esc(headline(report))}</p>',
        '<p class="meta">Datasets: ' + ", ".join(f"<code>{esc(d)}</code>" for d in report.dirs) + "</p>",
        *bargein_first(report, rest),
        *(section_html(s) for s in compare),
        *report_figures(report, samples, refs),
        *(section_html(s) for s in rest),
    ]
    return page("cancelbench report", body)


def diff_to_html(result) -> str:
    """The diff page: verdict, the cell table, then baseline vs candidate ECDFs of every changed cell."""
    from .diff_render import class_notes, diff_headline, diff_section

    body = [
        "<h1>cancelbench diff</h1>",
        f'<p id="verdict" class="verdict-{"defects" if result.exit_code else "ok"}">{esc(diff_headline(result))}</p>',
        f'<p class="meta">baseline: {esc(", ".join(result.baseline))}; candidate: {esc(", ".join(result.candidate))}'
        "</p>", *(f'<p class="meta">{esc(n)}</p>' for n in class_notes(result)),
    ]
    if result.samples:
        n = len(result.samples)
        cap = f" (first {plots.MAX_DIFF_PANELS} of {n})" if n > plots.MAX_DIFF_PANELS else ""
        bound = result.spec.bound
        body.append(figure("plot-diff", f"Changed cells{cap}: baseline (grey, dashed) vs candidate ECDF; dotted: "
                           "the bound", plots.plot_diff_ecdfs(result.cells, result.samples,
                                                              lambda c: bound.for_cell(c.workload, c.phase))))
    else:
        body.append("<p>No cell changed: nothing to overlay.</p>")
    body.append(section_html(diff_section(result)))
    body += [section_html(s) for s in getattr(result, "legend", [])]
    return page("cancelbench diff", body)
