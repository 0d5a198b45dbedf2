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
from dataclasses import asdict, dataclass, field

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


# Plans whose cancels are anchored to an engine event (entry into a phase, a step call).
ANCHORED_PLANS = ("phase", "progress")
# Plans that aim at a phase (round-robin over the engine's phases, min_per_phase each).
# phase_time is the time-anchored phase plan kept for comparison: a fraction of the
# reference run's time in the phase, converted to ms after hand-back.
PHASE_PLANS = ANCHORED_PLANS + ("phase_time",)


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
            phases = ENGINES[wl.engine].plan_phases(offsets.plan)
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
                    if offsets.plan in PHASE_PLANS:
                        n = max(n, offsets.min_per_phase * len(phases))
                    for k in range(n):
                        frac = ms = phase = None
                        if offsets.plan == "immediate":
                            ms = 0.0
                        elif offsets.plan == "fixed":
                            ms = offsets.fixed_ms[k % len(offsets.fixed_ms)]
                        elif offsets.plan == "uniform":
                            frac = float(roff.uniform(0.0, offsets.max_fraction))
                        else:  # phase / progress: round-robin over phases guarantees min_per_phase each
                            phase = phases[k % len(phases)]
                            top = 1.0 if offsets.plan == "progress" else offsets.max_fraction
                            frac = float(roff.uniform(0.0, min(top, 1.0)))
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


def _segments(run: dict) -> tuple[tuple[str, float, float], ...]:
    """A run's phase timeline shifted from t_start onto the hand-back (the offsets' origin)."""
    start, handback = run.get("t_start_ns"), run.get("t_handback_ns")
    shift = (start - handback) / 1e6 if start is not None and handback is not None else 0.0
    return tuple((p, a + shift, b + shift) for p, a, b in json.loads(run.get("phase_timeline_json") or "[]"))


@dataclass(frozen=True)
class ReferenceTimeline:
    """A cell's reference run (``schema.reference_run``): its duration, its phase
    timeline and its step calls per phase, all from that one uncancelled run."""

    duration_ms: float
    segments: tuple[tuple[str, float, float], ...]  # (phase, start_ms, end_ms) from hand-back
    steps: dict = field(default_factory=dict)  # phase -> step calls
    # Over every completed reference run, the shortest: first stay in each phase, and mean
    # step call per phase (ms). Anchored delays are fractions of these, so a trial that runs
    # faster than the median reference still receives its cancel inside the phase.
    first_stay_ms: dict = field(default_factory=dict)
    step_ms: dict = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows: list[dict]) -> ReferenceTimeline | None:
        run = reference_run(rows)
        if run is None:
            return None
        segs = _segments(run)
        first_stay: dict[str, float] = {}
        step_ms: dict[str, float] = {}
        for r in rows:
            if r.get("outcome") != "completed":
                continue
            spent: dict[str, float] = {}
            for p, a, b in _segments(r):
                spent[p] = spent.get(p, 0.0) + (b - a)
            seen: set[str] = set()
            for p, a, b in _segments(r):
                if p not in seen:
                    seen.add(p)
                    first_stay[p] = min(first_stay.get(p, b - a), b - a)
            for p, n in json.loads(r.get("phase_steps_json") or "{}").items():
                if n > 0 and p in spent:
                    step_ms[p] = min(step_ms.get(p, spent[p] / n), spent[p] / n)
        return cls(duration_ms=run["duration_ms"], segments=segs,
                   steps=json.loads(run.get("phase_steps_json") or "{}"), first_stay_ms=first_stay, step_ms=step_ms)

    def phase_segments(self, phase: str) -> list[tuple[float, float]]:
        """(start_ms, end_ms) of the reference run's stays in ``phase``, from hand-back."""
        return [(s, e) for p, s, e in self.segments if p == phase and e > s]


# The sub-step delay of a progress anchor stays inside the step call: at most this
# fraction of it, so the cancel lands in flight, not on the call's boundary.
MAX_STEP_FRACTION = 0.9


@dataclass(frozen=True)
class Resolved:
    """A cancel's anchor and its delay after it, on one device's reference run."""

    offset_ms: float  # delay after the anchor (progress: the fallback when no earlier step was timed)
    anchor_phase: str | None = None  # None: the hand-back
    anchor_step: int | None = None  # progress: the k-th step call of anchor_phase
    step_fraction: float | None = None  # progress: delay as a fraction of the previous step call
    anchor_ref_ms: float | None = None  # the reference run's hand-back -> entry into anchor_phase


def resolve_offset(trial: TrialSpec, ref: ReferenceTimeline | None) -> Resolved:
    """Where and when the trial's cancel fires, on this device's own reference run.

    Time plans run from hand-back: ``immediate``/``fixed`` as planned, ``uniform`` a
    fraction of the reference duration. ``phase`` fires a fraction of the reference
    run's first stay in the target phase after the engine *enters* that phase;
    ``progress`` draws a point among the phase's step calls (the fraction's integer
    part over the reference run's step count picks the step k, its remainder the
    position inside it) and fires that far into the k-th step call after it starts,
    measured on the trial's own shortest earlier step of the phase (the reference's
    shortest mean step for the first).
    Anchored to events, both survive a trial that runs slower or faster than its
    reference."""
    if trial.offset_ms is not None:
        return Resolved(float(trial.offset_ms))
    if ref is None:
        raise ValueError(f"{trial.trial_id}: offset plan {trial.offset_plan} needs reference runs")
    frac = float(trial.offset_fraction)
    if trial.offset_plan == "uniform":
        return Resolved(frac * ref.duration_ms)
    segs = ref.phase_segments(trial.target_phase)
    if not segs:
        raise ValueError(f"{trial.trial_id}: reference run never entered phase {trial.target_phase!r}")
    if trial.offset_plan == "phase_time":  # the fraction of the time spent in the phase, walked
        left = frac * sum(e - s for s, e in segs)
        for s, e in segs:
            if left <= e - s:
                return Resolved(s + left)
            left -= e - s
        return Resolved(segs[-1][1])
    if trial.offset_plan == "phase":
        stay = ref.first_stay_ms.get(trial.target_phase, segs[0][1] - segs[0][0])
        return Resolved(frac * stay, anchor_phase=trial.target_phase, anchor_ref_ms=segs[0][0])
    if trial.offset_plan == "progress":
        n = int(ref.steps.get(trial.target_phase, 0))
        if n < 1:
            raise ValueError(f"{trial.trial_id}: reference run made no step call in phase {trial.target_phase!r}")
        point = frac * n
        k = min(n, int(point) + 1)
        sub = (point - (k - 1)) * MAX_STEP_FRACTION
        step_ms = ref.step_ms.get(trial.target_phase, sum(e - s for s, e in segs) / n)
        return Resolved(sub * step_ms, anchor_phase=trial.target_phase, anchor_step=k, step_fraction=sub,
                        anchor_ref_ms=segs[0][0])
    raise ValueError(f"{trial.trial_id}: cannot resolve offset plan {trial.offset_plan!r}")
