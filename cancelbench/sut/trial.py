"""One run on the engine's side (cancelbench.sut.server): the :class:`Trial` an engine's
``run`` gets (its request, its event methods, its cancel state) and the :class:`Result`
it returns."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from cancelbench import native
from cancelbench.sut.protocol import AT_RECEIPT_FIELDS, AT_RECEIPT_NAMES, AUDIO_CHUNK_MAX, AUDIO_OUT, SEEN_WHERE
from cancelbench.sut.trial_thread import Reading, TrialThread

if TYPE_CHECKING:
    from .server import Server

ERROR_MAX = 2000
WORD_POLL_S = 0.0005  # how often a wait looks at the shared cancel word (no thread wakes for it)
now_ns = time.monotonic_ns  # the clock the hello declares and the pongs read (CLOCK_MONOTONIC on Linux)


@dataclass
class Result:
    """What ``engine.run`` returns: the trial's terminal state (the ``done`` message).

    ``t_terminal_ns`` defaults to when the trial's terminal decision was taken
    (:meth:`Trial.terminal`, called by the server when run returns if the engine did
    not); ``phase`` to the last phase entered. ``counters`` are name -> int (None
    values are left out); so is ``at_receipt``, the engine's progress when it took the
    cancel (``protocol.AT_RECEIPT_FIELDS``), sent only with a receipt."""

    outcome: str  # completed | cancelled | error
    t_terminal_ns: int | None = None
    phase: str | None = None
    output_sha256: str | None = None
    error: str | None = None
    counters: dict[str, int | None] = field(default_factory=dict)
    native_returned_ns: int | None = None
    at_receipt: dict[str, int | None] = field(default_factory=dict)


def one_line(text: str, limit: int = ERROR_MAX) -> str:
    return " ".join(str(text).split())[:limit] or "(no message)"


class Trial:
    """One run: its request, its event methods and its cancel state.

    Thread-safety: the cancel side (:meth:`_deliver`) runs on the stdin thread, the
    rest on the engine's thread. ``on_cancel`` is called under the trial's lock, on
    the stdin thread, when the first cancel for this trial is read (or at once, on the
    setting thread, when it is set on a trial that already has one: a latched cancel).
    If it returns ``False`` the cancel is refused as after the terminal state (e.g.
    ``CancelControl.request`` after ``close``) and not recorded.

    From the moment a cancel is taken to the ``done``, the trial's events are held, not
    written (:meth:`hold_events`): the engine's stop does no I/O, as an engine in the agent's
    own process does none, and each event still carries its own ``t``. They are written, in
    order, just before the ``done``."""

    def __init__(self, server: Server, msg: dict, t_read: int) -> None:
        self._server = server
        self.id: str = msg["trial"]
        self.input: str = msg["input"]
        self.mechanism: str = msg["mechanism"]
        self.settings: dict = dict(msg.get("settings") or {})
        self.output_path: str | None = msg.get("output_path")
        # The shared cancel word (docs/sut-protocol.md): this run's number in it, and its address
        # when the agent handed one over (server.word); None: cancels come by the line alone.
        self.cancel_seq: int | None = msg.get("cancel_seq")
        self.word: int | None = server.word if self.cancel_seq else None
        self.cancel_via: str | None = None  # word | line: how the receipt came
        self.run_received_ns = t_read
        self._decl = server.declaration
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._on_cancel: Callable[[int], object] | None = None
        self._closed = False
        self._t_terminal: int | None = None
        self.cancel_received_ns: int | None = None
        self.current_phase: str | None = None
        self._in_step = False
        self._seen_sent = False
        self._hold_lock = threading.Lock()
        self._held: list[dict] | None = None  # events kept from the cancel's taking to the done
        # the trial thread's CPU account (done.cpu): built on the thread engine.run runs on
        self.thread = TrialThread()

    # -- cancel side -------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        """A cancel for this trial was read (latched before the run or during it), or the shared
        cancel word holds this run's number (then recorded as the receipt, as a read cancel is)."""
        return self._event.is_set() or self._word_says()

    def _word_says(self) -> bool:
        """The word holds this run's cancel_seq: delivered (through on_cancel, as a line is)."""
        if self.word is None or native.word_load(self.word) != self.cancel_seq:
            return False
        self._deliver(now_ns(), "word")
        return self._event.is_set()

    def took_cancel(self, t: int, via: str = "word", reading: Reading | None = None) -> bool:
        """The engine's own cancel state took this trial's cancel at ``t`` (its native reader saw the
        shared word before the line was read): the receipt, unless one is recorded or the trial has
        reached its terminal decision. on_cancel is not called (the engine has it already).
        ``reading``: the trial thread's (CPU ns, run delay ns or None) at ``t`` where the engine
        stamped it (a reader on that thread latched the word); None: the receipt has no reading."""
        with self._lock:
            if self._closed or self.cancel_received_ns is not None:
                return False
            self.cancel_received_ns, self.cancel_via = t, via
            if reading is not None:
                self.thread.take("receipt", reading)
            self._event.set()
        self.hold_events()
        return True

    @property
    def on_cancel(self) -> Callable[[int], object] | None:
        return self._on_cancel

    @on_cancel.setter
    def on_cancel(self, hook: Callable[[int], object] | None) -> None:
        with self._lock:
            self._on_cancel = hook
            if hook is not None and self.cancel_received_ns is not None and not self._closed:
                hook(self.cancel_received_ns)

    def _deliver(self, t_read: int, via: str = "line") -> bool:
        """A cancel read at ``t_read`` (stdin thread), or seen in the shared word (``via``). True if recorded."""
        with self._lock:
            if self._closed or self.cancel_received_ns is not None:
                return False
            hook = self._on_cancel
            if hook is not None and hook(t_read) is False:
                return False
            self.cancel_received_ns, self.cancel_via = t_read, via
            self.thread.take("receipt")  # after the hook set the engine's cancel, as the agent reads in process
            self._event.set()
        self.hold_events()
        return True

    def wait_cancel(self, timeout: float | None = None) -> bool:
        """Block until a cancel is read or the word holds this run's number (True), or ``timeout`` s
        pass (False). With a word, the wait looks at it every WORD_POLL_S."""
        if self.word is None:
            return self._event.wait(timeout)
        end = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while not self.cancelled:
            left = WORD_POLL_S if end is None else min(WORD_POLL_S, end - time.monotonic())
            if left <= 0:
                return False
            self._event.wait(left)
        return True

    def sleep(self, seconds: float) -> bool:
        """Sleep ``seconds``, returning early (True) if a cancel is read (or seen in the word)."""
        return self.wait_cancel(max(0.0, seconds))

    def terminal(self) -> tuple[bool, int]:
        """The trial's terminal decision, atomic with cancel delivery: (a cancel was
        read before it, its time). Cancels read after it are ignored as late."""
        if not self._closed:
            self._word_says()  # a word stored before the decision is a cancel received before it
        with self._lock:
            if not self._closed:
                self._closed = True
                self._t_terminal = now_ns()
                self.thread.take("terminal")
            return self.cancel_received_ns is not None, self._t_terminal

    # -- events ------------------------------------------------------------
    def hold_events(self) -> None:
        """Keep this trial's events from now to its ``done`` instead of writing them: a cancel was taken
        (read, or latched by the engine's own reader: call it then), and the stop should not wait on a
        pipe. Each keeps its own ``t``; :meth:`_done` writes them, in order, before the ``done``."""
        with self._hold_lock:
            if self._held is None:
                self._held = []

    def _send(self, msg: dict) -> None:
        with self._hold_lock:
            if self._held is not None:
                self._held.append(msg)
                return
        self._server.send(msg)

    def _write_held(self) -> None:
        with self._hold_lock:
            held, self._held = self._held or [], None
        for msg in held:
            self._server.send(msg)

    def phase(self, name: str, t: int | None = None) -> None:
        """Entered phase ``name`` (a declared one). Entering the current phase again
        is no event; a step in flight is ended first."""
        if name not in self._decl.phase_names:
            raise ValueError(f"phase {name!r} is not declared (declared: {', '.join(self._decl.phase_names)})")
        if name == self.current_phase:
            return
        t = now_ns() if t is None else t
        if self._in_step:
            self.step_end(t)
        self.current_phase = name
        self._send({"type": "phase", "trial": self.id, "phase": name, "t": t})

    def step_start(self, t: int | None = None) -> None:
        if self.current_phase is None or self.current_phase not in self._decl.step_phases:
            raise ValueError(f"a step in phase {self.current_phase!r}, which is not declared with steps")
        if self._in_step:
            raise ValueError("step_start with a step already started")
        self._in_step = True
        self._send({"type": "step", "trial": self.id, "phase": self.current_phase, "edge": "start",
                    "t": now_ns() if t is None else t})

    def step_end(self, t: int | None = None) -> None:
        if not self._in_step:
            raise ValueError("step_end without a step started")
        self._in_step = False
        self._send({"type": "step", "trial": self.id, "phase": self.current_phase, "edge": "end",
                    "t": now_ns() if t is None else t})

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step call: start before, end after (also when it raises)."""
        self.step_start()
        try:
            yield
        finally:
            if self._in_step:
                self.step_end()

    def cancel_seen(self, t: int | None = None, where: str | None = None, cpu_t: int | None = None) -> None:
        """The native layer observed the cancel at ``t`` (sent at most once); ``where`` a reader
        inside a graph saw it (``range_end`` | ``next_ask``) and ``cpu_t`` the trial thread's CPU
        clock then (ns; the reader runs on it), where the engine knows them (protocol 1.3)."""
        if self._seen_sent:
            return
        self._seen_sent = True
        msg = {"type": "cancel_seen", "trial": self.id, "t": now_ns() if t is None else t}
        if where in SEEN_WHERE:
            msg["where"] = where
        if cpu_t:
            msg["cpu_t"] = int(cpu_t)
        self._send(msg)

    def audio(self, samples: int, t: int | None = None) -> None:
        """``samples`` of audio handed over to playback at ``t`` (1.4: an engine that declares
        ``audio_out``; a streaming app would play them now). A chunk over the protocol's bound
        is sent as several events at the same time."""
        if not self._decl.can(AUDIO_OUT):
            raise ValueError(f"audio from an engine that does not declare the capability {AUDIO_OUT}")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"audio samples must be a count, got {samples!r}")
        t = now_ns() if t is None else t
        while samples > 0:
            n = min(samples, AUDIO_CHUNK_MAX)
            self._send({"type": "audio", "trial": self.id, "t": t, "samples": n})
            samples -= n

    # -- the end -----------------------------------------------------------
    def _done(self, result: Result) -> dict:
        _, t_decided = self.terminal()
        if self._in_step:
            self.step_end()
        self._write_held()
        phase = result.phase or self.current_phase or self._decl.phase_names[0]
        msg = {"type": "done", "trial": self.id, "outcome": result.outcome,
               "t": t_decided if result.t_terminal_ns is None else int(result.t_terminal_ns), "phase": phase}
        if self.cancel_received_ns is not None:
            msg["cancel_received_t"] = self.cancel_received_ns
            msg["cancel_via"] = self.cancel_via or "line"
            at_receipt = {k: int(v) for k, v in result.at_receipt.items() if k in AT_RECEIPT_FIELDS and v is not None}
            for name in AT_RECEIPT_NAMES:  # 1.4 heavy_graph, 1.5 native_call
                if isinstance(result.at_receipt.get(name), str):
                    at_receipt[name] = result.at_receipt[name]
            if at_receipt:
                msg["at_receipt"] = at_receipt
        self.thread.take("end")
        cpu = self.thread.fields(self.cancel_received_ns is not None)
        if cpu:
            msg["cpu"] = cpu
        if result.native_returned_ns is not None:
            msg["native_returned_t"] = int(result.native_returned_ns)
        if result.output_sha256 is not None:
            msg["output_sha256"] = result.output_sha256
        if result.outcome == "error" or result.error is not None:
            msg["error"] = one_line(result.error or "the engine failed without saying why")
        counters = {k: int(v) for k, v in (result.counters or {}).items() if v is not None}
        if counters:
            msg["counters"] = counters
        return msg
