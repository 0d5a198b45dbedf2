"""``cancelbench trend DIR [DIR...]``: one cell's latency across many sweeps.

Sweeps are ordered by ``--by``: ``created`` (the manifest's creation time),
``given`` (the order on the command line), or any record column, e.g.
``llama_cpp_build``, ``cancelbench_version``, ``llama_cpp_commit`` or a
settings column (the sweep's most common value; strings in natural order, so
``b10`` follows ``b9``).  Ties keep the command-line order.

Cells match across sweeps exactly as ``diff`` matches them (``diff._cells_by_class``:
workload, phase, mechanism, delivery, device class).  Per cell and sweep the
table shows n, the p50 and the bound percentile with 95% bootstrap intervals
(the exact order-statistic bootstrap of ``stats.bootstrap_percentiles``,
seeded per cell and sweep); each percentile only where n reaches its minimum
count (``stats.min_samples``: 5 for the p50, 299 for a p99 at 95%), and a step
is tested only where both sides have their p50.

Change between consecutive sweeps: a two-sided Mann-Whitney U test on the raw
latencies (scipy's when installed, else the exact null distribution without
ties / the tie-corrected normal approximation here), Holm-corrected over every
test the trend makes (all cells x all consecutive pairs) at ``alpha`` (default
0.05).  A change is *flagged* when it is significant after correction and the
p50 moved by more than ``--threshold`` (default 10%): a statistically certain
1% shift is noise in practice.  Per cell, the first flagged sweep is named.

Exit 1 when the newest sweep regressed against the one before it, in any
cell: ``diff``'s verdict for that pair (new dropped/lost trials, newly over the
bound, a significant percentile increase) or a flagged p50 increase at the
last step.  Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from cancelbench.sink import DatasetError, read_manifest

from . import stats
from .diff import DiffSpec, _cells_by_class, _cell_seed, _one_sided, compare_cell
from .format import MARKDOWN_LIMIT, jsonable, markdown_document, md_safe, render_terminal_table, term_safe
from .load import TABLE_COLUMNS, Filters, load_frame, scan_table
from .sections import NA, Section, fmt_ms
from .tables import BoundSpec, ReportSpec

SPECIAL_KEYS = ("created", "given")
MAX_TREND_PANELS = 36


class TrendInputError(DatasetError):
    pass


@dataclass(frozen=True)
class TrendSpec:
    by: str = "created"
    percentile: float = 0.99
    alpha: float = 0.05
    rel_threshold: float = 0.10
    confidence: float = stats.DEFAULT_CONFIDENCE
    n_boot: int = 2000
    seed: int = 0
    bound: BoundSpec = BoundSpec()

    def diff_spec(self) -> DiffSpec:
        return DiffSpec(percentile=self.percentile, rel_threshold=self.rel_threshold, confidence=self.confidence,
                        n_boot=max(self.n_boot, 100), seed=self.seed, bound=self.bound)

    def report_spec(self) -> ReportSpec:
        return self.diff_spec().report_spec()


@dataclass
class SweepInfo:
    index: int
    path: str
    key: str  # the --by value, as text
    created: str
    sweep_id: str
    builds: dict[str, dict[str, str]] = field(default_factory=dict)  # device class -> build facts


@dataclass
class TrendPoint:
    n: int
    p50: float | None
    p50_ci: tuple[float, float] | None
    high: float | None  # the bound percentile; None below its minimum count
    high_ci: tuple[float, float] | None
    dropped: int
    lost: int
    over: bool


@dataclass
class Step:
    """The change from sweep ``index - 1`` to sweep ``index``."""

    index: int
    p_value: float
    p_holm: float = 1.0
    rel_change: float | None = None  # of the p50
    flagged: bool = False

    @property
    def direction(self) -> str:
        return "up" if (self.rel_change or 0.0) > 0 else "down"


@dataclass
class TrendCell:
    workload: str
    phase: str
    mechanism: str
    delivery: str
    device_class: str
    points: list[TrendPoint | None]
    steps: list[Step | None]  # steps[i] compares sweep i-1 with sweep i; steps[0] is None
    first_flag: int | None = None
    newest_verdict: str = ""  # diff's verdict, newest vs previous sweep
    newest_reasons: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.workload, self.phase, self.mechanism, self.delivery, self.device_class)

    @property
    def regressed(self) -> bool:
        return self.newest_verdict == "regressed"


@dataclass
class TrendResult:
    spec: TrendSpec
    sweeps: list[SweepInfo]
    cells: list[TrendCell]
    n_tests: int
    mwu: str  # which Mann-Whitney implementation ran
    samples: dict[tuple, list[np.ndarray | None]] = field(default_factory=dict, repr=False)

    @property
    def regressed(self) -> list[TrendCell]:
        return [c for c in self.cells if c.regressed]

    @property
    def exit_code(self) -> int:
        return 1 if self.regressed else 0


# ----------------------------------------------------------------- statistics --
def _ranks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average ranks (1-based) and the tie group sizes."""
    order = np.argsort(values, kind="mergesort")
    sorted_v = values[order]
    ranks = np.empty(len(values))
    _, start, counts = np.unique(sorted_v, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return ranks, counts


def _exact_u_cdf_counts(m: int, n: int) -> list[int]:
    """Counts of arrangements per U value (0..m*n): coefficients of the Gaussian binomial
    [m+n choose m]_q, built as prod_i (1 - q^(n+i)) / (1 - q^i), truncated at degree m*n (exact)."""
    deg = m * n
    a = [1] + [0] * deg
    for i in range(1, m + 1):
        j = n + i
        for k in range(deg, j - 1, -1):
            a[k] -= a[k - j]
        for k in range(i, deg + 1):
            a[k] += a[k - i]
    return a


def mann_whitney_u(x, y) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test: (U of x, p-value).  Exact null distribution when there
    are no ties and m*n <= 10000, else the normal approximation with tie and continuity
    correction (as scipy's ``method="auto"`` chooses, with a larger exact range)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    m, n = len(x), len(y)
    if not m or not n:
        raise ValueError("both samples need values")
    ranks, ties = _ranks(np.concatenate([x, y]))
    u = float(ranks[:m].sum() - m * (m + 1) / 2.0)
    big_n = m + n
    if (ties == 1).all() and m * n <= 10_000:
        counts = _exact_u_cdf_counts(min(m, n), max(m, n))
        total = math.comb(big_n, m)
        k = int(round(u))
        low = sum(counts[: k + 1]) / total
        high = sum(counts[k:]) / total
        return u, min(1.0, 2.0 * min(low, high))
    mu = m * n / 2.0
    tie_term = float(((ties ** 3) - ties).sum()) / (big_n * (big_n - 1))
    sigma = math.sqrt(m * n / 12.0 * ((big_n + 1) - tie_term))
    if sigma == 0:
        return u, 1.0
    z = (abs(u - mu) - 0.5) / sigma
    return u, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0)))


