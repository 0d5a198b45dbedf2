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
import os
import queue

from cancelbench import native
from cancelbench.request import TrialRequest
from cancelbench.sut.child import ChildProcess
from cancelbench.sut.client import EngineError, EngineProcess, Received, in_trial
from cancelbench.sut.protocol import AT_RECEIPT_CALL, AT_RECEIPT_FIELDS, AT_RECEIPT_GRAPH, AUDIO_OUT, TRIAL_EVENTS

from . import engine_cpu
from .base import CancelControl, EngineInputError, EngineResult

LIVENESS_PING_S = 1.0  # silence during a run after which the engine is pinged
# The bound on one run when the workload sets no run_timeout_s: before the engine has completed a run,
# RUN_BOUND_FIRST_S; then RUN_BOUND_FACTOR times its longest completed run, at least RUN_BOUND_FLOOR_S
# (a run that outlasts every run before it tenfold is stuck: the common deadlock answers pings, so
# answer_timeout_s never fires). Over the bound the engine is killed and started again.
RUN_BOUND_FIRST_S, RUN_BOUND_FACTOR, RUN_BOUND_FLOOR_S = 600.0, 10, 5.0
AUDIO_EVENTS_MAX = 1 << 16  # audio events one trial may send (each is kept for the playback model)
INT_RANGES = {"int32": (-(1 << 31), (1 << 31) - 1), "int64": (-(1 << 63), (1 << 63) - 1)}
OPEN_STEP = "step"  # native_call_at_receipt of an engine that names no call, where one of its steps was open


