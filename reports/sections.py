"""What a report says, as renderer-neutral sections: the verdict, then one
compact mechanism-comparison table per workload (rows mechanism x delivery,
one column group per device: p50 / p99-or-max / dropped), then defects, cells
over the bound, the per-phase table, hops and devices.

Cells are plain strings; the renderers (``format.py``, ``html.py``) escape
them for their medium and style three markers: ``NA`` (too few samples,
explained once in the note), ``OVER`` (over the latency bound, with a legend)
and ``MAX_MARK`` (the max shown where the bound percentile has too few
samples).
"""

from __future__ import annotations


from . import stats
from .bargein import bargein_sections
from .residue import residue_section
from .section import Section
from .tables import HOPS, INVALID, CellStats, Report
from .targeting import targeting_section

# The report's verdict (Report.verdict) as a person reads it, in every format.
VERDICT_WORDS = {"ok": "PASS", "over_bound": "WARN", "defects": "FAIL"}

NA = "–"  # en dash: muted in HTML, explained in the section note
OVER = "▲"
MAX_MARK = "ᵐ"




def fmt_ms(value: float | None) -> str:
    return NA if value is None else f"{value:.2f}"


def _high(c: CellStats, spec) -> tuple[float | None, bool]:
    """The bound percentile when the cell has enough samples, else its max
    (second value True)."""
    need = stats.min_samples(spec.bound_percentile, spec.confidence)
    if c.n >= need:
        return c.bound_stat_ms, False
    return c.max_ms, c.n > 0


def _group_columns(cells: list[CellStats | None], spec, over: list[bool], with_n: bool,
                   mark_max: bool) -> tuple[list[str], set]:
    """Strings of one row's device groups and the markers they use."""
    used: set[str] = set()
    out: list[str] = []
    for c, is_over in zip(cells, over):
        if c is None:
            out += [""] * (4 if with_n else 3)
            continue
        value, is_max = _high(c, spec)
        high = fmt_ms(value) + (MAX_MARK if is_max and mark_max else "") + (f" {OVER}" if is_over else "")
        p50 = fmt_ms(c.percentiles.get("p50"))
        used |= {m for m, hit in ((NA, NA in (p50, high)), (OVER, is_over), (MAX_MARK, MAX_MARK in high)) if hit}
        dropped = str(c.dropped) + (f" +{c.lost} lost" if c.lost else "")
        out += ([str(c.n)] if with_n else []) + [p50, high, dropped]
    return out, used


def _legend(spec, used: set, pooled: bool) -> str:
    bl = stats.percentile_label(spec.bound_percentile)
    mins = spec.min_counts()
    parts = ["latency_ms in ms (cancel received on the agent -> engine stopped), nearest rank"
             + (", all phases pooled" if pooled else "")]
    if NA in used:
        need = {"p50": mins.get("p50", stats.min_samples(0.5, spec.confidence)),
                bl: stats.min_samples(spec.bound_percentile, spec.confidence)}
        parts.append(f"{NA} too few samples ({', '.join(f'{k} needs n >= {v}' for k, v in need.items())} "
                     f"at {spec.confidence:g} confidence)")
    if MAX_MARK in used:
        parts.append(f"{MAX_MARK} the max, shown where the {bl} has too few samples")
    if OVER in used:
        parts.append(f"{OVER} over the latency bound ({bound_text(spec)})"
                     + (" in at least one phase" if pooled else ""))
    return "; ".join(parts)


def bound_text(spec) -> str:
    overrides = ", ".join(f"{w or '*'}:{p or '*'} {ms:g} ms" for w, p, ms in spec.bound.overrides)
    return (f"{spec.bound.default_ms:g} ms on the {stats.percentile_label(spec.bound_percentile)}"
            + (f"; {overrides}" if overrides else ""))


