"""Rendering ``cancelbench trend``: the table, the sweeps, terminal / Markdown /
JSON / HTML (one small line plot per cell), and the command's arguments."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from cancelbench.sink import DatasetError

from . import stats
from .format import MARKDOWN_LIMIT, jsonable, markdown_document, md_safe, render_terminal_table, term_safe
from .sections import NA, Section
from .trend import MAX_TREND_PANELS, SweepInfo, TrendCell, TrendResult, TrendSpec, run_trend

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
            f"sweep: two-sided Mann-Whitney U on the raw latencies by {result.mwu}, Holm-corrected over "
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


def noise_section(result: TrendResult) -> Section:
    """Each sweep's host facts (reports/noise.py) and what differed from the sweep before it."""
    rows = []
    for s, check in zip(result.sweeps, result.noise):
        facts = check.sides[1] if check is not None else (result.noise[1].sides[0] if len(result.noise) > 1 else None)
        if facts is None:
            continue
        show = lambda v, f: "–" if v is None else f(v)  # noqa: E731
        rows.append([sweep_label(s), str(facts.n), show(facts.wait_share, lambda v: f"{v:.0%}"),
                     show(facts.load_1m, lambda v: f"{v:.2f}"), show(facts.procs_running, lambda v: f"{v:g}"),
                     show(facts.steal, lambda v: f"{v:.2f}"), _flagged(check)])
    return Section("Host noise", "per sweep, over its trials with cpu columns: the engine thread's CPU-wait share, "
                   "median load average and runnable tasks, stolen CPUs; NOISY: noisier than the sweep before "
                   "(which facts; the JSON's noise has the values)",
                   ["sweep", "n", "wait share", "load", "runnable", "steal", "vs previous"], rows,
                   key_columns=1, sid="noise")


def _flagged(check) -> str:
    """Short: NOISY and the facts (the headline and the JSON say by how much)."""
    if check is None or not check.flagged:
        return ""
    facts = sorted({why.split(" ")[0] for _, why in check.reasons})
    return f"NOISY {' and '.join(check.noisy)}: {', '.join(facts)}"


def verdict_word(result: TrendResult) -> str:
    check = result.newest_noise
    if check is not None and check.refused:
        return f"REFUSED: NOISY {' and '.join(check.noisy)}"
    word = "REGRESSED" if result.regressed or result.invalid else "OK"
    return f"{word}, NOISY {' and '.join(check.noisy)}" if check is not None and check.flagged else word


def trend_headline(result: TrendResult) -> str:
    flagged = [c for c in result.cells if c.first_flag is not None]
    at = sorted({c.first_flag for c in flagged})
    where = ", ".join(sweep_label(result.sweeps[i]) for i in at)
    check = result.newest_noise
    return (f"verdict: {verdict_word(result)} (exit {result.exit_code}) - "
            + (f"newest vs previous: {check.line()} - " if check is not None and check.flagged else "")
            + f"{len(result.sweeps)} "
            f"sweeps, {len(result.cells)} cells; {len(flagged)} cell(s) with a flagged change"
            + (f" (first at {where})" if where else "") + f"; newest vs previous: {len(result.regressed)} regressed")


def trend_to_terminal(result: TrendResult) -> str:
    out = ["cancelbench trend", term_safe(trend_headline(result))]
    for s in (trend_section(result), noise_section(result), sweeps_section(result)):
        out += ["", f"== {term_safe(s.title)} ==", term_safe(s.note)]
        out += render_terminal_table(s) if s.rows else ["(none)"]
    for c in result.regressed:
        out.append(term_safe(f"REGRESSED {c.device_class} {cell_label(c)}: {'; '.join(c.newest_reasons)}"))
    return "\n".join(out) + "\n"


def trend_to_markdown(result: TrendResult, limit: int = MARKDOWN_LIMIT) -> str:
    head = [f"## cancelbench trend: {verdict_word(result)}", "", md_safe(trend_headline(result))]
    if result.regressed:
        head += [""] + [f"- {md_safe(f'{c.device_class} {cell_label(c)}: ' + '; '.join(c.newest_reasons))}"
                        for c in result.regressed]
    return markdown_document(head, [trend_section(result), noise_section(result), sweeps_section(result)],
                             ["sweeps", "noise", "trend"], limit)


