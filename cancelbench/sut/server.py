"""The engine's side of the protocol (docs/sut-protocol.md), for engines written in Python.

Declare the engine, implement ``load`` and ``run``, call :func:`main` (or
:func:`serve`)::

    from cancelbench.sut.declaration import Declaration, MechanismInfo, Phase, Setting
    from cancelbench.sut.server import Result, main

    class Echo:
        declaration = Declaration(
            name="echo", version="1.0", input="text",
            phases=(Phase("think", steps=True),),
            mechanisms=(MechanismInfo("flag", "a flag checked between steps"),),
            settings=(Setting("steps", "int", 10, min=1),))

        def load(self, models: dict, settings: dict) -> dict | None:
            self.steps = settings["steps"]      # every declared setting is there
            return None                          # or {name: effective value} it chose itself

        def run(self, trial: Trial) -> Result:
            trial.phase("think")
            for _ in range(self.steps):
                if trial.cancelled:              # read on the stdin thread; latched ones too
                    return Result("cancelled")
                with trial.step():               # step start/end events
                    trial.sleep(0.01)            # real work; returns early on a cancel
            return Result("completed", output_sha256=...)

    if __name__ == "__main__":
        main(Echo())

The API:

* ``serve(engine, *, stdin=None, stdout=None, eof_grace_s=4.0) -> int``: speaks the
  protocol until ``shutdown`` or end of stdin; returns the exit status (0). Without
  ``stdin``/``stdout`` it uses file descriptors 0 and 1, and points fd 1 (and
  ``sys.stdout``) at stderr so a stray ``print`` or a native library's log cannot
  corrupt the protocol. ``main(engine)`` is ``serve`` then ``os._exit`` with its status
  (no interpreter teardown racing the stdin thread).
* ``engine.declaration``: a :class:`~cancelbench.sut.declaration.Declaration`, sent as
  ``hello``.
* ``engine.load(models, settings) -> dict | None``: ``loaded`` (with the returned
  effective settings); an exception answers ``error`` of ``load`` (one line).
* ``engine.run(trial) -> Result``: one trial at a time, on the main thread. The server
  sends ``done`` from the result, with ``cancel_received_t`` whenever a cancel for the
  trial was read before the trial's terminal decision; an exception is a ``done`` with
  outcome ``error`` and the exception as one line.
* ``engine.close()`` (optional): called once before :func:`serve` returns.
* An engine whose declaration has the capability ``audio_out`` (1.4) hands its audio over
  with :meth:`Trial.audio` and has an ``audio_sample_rate`` attribute (an int, Hz) once
  ``load`` has returned: ``loaded.audio_sample_rate``.

What the server does on its stdin thread, at once, even during a run: answers ``ping``
with ``pong`` (``t``: when the ping was read); stamps every ``cancel`` when read and
forwards one for the running trial to it (:attr:`Trial.cancelled`,
:attr:`Trial.on_cancel`), latches one for a trial not run yet (the last 1024 ids; the
run then starts already cancelled) and ignores one for a finished trial; answers a line
that is not JSON, too long, malformed or of an unknown type with ``error`` and carries
on. At end of stdin during a run, it cancels the run; the server returns after it (and
the process exits anyway ``eof_grace_s`` later if the run does not end: nobody is
listening).

From a trial's cancel taken to its ``done`` the trial's events are held, not written
(:meth:`Trial.hold_events`; an engine whose own native reader took the cancel, such as one
latching the shared cancel word, calls it then): the stop writes nothing to the pipe, and
the events, each with its own ``t``, are written in order just before the ``done``.

Timestamps are ``time.monotonic_ns()`` (Linux ``CLOCK_MONOTONIC``, what
``cancelbench.native.now_ns`` reads too), the clock the hello declares and the pongs
use. Every event method takes an optional ``t`` for a time taken elsewhere (by native
code) on that clock.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections import OrderedDict
from typing import Callable, Protocol

from . import cancel_word
from .declaration import Declaration
from .trial import Result, Trial, one_line  # noqa: F401 (the engine API: server.Result)
from .protocol import AGENT_TYPES, AUDIO_OUT, CANCEL_WORD, MAX_LINE_BYTES, ProtocolError, encode, validate
from .protocol import decode as decode_line
from .protocol import type_of

from .trial import now_ns  # noqa: E402
LIBRARY_CAPABILITIES = (CANCEL_WORD,)  # what this library implements for every engine it serves
LATCHED_MAX = 1024  # cancels kept for trials not run yet
FINISHED_MAX = 4096  # trial ids whose late cancels are ignored
_EOF = object()


class Engine(Protocol):
    declaration: Declaration

    def load(self, models: dict, settings: dict) -> dict | None: ...

    def run(self, trial: Trial) -> Result: ...


class _Lines:
    """Newline framing over ``read(n) -> bytes`` with the 1 MiB limit: yields
    ``(line, t_read)``; an over-long line is discarded and yields ``(None, t)``."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self._buf = bytearray()
        self._eof = False

    def next(self) -> tuple[bytes | None, int] | None:
        discarding = False
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i + 1])
                del self._buf[:i + 1]
                if discarding or len(line) > MAX_LINE_BYTES:
                    return None, now_ns()
                return line, now_ns()
            if len(self._buf) > MAX_LINE_BYTES:
                self._buf.clear()
                discarding = True
            if self._eof:
                if discarding:
                    return None, now_ns()
                if self._buf:
                    line = bytes(self._buf)
                    self._buf.clear()
                    return line, now_ns()
                return None
            try:
                chunk = self._read(1 << 16)
            except (OSError, ValueError):
                chunk = b""
            if not chunk:
                self._eof = True
            else:
                self._buf += chunk