def _device_table(title: str, note_pooled: bool, keys: list[str], rows_by_key: dict[tuple, dict[str, CellStats]],
                  devices: list[str], spec, over_of, with_n: bool, sid: str) -> Section:
    """Rows = keys, one column group per device (shared by the comparison and
    per-phase tables).  The high column is headed by the bound percentile
    when every cell has enough samples for it, "max" when none has, and marks
    the maxima when the table mixes both."""
    present = [c for row in rows_by_key.values() for c in row.values() if c.n]
    kinds = {_high(c, spec)[1] for c in present}
    bl = stats.percentile_label(spec.bound_percentile)
    high = {frozenset({True}): "max"}.get(frozenset(kinds), bl if len(kinds) < 2 else f"{bl}/max{MAX_MARK}")
    built, used = [], set()
    for key in sorted(rows_by_key):
        cells = [rows_by_key[key].get(d) for d in devices]
        values, u = _group_columns(cells, spec, [c is not None and over_of(c) for c in cells], with_n, len(kinds) > 1)
        used |= u
        built.append([*key, *values])
    leaf = (["n"] if with_n else []) + ["p50", high, "dropped"]
    return Section(title, _legend(spec, used, note_pooled), keys + leaf * len(devices), built,
                   key_columns=len(keys), groups=[(d, len(leaf)) for d in devices], sid=sid)


def comparison_sections(report: Report) -> list[Section]:
    """One table per workload: rows mechanism x delivery, all phases pooled."""
    over = report.over_pooled()
    devices = report.devices_in_cells()
    by_workload: dict[str, dict[tuple, dict[str, CellStats]]] = {}
    for c in report.pooled:
        by_workload.setdefault(c.workload, {}).setdefault((c.mechanism, c.delivery), {})[c.device] = c
    return [_device_table(f"Mechanism comparison: {w}", True, ["mechanism", "delivery"], rows, devices,
                          report.spec, lambda c: (c.workload, c.mechanism, c.delivery, c.device) in over, False,
                          f"compare-{i}")
            for i, (w, rows) in enumerate(sorted(by_workload.items()))]


def _no_samples(cells: dict[str, CellStats]) -> bool:
    """A row with no latency sample and nothing wrong on any device: only dashes to show."""
    return all(c.n == 0 and not c.dropped and not c.lost for c in cells.values())


def detail_section(report: Report) -> Section:
    """Rows without a latency sample anywhere (cancels that never met a running engine, phase
    ``(none)``: the engine had finished) are folded into one line of the note, not listed per
    mechanism and delivery; a row with dropped or lost trials always stays."""
    rows: dict[tuple, dict[str, CellStats]] = {}
    for c in report.cells:
        rows.setdefault(c.row_key, {})[c.device] = c
    folded = {k: v for k, v in rows.items() if _no_samples(v)}
    kept = {k: v for k, v in rows.items() if k not in folded}
    s = _device_table("Per phase at receipt", False, ["workload", "phase", "mechanism", "delivery"], kept,
                      report.devices_in_cells(), report.spec, lambda c: c.over, True, "phases")
    if folded:
        cells = [c for v in folded.values() for c in v.values()]
        phases = sorted({k[1] for k in folded})
        outcomes = {name: sum(getattr(c, name) for c in cells) for name in ("completed", "errors")}
        what = ", ".join(f"{v} {k}" for k, v in outcomes.items() if v) or "no outcome counted"
        n_rows, n_trials = len(folded), sum(c.n_trials for c in cells)
        s.note += (f"; not listed: {n_rows} row{'s' if n_rows != 1 else ''} without a latency sample (phase "
                   f"{', '.join(phases)}: {n_trials} trial{'s' if n_trials != 1 else ''}, {what}; the engine "
                   "finished before the cancel arrived)")
    return s


def _defect_counts(report: Report) -> tuple[int, int, int]:
    """(dropped, lost, invalid) records among the defects."""
    d = report.defects
    return tuple(int((d["outcome"] == k).sum()) if len(d) else 0 for k in ("dropped", "lost", INVALID))


def verdict_line(report: Report) -> str:
    d = report.defects
    n_dropped, n_lost, n_invalid = _defect_counts(report)
    word = VERDICT_WORDS[report.verdict]
    said = f"{n_dropped} dropped cancel(s), {n_lost} lost trial(s)" + (
        f", {n_invalid} invalid record(s) (see Defects)" if n_invalid else "")
    what = [said if len(d) else "no dropped cancels or lost trials", *report.sweep_failures,
            f"{len(report.over)} cell(s) over the bound" if report.over else "every cell within the bound"]
    return f"{word}: {'; '.join(what)} ({bound_text(report.spec)}); exit {report.exit_code}"


