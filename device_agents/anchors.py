"""Cancels anchored to what the engine is doing, not to the clock since hand-back.

An :class:`AnchorWatch` listens to one trial's engine events (``Progress.emit``:
phase entries, step calls starting and returning), on the trial thread, and
notes the moment its anchor happens (``t_anchor_ns``) and when the cancel is due
after it. Both deliveries use the same watch: ``agent`` delivery fires from a
timer thread that waits for the watch; ``driver`` delivery asks the agent for
the anchor (``DeviceAgent.anchor``) and fires from the driver. The listener
only stores integers and sets an Event, so the engine is not slowed down.
"""

from __future__ import annotations

import threading
from typing import Callable

from cancelbench.request import TrialRequest

# Pace scaling of a planned delay (see AnchorWatch._pace): only from events at least this
# far into the reference run. It shrinks the delay of a trial faster than its reference
# (down to PACE_MIN) and never stretches it: the two errors are not alike. A delay too short
# lands earlier in the phase; one too long lands after the phase has ended and the cancel
# misses it altogether. And a trial's pace before the anchor does not predict the phase on a
# host whose load switches on and off: at field scale (one 8-15 s code2wav call), stretching
# up to 4x sent 12 of 22 code2wav cancels past the end of the run.
PACE_MIN_REF_MS = 5.0
PACE_MIN, PACE_MAX = 0.25, 1.0


class AnchorWatch:
    def __init__(self, request: TrialRequest, t_handback_ns: int) -> None:
        self.request = request
        self.t_handback_ns = t_handback_ns
        self.kind = request.anchor_kind
        self.t_anchor_ns: int | None = None
        self.delay_ns: int | None = None
        self.done = threading.Event()  # the anchor happened, or the trial ended without it
        self._steps = 0
        self._step_start: int | None = None
        self._prev_step_ns: int | None = None
        if self.kind == "handback":
            self._hit(t_handback_ns, self._delay(None))

    def _delay(self, prev_step_ns: int | None, t_ns: int | None = None) -> int:
        r = self.request
        planned = int(float(r.offset_ms or 0.0) * 1e6 * self._pace(t_ns))
        if self.kind == "progress" and prev_step_ns is not None and r.step_fraction is not None:
            # The live step length when this trial runs faster, never longer than planned: a
            # phase's steps are not alike (STT decode_embd: full batches, then the rest), and
            # the planned delay is the fraction of the references' shortest step of the phase.
            return min(planned, int(r.step_fraction * prev_step_ns))
        return planned

    def _pace(self, t_ns: int | None) -> float:
        """This trial's speed against its reference run: its time from hand-back to the
        anchor event over the reference's, clamped to [PACE_MIN, PACE_MAX] (never above 1:
        see PACE_MAX); 1 when the event comes too early in the run to say."""
        ref = self.request.anchor_ref_ms
        if t_ns is None or ref is None or ref < PACE_MIN_REF_MS:
            return 1.0
        return min(PACE_MAX, max(PACE_MIN, (t_ns - self.t_handback_ns) / 1e6 / ref))

    def _hit(self, t_ns: int, delay_ns: int) -> None:
        self.t_anchor_ns, self.delay_ns = t_ns, delay_ns
        self.done.set()

    def __call__(self, event: str, phase: str, t_ns: int) -> None:
        """``Progress.listener``: the engine announces an event."""
        if self.t_anchor_ns is not None or phase != self.request.anchor_phase:
            return
        if self.kind == "phase":
            if event == "phase":
                self._hit(t_ns, self._delay(None, t_ns))
        elif event == "step":
            self._steps += 1
            self._step_start = t_ns
            if self._steps == self.request.anchor_step:
                self._hit(t_ns, self._delay(self._prev_step_ns, t_ns))
        elif event == "step_end" and self._step_start is not None:
            # the shortest step so far: a preempted step must not push the cancel past the next one
            took = t_ns - self._step_start
            self._prev_step_ns = took if self._prev_step_ns is None else min(self._prev_step_ns, took)

    def finish(self) -> None:
        """The trial ended: whoever waits learns the anchor (or that it never came)."""
        self.done.set()

    @property
    def due_ns(self) -> int | None:
        return None if self.t_anchor_ns is None else self.t_anchor_ns + self.delay_ns

    def start_timer(self, fire: Callable[[int], None], sleep_until: Callable[[int], None]) -> threading.Thread:
        """Agent delivery: a thread that waits for the anchor, sleeps to the due time
        and calls ``fire(due_ns)``; it ends quietly if the trial ends first."""

        def run() -> None:
            self.done.wait()
            due = self.due_ns
            if due is None:
                return
            sleep_until(due)
            fire(due)

        timer = threading.Thread(target=run, name=f"cancel-timer-{self.request.trial_id}", daemon=True)
        timer.start()
        return timer


class PhaseFeed:
    """A reference run's phase entries, for the driver's reach probes: the driver asks for the
    next entry after its question arrived (DeviceAgent.next_phase_entry) and times the round
    trip from it, as a cancel anchored on entering that phase would travel. The listener only
    appends and notifies, so the engine is not slowed down."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, int]] = []  # (phase, t_entry_ns), in order
        self._done = False
        self._cond = threading.Condition()

    def __call__(self, event: str, phase: str, t_ns: int) -> None:
        if event == "phase" and phase != "done":
            with self._cond:
                self.entries.append((phase, t_ns))
                self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def next_after(self, since_ns: int) -> tuple[str, int] | None:
        """The first entry after ``since_ns`` (waits for it); None once the run has ended without one."""
        def first() -> tuple[str, int] | None:
            return next((e for e in self.entries if e[1] > since_ns), None)

        with self._cond:
            self._cond.wait_for(lambda: self._done or first() is not None)
            return first()
