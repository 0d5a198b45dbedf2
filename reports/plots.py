"""The report's comparison plots, rendered by matplotlib to SVG strings.

* ECDF of latency per mechanism, small multiples per device (rows: workload),
  shared log x-axis, the bound as a line; every mechanism line carries an id
  ``ecdf-w<i>-d<j>-m<k>`` so a test can count lines per panel.
* Dot plot: p50 and p99 (or max) per device x mechanism with seeded
  bootstrap intervals.
* Latency vs cancel offset coloured by mechanism, the reference run's phase
  bands shaded behind.
* Speech engines: per-phase uninterruptible share per mechanism.

Text stays text (``svg.fonttype = 'none'``): a reader can search the page for
a device or mechanism and screen readers read the labels.  matplotlib
escapes text it writes into SVG; ``plot_label`` keeps data from being parsed
as mathtext.  Large inputs are sampled (ECDFs evenly in rank from sorted
arrays, scatter points at random with a fixed seed).
"""

from __future__ import annotations

import io
import json
import re
import warnings

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator

from cancelbench.schema import reference_run

from . import stats

MAX_ECDF_POINTS = 200  # per line: evenly in rank (every half percent), the step shape survives
MAX_SCATTER_POINTS = 6000  # per page
MAX_PANEL_COLUMNS = 4
MAX_PANEL_ROWS = 6
MAX_OFFSET_PANELS = 6  # every panel costs a fixed share of the page's render time
MAX_DOT_ROWS = 48
N_BOOT = 1000


def plot_label(text: object) -> str:
    """A data string made inert for matplotlib (no mathtext, no newlines)."""
    return re.sub(r"[\x00-\x1f\x7f]", "?", str(text)).replace("$", r"\$")


