"""The agent's side of the engine protocol (docs/sut-protocol.md): start an engine process, read its hello,
check its clock, talk to it, supervise it. One :class:`EngineProcess` per engine process (a child process:
cancelbench.sut.child); a reader thread turns its stdout into
validated messages on a queue (each stamped with the agent's clock when read), another keeps its stderr
(bounded). Used by engines/external.py, the driver's :func:`declare` and sut-check.
"""
from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import threading
import uuid
from dataclasses import dataclass

from cancelbench import native

from . import cancel_word, stall
from .clock import ClockCheck, in_trial  # noqa: F401 (in_trial: the engines' callers)
from .declaration import Declaration
from .child import ChildProcess, SpawnError
from .leftovers import end_leftovers, group_alive  # noqa: F401 (sut-check)
from .protocol import ENGINE_TYPES, MAX_LINE_BYTES, ProtocolError, decode, encode

CLOCK_PINGS = 8
STDERR_KEEP = 8192  # bytes of stderr a record keeps (the last ones)
SHUTDOWN_GRACE_S = 5.0
REACH_PINGS = 64  # round trips of pongs during runs the cancel's reach is taken over (the last ones)


class EngineError(RuntimeError):
    """The engine could not be started or broke the protocol; one line says how."""


@dataclass(frozen=True)
class Received:
    """One line from the engine: the message (None at end of stream), or what was wrong with it."""
    msg: dict | None
    t_read_ns: int
    error: ProtocolError | None = None


def describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with status {rc}"