def headline(report: Report) -> str:
    line = f"{verdict_line(report)} - {report.n_records} cancel records from {len(report.dirs)} dataset(s)"
    if report.repeats:
        line += f" ({'; '.join(report.repeats)})"
    missed = sum(1 for t in report.targeting if t.missed)
    if missed:
        line += f" - {missed} cell(s) missed their target phase (see Targeting)"
    return line + (f" - {simulation_note(report)}" if report.simulated else "")


def simulation_note(report: Report) -> str:
    """Said wherever a report with simulated rows is shown (the headline carries it)."""
    return (f"SIMULATED engine(s) {', '.join(report.simulated)}: their rows wait instead of compute "
            "(scale and harness measurements, not engine latency)")


def defects_section(report: Report, max_defects: int) -> Section:
    d = report.defects
    n_dropped, n_lost, n_invalid = _defect_counts(report)
    return Section(
        f"Defects: {n_dropped} dropped cancels, {n_lost} lost trials"
        + (f", {n_invalid} invalid records (not counted in the cells)" if n_invalid else ""),
        "" if len(d) <= max_defects else f"first {max_defects} of {len(d)} shown; the JSON output lists all",
        ["outcome", "trial id", "device", "workload", "phase", "mechanism", "delivery", "error"],
        [[r.outcome, r.trial_id, r.device, r.workload, r.phase, r.mechanism, r.delivery, r.error]
         for r in d.head(max_defects).itertuples()], sid="defects")


def over_section(report: Report) -> Section:
    bl = stats.percentile_label(report.spec.bound_percentile)
    return Section(
        f"Over the latency bound: {len(report.over)} cells",
        f"{bl} latency_ms (nearest rank, even below the minimum count) compared with the bound; worst trial ids first",
        ["device", "workload", "phase", "mechanism", "delivery", f"{bl} ms", "bound ms", "n over / n", "worst trials"],
        [[c.device, c.workload, c.phase, c.mechanism, c.delivery, fmt_ms(c.bound_stat_ms), f"{c.bound_ms:g}",
          f"{c.n_over}/{c.n}", " ".join(c.worst_trial_ids)] for c in report.over], sid="over")


def hops_section(report: Report) -> Section:
    return Section(
        "Hop decomposition (mean ms, share of end_to_end_ms)",
        "end_to_end = deliver (issue -> agent) + observe (agent -> native reader) + return (native call returns) "
        "+ settle (engine reaches terminal state)",
        ["device", "n", "end_to_end", "deliver", "observe", "return", "settle"],
        [[h.device, str(h.n), fmt_ms(h.end_to_end_mean_ms),
          *(f"{fmt_ms(h.means_ms[k])} ({h.share[k]:.0%})" if h.share[k] is not None else fmt_ms(h.means_ms[k])
            for k in HOPS)] for h in report.hops],
        key_columns=1, sid="hops")


def devices_section(report: Report) -> Section:
    return Section(
        "Devices", "device class = platform/arch/backend/device_name (what diff matches on)",
        ["device", "hostname", "device name", "platform", "arch", "device class"],
        [[i.device, i.hostname, i.device_name, i.platform, i.arch, i.device_class] for i in report.devices],
        sid="devices")


def builds_section(devices) -> Section:
    """Build and host facts per device (``DeviceInfo.build``), one row per fact: a narrow table."""
    return Section(
        "Builds", "what each device's agent loaded and ran on (what a trend groups by); an external engine's "
                  "rows: its own version and build facts (engine NAME: ...), not the agent's llama.cpp",
        ["device", "fact", "value"],
        [[i.device, k, v] for i in devices for k, v in getattr(i, "build", {}).items()], sid="builds")


def sections(report: Report, max_defects: int = 50) -> list[Section]:
    """Headline tables first: the comparison, then what failed, then detail."""

    return [*bargein_sections(*report.bargein), *comparison_sections(report), defects_section(report, max_defects),
            over_section(report),
            detail_section(report), *(r for r in [residue_section(report.residue)] if r),
            *(t for t in [targeting_section(report.targeting)] if t),
            hops_section(report), devices_section(report),
            *(b for b in [builds_section(report.devices)] if b.rows)]  # older datasets: no build facts
