"""What every engine shares: progress, the per-trial cancel control, results.

An engine runs one trial at a time on the agent's trial thread. ``cancel()``
runs on another thread (a separate Ray concurrency group) and only touches
:class:`CancelControl`, which is safe to use from both sides: the native token
is atomic, the Python flag is a plain bool written once.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

from cancelbench import failpoints, native

T = TypeVar("T")


class EngineInputError(ValueError):
    """Bad input for an engine (empty text, wrong sample rate, missing model...)."""


# The llama.cpp settings every llama engine holds as attributes (engine_settings resolves them).
LLAMA_SETTING_NAMES = ("n_threads", "n_ctx", "n_batch", "n_ubatch", "chunk_tokens", "n_gpu_layers",
                       "use_extra_bufts", "graph_slice_us")


def engine_settings(kind: str, workload: dict) -> dict:
    """Built-in engine ``kind``'s settings, resolved by the declarations' one home of defaults
    (``cancelbench.engine_decls.resolve_settings``): an engine holds no default of its own. The
    agent resolves n_gpu_layers for its device before it builds one; an engine built outside an
    agent (tests, benchmarks, the protocol's builtin server) without it is on the CPU."""
    from cancelbench.engine_decls import resolve_settings
    from cancelbench.sut.declaration import SettingError

    try:
        return resolve_settings(kind, workload, f"engine {kind}", device_id="cpu")
    except SettingError as exc:
        raise EngineInputError(str(exc)) from None


class Cancelled(Exception):
    """Raised inside a trial once the engine has honoured the cancel: the trial
    unwinds to its terminal state from wherever it was."""


@dataclass
class Progress:
    """Live engine state; read by cancel() to snapshot the state at receipt."""

    phase: str = "idle"
    native_call: str | None = None
    input_tokens_done: int = 0
    tokens_generated: int = 0
    frames_generated: int | None = None
    heavy_graph: str | None = None  # e.g. "code2wav", "clip_encode" while one runs
    # Called on the trial thread at engine events: ("phase", phase, t_ns) on entry into
    # a phase, ("step", phase, t_ns) when a step call starts, ("step_end", phase, t_ns)
    # when it returns. The agent anchors cancels on them (device_agents/anchors.py).
    listener: Callable[[str, str, int], None] | None = None
    step_calls: frozenset[str] = frozenset()  # the engine's step calls (registry.EngineSpec.step_calls)
    steps: dict[str, int] = field(default_factory=dict)  # phase -> step calls started
    step_min_ns: dict[str, int] = field(default_factory=dict)  # phase -> shortest step call
    # Audio engines: called with the samples handed over so far and the time, each time the
    # engine has more audio a player could take (barge-in's playback model, bargein_run.py).
    audio_listener: Callable[[int, int], None] | None = None

    def hand_audio(self, total_samples: int, t_ns: int | None = None) -> None:
        """``t_ns``: when they were handed over (an engine's own stamp on the agent's clock); None: now."""
        if self.audio_listener is not None:
            self.audio_listener(total_samples, native.now_ns() if t_ns is None else t_ns)

    def step_ms(self) -> dict[str, float]:
        """The shortest step call of each phase, ms."""
        return {p: ns / 1e6 for p, ns in self.step_min_ns.items()}

    def emit(self, event: str, phase: str, t_ns: int) -> None:
        if self.listener is not None:
            self.listener(event, phase, t_ns)

    def snapshot(self) -> dict:
        return {
            "phase_at_receipt": self.phase,
            "native_call_at_receipt": self.native_call,
            "input_tokens_done_at_receipt": self.input_tokens_done,
            "tokens_generated_at_receipt": self.tokens_generated,
            "frames_generated_at_receipt": self.frames_generated,
            "heavy_graph_at_receipt": self.heavy_graph,
        }


class CancelControl:
    """Per-trial cancel state, shared by the trial thread and the cancel thread.

    * ``requested`` is the Python-level flag every mechanism checks between
      native calls (the status quo).
    * ``token`` is the native byte read by ``cb_token_reader`` inside native code;
      it is armed on the context only for mechanisms that use it, but it is
      always set on cancel so its set time is recorded.
    A cancel that arrives before the trial starts is latched by the agent and
    applied with :meth:`request` before the first native call.
    """

    def __init__(self, token: native.CancelToken, progress: Progress) -> None:
        self.token = token
        self.progress = progress
        self._lock = threading.Lock()
        self.requested = False
        self.received_ns: int | None = None
        self.at_receipt: dict = {}
        self.native_returned_ns: int | None = None
        self.last_rc: int | None = None  # return code of the last native call made through call_rc
        # Test-only variance injection (cancelbench.failpoints.step_delay, set by the agent): called
        # inside each step call, so the step is longer and still in flight. None in real runs.
        self.step_delay: Callable[[int], None] | None = None  # (the step call's start, agent ns)
        self._in_flight_at_receipt = False
        # The native call now in flight began at _call_t0 (the heavy graph it runs: _call_heavy); the last
        # one to return was (name, start, end, heavy graph). A receipt stamped before request() ran (a line
        # read on another thread) is placed by them.
        self._call_t0 = 0
        self._call_heavy: str | None = None
        self._last_call: tuple[str, int, int, str | None] | None = None
        self._closed = False
        # An out-of-process engine's forwarder (engines/external.py): called, under the lock,
        # when a cancel is taken, so the cancel reaches the engine process.
        self._forward: Callable[[], None] | None = None
        # The engine process's CPU accounting over receipt -> terminal (device_agents/cpu_account.py,
        # a Window set by the agent); None: not accounted.
        self.cpu = None

    def attach(self, forward: Callable[[], None] | None) -> bool:
        """Forward every cancel taken from now on with ``forward()`` (None: stop). Returns
        whether a cancel was already taken (latched before the run): the caller forwards it."""
        with self._lock:
            self._forward = forward
            return self.requested

    def request(self, received_ns: int) -> bool:
        """Record the cancel and set both flags. Returns False if already requested, or
        if the engine has already reached its terminal state (:meth:`close`): a cancel
        that comes after the engine's last decision is not this trial's."""
        with self._lock:
            if self.requested or self._closed:
                return False
            self.received_ns = received_ns
            self.at_receipt = self.progress.snapshot()
            call, returned, heavy = self._call_at(received_ns)
            self.at_receipt["native_call_at_receipt"] = call
            self.at_receipt["heavy_graph_at_receipt"] = heavy
            self.native_returned_ns = returned  # None while that call still runs: its return stamps it
            self._in_flight_at_receipt = call is not None and returned is None
            # The flag before the byte: a native call a reader stopped must find the
            # flag set when it returns (its half-computed outputs are never used).
            self.requested = True
            self.token.set()
            if self._forward is not None:
                try:
                    self._forward()
                except Exception:  # the engine is gone: its trial ends with the error it sees
                    pass
            cpu = self.cpu
            if cpu is not None:
                cpu.owe_receipt()  # a terminal snapshot (close) waits for this receipt's
        if cpu is not None:  # after the cancel is set and the lock released: it delays neither
            cpu.at_receipt()
        return True

    def _call_at(self, t: int) -> tuple[str | None, int | None, str | None]:
        """The native call in flight at ``t``, when it returned if it has since, and the heavy graph it
        runs (code2wav, clip_encode); under the lock. The call now in flight if it began by then; else
        the last one, if ``t`` fell inside it; else none."""
        if self.progress.native_call is not None and self._call_t0 <= t:
            return self.progress.native_call, None, self._call_heavy
        last = self._last_call
        if last is not None and last[1] <= t <= last[2]:
            return last[0], last[2], last[3]
        return None, None, None

    def _take_word(self) -> None:
        """The token set by no :meth:`request`: an engine process's native reader latched it from the
        shared cancel word (cb_token_watch) before the cancel line was read. Taken as received then."""
        if not self.requested and self.token.watching is not None and self.token.is_set():
            self.request(self.token.set_ns)

    def close(self) -> tuple[bool, int]:
        """The engine's terminal decision, atomic with :meth:`request`: (whether a cancel
        was received, the terminal time). A cancel received before it is honoured; one
        after it is refused, so no record can say "received before the terminal state"
        of a cancel the engine never had a chance to see (a false *dropped*)."""
        self._take_word()
        with self._lock:
            self._closed = True
            requested, t_terminal = self.requested, native.now_ns()
        if requested and self.cpu is not None:
            self.cpu.at_terminal()
        return requested, t_terminal

    def adopt_token(self, token: native.CancelToken) -> None:
        """Make ``token`` this trial's native token (a hook bound to one token at
        context creation, e.g. mtmd's cb_eval, needs its own). A cancel already
        received stays latched on the new token."""
        with self._lock:
            if self.token is token:
                return
            watching = self.token.watching
            token.reset()
            if watching is not None:  # the shared cancel word follows the trial to its new token
                token.watch(*watching)
            if self.requested:
                token.set()
            self.token = token

    def check(self) -> None:
        """Honour a cancel between native calls (every mechanism does this)."""
        self._take_word()
        if self.requested:
            raise Cancelled

    def call(self, name: str, fn: Callable[..., T], *args) -> T:
        """One native call that may be cancelled: checked before and after.

        The check after it also covers a call that a native reader stopped
        (llama_decode returning 2, a clip graph that stopped silently and
        returned half-computed outputs): its result is never used.
        """
        self.check()
        with self.native_call(name):
            out = fn(*args)
        self.check()
        return out

    def call_rc(self, name: str, fn: Callable[..., int], *args) -> int:
        """:meth:`call` for a call returning a status code, kept in ``last_rc``
        even when the call was stopped (llama_decode's 2 is the evidence)."""
        self.check()
        with self.native_call(name):
            self.last_rc = rc = int(fn(*args))
        self.check()
        return rc

    @contextmanager
    def native_call(self, name: str) -> Iterator[None]:
        """Wrap one native call: progress shows it in flight; its return is timed
        if a cancel arrived while it ran (``t_native_returned_ns``). A step call
        (the engine's unit of progress) is counted per phase and announced."""
        progress = self.progress
        self._call_heavy = heavy = progress.heavy_graph  # the engine names a heavy graph before its call
        self._call_t0 = t0 = native.now_ns()  # before the name: a receipt that finds the name finds its start
        progress.native_call = name
        step = name in progress.step_calls
        if step:
            progress.steps[progress.phase] = progress.steps.get(progress.phase, 0) + 1
            progress.emit("step", progress.phase, t0)
        try:
            yield
            if step and self.step_delay is not None:
                self.step_delay(t0)
        finally:
            now = native.now_ns()
            if self.token.watching is not None and not self.requested:
                # An engine process: its reader may have latched the shared word inside this call
                # before the cancel line was read. Taken now, while the call still shows in flight,
                # so its return is stamped as one a cancel reached (the agent's process: no read).
                self._take_word()
            if step:
                took, shortest = now - t0, progress.step_min_ns.get(progress.phase)
                if shortest is None or took < shortest:
                    progress.step_min_ns[progress.phase] = took
                progress.emit("step_end", progress.phase, now)
            with self._lock:
                self.progress.native_call = None
                self._last_call = (name, t0, now, heavy)
                if self._in_flight_at_receipt and self.native_returned_ns is None:
                    self.native_returned_ns = now


@dataclass
class EngineResult:
    """What an engine returns for one trial (agent clock ns)."""

    outcome: str  # "cancelled" | "completed"
    t_start_ns: int
    t_terminal_ns: int
    phase_at_terminal: str
    decode_rc: int | None = None
    output_sha256: str | None = None
    phase_durations_ms: dict[str, float] = field(default_factory=dict)
    phase_segments: list[tuple[str, float, float]] = field(default_factory=list)
    n_input_tokens: int | None = None
    phase_steps: dict[str, int] = field(default_factory=dict)  # phase -> step calls started
    phase_step_ms: dict[str, float] = field(default_factory=dict)  # phase -> shortest step call (ms)
    output: object = None  # tokens / text / pcm kept agent-side (not recorded)


class PhaseClock:
    """Accumulates wall time per phase on the agent clock."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.durations_ms: dict[str, float] = {}
        self.segments: list[tuple[str, float, float]] = []  # (phase, start_ms, end_ms) from t0
        self._t0 = self._t = native.now_ns()

    def enter(self, phase: str) -> None:
        now = native.now_ns()
        prev = self.progress.phase
        if prev == phase:
            return
        self.progress.emit("phase", phase, now)
        if prev not in ("idle", None):
            self.durations_ms[prev] = self.durations_ms.get(prev, 0.0) + (now - self._t) / 1e6
            start, end = (self._t - self._t0) / 1e6, (now - self._t0) / 1e6
            if self.segments and self.segments[-1][0] == prev and self.segments[-1][2] == start:
                self.segments[-1] = (prev, self.segments[-1][1], end)
            else:
                self.segments.append((prev, start, end))
        self.progress.phase = phase
        self._t = now

    def close(self) -> dict[str, float]:
        self.enter("done")
        return dict(self.durations_ms)


def finish_trial(ctl: CancelControl, clock: PhaseClock, *, stopped: bool, t_start_ns: int,
                 decode_rc: int | None, n_input_tokens: int | None, output: object,
                 output_sha256: str | None) -> EngineResult:
    """The engine's terminal state. A cancel that landed during the last native
    call is honoured too: the caller gets "cancelled", never a result it asked to stop."""
    requested, t_terminal = ctl.close()
    stopped = stopped or requested
    phase_at_terminal = ctl.progress.phase
    durations = clock.close()
    return EngineResult(
        outcome="cancelled" if stopped else "completed",
        t_start_ns=t_start_ns,
        t_terminal_ns=t_terminal,
        phase_at_terminal=phase_at_terminal,
        decode_rc=decode_rc,
        output_sha256=None if stopped else output_sha256,
        phase_durations_ms=durations,
        phase_segments=clock.segments,
        n_input_tokens=n_input_tokens,
        phase_steps=dict(ctl.progress.steps),
        phase_step_ms=ctl.progress.step_ms(),
        output=output,
    )


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def release(owner: object, *handles: tuple[str, Callable[[object], object]]) -> None:
    """Free the native handles ``owner`` holds in these attributes, in this order.

    Each is freed at most once and set to None, so ``close()`` may run twice
    (and after a constructor that failed half-way)."""
    for attr, free in handles:
        handle = getattr(owner, attr, None)
        if handle:
            free(handle)
            setattr(owner, attr, None)


def step_stretch(trial_id: str):
    """The agent's step delay of this trial (cancelbench.failpoints.step_delay): called inside each
    step call with its start (agent ns), it makes the call last ``factor`` times as long; None: none."""
    factor = failpoints.step_delay(trial_id)
    if factor is None:
        return None
    never_set = native.CancelToken()

    def stretch(t_start_ns: int) -> None:
        # Busy in native code, through ctypes, so the GIL is free as it is in the engine's own
        # native calls. A Python busy loop held it: the agent's anchor reply and cancel threads
        # then waited for the interpreter's 5 ms switch interval, an event hop no real engine
        # causes, and driver-delivered cancels missed phases they reach in real runs.
        extra_us = int((factor - 1.0) * (native.now_ns() - t_start_ns) / 1e3)
        if extra_us > 0:
            native.probe_busy(never_set, extra_us, extra_us)

    return stretch
