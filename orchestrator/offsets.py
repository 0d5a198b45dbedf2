"""Offset plans: where each cancel lands, as objects in one registry (``PLANS``).

A plan draws its trials' offsets when the plan is built (``draw``: fractions,
fixed milliseconds, target phases, from the cell's seeded stream), resolves one
trial's cancel on a device's own reference run once those have run
(``resolve``: the anchor event and the delay after it), names the config
parameters that shaped its cancels (``settings``, the record's offset_* columns)
and describes itself (``doc``). Config validation (:func:`parse_offsets`), the
planner (``plan.build_plan``) and the device runs ask the plan object; nothing
compares plan names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cancelbench.schema import reference_run

from .checks import ConfigError, check_int, table_of

if TYPE_CHECKING:
    from cancelbench.device_agents.engines.registry import EngineSpec

MAX_OFFSET_MS = 3_600_000.0  # one hour: a fixed offset beyond any trial
MAX_TRIALS_PER_CELL = 100_000
# The sub-step delay of a progress anchor stays inside the step call: at most this
# fraction of it, so the cancel lands in flight, not on the call's boundary.
MAX_STEP_FRACTION = 0.9


# --------------------------------------------------------------------- a device's reference

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
    # Over every completed reference run of the workload on the device, every mechanism's
    # (``pooled``), the shortest: first stay in each phase, and step call per phase (ms).
    # Anchored delays are fractions of these, so a trial that runs faster than the median
    # reference still receives its cancel inside the phase. Pooled because three runs of one
    # mechanism can all be slow when the host's load comes and goes (field scale: three
    # graph_eval references under load made a prompt "at least 1.6 s" that runs in 0.6 s,
    # and 12 of 22 prompt cancels landed after it); a mechanism's own runs stay in the pool.
    first_stay_ms: dict = field(default_factory=dict)
    step_ms: dict = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows: list[dict], pooled: list[dict] | None = None) -> ReferenceTimeline | None:
        """The reference run of ``rows`` (one cell's references); the shortest stays and
        steps over ``pooled`` (the workload's references of every mechanism; ``rows`` if None)."""
        run = reference_run(rows)
        if run is None:
            return None
        first_stay: dict[str, float] = {}
        step_ms: dict[str, float] = {}
        for r in rows if pooled is None else pooled:
            if r.get("outcome") == "completed":
                _shortest(r, first_stay, step_ms)
        return cls(duration_ms=run["duration_ms"], segments=_segments(run),
                   steps=json.loads(run.get("phase_steps_json") or "{}"), first_stay_ms=first_stay, step_ms=step_ms)

    def phase_segments(self, phase: str) -> list[tuple[float, float]]:
        """(start_ms, end_ms) of the reference run's stays in ``phase``, from hand-back."""
        return [(s, e) for p, s, e in self.segments if p == phase and e > s]


def _shortest(run: dict, first_stay: dict[str, float], step_ms: dict[str, float]) -> None:
    """Lower ``first_stay`` / ``step_ms`` to this completed run's first stays and step calls."""
    segs = _segments(run)
    spent: dict[str, float] = {}
    for p, a, b in segs:
        spent[p] = spent.get(p, 0.0) + (b - a)
    seen: set[str] = set()
    for p, a, b in segs:
        if p not in seen:
            seen.add(p)
            first_stay[p] = min(first_stay.get(p, b - a), b - a)
    timed = json.loads(run.get("phase_step_ms_json") or "{}")
    for p, n in json.loads(run.get("phase_steps_json") or "{}").items():
        # The shortest step call as timed; a record without it (written before the column):
        # the phase's time over its steps, which counts the phase's time outside step calls
        # too (TTS set_input: 3-9 ms around one 0.2 ms call).
        took = timed.get(p, spent[p] / n if n > 0 and p in spent else None)
        if took is not None and took > 0:
            step_ms[p] = min(step_ms.get(p, took), took)


@dataclass(frozen=True)
class Resolved:
    """A cancel's anchor and its delay after it, on one device's reference run."""

    offset_ms: float  # delay after the anchor (progress: the fallback when no earlier step was timed)
    anchor_phase: str | None = None  # None: the hand-back
    anchor_step: int | None = None  # progress: the k-th step call of anchor_phase
    step_fraction: float | None = None  # progress: delay as a fraction of the previous step call
    anchor_ref_ms: float | None = None  # the reference run's hand-back -> entry into anchor_phase
    # How long after the anchor the target is still there, at the shortest on the references
    # (phase: the first stay; progress: the k-th step call and the phase's steps after it).
    # A cancel whose delivery takes longer than this cannot be sure to land (see target_reachable).
    window_ms: float | None = None


# --------------------------------------------------------------------- the plans

@dataclass(frozen=True)
class Drawn:
    """One cell's planned offsets, a value per cancel trial."""

    fractions: list
    ms: list
    phases: list


class OffsetPlan:
    """One offset plan. Subclasses set the class attributes and ``draw``/``resolve``."""

    name = ""
    anchored = False  # anchored to an engine event (entry into a phase, a step call)
    aims_at_phases = False  # round-robin over target phases, min_per_phase each
    uses_max_fraction = False
    doc = ""

    def draw(self, spec: OffsetSpec, rng: np.random.Generator, n: int, phases: tuple[str, ...]) -> Drawn:
        raise NotImplementedError

    def resolve(self, trial, ref: ReferenceTimeline | None) -> Resolved:
        raise NotImplementedError

    def settings(self, spec: OffsetSpec) -> dict:
        """The offset_* columns this plan's cancels were shaped by (the others stay null)."""
        cols = {}
        if self.uses_max_fraction:
            cols["offset_max_fraction"] = spec.max_fraction
        if self.aims_at_phases:
            cols["offset_min_per_phase"] = spec.min_per_phase
            cols["offset_phases_json"] = json.dumps(list(spec.phases)) if spec.phases else None
        return cols

    def _segments(self, trial, ref: ReferenceTimeline | None) -> list[tuple[float, float]]:
        if ref is None:
            raise ValueError(f"{trial.trial_id}: offset plan {self.name} needs reference runs")
        segs = ref.phase_segments(trial.target_phase)
        if not segs:
            raise ValueError(f"{trial.trial_id}: reference run never entered phase {trial.target_phase!r}")
        return segs


class Immediate(OffsetPlan):
    name, doc = "immediate", "anchored on hand-back, 0 ms: the cancel races the engine's start"

    def draw(self, spec, rng, n, phases):
        return Drawn([None] * n, [0.0] * n, [None] * n)

    def resolve(self, trial, ref):
        return Resolved(float(trial.offset_ms))


class Fixed(Immediate):
    name, doc = "fixed", "anchored on hand-back, the listed offsets (ms), cycled over the trials"

    def draw(self, spec, rng, n, phases):
        fixed = spec.fixed_ms
        return Drawn([None] * n, [fixed[k % len(fixed)] for k in range(n)], [None] * n)

    def settings(self, spec):
        return {"offset_fixed_ms_json": json.dumps(list(spec.fixed_ms))}


class Uniform(OffsetPlan):
    name, uses_max_fraction = "uniform", True
    doc = "anchored on hand-back, a fraction in [0, max_fraction) of the reference run's duration"

    def draw(self, spec, rng, n, phases):
        return Drawn(rng.uniform(0.0, spec.max_fraction, size=n).tolist(), [None] * n, [None] * n)

    def resolve(self, trial, ref):
        if ref is None:
            raise ValueError(f"{trial.trial_id}: offset plan {self.name} needs reference runs")
        return Resolved(float(trial.offset_fraction) * ref.duration_ms)


class PhaseTime(OffsetPlan):
    name, aims_at_phases, uses_max_fraction = "phase_time", True, True
    doc = ("the time-anchored phase plan, for comparison: a fraction of the reference run's time in the "
           "target phase, from hand-back")
    top = None  # the draw's upper bound; None: max_fraction (at most 1)

    def draw(self, spec, rng, n, phases):
        top = self.top if self.top is not None else min(spec.max_fraction, 1.0)
        return Drawn(rng.uniform(0.0, top, size=n).tolist(), [None] * n, [phases[k % len(phases)] for k in range(n)])

    def resolve(self, trial, ref):
        segs = self._segments(trial, ref)
        left = float(trial.offset_fraction) * sum(e - s for s, e in segs)  # the fraction of the phase's time, walked
        for s, e in segs:
            if left <= e - s:
                return Resolved(s + left)
            left -= e - s
        return Resolved(segs[-1][1])


class Phase(PhaseTime):
    name, anchored = "phase", True
    doc = ("anchored on entering the target phase; a fraction of its shortest first stay on the references, "
           "shortened for a trial faster than its reference so far, never lengthened")

    def resolve(self, trial, ref):
        segs = self._segments(trial, ref)
        stay = ref.first_stay_ms.get(trial.target_phase, segs[0][1] - segs[0][0])
        return Resolved(float(trial.offset_fraction) * stay, anchor_phase=trial.target_phase,
                        anchor_ref_ms=segs[0][0], window_ms=stay)


class Progress(PhaseTime):
    name, anchored, uses_max_fraction, top = "progress", True, False, 1.0
    doc = ("anchored on the start of the k-th step call of the target phase, k drawn over the reference's "
           "step count; a fraction (< 0.9) of the phase's shortest step call after it")

    def resolve(self, trial, ref):
        """The fraction's integer part over the reference run's step count picks the step k,
        its remainder the position inside it, measured on the trial's own shortest earlier
        step of the phase (the references' shortest step call of the phase for the first)."""
        segs = self._segments(trial, ref)
        n = int(ref.steps.get(trial.target_phase, 0))
        if n < 1:
            raise ValueError(f"{trial.trial_id}: reference run made no step call in phase {trial.target_phase!r}")
        point = float(trial.offset_fraction) * n
        k = min(n, int(point) + 1)
        sub = (point - (k - 1)) * MAX_STEP_FRACTION
        step_ms = ref.step_ms.get(trial.target_phase, sum(e - s for s, e in segs) / n)
        # The steps from the k-th on, each at least the shortest; a phase the run enters more
        # than once (STT prefill) may end after any of them, so only the k-th step counts there.
        window = step_ms * ((n - k + 1) if len(segs) == 1 else 1)
        return Resolved(sub * step_ms, anchor_phase=trial.target_phase, anchor_step=k, step_fraction=sub,
                        anchor_ref_ms=segs[0][0], window_ms=window)


PLANS: dict[str, OffsetPlan] = {p.name: p for p in (Immediate(), Uniform(), Fixed(), Phase(), Progress(), PhaseTime())}
OFFSET_PLANS = tuple(PLANS)
ANCHORED_PLANS = tuple(n for n, p in PLANS.items() if p.anchored)
PHASE_PLANS = tuple(n for n, p in PLANS.items() if p.aims_at_phases)


def resolve_offset(trial, ref: ReferenceTimeline | None) -> Resolved:
    """Where and when the trial's cancel fires, on this device's own reference run (its plan's
    ``resolve``). Anchored to events, phase and progress survive a trial that runs slower or
    faster than its reference."""
    if trial.offset_ms is not None:
        return Resolved(float(trial.offset_ms))
    plan = PLANS.get(trial.offset_plan)
    if plan is None:
        raise ValueError(f"{trial.trial_id}: cannot resolve offset plan {trial.offset_plan!r}")
    return plan.resolve(trial, ref)


# --------------------------------------------------------------------- the [offsets] table

@dataclass(frozen=True)
class OffsetSpec:
    plan: str = "uniform"
    fixed_ms: tuple[float, ...] = ()
    min_per_phase: int = 5  # phase plans: cancels aimed at each phase, at least
    max_fraction: float = 0.9  # uniform: draw over [0, max_fraction) of the reference
    phases: tuple[str, ...] = ()  # phase plans: aim only at these phases (empty: every one the plan can reach)

    @property
    def kind(self) -> OffsetPlan:
        return PLANS[self.plan]

    def target_phases(self, engine: EngineSpec) -> tuple[str, ...]:
        """The phases this plan aims cancels at on ``engine``, in run order (empty for a
        plan that aims at no phase)."""
        if not self.kind.aims_at_phases:
            return ()
        reachable = engine.plan_phases(self.kind.anchored)
        return tuple(p for p in reachable if p in self.phases) if self.phases else reachable

    def cancels_per_cell(self, trials_per_cell: int, engine: EngineSpec) -> int:
        """Cancel trials per (device, workload, mechanism, delivery) cell: a phase plan
        aims at least min_per_phase at each target phase."""
        return max(trials_per_cell, self.min_per_phase * len(self.target_phases(engine)))

    def settings(self) -> dict:
        """The offset_* columns of a cancel trial: only the parameters the plan uses, so two
        sweeps differ in a setting only where it shaped their cancels."""
        cols = dict.fromkeys(("offset_max_fraction", "offset_min_per_phase", "offset_fixed_ms_json",
                              "offset_phases_json"))
        cols.update(self.kind.settings(self))
        return cols


def parse_offsets(data: dict) -> OffsetSpec:
    """The [offsets] table, validated."""
    off = table_of(data, "offsets", "[offsets]")
    known = set(OffsetSpec.__dataclass_fields__)
    if set(off) - known:
        raise ConfigError(f"[offsets]: unknown key(s) {', '.join(sorted(set(off) - known))}")
    plan = off.get("plan", "uniform")
    if plan not in PLANS:
        raise ConfigError(f"offsets.plan: unknown plan {plan!r} (known: {', '.join(PLANS)})")
    fixed = off.get("fixed_ms", [])
    if not isinstance(fixed, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in fixed):
        raise ConfigError("offsets.fixed_ms must be a list of numbers (ms)")
    if any(not 0 <= v <= MAX_OFFSET_MS for v in fixed):  # also false for NaN
        raise ConfigError(f"offsets.fixed_ms: offsets must be finite and >= 0 and <= {MAX_OFFSET_MS:.0f} "
                          f"(one hour), got {fixed}")
    if isinstance(PLANS[plan], Fixed) and not fixed:
        raise ConfigError(f"offsets.plan = '{plan}' needs a non-empty offsets.fixed_ms")
    max_fraction = off.get("max_fraction", OffsetSpec.max_fraction)
    if isinstance(max_fraction, bool) or not isinstance(max_fraction, (int, float)) or not 0 < max_fraction <= 2:
        raise ConfigError(f"offsets.max_fraction must be in (0, 2], got {max_fraction!r}")
    phases = off.get("phases", [])
    if not isinstance(phases, list) or not all(isinstance(p, str) for p in phases) or len(set(phases)) != len(phases):
        raise ConfigError("offsets.phases must be a list of distinct phase names")
    if phases and not PLANS[plan].aims_at_phases:
        raise ConfigError(f"offsets.phases applies to the phase plans ({', '.join(PHASE_PLANS)}), "
                          f"not to plan {plan!r}")
    return OffsetSpec(plan=plan, fixed_ms=tuple(float(v) for v in fixed),
                      min_per_phase=check_int(off.get("min_per_phase", 5), "offsets.min_per_phase", 1,
                                              MAX_TRIALS_PER_CELL),
                      max_fraction=float(max_fraction), phases=tuple(phases))