def _mwu_impl():
    try:
        from scipy.stats import mannwhitneyu
    except ImportError:
        return mann_whitney_u, "cancelbench (exact without ties, else normal approximation)"

    def scipy_mwu(x, y):
        r = mannwhitneyu(x, y, alternative="two-sided", method="auto")
        return float(r.statistic), float(r.pvalue)

    return scipy_mwu, "scipy.stats.mannwhitneyu (method auto)"


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down, monotone, capped at 1)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def fold_change(rel_change: float | None) -> float:
    """A change as a fold, the same either way: +100% and -50% are both 2x."""
    if rel_change is None:
        return 1.0
    ratio = 1.0 + rel_change
    return math.inf if ratio <= 0 else max(ratio, 1.0 / ratio)


def _interval(sorted_values: np.ndarray, p: float, rng: np.random.Generator, n_boot: int,
              confidence: float) -> tuple[float, float]:
    reps = np.sort(stats.bootstrap_percentiles(sorted_values, p, n_boot, rng))
    a = (1.0 - confidence) / 2.0
    return stats.nearest_rank(reps, a), stats.nearest_rank(reps, 1.0 - a)


# ------------------------------------------------------------------ ordering --
def natural_key(text: str) -> tuple:
    """``b9`` < ``b10``; numbers compare as numbers inside strings."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text) if t)


def expand_dirs(patterns: list[str]) -> list[str]:
    """Directories and globs (quoted globs reach us unexpanded), each directory once, in the order given."""
    out: list[str] = []
    for pat in patterns:
        matches = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        if not matches:
            raise TrendInputError(f"{pat}: no directory matches")
        for m in matches:
            if m not in out:
                out.append(m)
    return out


def _sweep_key(path: str, by: str, index: int) -> tuple[tuple, str]:
    """(sort key, the value as text) of one sweep."""
    if by == "given":
        return (index,), str(index + 1)
    if by == "created":
        created = str(read_manifest(Path(path)).get("created") or "")
        try:
            return (datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z").timestamp(),), created
        except ValueError:
            return (float("inf"),), created or "(unknown)"
    table = scan_table([path], [by], Filters(trial_kinds=None))
    values = [v for v in table.column(by).to_pylist() if v is not None]
    if not values:
        raise TrendInputError(f"{path}: column {by!r} is null in every record (cannot order by it)")
    counts: dict = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    value = max(sorted(counts, key=str), key=lambda v: counts[v])  # most common; ties: smallest text
    if isinstance(value, (int, float)):
        return (0, float(value)), f"{value:g}" if isinstance(value, float) else str(value)
    return (1, natural_key(str(value))), str(value)


def _builds_by_class(path: str) -> dict[str, dict[str, str]]:
    from .legend import builds_by_class

    return builds_by_class([path])


# ---------------------------------------------------------------------- build --
def run_trend(dirs: list[str], spec: TrendSpec = TrendSpec(), filters: Filters = Filters()) -> TrendResult:
    from cancelbench.schema import COLUMNS

    dirs = expand_dirs(dirs)
    if len(dirs) < 2:
        raise TrendInputError(f"a trend needs at least two sweeps, got {len(dirs)}")
    if spec.by not in SPECIAL_KEYS and spec.by not in COLUMNS:
        raise TrendInputError(f"--by {spec.by!r}: not 'created', 'given' or a record column")
    keyed = sorted(((_sweep_key(d, spec.by, i), i, d) for i, d in enumerate(dirs)), key=lambda t: (t[0][0], t[1]))
    sweeps, sides = [], []
    rspec = spec.report_spec()
    for pos, ((_, text), _, d) in enumerate(keyed):
        manifest = read_manifest(Path(d))
        frame = load_frame([d], TABLE_COLUMNS, filters).frame
        sides.append(_cells_by_class(frame, rspec, {}))
        sweeps.append(SweepInfo(pos, d, text, str(manifest.get("created") or ""), str(manifest.get("sweep_id") or ""),
                                _builds_by_class(d)))
    mwu, mwu_name = _mwu_impl()
    bl = spec.percentile
    need_high = stats.min_samples(bl, spec.confidence)
    need_p50 = stats.min_samples(0.5, spec.confidence)  # as the report: no p50 from fewer samples
    keys = sorted(set().union(*sides))
    cells: list[TrendCell] = []
    samples: dict[tuple, list] = {}
    tests: list[tuple[TrendCell, Step]] = []
    for key in keys:
        points: list[TrendPoint | None] = []
        arrays: list[np.ndarray | None] = []
        for i, side in enumerate(sides):
            s = side.get(key)
            if s is None:
                points.append(None)
                arrays.append(None)
                continue
            lat, st = s.sorted_latency, s.stats
            rng = np.random.default_rng(_cell_seed(spec.seed, (*key, i)))
            p50 = stats.nearest_rank(lat, 0.5) if len(lat) >= need_p50 else None
            p50_ci = _interval(lat, 0.5, rng, spec.n_boot, 0.95) if p50 is not None else None
            high = stats.nearest_rank(lat, bl) if len(lat) >= need_high else None
            high_ci = _interval(lat, bl, rng, spec.n_boot, 0.95) if high is not None else None
            points.append(TrendPoint(len(lat), p50, p50_ci, high, high_ci, st.dropped, st.lost, st.over))
            arrays.append(lat)
        steps: list[Step | None] = [None]
        for i in range(1, len(sides)):
            a, b = arrays[i - 1], arrays[i]
            if points[i - 1] is None or points[i] is None or points[i - 1].p50 is None or points[i].p50 is None:
                steps.append(None)  # no test where a side has too few samples for its p50
                continue
            _, p = mwu(a, b)
            pa50, pb50 = points[i - 1].p50, points[i].p50
            rel = (pb50 - pa50) / pa50 if pa50 else (math.inf if pb50 > pa50 else 0.0)
            steps.append(Step(i, float(p), rel_change=rel))
        cell = TrendCell(*key, points=points, steps=steps)
        cells.append(cell)
        samples[key] = arrays
        tests += [(cell, s) for s in steps if s is not None]
    for (cell, step), adj in zip(tests, holm([s.p_value for _, s in tests])):
        step.p_holm = adj
        step.flagged = adj < spec.alpha and fold_change(step.rel_change) - 1.0 > spec.rel_threshold
    dspec = spec.diff_spec()
    for cell in cells:
        cell.first_flag = next((s.index for s in cell.steps if s is not None and s.flagged), None)
        prev, last = sides[-2].get(cell.key), sides[-1].get(cell.key)
        if last is None:
            continue
        verdict = (compare_cell(cell.key, prev, last, dspec, cell.device_class) if prev is not None
                   else _one_sided(cell.key, last, "new", cell.device_class, dspec))
        cell.newest_verdict, cell.newest_reasons = verdict.verdict, list(verdict.reasons)
        step = cell.steps[-1]
        if step is not None and step.flagged and step.direction == "up":
            cell.newest_reasons.append(f"p50 {fmt_ms(cell.points[-2].p50)} -> {fmt_ms(cell.points[-1].p50)} ms "
                                       f"({step.rel_change:+.0%}), Mann-Whitney p = {step.p_holm:.2g} (Holm)")
            cell.newest_verdict = "regressed"
    order = {True: 0, False: 1}
    cells.sort(key=lambda c: (order[c.regressed], c.first_flag is None, c.key))
    return TrendResult(spec, sweeps, cells, len(tests), mwu_name, samples)


# ------------------------------------------------------------------ rendering --
def _ci(value: float | None, ci: tuple[float, float] | None) -> str:
    if value is None:
        return NA
    return f"{value:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{value:.2f}"


def cell_label(c: TrendCell) -> str:
    return f"{c.workload} · {c.phase} · {c.mechanism} · {c.delivery}"


def sweep_label(s: SweepInfo) -> str:
    return f"#{s.index + 1} {s.key}"


def shown_cells(result: TrendResult) -> list[TrendCell]:
    """Cells with a latency sample, a dropped cancel or a lost trial in some sweep (a row of
    dashes in every sweep, e.g. phase ``(none)``, says nothing; the note counts them)."""
    return [c for c in result.cells if any(p is not None and (p.n or p.dropped or p.lost) for p in c.points)]


def tick_label(s: SweepInfo) -> tuple[str, str]:
    """A short x tick, two lines: the sweep number and its key (a creation time: the clock time only)."""
    key = s.key[11:19] if len(s.key) >= 19 and s.key[10:11] == "T" else s.key
    return f"#{s.index + 1}", key[:16]


def trend_section(result: TrendResult) -> Section:
    pl = stats.percentile_label(result.spec.percentile)
    rows = []
    shown = shown_cells(result)
    for c in shown:
        for i, (pt, step) in enumerate(zip(c.points, c.steps)):
            if pt is None:
                rows.append([cell_label(c), c.device_class, sweep_label(result.sweeps[i]), "0", NA, NA, "", "", ""])
                continue
            change = "" if step is None else f"{step.rel_change:+.0%}" if step.rel_change is not None else ""
            p = "" if step is None else f"{step.p_holm:.2g}"
            flag = ""
            if step is not None and step.flagged:
                flag = ("FIRST " if c.first_flag == i else "") + ("SLOWER" if step.direction == "up" else "faster")
            if i == len(c.points) - 1 and c.regressed:
                flag = (flag + " " if flag else "") + "REGRESSED (newest)"
            defects = f" (+{pt.dropped} dropped, {pt.lost} lost)" if pt.dropped or pt.lost else ""
            rows.append([cell_label(c), c.device_class, sweep_label(result.sweeps[i]), f"{pt.n}{defects}",
                         _ci(pt.p50, pt.p50_ci), _ci(pt.high, pt.high_ci), change, p, flag])
    spec = result.spec
    note = (f"per sweep: p50 and {pl} with 95% bootstrap intervals ({spec.n_boot} replicates, seed {spec.seed}; "
            f"p50 where n >= {stats.min_samples(0.5, spec.confidence)}, {pl} where n >= "
            f"{stats.min_samples(spec.percentile, spec.confidence)}); change vs the previous "
            f"sweep: two-sided Mann-Whitney U on the raw latencies ({result.mwu}), Holm-corrected over "
            f"{result.n_tests} tests, alpha {spec.alpha:g}; flagged when significant and the p50 moved by more "
            f"than x{1 + spec.rel_threshold:.3g} either way")
    hidden = len(result.cells) - len(shown)
    if hidden:
        note += f"; not listed: {hidden} cell(s) without a latency sample in any sweep"
    return Section("Cells across sweeps", note, ["cell", "device class", "sweep", "n", "p50 ms [95% CI]",
                                                 f"{pl} ms [95% CI]", "p50 change", "p (Holm)", "flag"],
                   rows, key_columns=3, sid="trend")


def sweeps_section(result: TrendResult) -> Section:
    rows = []
    for s in result.sweeps:
        rows.append([sweep_label(s), "", "dataset", s.path])
        if s.created:
            rows.append([sweep_label(s), "", "created", s.created])
        for cls, facts in sorted(s.builds.items()):
            rows += [[sweep_label(s), cls, k, v] for k, v in facts.items()]
    return Section("Sweeps and builds", f"ordered by {result.spec.by} (ties: the order given)",
                   ["sweep", "device class", "fact", "value"], rows, sid="sweeps")


def trend_headline(result: TrendResult) -> str:
    flagged = [c for c in result.cells if c.first_flag is not None]
    at = sorted({c.first_flag for c in flagged})
    where = ", ".join(sweep_label(result.sweeps[i]) for i in at)
    return (f"verdict: {'REGRESSED' if result.exit_code else 'OK'} (exit {result.exit_code}) - {len(result.sweeps)} "
            f"sweeps, {len(result.cells)} cells; {len(flagged)} cell(s) with a flagged change"
            + (f" (first at {where})" if where else "") + f"; newest vs previous: {len(result.regressed)} regressed")


def trend_to_terminal(result: TrendResult) -> str:
    out = ["cancelbench trend", term_safe(trend_headline(result))]
    for s in (trend_section(result), sweeps_section(result)):
        out += ["", f"== {term_safe(s.title)} ==", term_safe(s.note)]
        out += render_terminal_table(s) if s.rows else ["(none)"]
    for c in result.regressed:
        out.append(term_safe(f"REGRESSED {c.device_class} {cell_label(c)}: {'; '.join(c.newest_reasons)}"))
    return "\n".join(out) + "\n"


def trend_to_markdown(result: TrendResult, limit: int = MARKDOWN_LIMIT) -> str:
    head = [f"## cancelbench trend: {'REGRESSED' if result.exit_code else 'OK'}", "", md_safe(trend_headline(result))]
    if result.regressed:
        head += [""] + [f"- {md_safe(f'{c.device_class} {cell_label(c)}: ' + '; '.join(c.newest_reasons))}"
                        for c in result.regressed]
    return markdown_document(head, [trend_section(result), sweeps_section(result)], ["sweeps", "trend"], limit)


def trend_dict(result: TrendResult) -> dict:
    return jsonable({
        "verdict": "regressed" if result.exit_code else "ok",
        "exit_code": result.exit_code,
        "by": result.spec.by,
        "alpha": result.spec.alpha,
        "rel_threshold": result.spec.rel_threshold,
        "percentile": stats.percentile_label(result.spec.percentile),
        "correction": "holm",
        "n_tests": result.n_tests,
        "mann_whitney": result.mwu,
        "sweeps": [asdict(s) for s in result.sweeps],
        "cells": [{**{k: v for k, v in asdict(c).items() if k not in ("points", "steps")},
                   "points": [asdict(p) if p else None for p in c.points],
                   "steps": [asdict(s) if s else None for s in c.steps]} for c in result.cells],
    })


def trend_to_json(result: TrendResult) -> str:
    return json.dumps(trend_dict(result), indent=2, allow_nan=False) + "\n"


def plot_trend(result: TrendResult) -> str:
    """One small panel per cell: p50 and the bound percentile across sweeps with their 95%
    intervals as bands; a flagged step is a red marker at the later sweep.  Each panel's
    axes carry the gid ``trend-c<i>`` (i = the cell's row)."""
    from matplotlib.figure import Figure

    from .plots import PAGE_WIDTH_IN, margins, plot_label, svg_text

    shown = shown_cells(result)[:MAX_TREND_PANELS]
    cols = min(3, len(shown))
    rows = (len(shown) + cols - 1) // cols
    fig = Figure(figsize=(PAGE_WIDTH_IN, 2.7 * rows + 1.0))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(shown):]:
        ax.set_visible(False)
    x_labels = ["\n".join(plot_label(part) for part in tick_label(s)) for s in result.sweeps]
    bl = stats.percentile_label(result.spec.percentile)
    for i, (ax, c) in enumerate(zip(axes.flat, shown)):
        ax.set_gid(f"trend-c{i}")
        for attr, ci_attr, colour, name in (("p50", "p50_ci", "#1f77b4", "p50"),
                                             ("high", "high_ci", "#d62728", bl)):
            xs = [k for k, p in enumerate(c.points) if p is not None and getattr(p, attr) is not None]
            if not xs:
                continue
            ys = [getattr(c.points[k], attr) for k in xs]
            lo = [getattr(c.points[k], ci_attr)[0] for k in xs]
            hi = [getattr(c.points[k], ci_attr)[1] for k in xs]
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.18, linewidth=0)
            ax.plot(xs, ys, marker="o", markersize=3, color=colour, label=name)
        for step in c.steps:
            if step is not None and step.flagged:
                y = c.points[step.index].p50
                ax.plot([step.index], [y], marker="o", markersize=9, markerfacecolor="none", color="#b00",
                        markeredgewidth=2)
                ax.annotate("flagged", (step.index, y), textcoords="offset points", xytext=(6, 6), fontsize=7,
                            color="#b00")
        ax.set_xticks(range(len(x_labels)), x_labels, fontsize=7)
        ax.set_title(plot_label(cell_label(c)) + "\n" + plot_label(c.device_class), fontsize=8)
        ax.set_ylim(bottom=0)  # magnitudes stay honest: a 10% wiggle is not drawn as a cliff
        ax.set_ylabel("latency_ms", fontsize=8)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    margins(fig, top=0.6, bottom=0.9, hspace=1.1, wspace=0.3)
    return svg_text(fig, "trend")