class ExternalEngine:
    kind = "external"

    def __init__(self, workload: dict) -> None:
        self.payload = workload
        self.models = {k: workload[k] for k in ("model", "mmproj") if workload.get(k)}
        self.settings = dict(workload.get("settings") or {})
        self.effective: dict = {}
        self.proc: EngineProcess | None = None
        self.restarts = 0
        self.run_timeout_s = workload.get("run_timeout_s")
        self._longest_run_ns = 0  # the longest completed run of this workload's engine (t_run -> done read)
        self._columns: dict = {}
        try:
            self._start()
        except EngineError as exc:
            raise EngineInputError(str(exc)) from None

    def _start(self) -> None:
        p = self.payload
        proc = EngineProcess(p["command"], cwd=p.get("cwd"), env=p.get("env"),
                             startup_timeout_s=float(p.get("startup_timeout_s", 30)),
                             answer_timeout_s=float(p.get("answer_timeout_s", 10)),
                             cancel_word=p.get("cancel_word", True), spawn=self.spawn)
        self.proc = proc
        decl = proc.start()
        if p.get("contract") and decl.contract() != p["contract"]:
            proc.close()
            raise EngineError("the engine's hello on this agent differs from the one the sweep was checked against "
                              f"(engine {decl.name} {decl.version})")
        self.declaration = decl
        self.effective = checked_settings(decl, proc.load(self.models, self.settings))
        # 1.4: an engine that streams audio says its rate (the playback model's, barge-in's) when loaded
        self.sample_rate = proc.loaded.get("audio_sample_rate") if decl.can(AUDIO_OUT) else None
        if decl.can(AUDIO_OUT) and self.sample_rate is None:
            proc.close()
            raise EngineError(f"the engine declares {AUDIO_OUT} but its loaded has no audio_sample_rate")

    def spawn(self, command: list[str], **kw) -> ChildProcess:
        """Run its engine: a process of its own (the channel's engine overrides this)."""
        return ChildProcess(command, **kw)

    def describe(self) -> dict:
        d = self.declaration
        return {"engine": self.kind, "engine_settings": {**self.settings, **self.effective},
                "engine_name": d.name, "engine_version": d.version}

    def identity_columns(self) -> dict:
        d = self.declaration
        return {"engine_name": d.name, "engine_version": d.version, "engine_restarts": self.restarts,
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

    def _run_settings(self, request: TrialRequest) -> dict:
        """The load's settings, with the corpus item's own language as ``lang`` (1.5) where the engine
        declares a string setting of that name: an item in another language is run in it."""
        declared = self.declaration.setting("lang")
        if request.lang is None or declared is None or declared.type != "string":
            return self.settings
        return {**self.settings, "lang": request.lang}

    def run_bound_ns(self) -> int:
        """The longest this run may take before the engine is killed (see RUN_BOUND_FIRST_S)."""
        if self.run_timeout_s is not None:
            return int(float(self.run_timeout_s) * 1e9)
        if not self._longest_run_ns:
            return int(RUN_BOUND_FIRST_S * 1e9)
        return max(int(RUN_BOUND_FLOOR_S * 1e9), RUN_BOUND_FACTOR * self._longest_run_ns)

    def run(self, request: TrialRequest, ctl: CancelControl) -> EngineResult:
        self._ensure_running()
        proc, trial = self.proc, request.trial_id
        sent: list[int] = []
        seq = proc.next_seq()  # the shared cancel word's number for this run (None: the line alone)

        def send_cancel() -> None:  # the word, the line, then a ping: the cancel's reach (EngineProcess.send_timed)
            sent.append(proc.send_cancel(trial, seq))

        if ctl.cpu is not None:
            ctl.cpu.watch(proc.proc.pid)  # the engine's threads are its process's, not the agent's
        if ctl.attach(send_cancel):  # a cancel latched before the run goes first: the engine must latch it
            send_cancel()
        self._sent = sent
        if request.wav_out:  # where the engine may write the reference run's audio: its folder exists
            os.makedirs(os.path.dirname(request.wav_out), exist_ok=True)
        run = {"type": "run", "trial": trial, "mechanism": request.mechanism, "input": request.input,
               "settings": self._run_settings(request), "output_path": request.wav_out}
        if seq is not None:
            run["cancel_seq"] = seq
        t_run = proc.send_timed(run)
        self._cancel_path = "word" if seq is not None else "line"
        self._trial_kind = request.trial_kind
        try:
            result = self._follow(ctl, trial, t_run)
            if result.outcome == "completed":
                self._longest_run_ns = max(self._longest_run_ns, self._columns["t_engine_done_read_ns"] - t_run)
            return result
        except EngineError:
            proc.kill()  # its stream can no longer be trusted: started again for the next trial
            proc.broken = proc.broken or "killed"
            raise
        finally:
            ctl.attach(None)
            proc.end_run()

    def _follow(self, ctl: CancelControl, trial: str, t_run: int) -> EngineResult:
        """The run's events until its done: progress for the anchors, timestamps checked."""
        proc, progress, clock = self.proc, ctl.progress, self.proc.clock
        self._t_run = t_run
        segments: list[list] = []  # [phase, start_ns, end_ns]
        steps: dict[str, int] = {}
        step_min: dict[str, int] = {}
        step_start: int | None = None
        self._step_edges: list[tuple[int, bool]] = []  # (t, a step opened): what was open at the engine's receipt
        last_t, observed, last_heard = t_run, None, native.now_ns()
        self._seen = None  # the first cancel_seen (1.3: where, cpu_t)
        self._audio_events = self._audio_total = 0
        bound_ns = self.run_bound_ns()
        while True:
            ran_ns = native.now_ns() - t_run
            if ran_ns > bound_ns:
                raise EngineError(f"trial {trial} ran for {ran_ns / 1e9:.1f} s, over its bound of "
                                  f"{bound_ns / 1e9:g} s ({self._bound_source()}); killed")
            try:
                got = proc.messages.get(timeout=min(LIVENESS_PING_S, max(0.001, (bound_ns - ran_ns) / 1e9)))
            except queue.Empty:
                silent_s = (native.now_ns() - last_heard) / 1e9
                if silent_s > proc.answer_timeout_s:
                    raise EngineError(f"the engine answered nothing for {silent_s:.1f} s during trial {trial} "
                                      f"(answer_timeout_s = {proc.answer_timeout_s:g}); killed") from None
                if silent_s >= LIVENESS_PING_S:
                    proc.send_timed()
                continue
            msg = proc.check(got, f"the done of trial {trial}").msg
            last_heard = got.t_read_ns
            kind = msg["type"]
            if kind == "pong":
                proc.took_pong(msg, got.t_read_ns)
                continue
            if kind not in TRIAL_EVENTS:
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
                self._step_edges.append((t, msg["edge"] == "start"))
            elif kind == "cancel_seen":
                if observed is None:
                    observed, self._seen = t, msg
            elif kind == "audio":
                self._audio(progress, msg, t)
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

    def _audio(self, progress, msg: dict, t: int) -> None:
        """Audio handed over to playback (1.4): the barge-in's playback model hears it from ``t``."""
        if self.sample_rate is None:
            raise EngineError(f"the engine sent audio, but did not declare the capability {AUDIO_OUT}")
        self._audio_events += 1
        if self._audio_events > AUDIO_EVENTS_MAX:
            raise EngineError(f"the engine sent over {AUDIO_EVENTS_MAX} audio events in trial {msg['trial']}")
        self._audio_total += msg["samples"]
        progress.hand_audio(self._audio_total, t)

    @staticmethod
    def _step(progress, steps: dict, step_min: dict, step_start: int | None, msg: dict, t: int) -> int | None:
        """A step call started or returned: counted, timed, announced; the open step's start."""
        phase = msg["phase"]
        if msg["edge"] == "start":
            steps[phase] = steps.get(phase, 0) + 1
            progress.steps[phase] = steps[phase]
            progress.native_call = OPEN_STEP
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
        forwarded = self._sent[0] if self._sent else None
        self._columns = {
            "t_engine_done_read_ns": got.t_read_ns,
            "t_cancel_forwarded_ns": forwarded,
            "t_native_observed_ns": observed,
            "cancel_reach_ns": self.proc.reach_ns() if forwarded is not None else None,
            "cancel_stall_ns": self.proc.stall_ns() if forwarded is not None else None,
            "engine_counters_json": json.dumps(counters, sort_keys=True) if counters else None,
            "engine_cancel_path": self._cancel_path if forwarded is not None else None,
            "engine_cancel_via": msg.get("cancel_via") if msg.get("cancel_received_t") is not None else None,
        }
        self._columns = {k: v for k, v in self._columns.items() if v is not None or k == "t_native_observed_ns"}
        # Progress at receipt is the engine's done.at_receipt (1.2, bounds checked by the decode) or unknown:
        # never the agent's own 0, over which these are laid
        at_receipt = (msg.get("at_receipt") or {}) if msg.get("cancel_received_t") is not None else {}
        self._columns.update({f"{k}_at_receipt": at_receipt.get(k) for k in (*AT_RECEIPT_FIELDS, AT_RECEIPT_GRAPH)})
        self._columns.update(self._checked_stamps(msg, got, forwarded, counters))
        received = self._columns.get("t_engine_received_ns")
        if received is not None:  # 1.5: the engine's name for its call, else OPEN_STEP if one was open at its receipt
            self._columns["native_call_at_receipt"] = at_receipt.get(AT_RECEIPT_CALL) or (
                OPEN_STEP if step_open_at(self._step_edges, received) else None)
        self._columns.update(self._cpu_columns(msg, got))
        self._columns["abort_polls"] = counters.get("abort_polls")
        if counters.get("known_answer_error_ns") is not None:  # a known-answer engine's own error (sim, probe)
            self._columns["known_answer_error_ms"] = counters["known_answer_error_ns"] / 1e6
        if msg["outcome"] == "error":
            raise EngineError(f"the engine failed: {' '.join(str(msg.get('error') or 'no message').split())[:1500]}")
        return EngineResult(
            outcome=msg["outcome"], t_start_ns=t0, t_terminal_ns=t_end, phase_at_terminal=msg["phase"],
            decode_rc=counters.get("decode_rc"), output_sha256=msg.get("output_sha256"),
            phase_durations_ms=durations, phase_segments=timeline, n_input_tokens=counters.get("n_input_tokens"),
            phase_steps=steps, phase_step_ms={p: ns / 1e6 for p, ns in step_min.items()})

    def _checked_stamps(self, msg: dict, got: Received, forwarded: int | None, counters: dict) -> dict:
        """The done's own stamps on the agent's clock, each inside what the agent saw of the trial (a cancel
        read no earlier than the agent wrote it, a native call's return between the run and its done), its
        phase declared, its counters within their columns; EngineError naming the field otherwise."""
        clock, columns = self.proc.clock, {}
        if msg["phase"] not in self.declaration.phase_names:
            raise EngineError(f"the engine's done says phase {msg['phase'][:64]!r}, which it did not declare")
        u, t_run = clock.uncertainty_ns, self._t_run
        received = msg.get("cancel_received_t")
        if received is not None:
            if forwarded is None:
                what = "a reference run, which is sent none" if self._trial_kind == "reference" else \
                    "a trial whose cancel the agent never sent it"
                raise EngineError(f"the engine says it read a cancel (done.cancel_received_t) in {what}")
            received = clock.to_agent(received)
            if not forwarded - u <= received <= got.t_read_ns + u:
                raise EngineError(f"done.cancel_received_t {msg['cancel_received_t']} lies outside the time the "
                                  "cancel was in the engine's hands (after the agent wrote it, before the done)")
            columns["t_engine_received_ns"] = received
        returned = msg.get("native_returned_t")
        if returned is not None:
            returned = clock.to_agent(returned)
            if not t_run - u <= returned <= got.t_read_ns + u:
                raise EngineError(f"done.native_returned_t {msg['native_returned_t']} lies outside trial "
                                  f"{msg['trial']} on the clock the engine answered pings with")
            columns["t_native_returned_ns"] = returned
        for name, width in (("abort_polls", "int64"), ("decode_rc", "int32"), ("n_input_tokens", "int32")):
            value = counters.get(name)
            lo, hi = INT_RANGES[width]
            if value is not None and not lo <= value <= hi:
                raise EngineError(f"done.counters.{name} = {value} is out of its column's range ({width})")
        return columns

    def _cpu_columns(self, msg: dict, got: Received) -> dict:
        """The trial thread's account the engine sent (1.3, engine_cpu), checked against the span the
        run was in its hands (the agent's run write to its done read, widened by the clock's uncertainty)."""
        cpu, seen = msg.get("cpu") or {}, self._seen
        span = got.t_read_ns - self._t_run + 2 * self.proc.clock.uncertainty_ns
        received = msg.get("cancel_received_t")
        try:
            engine_cpu.check(cpu, (seen or {}).get("cpu_t"), received is not None, span)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        return engine_cpu.columns(cpu, seen, received is not None)

    def _bound_source(self) -> str:
        if self.run_timeout_s is not None:
            return "run_timeout_s"
        if not self._longest_run_ns:
            return f"no run completed yet: {RUN_BOUND_FIRST_S:g} s; set run_timeout_s"
        return (f"{RUN_BOUND_FACTOR} x its longest completed run, {self._longest_run_ns / 1e9:.3f} s, at least "
                f"{RUN_BOUND_FLOOR_S:g} s; set run_timeout_s")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc = None


def step_open_at(edges: list[tuple[int, bool]], t: int) -> bool:
    """Whether a step was open at ``t`` by the run's step events ((t, opened), in arrival order): the
    engine's receipt, not the agent's write, which may come while a step's end is still on its way."""
    is_open = False
    for t_edge, opened in edges:
        if t_edge > t:
            break
        is_open = opened
    return is_open


def checked_settings(decl, effective: dict) -> dict:
    """An engine's ``loaded.settings``: declared names only, each a value its declaration allows
    (type, bounds; no NaN or infinity): what the record's engine_settings_json may hold."""
    from cancelbench.sut.declaration import SettingError

    declared = {s.name for s in decl.settings}
    out = {}
    for name, value in effective.items():
        if name not in declared:
            raise EngineError(f"the engine's loaded.settings names {name[:64]!r}, which is not a setting it declared")
        try:
            decl.setting(name).check(value, f"loaded.settings.{name}")
        except SettingError as exc:  # NaN and infinity among them: engine_settings_json stays JSON
            raise EngineError(str(exc)) from None
        out[name] = value
    return out
