"""How an engine's timestamps relate to the agent's clock: the start-up check's result
(:class:`ClockCheck`) and the window a run's stamps must lie in (:func:`in_trial`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClockCheck:
    """How the engine's timestamps relate to the agent's clock."""

    same: bool
    offset_ns: int  # engine minus agent
    uncertainty_ns: int

    def to_agent(self, t_ns: int) -> int:
        return t_ns - self.offset_ns

    def columns(self) -> dict:
        return {"engine_clock": "same" if self.same else "estimated", "engine_clock_offset_ns": self.offset_ns,
                "engine_clock_uncertainty_ns": self.uncertainty_ns}


def in_trial(clock: ClockCheck, t_engine: int, t_run: int, t_read: int, last: int) -> int | None:
    """An engine timestamp of a run on the agent's clock, or None when it lies outside the run
    (before the run was written, after its line was read, or before the run's previous event),
    within the clock's uncertainty: the engine does not stamp the clock it answered pings with."""
    t, u = clock.to_agent(t_engine), clock.uncertainty_ns
    return t if t_run - u <= t <= t_read + u and t >= last - u else None
