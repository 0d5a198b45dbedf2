"""The wall-clock residue of a cancelled trial, split: engine work vs CPU wait vs the rest.

The residue is ``latency_ms`` (t_terminal - t_received, the agent's monotonic clock). The
agent reads the *trial thread* (the thread that runs the engine's native calls and
reaches the terminal state) at the receipt and at the terminal state
(device_agents/cpu_account.py): its CPU time (``trial_cpu_ms``) and its schedstat run delay
(``trial_cpu_wait_ms``). Per trial, with W the residue::

    work = min(trial_cpu_ms, W)                 the trial thread on a CPU
    wait = min(trial_cpu_wait_ms, W - work)     the trial thread runnable, waiting for a CPU
    rest = W - work - wait                      neither: blocked (the GIL, a lock, a futex or
                                                barrier sleep, I/O) and the edge the reads miss

so ``work + wait + rest == W`` exactly, each term >= 0. One thread's time is on a CPU,
waiting for one, or blocked, so the three are what that thread did during the residue.
The caps matter only at the edges: a wait in progress at the receipt read is counted whole
by schedstat (its part before the receipt included); ``cpu_window_ms`` (the reads' span)
against ``latency_ms`` shows how much the reads miss.

Where the work went (graph_eval): its eval reader stamps the trial thread's CPU clock and where it
stood when it first saw the cancel (``trial_observe_cpu_ms``, ``native_seen_where``). A cancel seen
at a node's ask came where no node was polled (a graph's unsynced tail, or the engine's own work
between graphs such as building the next one): its work before the sight is that stretch, which
no node-level bound covers. The section counts those trials and shows the most work before a sight.

Limits: the trial thread is llama.cpp's calling thread, one of ``n_threads``; with more
than one, its work includes spinning at ggml's barrier for a peer (a preempted peer shows
as work here, and as wait in the process-wide ``engine_cpu_wait_ms``). External engines send
their trial thread's readings (protocol 1.3, ``trial_cpu_source = engine-reported``); a receipt a
native reader latched from the shared cancel word has no run-delay reading (no reader reads
schedstat), so its trial's wait is unknown: counted in the rest, and counted per cell
(``wait_unknown_n``) and in the section's note.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from . import stats
from .section import Section

COLUMNS = ["workload", "phase_at_receipt", "mechanism", "delivery", "host", "device", "outcome", "latency_ms",
           "trial_cpu_ms", "trial_cpu_wait_ms", "cpu_window_ms", "trial_observe_cpu_ms", "native_seen_where"]
KEYS = ["workload", "phase", "mechanism", "delivery", "device"]


def split(wall, work_raw, wait_raw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(work, wait, rest) per trial, additive to ``wall`` (NaN where a reading is missing)."""
    wall = np.asarray(wall, dtype=float)
    work = np.minimum(np.maximum(np.asarray(work_raw, dtype=float), 0.0), wall)
    wait = np.minimum(np.maximum(np.asarray(wait_raw, dtype=float), 0.0), wall - work)
    return work, wait, wall - work - wait