def svg_text(fig: Figure, name: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name, "text.usetex": False,
                                "font.family": "sans-serif"}):
        # No bbox_inches="tight": it draws the figure twice; margins are set in inches (``margins``) instead.
        with warnings.catch_warnings():
            # The SVG keeps text as text (svg.fonttype none): the browser draws CJK and emoji names with
            # its own fonts; matplotlib's font only measures them, so its missing-glyph warnings are noise.
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from (current )?font")
            fig.savefig(buf, format="svg", dpi=100, metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: invalid inside HTML


def even_sample(sorted_values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """At most k points of an ECDF, evenly spaced in rank (keeps its shape)."""
    n = len(sorted_values)
    idx = np.unique(np.linspace(0, n - 1, min(n, k)).round().astype(int))
    return sorted_values[idx], (idx + 1) / n


def samples_frame(table: pa.Table) -> pd.DataFrame:
    """Latency samples of a prepared Arrow table (outcome cancelled, latency
    present), built in Arrow so a million rows cost little.  ``residue_ms`` =
    how long the native call in flight at receipt ran on (latency - settle),
    null when no call was in flight.  Label columns become categoricals with
    their categories in name order (plots follow it)."""
    t = table.filter(pc.and_(pc.equal(table["outcome"].cast(pa.string()), "cancelled"),
                             pc.is_valid(table["latency_ms"])))
    in_call = pc.and_(pc.is_valid(t["native_call_at_receipt"]), pc.is_valid(t["settle_ms"]))
    labels = {c: t[c] for c in ("workload", "device_key", "mechanism", "phase")}
    labels["engine"] = pc.fill_null(t["engine"].cast(pa.string()), "")
    out = pa.table({
        **{c: v if pa.types.is_dictionary(v.type) else pc.dictionary_encode(v) for c, v in labels.items()},
        "latency_ms": t["latency_ms"], "offset_actual_ms": t["offset_actual_ms"],
        "residue_ms": pc.if_else(in_call, pc.subtract(t["latency_ms"], t["settle_ms"]), pa.scalar(None, pa.float64())),
    }).to_pandas()
    for col in labels:
        s = out[col].cat.remove_unused_categories()
        out[col] = s.cat.reorder_categories(sorted(s.cat.categories))
    return out


def mechanism_colors(samples: pd.DataFrame) -> dict[str, str]:
    """One colour per mechanism, the same in every plot."""
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    return {m: palette[i % len(palette)] for i, m in enumerate(samples["mechanism"].cat.categories)}


def _panels(samples: pd.DataFrame) -> tuple[list[str], list[str]]:
    workloads = list(samples["workload"].cat.categories)[:MAX_PANEL_ROWS]
    devices = list(samples["device_key"].cat.categories)[:MAX_PANEL_COLUMNS]
    return workloads, devices


def margins(fig: Figure, left: float = 0.7, bottom: float = 0.55, top: float = 0.5, right: float = 0.2,
            hspace: float = 0.45, wspace: float = 0.25) -> None:
    """Figure margins in inches (fixed room for tick labels, titles and the legend)."""
    w, h = fig.get_figwidth(), fig.get_figheight()
    fig.subplots_adjust(left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h, hspace=hspace,
                        wspace=wspace)


# Figures are drawn at the page's width (the HTML scales them to it): at 1400 px a reader
# compares mechanisms in these plots first; few panels get taller rows, not a narrow strip.
PAGE_WIDTH_IN = 13.0


def _grid(n_rows: int, n_cols: int, height: float, **kw):
    row = height * {1: 1.45, 2: 1.2}.get(n_cols, 1.0)
    fig = Figure(figsize=(PAGE_WIDTH_IN, row * n_rows + 1.0))
    return fig, fig.subplots(n_rows, n_cols, squeeze=False, **kw)


def _groups(samples: pd.DataFrame, keys: list[str]) -> dict[tuple, np.ndarray]:
    """Row positions per key combination (categorical, observed only)."""
    return {tuple(map(str, k if isinstance(k, tuple) else (k,))): v
            for k, v in samples.groupby(keys, observed=True, sort=True).indices.items()}


def plot_ecdf(samples: pd.DataFrame, spec) -> str:
    workloads, devices = _panels(samples)
    colors = mechanism_colors(samples)
    lat = samples["latency_ms"].to_numpy()
    groups = _groups(samples, ["workload", "device_key", "mechanism"])
    fig, axes = _grid(len(workloads), len(devices), 2.6, sharex=True, sharey=True)
    positive = lat[lat > 0]
    for wi, w in enumerate(workloads):
        for di, d in enumerate(devices):
            ax = axes[wi][di]
            for mi, m in enumerate(colors):
                idx = groups.get((w, d, m))
                if idx is None:
                    continue
                x, y = even_sample(np.sort(lat[idx]), MAX_ECDF_POINTS)
                line, = ax.step(np.maximum(x, positive.min() if len(positive) else 1e-3), y, where="post",
                                color=colors[m], label=plot_label(m))
                line.set_gid(f"ecdf-w{wi}-d{di}-m{mi}")
            ax.axvline(spec.bound.for_cell(w, "*"), color="#555", linestyle="--", linewidth=1)
            ax.set_title(plot_label(f"{d} · {w}"), fontsize=9)
            ax.grid(True, alpha=0.3)
            if di == 0:
                ax.set_ylabel("fraction <= x", fontsize=8)
            if wi == len(workloads) - 1:
                ax.set_xlabel("latency_ms (log)", fontsize=8)
    axes[0][0].set_xscale("log")
    axes[0][0].xaxis.set_minor_locator(NullLocator())  # shared axes: no minor ticks anywhere (size, speed)
    axes[0][0].yaxis.set_major_locator(FixedLocator([0.0, 0.25, 0.5, 0.75, 1.0]))
    handles = [axes[0][0].plot([], [], color=c, label=plot_label(m))[0] for m, c in colors.items()]
    handles.append(axes[0][0].plot([], [], color="#555", linestyle="--", label="bound")[0])
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    margins(fig)
    return svg_text(fig, "ecdf")


def _interval(sorted_values: np.ndarray, p: float, rng: np.random.Generator) -> tuple[float, float, float]:
    """Nearest-rank p-th percentile and its 95% bootstrap interval."""
    boot = np.sort(stats.bootstrap_percentiles(sorted_values, p, N_BOOT, rng))
    return stats.nearest_rank(sorted_values, p), stats.nearest_rank(boot, 0.025), stats.nearest_rank(boot, 0.975)


def plot_dots(samples: pd.DataFrame, spec, seed: int = 0) -> str:
    colors = mechanism_colors(samples)
    lat = samples["latency_ms"].to_numpy()
    groups = list(_groups(samples, ["workload", "device_key", "mechanism"]).items())[:MAX_DOT_ROWS]
    need = stats.min_samples(spec.bound_percentile, spec.confidence)
    bl = stats.percentile_label(spec.bound_percentile)
    labels = [plot_label(f"{d} · {m} · {w}") for (w, d, m), _ in groups]
    left = 0.3 + 0.062 * max((len(t) for t in labels), default=10)  # ~inches of 8 pt text
    fig = Figure(figsize=(max(PAGE_WIDTH_IN, 6.5 + left), 1.0 + 0.3 * max(1, len(groups))))
    ax = fig.add_subplot()
    margins(fig, left=left, top=0.15, bottom=0.6)
    rng = np.random.default_rng(seed)
    for row, ((w, d, m), idx) in enumerate(groups):
        x = np.sort(lat[idx])
        high_p = spec.bound_percentile if len(x) >= need else 1.0
        for p, marker in ((0.5, "o"), (high_p, "D")):
            v, lo, hi = _interval(x, p, rng)
            ax.errorbar([v], [row], xerr=[[v - lo], [hi - v]], fmt=marker, color=colors[m], capsize=2,
                        markersize=5, markerfacecolor="white" if marker == "D" else colors[m])
    ax.set_yticks(range(len(groups)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"latency_ms (log): ● p50, ◇ {bl} (max where n < {need}); bars: 95% bootstrap interval", fontsize=8)
    ax.axvline(spec.bound.default_ms, color="#555", linestyle="--", linewidth=1)
    ax.grid(True, axis="x", alpha=0.3)
    return svg_text(fig, "dots")


def reference_runs(refs: pd.DataFrame) -> dict[tuple[str, str], tuple[str, pd.Series]]:
    """Per (workload, device): (mechanism, its reference run), the run the planner
    resolved that mechanism's offsets on (``schema.reference_run``). A panel pools
    mechanisms, so it shades the first mechanism's (by name) and says which."""
    out: dict = {}
    if refs is None or refs.empty:
        return out
    for (w, d, m), g in refs.groupby(["workload", "device_key", "mechanism"], sort=True):
        if (str(w), str(d)) in out:
            continue
        rows = g[g["phase_timeline_json"].notna()].to_dict("records")
        run = reference_run([{**r, "outcome": "completed"} for r in rows])  # load_references keeps completed only
        if run is not None:
            out[(str(w), str(d))] = (str(m), pd.Series(run))
    return out


def phase_bands(ref: pd.Series) -> list[tuple[str, float, float]]:
    """(phase, start, end) in ms from hand-back (the cancel offset's origin)."""
    try:
        timeline = json.loads(ref["phase_timeline_json"])
        shift = (float(ref["t_start_ns"]) - float(ref["t_handback_ns"])) / 1e6
        if not np.isfinite(shift):
            shift = 0.0
        return [(str(p), float(a) + shift, float(b) + shift) for p, a, b in timeline]
    except (TypeError, ValueError, KeyError):
        return []  # a malformed timeline draws no bands; the points still plot


def offset_panels(samples: pd.DataFrame) -> list[tuple[str, str]]:
    """The (workload, device) pairs with samples, in name order, at most MAX_OFFSET_PANELS."""
    return list(_groups(samples, ["workload", "device_key"]))[:MAX_OFFSET_PANELS]


def plot_offsets(samples: pd.DataFrame, refs: pd.DataFrame, seed: int = 0) -> str:
    """Latency vs cancel offset per (workload, device) panel, coloured by
    mechanism, the reference run's phases shaded behind."""
    colors = mechanism_colors(samples)
    if len(samples) > MAX_SCATTER_POINTS:
        keep = np.sort(np.random.default_rng(seed).choice(len(samples), MAX_SCATTER_POINTS, replace=False))
        samples = samples.iloc[keep]
    pairs = offset_panels(samples)
    groups = _groups(samples, ["workload", "device_key", "mechanism"])
    off, lat = samples["offset_actual_ms"].to_numpy(), samples["latency_ms"].to_numpy()
    references = reference_runs(refs)
    cols = min(3, len(pairs))
    fig, axes = _grid((len(pairs) + cols - 1) // cols, cols, 2.8, sharey=True)
    for ax in axes.flat[len(pairs):]:
        ax.set_visible(False)
    shades = ["#f2f2f2", "#dde6f0"]
    for i, (ax, (w, d)) in enumerate(zip(axes.flat, pairs)):
        ref_mech, ref = references.get((w, d), (None, None))
        for k, (phase, a, b) in enumerate(phase_bands(ref) if ref is not None else []):
            ax.axvspan(a, b, color=shades[k % 2], zorder=0)
            ax.text((a + b) / 2, 1.0, plot_label(phase), transform=ax.get_xaxis_transform(), ha="center",
                    va="bottom", fontsize=7, color="#444", clip_on=False)
        for m in colors:
            idx = groups.get((w, d, m))
            if idx is not None:
                ax.scatter(off[idx], lat[idx], s=5, alpha=0.7, color=colors[m], rasterized=len(off) > 1500,
                           zorder=2)  # many points: one embedded PNG per panel, not a vector marker each
        ax.set_title(plot_label(f"{d} · {w}" + (f" (phases: {ref_mech} reference run)" if ref_mech else "")),
                     fontsize=9, pad=12)
        ax.grid(True, alpha=0.3)
        ax.locator_params(axis="x", nbins=5)
        if i % cols == 0:
            ax.set_ylabel("latency_ms", fontsize=8)
        ax.set_xlabel("cancel offset from hand-back, ms", fontsize=8)
    handles = [axes[0][0].scatter([], [], s=12, color=c, label=plot_label(m)) for m, c in colors.items()]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    margins(fig, top=0.65, hspace=0.6, wspace=0.3)
    return svg_text(fig, "offsets")


def uninterruptible_shares(samples: pd.DataFrame, refs: pd.DataFrame) -> pd.DataFrame:
    """Per speech (workload, device, phase, mechanism): the mean residue of
    cancels received inside a native call over half the phase's reference
    duration, capped at 1.  A cancel at a uniform point of a phase that
    nothing interrupts waits half the phase on average (share 1); one that
    stops at the next graph node waits ~0."""
    from cancelbench.device_agents.engines.registry import SPEECH_ENGINES  # what their declarations say

    sp = samples[samples["engine"].isin(SPEECH_ENGINES) & samples["residue_ms"].notna()]
    if sp.empty or refs is None or refs.empty:
        return pd.DataFrame(columns=["workload", "device_key", "phase", "mechanism", "share", "n", "order"])
    durations: dict[tuple, list[float]] = {}
    order: dict[str, int] = {}  # phases in run order (the durations' key order)
    for r in refs[refs["phase_durations_json"].notna()].itertuples():
        try:
            phases = json.loads(r.phase_durations_json)
        except ValueError:
            continue
        for k, (phase, ms) in enumerate(phases.items() if isinstance(phases, dict) else ()):
            order.setdefault(str(phase), k)
            durations.setdefault((str(r.workload), str(r.device_key), str(r.mechanism), str(phase)), []).append(ms)
    rows = []
    for (w, d, ph, m), g in sp.groupby(["workload", "device_key", "phase", "mechanism"], observed=True, sort=True):
        ref = durations.get((str(w), str(d), str(m), str(ph)))
        if ref and float(np.median(ref)) > 0:
            share = min(1.0, float(g["residue_ms"].mean()) / (float(np.median(ref)) / 2))
            rows.append((str(w), str(d), str(ph), str(m), share, len(g), order.get(str(ph), 99)))
    return pd.DataFrame(rows, columns=["workload", "device_key", "phase", "mechanism", "share", "n", "order"])


MAX_BAR_PANELS = 4


def plot_uninterruptible(shares: pd.DataFrame, colors: dict[str, str]) -> str:
    panels = list(shares.groupby(["workload", "device_key"], sort=True))[:MAX_BAR_PANELS]
    cols = min(len(panels), 4)
    fig, axes = _grid((len(panels) + cols - 1) // cols, cols, 2.8, sharey=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, ((w, d), g) in zip(axes.flat, panels):
        phases = list(g.sort_values(["order", "phase"])["phase"].drop_duplicates())
        mechs = [m for m in colors if m in set(g["mechanism"])]
        width = 0.8 / max(1, len(mechs))
        for k, m in enumerate(mechs):
            sub = g[g["mechanism"] == m].set_index("phase")["share"]
            ax.bar([i + k * width for i in range(len(phases))], [sub.get(p, np.nan) for p in phases], width,
                   color=colors[m], label=plot_label(m))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(phases))], [plot_label(p) for p in phases],
                      fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_title(plot_label(f"{d} · {w}"), fontsize=9)
        ax.set_ylabel("uninterruptible share", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    handles = [axes[0][0].bar([0], [0], width=0, color=c, label=plot_label(m)) for m, c in colors.items()]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    margins(fig, hspace=0.5)
    return svg_text(fig, "uninterruptible")


MAX_DIFF_PANELS = 24


def plot_diff_ecdfs(cells: list, samples: dict, bound_of) -> str:
    """Baseline (grey) and candidate ECDFs overlaid, one panel per changed
    cell; lines carry ids ``diff-base-<i>`` / ``diff-cand-<i>``."""
    shown = [c for c in cells if c.key in samples][:MAX_DIFF_PANELS]
    cols = min(3, len(shown))
    fig, axes = _grid((len(shown) + cols - 1) // cols, cols, 2.6)
    for ax in axes.flat[len(shown):]:
        ax.set_visible(False)
    for i, (ax, c) in enumerate(zip(axes.flat, shown)):
        colour = "#d62728" if c.verdict == "regressed" else "#2ca02c"
        for side, values, style in (("base", samples[c.key][0], dict(color="#888", linestyle="--")),
                                    ("cand", samples[c.key][1], dict(color=colour))):
            if values is not None and len(values):
                x, y = even_sample(values, MAX_ECDF_POINTS)
                line, = ax.step(np.maximum(x, 1e-3), y, where="post", label="baseline" if side == "base"
                                else "candidate", **style)
                line.set_gid(f"diff-{side}-{i}")
        ax.axvline(bound_of(c), color="#555", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_title(plot_label(f"{c.verdict}: {c.workload} · {c.phase} · {c.mechanism} · {c.delivery}\n")
                     + plot_label(c.device_class), fontsize=8)
        ax.set_xlabel("latency_ms (log)", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    margins(fig, top=0.55, hspace=0.8, wspace=0.3)
    return svg_text(fig, "diff")