def trend_to_html(result: TrendResult) -> str:
    from .html import esc, figure, page, section_html

    n = len(shown_cells(result))
    cap = f" (first {MAX_TREND_PANELS} of {n} cells; the table has all)" if n > MAX_TREND_PANELS else ""
    body = ["<h1>cancelbench trend</h1>",
            f'<p id="verdict" class="verdict-{"defects" if result.exit_code else "ok"}">{esc(trend_headline(result))}'
            "</p>"]
    body += [f'<p class="meta">REGRESSED {esc(c.device_class)} {esc(cell_label(c))}: {esc("; ".join(c.newest_reasons))}'
             "</p>" for c in result.regressed]
    if n:
        body.append(figure("plot-trend", f"p50 (blue) and {stats.percentile_label(result.spec.percentile)} (red) "
                           f"per sweep with 95% bootstrap bands; circled: a flagged change{cap}", plot_trend(result)))
    body += [section_html(trend_section(result)), section_html(sweeps_section(result))]
    return page("cancelbench trend", body)


# ------------------------------------------------------------------------ cli --
def add_trend_parser(subparsers) -> argparse.ArgumentParser:
    from .cli import _add_common, _fraction, _percent, _positive

    p = subparsers.add_parser(
        "trend", help="one cell's latency across many sweeps (ordered by build, version, date or a column)",
        description="Latency of every cell across sweeps, with the first significant change per cell. Exit 1 "
                    "when the newest sweep regressed against the previous one, 0 otherwise, 2 on bad input.")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="sweep result directories or globs (at least two sweeps)")
    p.add_argument("--by", default="created", metavar="KEY",
                   help="order sweeps by: created (default), given (command-line order), llama_cpp_build, "
                        "cancelbench_version or any record column (its most common value per sweep)")
    p.add_argument("--format", choices=("terminal", "markdown", "json", "html"), default="terminal",
                   help="what goes to stdout (default terminal)")
    p.add_argument("--markdown", metavar="PATH", help="also write the Markdown here")
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    p.add_argument("--html", metavar="PATH", help="also write the HTML page (one plot per cell) here")
    p.add_argument("--percentile", type=_percent, default=0.99, metavar="PCT",
                   help="the bound percentile shown beside the p50 (default 99)")
    p.add_argument("--alpha", type=_fraction, default=0.05, help="family-wise alpha, Holm-corrected (default 0.05)")
    p.add_argument("--threshold", type=_positive, default=0.10, metavar="FRACTION",
                   help="p50 change that counts when significant, as a fraction of the smaller side, either "
                        "way (default 0.10: x1.1 up or down)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates for the intervals (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    _add_common(p)
    p.set_defaults(func=run_trend_cmd)
    return p


def run_trend_cmd(args: argparse.Namespace) -> int:
    from .cli import _bound_spec, _fail, _filters, _write
    from .github import append_step_summary

    try:
        if args.bootstrap < 100:
            raise ValueError("--bootstrap must be at least 100")
        spec = TrendSpec(by=args.by, percentile=args.percentile, alpha=args.alpha, rel_threshold=args.threshold,
                         confidence=args.confidence, n_boot=args.bootstrap, seed=args.seed, bound=_bound_spec(args))
        result = run_trend(args.dirs, spec, _filters(args))
        renders = {"terminal": trend_to_terminal, "markdown": trend_to_markdown, "json": trend_to_json,
                   "html": trend_to_html}
        for path, form in ((args.markdown, "markdown"), (args.json, "json"), (args.html, "html")):
            if path:
                _write(path, renders[form](result))
        sys.stdout.write(renders[args.format](result))
        append_step_summary(lambda limit: trend_to_markdown(result, limit), "trend")
    except (DatasetError, ValueError, OSError) as exc:
        return _fail("trend", exc)
    return result.exit_code