class EngineProcess:
    def __init__(self, command: list[str], *, cwd: str | None = None, env: dict | None = None,
                 startup_timeout_s: float = 30.0, answer_timeout_s: float = 10.0, cancel_word: bool = True,
                 spawn=ChildProcess) -> None:
        self.command, self.cwd, self.env = list(command), cwd, dict(env or {})
        # what runs the engine: ChildProcess (a process of its own), or channel.ThreadEngine's factory (a
        # simulated engine on a thread of this process); called as ChildProcess is
        self._spawn = spawn
        self.offer_word = cancel_word  # False: no shared cancel word (the line alone), as for an engine without one
        self.startup_timeout_s, self.answer_timeout_s = startup_timeout_s, answer_timeout_s
        self.proc: ChildProcess | None = None
        self.messages: queue.Queue[Received] = queue.Queue()
        self.declaration: Declaration | None = None
        self.clock = ClockCheck(True, 0, 0)
        self._stderr, self._stderr_dropped = bytearray(), 0
        self._stderr_lock = threading.Lock()
        self._write_lock = threading.RLock()  # send_ping holds it around its id and its write
        self.broken: str | None = None  # set once the stream can no longer be trusted
        self.mark = uuid.uuid4().hex
        # Round trips (ns) of the pings this process answered: at start-up, and during runs (the last
        # REACH_PINGS, timed by the trial's reader): how long a line takes to reach it and an answer to come back.
        self.startup_rtts: list[int] = []
        self.run_rtts: collections.deque[int] = collections.deque(maxlen=REACH_PINGS)
        self._timed: dict[int, int] = {}  # ping id -> sent, of the running trial's send_timed pings
        self._reader_tid: int | None = None  # the agent's stdout reader (Linux tid); run delays at the cancel:
        self._waits_at_cancel: stall.RunDelays | None = None
        self.word: cancel_word.CancelWord | None = None  # this process's shared cancel word (start)
        self._ping_id, self._seq = 0, 0  # the last ping's id; the last run's cancel_seq
        self.loaded: dict = {}  # the engine's loaded (load; 1.4: its audio_sample_rate)

    # -- start ---------------------------------------------------------------
    def start(self) -> Declaration:
        """Start the process, read its hello, check its clock. EngineError (one line) on failure;
        the process is gone then."""
        if self.cwd is not None and not os.path.isdir(self.cwd):
            raise EngineError(f"cannot start the engine {self.command[0]!r}: its cwd {self.cwd!r} is not a directory")
        # offered to every engine (unless the workload says not); used with one that declares cancel_word
        self.word = cancel_word.create() if self.offer_word else None
        try:
            self.proc = self._spawn(self.command, cwd=self.cwd, env=self.env, mark=self.mark, word=self.word)
        except SpawnError as exc:
            self._close_word()
            raise EngineError(str(exc)) from None
        if self.word is not None:  # the engine holds its copy now
            self.word.engine_started()
        threading.Thread(target=self._read_stdout, name="engine-stdout", daemon=True).start()
        threading.Thread(target=self._read_stderr, name="engine-stderr", daemon=True).start()
        try:
            first = self._next(self.startup_timeout_s, "its hello")
            if first.msg.get("type") != "hello":
                raise EngineError(f"the engine's first line must be a hello, got a {first.msg.get('type')!r} message")
            try:
                self.declaration = Declaration.from_hello(first.msg)
            except ProtocolError as exc:
                raise EngineError(str(exc)) from None
            self.clock = self._check_clock()
        except BaseException:
            self.kill()
            raise
        return self.declaration

    def _check_clock(self) -> ClockCheck:
        same, best = True, None
        for _ in range(CLOCK_PINGS):
            sent = native.now_ns()
            pong = self.ping()
            back = native.now_ns()
            self.startup_rtts.append(back - sent)
            t = pong.msg["t"]
            same = same and sent <= t <= back
            if best is None or back - sent < best[0]:
                best = (back - sent, t - (sent + back) // 2)
        if same:
            return ClockCheck(True, 0, 0)
        if not -(1 << 62) <= best[1] <= (1 << 62):  # its stamps converted (and the column) must stay in int64
            raise EngineError(f"the engine's clock is {best[1]} ns from the agent's, beyond 2^62 ns: its pongs' t "
                              "is not a monotonic clock reading")
        return ClockCheck(False, best[1], best[0] // 2)

    def ping(self, timeout_s: float | None = None) -> Received:
        """A ping and its pong, between trials (another message is an error; an earlier ping's late pong is skipped)."""
        ping_id, _ = self.send_ping()
        while True:
            got = self._next(timeout_s or self.answer_timeout_s, "a pong")
            if got.msg.get("type") == "pong" and isinstance(got.msg.get("id"), int) and got.msg["id"] < ping_id:
                continue
            if got.msg.get("type") != "pong" or got.msg.get("id") != ping_id:
                raise EngineError(f"expected pong {ping_id}, got {got.msg.get('type')!r} "
                                  f"{str(got.msg.get('id', ''))[:40]!r}")
            return got

    def send_timed(self, msg: dict | None = None) -> int:
        """Write a run's line (``run``, ``cancel``; None: only the ping), then a ping whose round trip, if answered
        before the run's done, is one of the cancel's reach (:meth:`reach_ns`); the agent's clock before the write."""
        with self._write_lock:
            t = None if msg is None else self.send(msg)
            ping_id, sent = self.send_ping()
            self._timed[ping_id] = sent
        return sent if t is None else t

    def took_pong(self, msg: dict, t_read: int) -> None:
        """A pong read during a run: the round trip of its ping, if :meth:`send_timed` sent it."""
        sent = self._timed.pop(msg["id"], None)
        if sent is not None:
            self.run_rtts.append(t_read - sent)

    def end_run(self) -> None:
        """The run's done was read: a pong that comes later was not answered during the run."""
        self._timed.clear()
        self._waits_at_cancel = None

    def stall_ns(self) -> int | None:
        """The cancel's stall since :meth:`send_cancel` (cancelbench.sut.stall); None when not measured."""
        return stall.stall_ns(self._waits_at_cancel, self._run_delays())

    def _run_delays(self) -> stall.RunDelays | None:
        if self.proc is None:
            return None
        return stall.run_delays(self.proc.pid, self._reader_tid, getattr(self.proc, "engine_tids", None))

    @property
    def uses_word(self) -> bool:
        """Cancels go through the shared cancel word (then the line): the engine declared cancel_word."""
        return self.word is not None and self.declaration is not None and self.declaration.can("cancel_word")

    def next_seq(self) -> int | None:
        """The next run's cancel_seq (None: the word is not used). Never 0, never reused in this process."""
        if not self.uses_word:
            return None
        self._seq += 1
        return self._seq

    def send_cancel(self, trial: str, seq: int | None) -> int:
        """Hand a trial's cancel over: its ``seq`` stored in the shared word first (the engine's readers see
        it at their next poll), then the ``cancel`` line (its receipt stamp; engines without the word) and
        the reach ping. The agent's clock just before the first of them."""
        with self._write_lock:
            t = self.word.store(seq) if seq is not None and self.word is not None else None
            t_line = self.send_timed({"type": "cancel", "trial": trial})
        if self._waits_at_cancel is None:  # after the cancel is out: the kernel's figures delay not the cancel
            self._waits_at_cancel = self._run_delays()
        return t_line if t is None else t

    def _close_word(self) -> None:
        with self._write_lock:  # never unmapped under a cancel's store
            word, self.word = self.word, None
            if word is not None:
                word.close()

    def reach_ns(self) -> int:
        """Twice the slowest round trip of the last REACH_PINGS answered during runs (before any, at start-up):
        a cancel's trip in and its done's trip out (docs/sut-protocol.md, "The outcome rule")."""
        return 2 * max(self.run_rtts or self.startup_rtts, default=0)

    def load(self, models: dict, settings: dict) -> dict:
        """``load``; the effective settings (``loaded.settings``); the whole answer in :attr:`loaded`."""
        self.send({"type": "load", "models": models, "settings": settings})
        got = self._next(max(self.startup_timeout_s, self.answer_timeout_s), "loaded")
        if got.msg.get("type") == "error":
            raise EngineError(f"the engine could not load: {' '.join(str(got.msg.get('message')).split())[:500]}")
        if got.msg.get("type") != "loaded":
            raise EngineError(f"expected loaded, got a {got.msg.get('type')!r} message")
        self.loaded = got.msg
        return dict(got.msg.get("settings") or {})

    # -- talking -------------------------------------------------------------
    def send_ping(self) -> tuple[int, int]:
        """A ping with the next id: (its id, the agent's clock when sent). Safe from any thread."""
        with self._write_lock:
            self._ping_id += 1
            ping_id = self._ping_id
            return ping_id, self.send({"type": "ping", "id": ping_id, "t": native.now_ns()})

    def send(self, msg: dict) -> int:
        """Write one message; the agent's clock just before the write. EngineError if the engine is gone."""
        return self.send_line(encode(msg))

    def send_line(self, line: bytes) -> int:
        """Write one line as it is (sut-check's malformed input too); see :meth:`send`."""
        with self._write_lock:
            t = native.now_ns()
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError, AttributeError):
                raise EngineError(f"the engine stopped reading its stdin ({self.exit_description()})") from None
            return t

    def _next(self, timeout_s: float, waiting_for: str) -> Received:
        """The next message; EngineError on timeout, end of stream or a bad line."""
        try:
            got = self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineError(f"the engine said nothing for {timeout_s:g} s while cancelbench waited for "
                              f"{waiting_for}{self.stderr_hint()}") from None
        return self.check(got, waiting_for)

    def check(self, got: Received, waiting_for: str) -> Received:
        if got.error is not None:
            self.broken = str(got.error)
            raise EngineError(f"the engine wrote {got.error}")
        if got.msg is None:
            self.broken = "stdout closed"
            raise EngineError(f"the engine closed its stdout while cancelbench waited for {waiting_for} "
                              f"({self.exit_description(wait_s=1.0)}){self.stderr_hint()}")
        return got

    def _read_stdout(self) -> None:
        stream, self._reader_tid = self.proc.stdout, threading.get_native_id()
        while True:
            try:
                line = stream.readline(MAX_LINE_BYTES + 1)
            except (OSError, ValueError):
                line = b""
            now = native.now_ns()
            if not line:
                self.messages.put(Received(None, now))
                return
            if len(line) > MAX_LINE_BYTES or not line.endswith(b"\n") and len(line) == MAX_LINE_BYTES + 1:
                self.messages.put(Received(None, now, ProtocolError("a line of over 1 MiB (the protocol's limit)")))
                return  # the framing is lost: nothing after it can be trusted
            try:  # a message type of a later protocol revision is ignored (forward compatible)
                msg = decode(line, ENGINE_TYPES, skip_unknown=True)
                if msg is not None:
                    self.messages.put(Received(msg, now))
            except ProtocolError as exc:
                self.messages.put(Received(None, now, exc))

    def _read_stderr(self) -> None:
        stream = self.proc.stderr
        while True:
            try:
                chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            except (OSError, ValueError):
                return
            if not chunk:
                return
            with self._stderr_lock:
                self._stderr += chunk
                if len(self._stderr) > STDERR_KEEP:
                    cut = len(self._stderr) - STDERR_KEEP
                    self._stderr_dropped += cut
                    del self._stderr[:cut]

    def take_stderr(self) -> str | None:
        """What the engine wrote to stderr since the last call (its last 8 KiB), or None."""
        with self._stderr_lock:
            data, dropped = bytes(self._stderr), self._stderr_dropped
            self._stderr.clear()
            self._stderr_dropped = 0
        if not data and not dropped:
            return None
        head = f"[{dropped} earlier bytes not kept]\n" if dropped else ""
        return head + data.decode("utf-8", "replace")

    def stderr_hint(self) -> str:
        with self._stderr_lock:
            tail = bytes(self._stderr[-300:]).decode("utf-8", "replace")
        tail = " | ".join(line.strip() for line in tail.strip().splitlines()[-3:])
        return f"; its stderr: {tail}" if tail else ""

    # -- ending --------------------------------------------------------------
    def exit_description(self, wait_s: float = 0.0) -> str:
        if self.proc is None:
            return "not started"
        try:
            rc = self.proc.wait(timeout=wait_s) if wait_s else self.proc.poll()
        except subprocess.TimeoutExpired:
            rc = None
        return describe_exit(rc)

    def close(self) -> int | None:
        """``shutdown``, then SIGTERM and SIGKILL to the group if it lingers; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.send({"type": "shutdown"})
                self.proc.stdin.close()
            except (EngineError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=SHUTDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int | None:
        """Whatever is left of the engine (its process group: SIGTERM, then SIGKILL); its exit status."""
        if self.proc is None:
            return None
        rc = self.proc.end()
        self._close_word()
        return rc


def declare(command: list[str], *, cwd: str | None = None, env: dict | None = None,
            startup_timeout_s: float = 30.0) -> Declaration:
    """Start the engine once, read its hello, shut it down: the driver's pre-flight."""
    engine = EngineProcess(command, cwd=cwd, env=env, startup_timeout_s=startup_timeout_s)
    try:
        return engine.start()
    finally:
        engine.close()
