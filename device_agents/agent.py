"""The device agent: one per (node, device), a Ray actor with two concurrency
groups so ``cancel()`` is served while ``run_trial()`` is inside native code.

The class is plain Python (usable without Ray, e.g. in benchmarks); Ray wraps it with
:func:`remote_agent_class`. The driver imports this module only to name the actor class:
native code and engines are imported where the agent runs, never at module import.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import ray

from cancelbench.request import TrialRequest
from cancelbench.schema import TrialRecord, agent_half, columns_of

from . import cpu_account
from .anchors import AnchorWatch, PhaseFeed

CONTROL = "control"
TRIAL = "trial"
CONCURRENCY_GROUPS = {TRIAL: 1, CONTROL: 4}
SIM_BACKEND = "sim"  # device ids sim:0..N-1: simulated devices ([devices] sim_per_host), sim engine only
# How long a thread that wants the GIL waits before the holder is asked to let go (Python's
# default is 5 ms). The engine's trial thread runs Python between its native calls
# (tokenizing, sampling, building batches); at the default, a cancel or an anchor reply
# arriving then waited up to 5 ms for the GIL: delivery latency of the harness, not of the
# engine. Recorded on every row (agent_switch_interval_us).
AGENT_SWITCH_INTERVAL_S = 0.0001


def _sleep_until(deadline_ns: int) -> None:
    """Sleep coarsely, then spin the last millisecond (timer precision matters here)."""
    from cancelbench import native

    while True:
        left = deadline_ns - native.now_ns()
        if left <= 0:
            return
        if left > 2_000_000:
            time.sleep((left - 1_000_000) / 1e9)


class DeviceAgent:
    def __init__(self, device_id: str = "cpu:0", device_name: str | None = None, n_threads: int | None = None,
                 node_label: str | None = None) -> None:
        self.device_id = device_id
        sys.setswitchinterval(AGENT_SWITCH_INTERVAL_S)
        from cancelbench import native

        from .probe import probe_host
        simulated = device_id.startswith(SIM_BACKEND + ":")  # sim engine only: no llama.cpp in this process
        if simulated:
            devices = [{"device_id": device_id, "description": "simulated device (sim engine)"}]
        else:
            from .engines.llama_runtime import quiet_logs
            quiet_logs()  # before the device probe initialises ggml's backends
            devices = self._probe_devices()
        mine = next((d for d in devices if d.get("device_id") == device_id), None)
        self.meta = probe_host(device_id, device_name or (mine or {}).get("description"), n_threads,
                               with_llama=not simulated)
        self.meta["device_present"] = mine is not None
        self.meta["devices_seen"] = [d.get("device_id") for d in devices]
        if node_label:
            self.meta["node_label"] = node_label
        # Outside Ray (benchmarks, tests) there is no node; never auto-start a Ray here.
        self.meta["node_id"] = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.token = native.CancelToken()
        self._lock = threading.Lock()
        self._current: tuple[str, object] | None = None  # (trial id, its CancelControl)
        # trial id -> its AnchorWatch (cancel trials), until the driver asked for its anchor
        self._watches: collections.OrderedDict[str, AnchorWatch] = collections.OrderedDict()
        # trial id -> its PhaseFeed (reference runs with feed_phases), kept until old
        self._feeds: collections.OrderedDict[str, PhaseFeed] = collections.OrderedDict()
        self._changed = threading.Condition(self._lock)  # a trial started or finished
        self._latched: dict[str, int] = {}
        self._finished: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._engine = None
        self._engine_key: str | None = None
        self._model_sha256: str | None = None

    @staticmethod
    def _probe_devices() -> list[dict]:
        """Devices ggml sees in this process (its environment was set by the runtime_env)."""
        try:
            from .backends import probe_devices
            return [d.to_dict() for d in probe_devices()]
        except Exception as exc:  # a probe failure is reported, not fatal for CPU agents
            return [{"device_id": "cpu:0", "description": None, "probe_error": str(exc)}]

    # -- control group -----------------------------------------------------
    @ray.method(concurrency_group=CONTROL)
    def probe(self) -> dict:
        return dict(self.meta)

    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> int:
        """The agent clock, for driver-side offset estimation."""
        from cancelbench import native
        return native.now_ns()

    @ray.method(concurrency_group=CONTROL)
    def anchor(self, trial_id: str) -> tuple[int, int] | None:
        """(t_anchor_ns, delay_ns) of a cancel trial once its anchor event has happened
        (the driver fires at their sum); None if the trial ended without it."""
        with self._changed:
            self._changed.wait_for(lambda: trial_id in self._watches or trial_id in self._finished)
            watch = self._watches.pop(trial_id, None)
        if watch is None:
            return None
        watch.done.wait()
        return None if watch.t_anchor_ns is None else (watch.t_anchor_ns, watch.delay_ns)

    @ray.method(concurrency_group=CONTROL)
    def next_phase_entry(self, trial_id: str, first: bool = False) -> tuple[str, int] | None:
        """(phase, t_entry_ns) of the reference run's first phase entry after this call
        arrived (``first``: the run's first entry, whenever the call arrived); None if it ended
        without one (or feeds no phases). Asked again at once after each answer, it lets the
        driver time a cancel path from each phase entry."""
        from cancelbench import native

        # The first question is sent before the run, but this group runs beside the trial's, so it
        # may arrive after the run entered its first phase: answered from the run's start, as
        # `anchor` answers a cancel trial's, it times that phase as an anchored cancel travels.
        since = 0 if first else native.now_ns()
        with self._changed:
            self._changed.wait_for(lambda: trial_id in self._feeds or trial_id in self._finished)
            feed = self._feeds.get(trial_id)
        return None if feed is None else feed.next_after(since)

    @ray.method(concurrency_group=CONTROL)
    def timer_probe(self, n: int) -> list[int]:
        """How late agent delivery's timer fires (ns), ``n`` times, on the path a trial uses:
        an AnchorWatch's timer (``start_timer``) waiting for a phase anchor, woken by the
        event on another thread, fires a cancel due at the anchor itself (a delay of 0, the
        worst case: the whole wake-up is late). The driver's first estimate of agent
        delivery's reach, before any agent-delivered cancel has run."""
        from cancelbench import native

        probe = TrialRequest(mechanism="none", input="", trial_id="timer-probe", trial_kind="cancel",
                             delivery="agent", offset_ms=0.0, anchor_phase="probe")
        late = []
        for _ in range(max(1, int(n))):
            watch, fired = AnchorWatch(probe, native.now_ns()), []
            timer = watch.start_timer(lambda due: fired.append(native.now_ns() - due), _sleep_until)
            time.sleep(0.001)  # the timer is waiting, as it is when a trial's anchor comes
            watch("phase", "probe", native.now_ns())
            timer.join()
            late.append(max(0, fired[0]))
        return late

    @ray.method(concurrency_group=CONTROL)
    def status(self) -> dict:
        with self._lock:
            cur = self._current
            return {"trial_id": cur[0] if cur else None,
                    "phase": cur[1].progress.phase if cur else None,
                    "engine": self._engine_key}

    @ray.method(concurrency_group=CONTROL)
    def cancel(self, trial_id: str) -> dict:
        """Cancel ``trial_id``: set it if running, latch it if not started yet."""
        from cancelbench import native
        return self._deliver(trial_id, native.now_ns())

    def _deliver(self, trial_id: str, received_ns: int) -> dict:
        with self._lock:
            cur = self._current
            if cur is not None and cur[0] == trial_id:
                if cur[1].request(received_ns) or cur[1].requested:
                    return {"state": "active", "received_ns": received_ns, "phase": cur[1].progress.phase}
                return {"state": "finished", "received_ns": received_ns}  # the engine had already ended
            if trial_id in self._finished:
                return {"state": "finished", "received_ns": received_ns}
            # Not started yet: latch it, never drop it (the race that cost a whole synthesis).
            self._latched.setdefault(trial_id, received_ns)
            return {"state": "latched", "received_ns": received_ns}

    # -- trial group -------------------------------------------------------
    @ray.method(concurrency_group=TRIAL)
    def load(self, workload: dict) -> dict:
        """Load the workload's engine once; later trials of the workload reuse it.

        Model files are verified against their locks here, once, before
        llama.cpp sees them; the engine gets the verified paths.
        """
        from cancelbench.engine_decls import on_device

        workload = on_device(workload, self.device_id)
        key = json.dumps(workload, sort_keys=True, default=str)
        if key != self._engine_key:
            from cancelbench import native

            from .engines.registry import make_engine
            from .models import resolve_models

            if self._engine is not None:
                self._engine.close()
                self._engine, self._engine_key, self._model_sha256 = None, None, None
            t0 = native.now_ns()
            verified = resolve_models(workload)
            self._engine = make_engine(verified)  # a team's engine: out of process (engines/external.py)
            self._engine_key = key
            self._model_sha256 = verified.get("model_sha256")
            return {"loaded": True, "load_ms": (native.now_ns() - t0) / 1e6, **self._describe()}
        return {"loaded": False, **self._describe()}

    def _describe(self) -> dict:
        return {**self._engine.describe(), "model_sha256": self._model_sha256}

    @ray.method(concurrency_group=TRIAL)
    def run_trial(self, request: TrialRequest) -> TrialRecord:
        """Run one trial. Returns the agent's half of the record (the driver
        merges it with its own and classifies the outcome)."""
        from cancelbench import native

        from .engines.base import CancelControl, Progress, step_stretch

        trial_id, scheduled = request.trial_id, {}
        # a barge-in's microphone and detector are made ready before the hand-back
        bargein = _bargein(request, lambda t: self._fire(trial_id, None, scheduled, t))
        t_handback = native.now_ns()
        ctl = CancelControl(self.token, Progress(step_calls=self._step_calls))
        watch = AnchorWatch(request, t_handback) if request.has_cancel else None
        feed = PhaseFeed() if request.feed_phases and watch is None else None
        if watch is not None or feed is not None:
            ctl.progress.listener = watch or feed
        if bargein is not None:
            bargein.attach(ctl.progress)
        ctl.step_delay = step_stretch(trial_id)  # a test's injected variance; None in real runs
        ctl.cpu = cpu_account.Window(os.getpid())  # an external engine watches its own process (engines/external.py)
        with self._changed:
            self.token.reset()
            self._current = (trial_id, ctl)
            if watch is not None and request.delivery == "driver":
                self._watches[trial_id] = watch
            if feed is not None:
                self._feeds[trial_id] = feed
                while len(self._feeds) > 64:
                    self._feeds.popitem(last=False)
            latched_ns = self._latched.pop(trial_id, None)
            self._changed.notify_all()
        if latched_ns is not None:
            ctl.request(latched_ns)
        if watch is not None and request.delivery == "agent":
            watch.start_timer(lambda due: self._fire(trial_id, due, scheduled), _sleep_until)
        elif bargein is not None and watch is not None:  # the plan's due time is the user's onset
            bargein.start()
            watch.start_timer(bargein.onset_due, _sleep_until)
        try:
            columns = self._run_engine(request, ctl)
        finally:
            if bargein is not None:
                bargein.finish()
            if watch is not None:
                watch.finish()
            if feed is not None:
                feed.finish()
            self._ended(trial_id)
        columns.update(scheduled)
        if watch is not None:
            columns["t_anchor_ns"] = watch.t_anchor_ns
            if request.delivery != "driver":  # due, whether or not the trial was still running then
                columns.setdefault("t_cancel_scheduled_ns", watch.due_ns)
        return agent_half(trial_id=trial_id, t_handback_ns=t_handback, model_sha256=self._model_sha256,
                          **self._trial_columns(ctl, columns, bargein))

    def _ended(self, trial_id: str) -> None:
        """The trial is over: no longer current, remembered as finished (a bounded memory)."""
        from cancelbench import native

        with self._changed:
            self._current = None
            self._finished[trial_id] = native.now_ns()
            while len(self._finished) > 4096:
                self._finished.popitem(last=False)
            while len(self._watches) > 4096:  # never asked for (a driver that went away)
                self._watches.popitem(last=False)
            self._changed.notify_all()

    def _trial_columns(self, ctl, columns: dict, bargein) -> dict:
        """The trial's columns with the cancel's receipt, a barge-in's hops, the host, the
        engine's declaration and the cpu account."""
        if ctl.received_ns is not None:
            columns.update(ctl.at_receipt, t_received_ns=ctl.received_ns,
                           t_native_returned_ns=ctl.native_returned_ns,
                           t_native_observed_ns=ctl.token.seen_ns or None)  # the token the engine armed
        if bargein is not None:
            columns.update(bargein.columns(getattr(self._engine, "sample_rate", None), columns.get("t_terminal_ns"),
                                           columns.get("outcome") == "cancelled"))
        return {"abort_polls": ctl.token.polls, **self._meta_columns(), **columns, **self._engine_columns(),
                **ctl.cpu.columns(), **ctl.cpu.observe_columns(ctl.token.seen_cpu_ns, ctl.token.seen_where)}

    def _engine_columns(self) -> dict:
        """Who the engine is (its declaration); an out-of-process engine adds its own stamps,
        counters and stderr of the trial (ExternalEngine.trial_columns)."""
        engine = self._engine
        if engine is None:
            return {}
        if hasattr(engine, "trial_columns"):
            return engine.trial_columns()
        from cancelbench.engine_decls import DECLARATIONS
        decl = DECLARATIONS.get(engine.kind)
        return {} if decl is None else {"engine_name": decl.name, "engine_version": decl.version}

    def _fire(self, trial_id: str, due_ns: int | None, scheduled: dict, issued: int | None = None) -> None:
        """Agent delivery: the timer thread issues the cancel (its due time recorded); detector
        delivery: the microphone thread, when its detector fired (``issued``; no due time)."""
        from cancelbench import native

        issued = native.now_ns() if issued is None else issued
        scheduled.update(t_issued_ns=issued)
        if due_ns is not None:
            scheduled["t_cancel_scheduled_ns"] = due_ns
        self._deliver(trial_id, issued)

    @property
    def _step_calls(self) -> frozenset[str]:
        from .engines.registry import ENGINES
        spec = ENGINES.get(getattr(self._engine, "kind", None))
        return frozenset() if spec is None else spec.step_calls  # an external engine announces its steps

    def _run_engine(self, request: TrialRequest, ctl) -> dict:
        """The engine's result as record columns; an exception becomes an ``error`` record."""
        from cancelbench import native

        from .engines.base import EngineInputError

        try:
            if self._engine is None:
                raise EngineInputError("no workload loaded on this agent (call load() first)")
            result = self._engine.run(_resolve_input(request), ctl)
        except Exception as exc:  # the record says what failed; the agent stays usable
            from cancelbench.sut.client import EngineError
            from cancelbench.textsafe import error_line

            columns = {"outcome": "error", "t_terminal_ns": native.now_ns(),
                       "error": error_line(f"{type(exc).__name__}: {exc}")}
            if not isinstance(exc, (EngineInputError, EngineError)):  # the harness failed: where, kept apart
                columns["error_detail"] = traceback.format_exc(limit=8)[-4000:]
            return columns
        columns = dict(
            outcome=result.outcome, t_start_ns=result.t_start_ns, t_terminal_ns=result.t_terminal_ns,
            phase_at_terminal=result.phase_at_terminal, decode_rc=result.decode_rc,
            output_sha256=result.output_sha256, n_input_tokens=result.n_input_tokens,
            phase_durations_json=json.dumps(result.phase_durations_ms, sort_keys=True),
            phase_timeline_json=json.dumps([list(seg) for seg in result.phase_segments]),
            phase_steps_json=json.dumps(result.phase_steps, sort_keys=True),
            phase_step_ms_json=json.dumps(result.phase_step_ms, sort_keys=True),
        )
        if isinstance(result.output, dict) and "known_answer_error_ms" in result.output:
            columns["known_answer_error_ms"] = result.output["known_answer_error_ms"]
        return columns

    def _meta_columns(self) -> dict:
        """Host and build metadata, collected once at start, carried on every record."""
        m = self.meta
        return {k: m.get(k) for k in columns_of("host") + ("backend",)}

    @ray.method(concurrency_group=TRIAL)
    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def _bargein(request: TrialRequest, deliver):
    """A barge-in trial's session (device_agents/bargein_run.py); None for every other trial."""
    from .bargein_run import BargeinSession
    return None if request.bargein is None else BargeinSession(request.bargein, deliver)


def _resolve_input(request: TrialRequest) -> TrialRequest:
    """Corpus audio paths are relative to the datasets package on the agent's host."""
    if request.input.endswith(".wav") and not Path(request.input).is_absolute():
        from cancelbench.datasets.paths import DATASETS_DIR
        return dataclasses.replace(request, input=str(DATASETS_DIR / request.input))
    return request


def remote_agent_class():
    """The Ray actor class for :class:`DeviceAgent`."""
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(DeviceAgent)