class Server:
    """The protocol state of one engine process (see :func:`serve`)."""

    def __init__(self, engine: Engine, read: Callable[[int], bytes], write: Callable[[bytes], None],
                 eof_grace_s: float | None = 4.0, word: int | None = None) -> None:
        self.engine = engine
        self.declaration: Declaration = engine.declaration
        self._read = read
        self._write = write
        self.eof_grace_s = eof_grace_s
        self.stdout_lock = threading.Lock()  # every line to stdout is written under it
        self._out_closed = False
        self._state = threading.Lock()  # current trial, latched and finished ids
        self._current: Trial | None = None
        self._latched: OrderedDict[str, int] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._queue: queue.Queue = queue.Queue()
        self._eof = threading.Event()
        self._run_over = threading.Event()
        self._run_over.set()
        self.reader_tid: int | None = None  # the stdin thread's (Linux tid), once it runs
        # The shared cancel word the agent handed over (its address; None: none, or it cannot be mapped):
        # every Trial with a run.cancel_seq looks at it (Trial.cancelled, sleep, terminal). A process's is the
        # one it inherited (make_server); an engine in the agent's own process is given it (sut/channel.py).
        self.word = word

    # -- output ------------------------------------------------------------
    def write_line(self, line: bytes) -> bool:
        """Write one raw line (already framed) under the stdout lock, flushed. False once
        stdout is gone (the agent closed it): nothing more is written."""
        with self.stdout_lock:
            if self._out_closed:
                return False
            try:
                self._write(line)
                return True
            except (OSError, ValueError):
                self._out_closed = True
                return False

    def send(self, msg: dict) -> bool:
        return self.write_line(encode(msg))

    def close_output(self, close: Callable[[], None]) -> None:
        """Nothing more is written (as once stdout is gone), then ``close()`` under the stdout lock: a
        writer on another thread (the stdin thread's pongs) never writes to the stream once closed."""
        with self.stdout_lock:
            self._out_closed = True
            close()

    def error(self, of: str | None, message: str) -> None:
        self.send({"type": "error", "of": of, "message": one_line(message)})

    # -- the stdin thread --------------------------------------------------
    def _reader(self) -> None:
        self.reader_tid = threading.get_native_id()
        lines = _Lines(self._read)
        while True:
            item = lines.next()
            if item is None:
                break
            line, t = item
            if line is None:
                self.error(None, f"a line of over {MAX_LINE_BYTES} bytes (the limit is 1 MiB)")
                continue
            if not line.strip():
                continue
            try:
                msg = decode_line(line, AGENT_TYPES)
            except ProtocolError as exc:
                kind = type_of(line)
                self.error(None if kind is None else kind[:64], str(exc))
                continue
            kind = msg["type"]
            if kind == "ping":
                self.send({"type": "pong", "id": msg["id"], "t": t})
            elif kind == "cancel":
                self._cancel(msg["trial"], t)
            else:
                self._queue.put((msg, t))
        self._on_eof()

    def _cancel(self, trial_id: str, t: int) -> None:
        with self._state:
            cur = self._current
            if cur is not None and cur.id == trial_id:
                cur._deliver(t)
            elif trial_id in self._finished:
                return  # after its done: ignored
            else:
                self._latched.setdefault(trial_id, t)
                while len(self._latched) > LATCHED_MAX:
                    self._latched.popitem(last=False)

    def _on_eof(self) -> None:
        self._eof.set()
        with self._state:
            cur = self._current
        if cur is not None:
            cur._deliver(now_ns())
        self._queue.put((_EOF, now_ns()))
        if cur is not None and self.eof_grace_s is not None and not self._run_over.wait(self.eof_grace_s):
            print("cancelbench.sut.server: stdin closed and the run did not end; exiting", file=sys.stderr)
            _flush_stderr()
            os._exit(0)

    # -- the main thread ---------------------------------------------------
    def hello(self) -> dict:
        """The declaration as hello, with the capabilities this library implements for every engine."""
        hello = self.declaration.to_hello()
        caps = hello.get("capabilities") or []
        hello["capabilities"] = [*caps, *(c for c in LIBRARY_CAPABILITIES if c not in caps)]
        return hello

    def serve(self) -> int:
        self.send(self.hello())
        threading.Thread(target=self._reader, name="sut-stdin", daemon=True).start()
        try:
            while True:
                msg, t = self._queue.get()
                if msg is _EOF:  # what came before it is taken in order (a run cancelled at once)
                    return 0
                kind = msg["type"]
                if kind == "shutdown":
                    return 0
                if kind == "load":
                    self._load(msg)
                elif kind == "run":
                    self._run(msg, t)
        finally:
            close = getattr(self.engine, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:  # exiting anyway; say why on stderr
                    print(f"cancelbench.sut.server: engine close failed: {one_line(exc)}", file=sys.stderr)

    def _load(self, msg: dict) -> None:
        try:
            effective = self.engine.load(dict(msg["models"]), dict(msg["settings"]))
            reply = {"type": "loaded", "t": now_ns()}
            if effective:
                reply["settings"] = {k: v for k, v in effective.items()
                                     if isinstance(v, (bool, int, float, str))}
            if self.declaration.can(AUDIO_OUT):  # 1.4: the rate its audio events count samples at
                rate = getattr(self.engine, "audio_sample_rate", None)
                if isinstance(rate, bool) or not isinstance(rate, int):
                    raise ValueError(f"the engine declares {AUDIO_OUT} but its audio_sample_rate after load is {rate!r}")
                reply["audio_sample_rate"] = rate
            validate(reply, ("loaded",))
        except Exception as exc:
            self.error("load", f"{type(exc).__name__}: {exc}")
            return
        self.send(reply)

    def _run(self, msg: dict, t_read: int) -> None:
        trial = Trial(self, msg, t_read)
        with self._state:
            latched = self._latched.pop(trial.id, None)
            self._finished.pop(trial.id, None)
            self._current = trial
            self._run_over.clear()
        if latched is not None:
            trial._deliver(latched)
        if self._eof.is_set():  # stdin closed as this run started: nobody waits for it
            trial._deliver(now_ns())
        try:
            try:
                result = self.engine.run(trial)
                if not isinstance(result, Result):
                    raise TypeError(f"engine.run returned {type(result).__name__}, not a Result")
                done = trial._done(result)
                validate(done, ("done",))
            except Exception as exc:
                done = trial._done(Result("error", error=f"{type(exc).__name__}: {exc}"))
            with self._state:
                self._current = None
                self._finished[trial.id] = None
                while len(self._finished) > FINISHED_MAX:
                    self._finished.popitem(last=False)
            self.send(done)
        finally:
            with self._state:
                self._current = None
            self._run_over.set()


def _flush_stderr() -> None:
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def fd_writer(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    return write


def make_server(engine: Engine, *, stdin=None, stdout=None, eof_grace_s: float | None = 4.0) -> Server:
    """A :class:`Server` on these streams (binary; ``None``: file descriptors 0 and 1,
    fd 1 then pointed at stderr so nothing else can write to the protocol's stdout)."""
    if stdin is None:
        read = lambda n: os.read(0, n)  # noqa: E731  (no buffered object: no lock at teardown)
    else:
        read = getattr(stdin, "read1", None) or stdin.read
    if stdout is None:
        sys.stdout.flush()
        out_fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        write = fd_writer(out_fd)
    else:
        def write(data: bytes) -> None:
            stdout.write(data)
            stdout.flush()
    return Server(engine, read, write, eof_grace_s, word=cancel_word.inherited())


def serve(engine: Engine, *, stdin=None, stdout=None, eof_grace_s: float | None = 4.0) -> int:
    """Speak the protocol for ``engine`` until ``shutdown`` or end of stdin; the exit status."""
    return make_server(engine, stdin=stdin, stdout=stdout, eof_grace_s=eof_grace_s).serve()


# How long the stdin thread may wait for the GIL while the engine's thread runs Python between
# its native calls (Python's default is 5 ms): a cancel or a ping read then would wait that long,
# a delay of the Python wrapper, not of the engine. The agent runs at the same interval.
SWITCH_INTERVAL_S = 0.0001


def main(engine: Engine) -> None:
    """``serve`` on the process's stdin/stdout, then exit with its status."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    code = serve(engine)
    _flush_stderr()
    os._exit(code)
