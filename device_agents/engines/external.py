"""An engine a team ships, run out of process through the engine protocol
(docs/sut-protocol.md; ``cancelbench.sut.client``).

The agent treats it like a built-in engine: ``run(request, ctl)`` returns an
:class:`EngineResult`. The engine's ``phase`` and ``step`` events drive the same
``Progress`` the built-in engines drive (so the phase and progress anchors, the
phase-entry probes and the receipt snapshot work unchanged); a cancel the agent
takes (``CancelControl.request``) is forwarded to the engine as a ``cancel``
message, also one latched before the run. The engine's timestamps are converted to
the agent's clock and checked to lie within the trial. A trial the engine breaks
(a crash, a bad line, silence, timestamps off its clock) raises :class:`EngineError`:
the agent records it as ``error``, and the engine is started again for the next trial.
"""

from __future__ import annotations

import json
import queue

from cancelbench import native
from cancelbench.request import TrialRequest
from cancelbench.sut.client import EngineError, EngineProcess, Received, in_trial

from .base import CancelControl, EngineInputError, EngineResult

LIVENESS_PING_S = 1.0  # silence during a run after which the engine is pinged


class ExternalEngine:
    kind = "external"

    def __init__(self, workload: dict) -> None:
        self.payload = workload
        self.models = {k: workload[k] for k in ("model", "mmproj") if workload.get(k)}
        self.settings = dict(workload.get("settings") or {})
        self.effective: dict = {}
        self.proc: EngineProcess | None = None
        self.restarts = 0
        self._columns: dict = {}
        try:
            self._start()
        except EngineError as exc:
            raise EngineInputError(str(exc)) from None

    def _start(self) -> None:
        p = self.payload
        proc = EngineProcess(p["command"], cwd=p.get("cwd"), env=p.get("env"),
                             startup_timeout_s=float(p.get("startup_timeout_s", 30)),
                             answer_timeout_s=float(p.get("answer_timeout_s", 10)))
        self.proc = proc
        decl = proc.start()
        if p.get("contract") and decl.contract() != p["contract"]:
            proc.close()
            raise EngineError("the engine's hello on this agent differs from the one the sweep was checked against "
                              f"(engine {decl.name} {decl.version})")
        self.declaration = decl
        self.effective = proc.load(self.models, self.settings)

    def describe(self) -> dict:
        d = self.declaration
        return {"engine": self.kind, "engine_settings": {**self.settings, **self.effective},
                "engine_name": d.name, "engine_version": d.version}

    def identity_columns(self) -> dict:
        d = self.declaration
        return {"engine_name": d.name, "engine_version": d.version,
                "engine_build_json": json.dumps(dict(d.build), sort_keys=True), **self.proc.clock.columns()}

    def trial_columns(self) -> dict:
        """Columns of the last trial (also one that failed): identity, stderr, the engine's own stamps."""
        cols = {**self.identity_columns(), **self._columns}
        if self.proc is not None:
            cols["engine_stderr"] = self.proc.take_stderr()
        self._columns = {}
        return cols

    def _ensure_running(self) -> None:
        if self.proc is not None and self.proc.broken is None and self.proc.proc.poll() is None:
            return
        if self.proc is not None:
            self.proc.kill()
        self.restarts += 1
        self._start()

    def run(self, request: TrialRequest, ctl: CancelControl) -> EngineResult:
        self._ensure_running()
        proc, trial = self.proc, request.trial_id
        sent: list[int] = []

        def send_cancel() -> None:
            sent.append(proc.send({"type": "cancel", "trial": trial}))

        if ctl.cpu is not None:
            ctl.cpu.watch(proc.proc.pid)  # the engine's threads are its process's, not the agent's
        if ctl.attach(send_cancel):  # a cancel latched before the run goes first: the engine must latch it
            send_cancel()
        self._sent = sent
        t_run = proc.send({"type": "run", "trial": trial, "mechanism": request.mechanism, "input": request.input,
                           "settings": self.settings, "output_path": request.wav_out})
        try:
            return self._follow(ctl, trial, t_run)
        except EngineError:
            proc.kill()  # its stream can no longer be trusted: started again for the next trial
            proc.broken = proc.broken or "killed"
            raise
        finally:
            ctl.attach(None)

    def _follow(self, ctl: CancelControl, trial: str, t_run: int) -> EngineResult:
        """The run's events until its done: progress for the anchors, timestamps checked."""
        proc, progress, clock = self.proc, ctl.progress, self.proc.clock
        segments: list[list] = []  # [phase, start_ns, end_ns]
        steps: dict[str, int] = {}
        step_min: dict[str, int] = {}
        step_start: int | None = None
        last_t, observed, last_heard = t_run, None, native.now_ns()
        while True:
            try:
                got = proc.messages.get(timeout=LIVENESS_PING_S)
            except queue.Empty:
                silent_s = (native.now_ns() - last_heard) / 1e9
                if silent_s > proc.answer_timeout_s:
                    raise EngineError(f"the engine answered nothing for {silent_s:.1f} s during trial {trial} "
                                      f"(answer_timeout_s = {proc.answer_timeout_s:g}); killed") from None
                proc.send_ping()
                continue
            msg = proc.check(got, f"the done of trial {trial}").msg
            last_heard = got.t_read_ns
            kind = msg["type"]
            if kind == "pong":
                continue
            if kind not in ("phase", "step", "cancel_seen", "done"):
                raise EngineError(f"the engine sent a {kind!r} message during trial {trial}")
            if msg["trial"] != trial:
                raise EngineError(f"the engine sent a {kind} event for trial {msg['trial'][:80]!r}, "
                                  f"which is not running (running: {trial})")
            t = in_trial(clock, msg["t"], t_run, got.t_read_ns, last_t)
            if t is None:
                raise EngineError(f"the engine's {kind} timestamp {msg['t']} lies outside trial {trial} on the clock it "
                                  "answered pings with (its timestamps are not on the clock it declared)")
            last_t = max(last_t, t)
            if kind == "phase":
                self._phase(progress, segments, msg["phase"], t)
            elif kind == "step":
                step_start = self._step(progress, steps, step_min, step_start, msg, t)
            elif kind == "cancel_seen":
                observed = observed or t
            else:
                return self._done(ctl, msg, got, segments, steps, step_min, observed)

    def _phase(self, progress, segments: list, phase: str, t: int) -> None:
        """A phase entered: the timeline, and the agent's anchors (Progress.emit)."""
        if phase not in self.declaration.phase_names:
            raise EngineError(f"the engine entered phase {phase!r}, which it did not declare")
        if segments:
            segments[-1][2] = t
        segments.append([phase, t, None])
        progress.phase = phase
        progress.emit("phase", phase, t)

    @staticmethod
    def _step(progress, steps: dict, step_min: dict, step_start: int | None, msg: dict, t: int) -> int | None:
        """A step call started or returned: counted, timed, announced; the open step's start."""
        phase = msg["phase"]
        if msg["edge"] == "start":
            steps[phase] = steps.get(phase, 0) + 1
            progress.steps[phase] = steps[phase]
            progress.native_call = "step"
            progress.emit("step", phase, t)
            return t
        if step_start is not None:
            step_min[phase] = min(step_min.get(phase, t - step_start), t - step_start)
        progress.native_call = None
        progress.emit("step_end", phase, t)
        return None

    def _done(self, ctl: CancelControl, msg: dict, got: Received, segments: list, steps: dict, step_min: dict,
              observed: int | None) -> EngineResult:
        clock = self.proc.clock
        ctl.close()  # a cancel after the engine's terminal state is refused (not this trial's)
        t_end = clock.to_agent(msg["t"])
        if segments:
            segments[-1][2] = t_end
        t0 = segments[0][1] if segments else t_end
        durations: dict[str, float] = {}
        timeline = []
        for phase, start, end in segments:
            durations[phase] = durations.get(phase, 0.0) + (end - start) / 1e6
            timeline.append((phase, (start - t0) / 1e6, (end - t0) / 1e6))
        counters = dict(msg.get("counters") or {})
        received = msg.get("cancel_received_t")
        returned = msg.get("native_returned_t")
        self._columns = {
            "t_engine_received_ns": None if received is None else clock.to_agent(received),
            "t_engine_done_read_ns": got.t_read_ns,
            "t_cancel_forwarded_ns": self._sent[0] if self._sent else None,
            "t_native_observed_ns": observed,
            "t_native_returned_ns": None if returned is None else clock.to_agent(returned),
            "abort_polls": counters.get("abort_polls"),
            "engine_counters_json": json.dumps(counters, sort_keys=True) if counters else None,
            "tokens_generated_at_receipt": None,
        }
        self._columns = {k: v for k, v in self._columns.items() if v is not None or k == "t_native_observed_ns"}
        if msg["outcome"] == "error":
            raise EngineError(f"the engine failed: {' '.join(str(msg.get('error') or 'no message').split())[:1500]}")
        return EngineResult(
            outcome=msg["outcome"], t_start_ns=t0, t_terminal_ns=t_end, phase_at_terminal=msg["phase"],
            decode_rc=counters.get("decode_rc"), output_sha256=msg.get("output_sha256"),
            phase_durations_ms=durations, phase_segments=timeline, n_input_tokens=counters.get("n_input_tokens"),
            phase_steps=steps, phase_step_ms={p: ns / 1e6 for p, ns in step_min.items()})

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc = None
