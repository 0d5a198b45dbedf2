"""The Barge-in section (docs/bargein.md): first in a report of a barge-in sweep.

Per cell (device, workload, mechanism, detector, playback buffer): from the user's speech
onset to silence, p50/p90/p99 (each only with enough samples, stats.min_samples), and its
hops as medians, detect / deliver (issue + deliver) / engine stop (latency_ms) / playback
drain, what the user heard over their own voice, and the detector's misses and false
barge-ins. A second table splits the engine's stop by the phase the cancel reached
(a barge-in during code2wav is where mechanisms differ). Full-Duplex-Bench's published
figures are quoted as context, labelled as the different setup they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from . import stats
from .section import Section

COLUMNS = ["trial_kind", "outcome", "workload", "host", "backend", "device", "mechanism", "bargein_detector",
           "playback_buffer_ms", "bargein_clip", "t_onset_ns", "detector_fired", "false_barge_in",
           "onset_to_silence_ms", "detect_ms", "issue_ms", "deliver_ms", "latency_ms", "drain_ms",
           "audio_after_onset_ms", "detection_error_ms", "phase_at_receipt"]
KEYS = ["device", "workload", "mechanism", "bargein_detector", "playback_buffer_ms"]
HOPS = ("detect", "deliver", "engine stop", "drain")  # the stacked bar's segments, in order
PERCENTILES = (0.50, 0.90, 0.99)
# Context only: a different setup (cloud and research models end to end, stop detection that
# merges gaps of 0.5 s), published by Full-Duplex-Bench; never compared with a cell.
FDB_CONTEXT = ("Full-Duplex-Bench (cloud and research speech models, a different setup; its stop detection "
               "merges gaps of 0.5 s): response after a user interruption 0.26-2.5 s")
NA = "–"


@dataclass(frozen=True)
class BargeinCell:
    device: str
    workload: str
    mechanism: str
    detector: str
    buffer_ms: float
    n_onsets: int  # trials whose user started talking (speech clips with an onset)
    n_silenced: int  # of those, cancelled after the detector fired on the speech
    n_missed: int  # the detector never fired on the speech
    n_noise_only: int
    n_false: int  # fired on noise only, or before the speech
    onset_to_silence: dict  # "p50" -> ms (None: too few samples)
    hops_p50: dict  # HOPS -> median ms
    heard_p50: float | None  # audio after onset, ms
    heard_p90: float | None
    detection_error_p50: float | None


@dataclass(frozen=True)
class PhaseStop:
    device: str
    workload: str
    mechanism: str
    phase: str
    n: int
    stop_p50: float | None
    stop_max: float | None


def _pct(values: np.ndarray, p: float, confidence: float) -> float | None:
    return stats.nearest_rank(np.sort(values), p) if len(values) >= stats.min_samples(p, confidence) else None


def _median(values: np.ndarray) -> float | None:
    return stats.percentile(values[~np.isnan(values)], 0.5)


def bargein_of(table: pa.Table, confidence: float = stats.DEFAULT_CONFIDENCE) -> tuple[list, list]:
    """(cells, per-phase engine stops) of the barge-in trials among ``table``'s rows."""
    if "bargein_detector" not in table.column_names or table.num_rows == 0:
        return [], []
    df = table.to_pandas()
    df = df[(df["trial_kind"] == "cancel") & df["bargein_detector"].notna()]
    if not len(df):
        return [], []
    df["device"] = df["host"].astype(str) + "/" + df["device"].astype(str)
    cells, phases = [], []
    for key, g in df.groupby(KEYS, observed=True, sort=True):
        speech = g[g["t_onset_ns"].notna()]
        noise = g[g["bargein_clip"].astype(str).str.startswith("noise-only")]
        silenced = speech[(speech["outcome"] == "cancelled") & speech["detector_fired"].astype(bool)
                          & ~speech["false_barge_in"].fillna(False).astype(bool)]
        f = lambda c: silenced[c].to_numpy(dtype=float)  # noqa: E731
        total = f("onset_to_silence_ms")
        total = total[~np.isnan(total)]
        hops = {"detect": _median(f("detect_ms")), "deliver": _median(f("issue_ms") + f("deliver_ms")),
                "engine stop": _median(f("latency_ms")), "drain": _median(f("drain_ms"))}
        heard = speech["audio_after_onset_ms"].to_numpy(dtype=float)
        heard = np.sort(heard[~np.isnan(heard)])
        cells.append(BargeinCell(
            *key[:4], float(key[4]), n_onsets=len(speech), n_silenced=len(silenced),
            n_missed=int((~speech["detector_fired"].fillna(False).astype(bool)).sum()),
            n_noise_only=len(noise), n_false=int(g["false_barge_in"].fillna(False).astype(bool).sum()),
            onset_to_silence={stats.percentile_label(p): _pct(total, p, confidence) for p in PERCENTILES},
            hops_p50=hops, heard_p50=_pct(heard, 0.5, confidence), heard_p90=_pct(heard, 0.9, confidence),
            detection_error_p50=_median(f("detection_error_ms"))))
        for phase, h in silenced.groupby("phase_at_receipt", observed=True, sort=True):
            stop = np.sort(h["latency_ms"].to_numpy(dtype=float))
            phases.append(PhaseStop(key[0], key[1], key[2], str(phase), len(stop), _pct(stop, 0.5, confidence),
                                    float(stop[-1]) if len(stop) else None))
    return cells, phases


