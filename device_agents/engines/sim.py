"""The simulated engine (``sim``): phases that wait instead of compute.

For scale work (many devices per host, the driver under load) and as a
known answer for the harness. Every native call is :func:`native.sim_wait`,
a timed sleep that honours the cancel token, so what a cancel costs is known
from the mechanism and the settings alone; nothing here burns CPU.

Phases, as the text engine: ``prefill`` (one wait of ``sim_phase_us``, like one
prompt batch) then ``generate`` (``sim_steps`` waits of ``sim_phase_us /
sim_steps``, like one decode per token). Mechanisms, honestly mapped:

* ``between_calls``: the flag between waits only; a cancel waits out the rest
  of the wait in flight (the wait is given no token).
* ``chunked``: as between_calls, but prefill is ``sim_steps`` shorter waits.
* ``abort_callback``, ``graph_eval``: the wait itself checks the token every
  ``sim_granularity_us`` (the reader stamps ``t_native_observed_ns`` like the
  real readers), so a cancel stops it at the next check.

``known_answer_error_ms`` on a cancelled trial: the wait in flight at receipt
returned this long after its known answer (in-wait: its check scheduled at
start + k * granularity, k the check that saw the token; between waits: the
wait's own end). Never negative; what it adds is the sleeps' wake-up latency.

Imports no llama.cpp: a sim agent is a small process.
"""

from __future__ import annotations

from cancelbench import native
from cancelbench.engine_decls import settings_record
from cancelbench.request import TrialRequest

from .base import CancelControl, EngineInputError, EngineResult, PhaseClock, engine_settings, finish_trial
from .registry import ENGINES, UnknownEngine, mechanism_for

PHASES = ENGINES["sim"].phases


class SimEngine:
    kind = "sim"
    phases = PHASES

    def __init__(self, workload: dict) -> None:
        self.settings = engine_settings(self.kind, workload)
        s = self.settings
        self.phase_us, self.granularity_us, self.steps = s["sim_phase_us"], s["sim_granularity_us"], s["sim_steps"]
        self.last_waits: list[dict] = []  # the last trial's waits (k, start, end, duration, granularity)

    def describe(self) -> dict:
        return {"engine": self.kind, **settings_record(self.kind, self.settings)}

    def _waits(self, chunked: bool) -> list[tuple[str, int]]:
        """(phase, duration_us) of every native call of one trial, in order."""
        per_step = max(1, self.phase_us // self.steps)
        prefill = [per_step] * self.steps if chunked else [self.phase_us]
        return [("prefill", d) for d in prefill] + [("generate", per_step)] * self.steps

    def run(self, request: TrialRequest, ctl: CancelControl) -> EngineResult:
        try:
            mech = mechanism_for(self.kind, request.mechanism)
        except UnknownEngine as exc:
            raise EngineInputError(str(exc)) from None
        in_wait = mech.abort_callback or mech.eval_hook
        granularity = self.granularity_us if in_wait else 0
        token = ctl.token if in_wait else None
        clock = PhaseClock(ctl.progress)
        t_start = native.now_ns()
        self.last_waits = []
        stopped = False
        last_k = None
        waits = self._waits(mech.chunked)
        clock.enter(waits[0][0])  # a cancel latched before the start stops in the first phase
        for phase, duration in waits:
            if ctl.requested:  # between waits: every mechanism checks the flag here
                stopped = True
                break
            clock.enter(phase)
            with ctl.native_call("cb_sim_wait"):
                k, start, end = native.sim_wait(token, duration, granularity)
            self.last_waits.append({"k": k, "start_ns": start, "end_ns": end, "duration_us": duration,
                                    "granularity_us": granularity})
            last_k = k
            if k:
                stopped = True
                break
            if phase == "prefill":
                ctl.progress.input_tokens_done += 1
            else:
                ctl.progress.tokens_generated += 1
        result = finish_trial(ctl, clock, stopped=stopped, t_start_ns=t_start, decode_rc=last_k,
                              n_input_tokens=None, output=None, output_sha256=None)
        error = self.known_answer_error_ms(ctl)
        if error is not None:
            result.output = {"known_answer_error_ms": error}
        return result

    def known_answer_error_ms(self, ctl: CancelControl) -> float | None:
        """How long after its known answer the wait in flight at the cancel returned (ms);
        None when no wait ran after the token was set."""
        set_ns = ctl.token.set_ns
        if not set_ns:
            return None
        # the first wait still running at the set (one that began just after it counts: no check came between)
        wait = next((w for w in self.last_waits if set_ns <= w["end_ns"]), None)
        if wait is None:
            return None
        return (wait["end_ns"] - expected_return_ns(wait, set_ns)) / 1e6

    def close(self) -> None:
        pass


def expected_return_ns(wait: dict, set_ns: int) -> int:
    """The known answer for one wait during which the token was set at ``set_ns``:
    in-wait checks stop at the check that saw it (scheduled at start + k *
    granularity; ``k`` is at most ``native.sim_expected_check``), a wait without
    checks at its own end."""
    end = wait["start_ns"] + wait["duration_us"] * 1000
    if not wait["granularity_us"] or not wait["k"]:
        return end
    return min(end, wait["start_ns"] + wait["k"] * wait["granularity_us"] * 1000)