def split_frame(table: pa.Table, extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """The cancelled trials of ``table`` that have a split: key columns, wall, work, wait, rest and
    the reads' missed edge (``uncovered`` = latency_ms - cpu_window_ms), ms; ``extra`` columns as
    labels (null: ``(none)``)."""
    have = [c for c in [*COLUMNS, *extra] if c in table.column_names]
    if "trial_cpu_ms" not in have or table.num_rows == 0:
        return pd.DataFrame(columns=[*KEYS, *extra, "wall", "work", "wait", "rest", "wait_known", "uncovered",
                                     "before_seen", "unpolled"])
    t = table.select(have)
    keep = pc.and_(pc.fill_null(pc.equal(t.column("outcome").cast(pa.string()), "cancelled"), False),
                   pc.and_(pc.is_valid(t.column("trial_cpu_ms")), pc.is_finite(t.column("latency_ms"))))
    f = t.filter(pc.fill_null(keep, False)).to_pandas()
    label = lambda name: f[name].astype(object).where(f[name].notna(), "(none)").astype(str)  # noqa: E731
    work, wait, rest = split(f["latency_ms"], f["trial_cpu_ms"], f["trial_cpu_wait_ms"].fillna(0.0))
    return pd.DataFrame({
        "workload": label("workload"), "phase": label("phase_at_receipt"), "mechanism": label("mechanism"),
        "delivery": label("delivery"), "device": label("host") + "/" + label("device"),
        **{c: label(c) for c in extra},
        "wall": f["latency_ms"].astype(float), "work": work, "wait": wait, "rest": rest,
        "wait_known": f["trial_cpu_wait_ms"].notna(),
        "uncovered": f["latency_ms"].astype(float) - f["cpu_window_ms"].astype(float),
        # graph_eval: the engine work before its reader saw the cancel, and whether it came where no
        # node was polled (seen at the next node's ask: the engine's work between graphs)
        "before_seen": (f["trial_observe_cpu_ms"].astype(float) if "trial_observe_cpu_ms" in f
                        else pd.Series(np.nan, index=f.index)),
        "unpolled": (f["native_seen_where"] == "next_ask") if "native_seen_where" in f
        else pd.Series(False, index=f.index)})


@dataclass(frozen=True)
class ResidueCell:
    """One cell's split (its cancelled trials that have one)."""

    workload: str
    phase: str
    mechanism: str
    delivery: str
    device: str
    n: int
    wall_p50: float
    wall_max: float
    work_p50: float
    work_max: float
    wait_p50: float
    rest_p50: float
    work_share: float  # of the summed wall: sum(work) / sum(wall); the three shares add up to 1
    wait_share: float
    rest_share: float
    uncovered_max: float  # the most |latency_ms - cpu_window_ms| of its trials
    seen_n: int = 0  # trials whose eval reader (graph_eval) stamped where it saw the cancel
    unpolled_n: int = 0  # of them, seen at a node's ask: the cancel came where no node was polled
    before_seen_max: float | None = None  # the most engine work before the reader saw the cancel, ms
    wait_unknown_n: int = 0  # trials with no run-delay reading: their wait (if any) is in the rest


def summarize(group: pd.DataFrame) -> dict:
    """n, nearest-rank p50s and maxima, and the shares of the summed wall of one group of trials."""
    p50 = lambda col: stats.percentile(group[col].tolist(), 0.5)  # noqa: E731
    total = float(group["wall"].sum())
    share = lambda col: float(group[col].sum()) / total if total > 0 else 0.0  # noqa: E731
    return {"n": len(group), "wall_p50": p50("wall"), "wall_max": float(group["wall"].max()),
            "work_p50": p50("work"), "work_max": float(group["work"].max()), "wait_p50": p50("wait"),
            "rest_p50": p50("rest"), "work_share": share("work"), "wait_share": share("wait"),
            "rest_share": share("rest"), "uncovered_max": float(group["uncovered"].abs().max()),
            "seen_n": int(group["before_seen"].notna().sum()), "wait_unknown_n": int((~group["wait_known"]).sum()), "unpolled_n": int(group["unpolled"].sum()),
            "before_seen_max": float(group["before_seen"].max()) if group["before_seen"].notna().any() else None}


def residue_of(table, from_frame: bool = False) -> list[ResidueCell]:
    """Per cell (report keys: workload, phase at receipt, mechanism, delivery, host/device) of the
    rows of ``table`` (or of a ``split_frame`` already made, ``from_frame``)."""
    f = table if from_frame else split_frame(table)
    if f.empty:
        return []
    return [ResidueCell(*key, **summarize(g)) for key, g in f.groupby(KEYS, sort=True)]


def residue_by_class(table: pa.Table, class_map: dict[str, str]) -> dict[tuple, ResidueCell]:
    """Per diff cell (workload, phase, mechanism, delivery, device class as ``diff`` maps it)."""
    from .settings import CLASS_COLUMNS
    from .tables import device_class_key

    f = split_frame(table, tuple(CLASS_COLUMNS))
    if f.empty:
        return {}
    classes = [device_class_key(*k) for k in f[CLASS_COLUMNS].itertuples(index=False)]
    f = f.assign(device=[class_map.get(c, c) for c in classes])
    return {tuple(c.__dict__[k] for k in KEYS): c for c in residue_of(f, from_frame=True)}


def _ms(v: float) -> str:
    return f"{v:.2f}"


def residue_section(cells: list[ResidueCell]) -> Section | None:
    """The split per cell and phase at receipt; None when no record has one (older datasets,
    engines that send no readings, non-Linux hosts)."""
    if not cells:
        return None
    edge = max(c.uncovered_max for c in cells)
    note = ("cancelled trials: the wall-clock residue (latency_ms) = engine work (the trial thread on a CPU) + "
            "CPU wait (it waited runnable for a CPU, schedstat) + rest (neither: blocked, and the reads' edge), "
            "per trial; ms, nearest-rank p50 per column (p50s need not add up), shares of the summed residue "
            f"(they do); the reads missed at most {edge:.3f} ms of a trial's residue. graph_eval: of the trials its "
            "reader saw, those seen at a node's ask (the cancel came where no node was polled: the engine's own "
            "work between graphs), and the most engine work done before the reader saw a cancel")
    unknown, n = sum(c.wait_unknown_n for c in cells), sum(c.n for c in cells)
    if unknown:
        note += (f". {unknown} of {n} trials have no run-delay reading (a receipt a native reader latched from "
                 "the shared cancel word: no reader reads schedstat): their wait, if any, is counted in the rest")
    rows = [[c.workload, c.phase, c.mechanism, c.delivery, c.device, str(c.n), _ms(c.wall_p50), _ms(c.work_p50),
             _ms(c.wait_p50), _ms(c.rest_p50), _ms(c.wall_max), _ms(c.work_max),
             f"{c.work_share:.0%} / {c.wait_share:.0%} / {c.rest_share:.0%}",
             f"{c.unpolled_n}/{c.seen_n}, {_ms(c.before_seen_max)}" if c.seen_n else "-"] for c in cells]
    return Section("Residue split per phase at receipt", note,
                   ["workload", "phase", "mechanism", "delivery", "device", "n", "wall p50", "work p50", "wait p50",
                    "rest p50", "wall max", "work max", "work / wait / rest", "unpolled, work before seen max"],
                   rows, key_columns=5, sid="residue")
