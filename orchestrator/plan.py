"""The trial plan, generated whole before the run (MLPerf LoadGen style).

Pure functions only. Same config + same devices => the same plan, trial ids
included. Input choice and offsets draw from separate seeded streams, and each
cell (device, workload, mechanism, delivery) has its own stream, so adding a
device or a mechanism does not change the other cells' trials.

Offsets are planned as fractions where they depend on a device's own timeline
(``uniform``: of the reference duration; ``phase``: of the time the reference
run spent in the target phase) and resolved to ms per device once its
reference runs are in (:func:`resolve_offset_ms`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from cancelbench.device_agents.engines.registry import ENGINES
from cancelbench.schema import NOT_APPLICABLE, reference_run

from .config import SweepConfig


@dataclass(frozen=True)
class TrialSpec:
    trial_id: str
    trial_index: int
    device: str  # device key: "<node label or host>/<device id>"
    workload: str
    trial_kind: str  # reference | cancel
    mechanism: str
    delivery: str  # driver | agent | NOT_APPLICABLE (reference)
    offset_plan: str
    input_id: str
    input_seed: int
    offset_seed: int
    offset_fraction: float | None = None
    offset_ms: float | None = None  # immediate / fixed
    target_phase: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _stream(seed: int, *parts: str) -> np.random.Generator:
    key = zlib.crc32("\x1f".join(parts).encode())
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key])))


def _id_part(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def build_plan(config: SweepConfig, devices: list[str], inputs: dict[str, list[str]]) -> list[TrialSpec]:
    """Every trial of the sweep: per device and workload, references then interleaved cancels.

    ``devices``: device keys; ``inputs``: workload name -> input ids (corpus order).
    """
    plan: list[TrialSpec] = []
    in_seed, off_seed = config.effective_input_seed, config.effective_offset_seed
    offsets = config.offsets
    for device in sorted(devices):
        backend = device.rsplit("/", 1)[-1].split(":", 1)[0]
        for wl in config.workloads:
            if wl.backends and backend not in wl.backends:
                continue
            refs: list[TrialSpec] = []
            cancels: list[TrialSpec] = []
            ids = inputs[wl.name]
            phases = ENGINES[wl.engine].phases
            for mech in config.mechanisms:
                rin = _stream(in_seed, device, wl.name, mech, "reference")
                for r in range(config.reference_runs):
                    refs.append(TrialSpec(
                        trial_id=f"{_id_part(device)}.{_id_part(wl.name)}.{mech}.ref.{r:03d}", trial_index=0,
                        device=device, workload=wl.name, trial_kind="reference", mechanism=mech,
                        delivery=NOT_APPLICABLE, offset_plan=NOT_APPLICABLE, input_id=ids[int(rin.integers(len(ids)))],
                        input_seed=in_seed, offset_seed=off_seed))
                for delivery in config.deliveries:
                    rin = _stream(in_seed, device, wl.name, mech, delivery)
                    roff = _stream(off_seed, device, wl.name, mech, delivery)
                    n = config.trials_per_cell
                    if offsets.plan == "phase":
                        n = max(n, offsets.min_per_phase * len(phases))
                    for k in range(n):
                        frac = ms = phase = None
                        if offsets.plan == "immediate":
                            ms = 0.0
                        elif offsets.plan == "fixed":
                            ms = offsets.fixed_ms[k % len(offsets.fixed_ms)]
                        elif offsets.plan == "uniform":
                            frac = float(roff.uniform(0.0, offsets.max_fraction))
                        else:  # phase: round-robin over phases guarantees min_per_phase each
                            phase = phases[k % len(phases)]
                            frac = float(roff.uniform(0.0, 1.0))
                        cancels.append(TrialSpec(
                            trial_id=f"{_id_part(device)}.{_id_part(wl.name)}.{mech}.{delivery}.{k:04d}",
                            trial_index=0, device=device, workload=wl.name, trial_kind="cancel", mechanism=mech,
                            delivery=delivery, offset_plan=offsets.plan, input_id=ids[int(rin.integers(len(ids)))],
                            input_seed=in_seed, offset_seed=off_seed, offset_fraction=frac, offset_ms=ms,
                            target_phase=phase))
            # References first (offsets need them); then the workload's cells
            # interleaved, so slow drift on the host does not bias one cell. The
            # model is loaded once per workload.
            order = _stream(config.seed, device, wl.name, "order").permutation(len(cancels))
            plan.extend(refs)
            plan.extend(cancels[i] for i in order)
    return [TrialSpec(**{**t.to_dict(), "trial_index": i}) for i, t in enumerate(plan)]


@dataclass(frozen=True)
class ReferenceTimeline:
    """A cell's reference run (``schema.reference_run``): its duration and its phase
    timeline, both from that one uncancelled run."""

    duration_ms: float
    segments: tuple[tuple[str, float, float], ...]  # (phase, start_ms, end_ms) from hand-back

    @classmethod
    def from_rows(cls, rows: list[dict]) -> ReferenceTimeline | None:
        run = reference_run(rows)
        if run is None:
            return None
        # the timeline runs from t_start; offsets run from hand-back: shift it onto the origin
        start, handback = run.get("t_start_ns"), run.get("t_handback_ns")
        shift = (start - handback) / 1e6 if start is not None and handback is not None else 0.0
        segs = tuple((p, a + shift, b + shift) for p, a, b in json.loads(run.get("phase_timeline_json") or "[]"))
        return cls(duration_ms=run["duration_ms"], segments=segs)


def resolve_offset_ms(trial: TrialSpec, ref: ReferenceTimeline | None) -> float:
    """The planned offset in ms from the origin (the agent's hand-back), on this
    device's own reference run."""
    if trial.offset_ms is not None:
        return float(trial.offset_ms)
    if ref is None:
        raise ValueError(f"{trial.trial_id}: offset plan {trial.offset_plan} needs reference runs")
    if trial.offset_plan == "uniform":
        return float(trial.offset_fraction) * ref.duration_ms
    if trial.offset_plan == "phase":
        segs = [(s, e) for p, s, e in ref.segments if p == trial.target_phase and e > s]
        total = sum(e - s for s, e in segs)
        if not segs or total <= 0:
            raise ValueError(f"{trial.trial_id}: reference run never entered phase {trial.target_phase!r}")
        # Walk the phase's segments: the fraction is of the time spent in that phase.
        left = float(trial.offset_fraction) * total
        for s, e in segs:
            if left <= e - s:
                return s + left
            left -= e - s
        return segs[-1][1]
    raise ValueError(f"{trial.trial_id}: cannot resolve offset plan {trial.offset_plan!r}")