def trend_dict(result: TrendResult) -> dict:
    return jsonable({
        "verdict": "regressed" if result.regressed or result.invalid else "ok",
        "noise": [c.to_dict() if c is not None else None for c in result.noise],
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
    body += [section_html(trend_section(result)), section_html(noise_section(result)), section_html(sweeps_section(result))]
    return page("cancelbench trend", body)


# ------------------------------------------------------------------------ cli --
def add_trend_parser(subparsers) -> argparse.ArgumentParser:
    from .cli import _add_bootstrap, _add_common, _positive, add_noise_options, fraction, percentile

    p = subparsers.add_parser(
        "trend", help="one cell's latency across many sweeps (ordered by build, version, date or a column)",
        description="Latency of every cell across sweeps, with the first significant change per cell. Exit 1 "
                    "when the newest sweep regressed against the previous one, 0 otherwise, 2 on bad input, 3 when "
                    "--refuse-noisy refuses a noisy newest pair.")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="sweep result directories or globs (at least two sweeps)")
    p.add_argument("--by", default="created", metavar="KEY",
                   help="order sweeps by: created (default), given (command-line order), llama_cpp_build, "
                        "cancelbench_version or any record column (its most common value per sweep)")
    p.add_argument("--format", choices=("terminal", "markdown", "json", "html"), default="terminal",
                   help="what goes to stdout (default terminal)")
    p.add_argument("--markdown", metavar="PATH", help="also write the Markdown here")
    p.add_argument("--json", metavar="PATH", help="also write the JSON here")
    p.add_argument("--html", metavar="PATH", help="also write the HTML page (one plot per cell) here")
    p.add_argument("--percentile", type=percentile, default=0.99, metavar="PCT",
                   help="the bound percentile shown beside the p50 (default 99)")
    p.add_argument("--alpha", type=fraction, default=0.05, metavar="A", help="family-wise alpha, Holm-corrected (default 0.05)")
    p.add_argument("--threshold", type=_positive, default=0.10, metavar="FRACTION",
                   help="p50 change that counts when significant, as a fraction of the smaller side, either "
                        "way (default 0.10: x1.1 up or down)")
    _add_bootstrap(p, 2000, "for the intervals ")
    add_noise_options(p)
    _add_common(p)
    p.set_defaults(func=run_trend_cmd)
    return p


TREND_FILES = ("markdown", "json", "html")


def run_trend_cmd(args: argparse.Namespace) -> int:
    from cancelbench.outputs import check_outputs

    from .cli import (_bootstrap, _bound_spec, _fail, _filters, check_bound_targets, noise_spec, output_options,
                      refuse_line, write_renders)
    from .github import append_step_summary
    from .trend import expand_dirs

    try:
        dirs = expand_dirs(args.dirs, warn=lambda line: print(f"cancelbench trend: warning: {line}", file=sys.stderr))
        outputs = check_outputs(output_options(args, TREND_FILES), inputs=dirs)
        spec = TrendSpec(by=args.by, percentile=args.percentile, alpha=args.alpha, rel_threshold=args.threshold,
                         confidence=args.confidence, n_boot=_bootstrap(args), seed=args.seed, bound=_bound_spec(args),
                         noise=noise_spec(args))
        result = run_trend(dirs, spec, _filters(args))
        check_bound_targets(spec.bound, result.cells)
        renders = {"terminal": trend_to_terminal, "markdown": trend_to_markdown, "json": trend_to_json,
                   "html": trend_to_html}
        write_renders(outputs, lambda form: renders[form](result))
        sys.stdout.write(renders[args.format](result))
        append_step_summary(lambda limit: trend_to_markdown(result, limit), "trend")
    except (DatasetError, ValueError, OSError) as exc:
        return _fail("trend", exc)
    refuse_line("trend", result.newest_noise)
    return result.exit_code
