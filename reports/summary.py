"""The end-of-sweep summary: one row per device x workload x mechanism x delivery.

All phases are pooled (the cross-platform table of ``cancelbench report``
splits them by phase at receipt). Same aggregation and minimum counts as the
report, so the numbers agree with it.
"""

from __future__ import annotations

from pathlib import Path

from . import load_defects
from .format import Section, fmt_ms, render_terminal_table
from .load import TABLE_COLUMNS, Filters, load_frame
from .tables import ReportSpec, aggregate_cells

ALL_PHASES = "*"


def summary_section(dirs: list[str | Path], spec: ReportSpec = ReportSpec()) -> Section:
    frame = load_frame(dirs, TABLE_COLUMNS, Filters()).frame
    frame["phase"] = ALL_PHASES
    cells = sorted(aggregate_cells(frame, spec), key=lambda c: (c.device, c.workload, c.mechanism, c.delivery))
    mins = spec.min_counts()
    rows = []
    for c in cells:
        pcts = [fmt_ms(v) if v is not None else f"insufficient (<{mins[k]})" for k, v in c.percentiles.items()]
        rows.append([c.device, c.workload, c.mechanism, c.delivery, f"{c.n}/{c.n_trials}", *pcts,
                     fmt_ms(c.max_ms), str(c.dropped), f"{c.cost_ratio_p50:.3f}" if c.cost_ratio_p50 is not None else "-"])
    headers = ["device", "workload", "mechanism", "delivery", "n", *(f"{k} ms" for k in mins), "max ms", "dropped",
               "cost ratio"]
    note = ("latency_ms = cancel received on the agent -> engine terminal, all phases pooled; nearest-rank "
            f"percentiles need {', '.join(f'{k} n>={v}' for k, v in mins.items())}; cost ratio = median latency / "
            "uncancelled run")
    return Section("Summary", note, headers, rows)


def summary_text(dirs: list[str | Path]) -> str:
    s = summary_section(dirs)
    lines = [f"== {s.title} ==", s.note, *render_terminal_table(s)]
    defects = load_defects(dirs, Filters())
    if len(defects):
        lines.append(f"DEFECTS: {len(defects)} dropped/lost trial(s); see `cancelbench report`")
    return "\n".join(lines) + "\n"