def _ms(v: float | None) -> str:
    return NA if v is None else f"{v:.1f}"


def bargein_sections(cells: list[BargeinCell], phases: list[PhaseStop]) -> list[Section]:
    """The section (and its per-phase table); nothing for a sweep without barge-in trials."""
    if not cells:
        return []
    pl = [stats.percentile_label(p) for p in PERCENTILES]
    main = Section(
        "Barge-in: from the user's first word to silence (ms)",
        "onset = the user's speech starts (ground truth, the clip's labelled sample); silence = the engine has "
        "stopped and the playback device has played its last sample. Hops are medians of the silenced trials: "
        "detect (onset -> detector fired) + deliver (-> cancel received) + engine stop (-> terminal) + drain "
        f"(-> silence); heard = audio played over the user's voice. {NA}: too few samples for the percentile. "
        f"Context, not a comparison: {FDB_CONTEXT}.",
        ["device", "workload", "mechanism", "detector", "buffer ms", "n", *pl, *HOPS, "heard p50", "heard p90",
         "missed", "false / noise-only"],
        [[c.device, c.workload, c.mechanism, c.detector, f"{c.buffer_ms:g}", f"{c.n_silenced}/{c.n_onsets}",
          *(_ms(c.onset_to_silence[k]) for k in pl), *(_ms(c.hops_p50[h]) for h in HOPS), _ms(c.heard_p50),
          _ms(c.heard_p90), str(c.n_missed), f"{c.n_false} / {c.n_noise_only}"] for c in cells],
        key_columns=5, sid="bargein")
    by_phase = Section(
        "Barge-in: the engine's stop by the phase the cancel reached (ms)",
        "cancel received -> engine stopped (latency_ms) of the silenced trials, per phase at receipt: a mechanism "
        "that cannot stop inside a native call waits out a code2wav window",
        ["device", "workload", "mechanism", "phase", "n", "p50", "max"],
        [[p.device, p.workload, p.mechanism, p.phase, str(p.n), _ms(p.stop_p50), _ms(p.stop_max)] for p in phases],
        key_columns=4, sid="bargein-phases")
    return [main, by_phase]


HOP_COLORS = {"detect": "#4c72b0", "deliver": "#dd8452", "engine stop": "#c44e52", "drain": "#8172b3"}


def plot_bargein(cells: list[BargeinCell]) -> str:
    """Stacked horizontal bars, one per cell: the median hops from onset to silence (SVG)."""
    from matplotlib.figure import Figure

    from .plots import margins, plot_label, svg_text

    shown = cells[:24]
    fig = Figure(figsize=(8.0, 0.9 + 0.32 * len(shown)))
    ax = fig.add_subplot(1, 1, 1)
    labels = [plot_label(f"{c.workload} · {c.mechanism} · {c.buffer_ms:g} ms buffer · {c.device}") for c in shown]
    left = np.zeros(len(shown))
    for hop in HOPS:
        widths = np.array([c.hops_p50[hop] or 0.0 for c in shown])
        ax.barh(range(len(shown)), widths, left=left, color=HOP_COLORS[hop], label=hop, height=0.6)
        left += widths
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the user's first word (medians of the silenced trials)")
    ax.legend(fontsize=7, ncols=4, loc="lower right")
    margins(fig, left=3.6)
    return svg_text(fig, "bargein")
