"""Did the cancels land where they were planned?  Per cell (workload, device,
mechanism, delivery, offset plan): the share of cancel trials received in
their target phase and inside a native call (in flight). A cell of a
phase-aiming plan under ``TARGET_SHARE`` gets a line in the report: its
latencies describe other phases than the ones it was meant to measure.

A cancel whose target does not outlast its planned delay by its delivery's
measured reach (``target_reachable`` false, e.g. a driver-delivered cancel at a
3 ms phase when the 95th percentile of the driver's round trips from that phase
was 5 ms) is counted apart: the shares
are over the reachable cancels, and the unreachable ones are listed with how
many of them landed anyway. A cell whose cancels were all unreachable says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from .load import Filters, read_once, records_of
from .section import Section

TARGET_SHARE = 0.90  # below this a phase-aiming cell is reported as missing its target
COLUMNS = ["workload", "host", "backend", "device", "mechanism", "delivery", "offset_plan", "target_phase",
           "phase_at_receipt", "native_call_at_receipt", "t_received_ns", "target_reachable", "phase_at_onset",
           "bargein_aim"]
KEYS = ["workload", "device_key", "mechanism", "delivery", "offset_plan"]


@dataclass(frozen=True)
class Targeting:
    workload: str
    device_key: str
    mechanism: str
    delivery: str
    offset_plan: str
    n: int
    in_phase: float | None  # share received in the target phase (None: the plan aims at no phase)
    in_flight: float | None  # share received inside a native call (None: no reachable cancel)
    unreachable: int = 0  # cancels aimed at a target shorter than their delivery's round trip (not in the shares)
    unreachable_in_phase: int = 0  # of those, how many landed in their target phase anyway

    @property
    def missed(self) -> bool:
        return (self.in_phase is not None and self.in_flight is not None
                and min(self.in_phase, self.in_flight) < TARGET_SHARE)


def load_targeting(dirs: list[str | Path], filters: Filters = Filters()) -> list[Targeting]:
    """``targeting_of`` the cancel trials of ``dirs``, in a scan of its own."""
    return targeting_of(records_of(read_once(dirs, COLUMNS, filters, kinds=("cancel",)), filters.widened(("cancel",))))


def targeting_of(table: pa.Table) -> list[Targeting]:
    """Per cell, from the cancel trials' rows of the report's one scan (counted in Arrow: a
    million rows are one grouping, not a Python loop over groups)."""
    if table.num_rows == 0:
        return []
    t = table.select(COLUMNS)
    label = lambda name: pc.fill_null(t.column(name).cast(pa.string()), "nan")  # noqa: E731 (a null key)
    as_int = lambda mask: pc.cast(pc.fill_null(mask, False), pa.int64())  # noqa: E731
    # a barge-in aims its onset (the user starts talking) at the phase; the detector's cancel comes later
    onset = pc.fill_null(pc.equal(t.column("bargein_aim"), "onset"), False)  # aim = cancel: the receipt's phase
    landed = pc.if_else(onset, t.column("phase_at_onset"), t.column("phase_at_receipt"))
    in_phase = pc.fill_null(pc.equal(landed, t.column("target_phase")), False)
    # null (records from before the column, time plans): reachable
    far = pc.fill_null(pc.equal(t.column("target_reachable"), False), False)
    near = pc.invert(far)
    in_flight = pc.is_valid(t.column("native_call_at_receipt"))
    g = pa.table({
        "workload": label("workload"), "mechanism": label("mechanism"), "delivery": label("delivery"),
        "offset_plan": label("offset_plan"),
        "device_key": pc.if_else(pc.and_(pc.is_valid(t.column("host")), pc.is_valid(t.column("device"))),
                                 pc.binary_join_element_wise(label("host"), label("device"), "/"), "nan"),
        "near": as_int(near), "far": as_int(far), "aimed": as_int(pc.is_valid(t.column("target_phase"))),
        "near_in_phase": as_int(pc.and_(in_phase, near)), "far_in_phase": as_int(pc.and_(in_phase, far)),
        "near_in_flight": as_int(pc.and_(in_flight, near)),
    }).group_by(KEYS).aggregate([(c, "sum") for c in ("near", "far", "aimed", "near_in_phase", "far_in_phase",
                                                       "near_in_flight")])
    out = []
    for r in sorted(g.to_pylist(), key=lambda r: tuple(r[k] for k in KEYS)):
        n = r["near_sum"]
        out.append(Targeting(*(r[k] for k in KEYS), n=n,
                             in_phase=r["near_in_phase_sum"] / n if r["aimed_sum"] and n else None,
                             in_flight=r["near_in_flight_sum"] / n if n else None,
                             unreachable=r["far_sum"], unreachable_in_phase=r["far_in_phase_sum"]))
    return out


def targeting_section(rows: list[Targeting]) -> Section | None:
    """The cells whose plan aims at a phase (phase, progress, phase_time); the others
    (time plans) are summed up in the note by their in-flight share."""
    aimed = [r for r in rows if r.in_phase is not None or r.unreachable]
    if not aimed:
        return None
    missed = [r for r in aimed if r.missed]
    others = [r for r in rows if r.in_phase is None and not r.unreachable and r.in_flight is not None]
    n_others = sum(r.n for r in others)
    far = sum(r.unreachable for r in aimed)
    note = (f"share of cancel trials received in their target phase and inside a native call; "
            f"a cell under {TARGET_SHARE:.0%} is marked MISSED" + (f" ({len(missed)} cell(s))" if missed else "")
            + (f"; {far} cancel(s) aimed at a target shorter than their delivery's round trip are not in the "
               f"shares (\"unreachable\": landed in phase / aimed)" if far else "")
            + (f"; cells of time plans: {sum(r.in_flight * r.n for r in others) / n_others:.0%} of "
               f"{n_others} cancels in flight" if n_others else ""))
    return Section(
        "Targeting", note,
        ["workload", "device", "mechanism", "delivery", "plan", "n", "in target phase", "in flight", "unreachable", ""],
        [[r.workload, r.device_key, r.mechanism, r.delivery, r.offset_plan, str(r.n),
          "–" if r.in_phase is None else f"{r.in_phase:.0%}", "–" if r.in_flight is None else f"{r.in_flight:.0%}",
          f"{r.unreachable_in_phase}/{r.unreachable}" if r.unreachable else "", "MISSED" if r.missed else ""]
         for r in aimed],
        key_columns=5, sid="targeting")
