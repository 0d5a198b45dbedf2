"""A misbehaving engine for the agent's bad-engine tests: ``python misbehave.py MODE [N]``.

Apart from its defect it is a small working engine (one phase ``work`` of
``steps`` step calls of ``step_ms`` each, a flag checked between them) served by
cancelbench.sut.server. Defects that happen during a run happen in the N-th run
(default 1); earlier runs are normal.

Modes: exit_at_start (a line on stderr, exit 3 before hello), never_hello (sleeps
forever), wrong_version (hello with protocol 2), not_json (a non-JSON line during a
run), huge_line (a 10 MB line during a run), other_clock (pongs on
time.monotonic_ns, the N-th run's events stamped with time.time_ns), unknown_trial
(an event for a trial id that is not running), two_dones (two done for one run),
close_stdout (closes stdout mid-run and keeps running), sigill (kills itself with
SIGILL during the N-th run), silent (answers nothing, pings included, from the
middle of a run), ignores_shutdown (ignores shutdown, end of stdin and SIGTERM;
keeps sleeping).

Modes whose defect the outcome rule must see through (issue 33): drops_silently (a
cancel read in a run's first ``setup_ms``, default 300, is lost and never reported:
no cancel_received_t; the run completes), no_latch (a cancel read before its run is
forgotten when the run starts), claims_receipt (every done carries a
cancel_received_t, reference runs too), claims_cancel (a reference run ends
``cancelled``), bad_stamp (the N-th run's done.native_returned_t = 1), bad_phase (the
N-th run's done names an undeclared phase), big_counter (the N-th run's
done.counters.decode_rc = 2^31), nan_setting (loaded.settings.step_ms is NaN),
deadlock (the N-th run's thread blocks for ever after its first step; the stdin
thread still answers pings), escapes (at load it starts a child in its own
session that sleeps; its pid on stderr: ``misbehave escapes: child pid P``),
hostile_text (a version string and, in the N-th run, a done.error and stderr that
carry terminal control sequences: ESC, OSC, BEL, CR, NUL), bad_cpu (the N-th run's done.cpu
claims 10 s more CPU at its end), undeclared_audio (the N-th run, if it completes, sends an audio
event before its done; its hello does not declare audio_out).

The shared cancel word (every mode declares cancel_word: cancelbench.sut.server does): no_latch
and drops_silently never read it (their defects lose the word's cancel too); ignores_word
never reads it and has no other defect (a cancel line still stops it).

A mode that serves says so on stderr first, with its pid (a
sweep keeps it in the first record's engine_stderr: a restart shows a new pid).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

from cancelbench.sut.declaration import Declaration, MechanismInfo, Phase, Setting
from cancelbench.sut.protocol import encode
from cancelbench.sut.server import Result, Trial, make_server

MODES = ("exit_at_start", "never_hello", "wrong_version", "not_json", "huge_line", "other_clock", "unknown_trial",
         "two_dones", "close_stdout", "sigill", "silent", "ignores_shutdown", "drops_silently", "no_latch",
         "claims_receipt", "claims_cancel", "bad_stamp", "bad_phase", "big_counter", "nan_setting", "deadlock",
         "escapes", "hostile_text", "ignores_word", "bad_cpu", "undeclared_audio")

DECLARATION = Declaration(
    name="misbehave", version="1", input="text",
    phases=(Phase("work", True),),
    mechanisms=(MechanismInfo("flag", "a flag checked between step calls"),),
    settings=(Setting("steps", "int", 5, 1, 100_000, "step calls per run"),
              Setting("step_ms", "int", 10, 0, 600_000, "each step call's sleep, ms"),
              Setting("setup_ms", "int", 300, 0, 600_000, "drops_silently: the set-up at a run's start, ms")))


# Clears the screen, sets the terminal's title, rings, returns the carriage, ends a C string.
HOSTILE = "\x1b[2J\x1b]0;owned\x07\r\x00"


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


class Misbehave:
    def __init__(self, mode: str, n: int) -> None:
        self.mode = mode
        self.n = n
        self.runs = 0
        self.server = None
        self.steps, self.step_ms = 5, 10
        self.declaration = dataclasses.replace(DECLARATION, protocol=2) if mode == "wrong_version" else DECLARATION
        if mode == "hostile_text":
            self.declaration = dataclasses.replace(DECLARATION, version="1" + HOSTILE + "x")

    def load(self, models: dict, settings: dict) -> dict | None:
        self.steps = int(settings.get("steps") or 5)
        self.step_ms = int(settings.get("step_ms") or 0)
        self.setup_ms = int(settings.get("setup_ms") or 0)
        if self.mode == "escapes":
            import subprocess
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
            print(f"misbehave escapes: child pid {child.pid}", file=sys.stderr, flush=True)
        if self.mode == "nan_setting":
            return {"step_ms": float("nan")}
        return None

    def _defect(self, trial: Trial) -> None:
        """The mode's defect, once the run has started (after its first step)."""
        mode, server = self.mode, self.server
        if mode == "not_json":
            server.write_line(b"this is not JSON {\n")
        elif mode == "huge_line":
            server.write_line(b'{"type":"phase","trial":"' + b"x" * (10 * 1000 * 1000) + b'"}\n')
        elif mode == "unknown_trial":
            server.write_line(encode({"type": "phase", "trial": trial.id + ".not-running", "phase": "work",
                                      "t": time.monotonic_ns()}))
        elif mode == "close_stdout":
            with server.stdout_lock:
                os.close(server.out_fd)
                os.close(1)  # fd 1 points at stderr's file; closed too: nothing of ours is on stdout
                sleep_forever()
        elif mode == "sigill":
            os.kill(os.getpid(), signal.SIGILL)
            sleep_forever()
        elif mode == "silent":
            server.stdout_lock.acquire()  # every write, pongs included, waits for ever
            sleep_forever()
        elif mode == "deadlock" and not trial.cancelled:  # (a restarted engine's N-th run, cancelled, is spared)
            threading.Event().wait()  # the run thread is stuck; the stdin thread answers pings

    def run(self, trial: Trial) -> Result:
        self.runs += 1
        mode, nth = self.mode, self.runs == self.n
        other_clock = mode == "other_clock" and nth
        stamp = time.time_ns if other_clock else time.monotonic_ns
        if mode in ("no_latch", "drops_silently", "ignores_word"):
            trial.word = None  # the shared cancel word is never read (the defects below lose it too)
        if mode == "no_latch" and trial.cancelled:  # THE DEFECT: a cancel read before the run is forgotten
            trial.cancel_received_ns = None
            trial._event.clear()
        if mode == "drops_silently":  # THE DEFECT: a cancel read during the set-up is refused, and unsaid
            trial.on_cancel = lambda t: False
            if trial.cancelled:  # latched: forgotten too
                trial.cancel_received_ns = None
                trial._event.clear()
        trial.phase("work", stamp())
        if mode == "drops_silently":
            time.sleep(self.setup_ms / 1000)
            trial.on_cancel = None
        if mode == "hostile_text" and nth:
            print("misbehave hostile_text: stderr " + HOSTILE, file=sys.stderr, flush=True)
            return Result("error", error="failed " + HOSTILE + " here")
        if mode == "claims_cancel" and not trial.cancelled:
            return Result("cancelled")  # no cancel was ever sent
        result = self._work(trial, stamp, other_clock)
        if mode == "claims_receipt" and trial.cancel_received_ns is None:
            trial.cancel_received_ns = trial.run_received_ns  # a receipt that never happened
        if nth and result.outcome == "completed":
            if mode == "bad_stamp":
                result.native_returned_ns = 1
            elif mode == "bad_phase":
                result.phase = "nowhere"
            elif mode == "big_counter":
                result.counters = {"decode_rc": 1 << 31}
            elif mode == "bad_cpu":  # done.cpu (1.3): a trial thread that ran 10 s of CPU in a short run
                t, cpu, wait = trial.thread.read()  # now, as the end's reading is, but 10 s more CPU
                trial.thread.readings["end"] = (t, cpu + 10 * 10**9, wait)
            elif mode == "undeclared_audio":  # 1.4's audio event, from an engine that streams nothing
                self.server.write_line(encode({"type": "audio", "trial": trial.id, "t": time.monotonic_ns(),
                                               "samples": 480}))
        return result

    def _work(self, trial: Trial, stamp, other_clock: bool) -> Result:
        for i in range(self.steps):
            if trial.cancelled:
                return Result("cancelled", t_terminal_ns=stamp() if other_clock else None)
            trial.step_start(stamp())
            trial.sleep(self.step_ms / 1000)
            trial.step_end(stamp())
            if i == 0 and self.runs == self.n:
                self._defect(trial)
        cancelled, t = trial.terminal()
        if self.mode == "two_dones" and self.runs == self.n:  # one done here, the server sends the other
            self.server.write_line(encode({"type": "done", "trial": trial.id, "outcome": "completed",
                                           "t": t, "phase": "work"}))
        return Result("cancelled" if cancelled else "completed", t_terminal_ns=stamp() if other_clock else t)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in MODES:
        print(f"usage: misbehave.py {{{','.join(MODES)}}} [N]", file=sys.stderr)
        sys.exit(2)
    mode, n = argv[0], int(argv[1]) if len(argv) > 1 else 1
    if mode == "exit_at_start":
        print("misbehave: exiting before hello, as asked", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "never_hello":
        sleep_forever()
    if mode == "ignores_shutdown":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"misbehave {mode}: pid {os.getpid()} serving", file=sys.stderr, flush=True)  # kept in engine_stderr
    engine = Misbehave(mode, n)
    out_fd = os.dup(1)
    server = make_server(engine, stdout=_FdOut(out_fd), eof_grace_s=None)
    server.out_fd = out_fd
    os.dup2(2, 1)  # nothing else of ours on the protocol's stdout
    sys.stdout = sys.stderr
    engine.server = server
    code = server.serve()
    if mode == "ignores_shutdown":
        sleep_forever()
    sys.stderr.flush()
    os._exit(code)


class _FdOut:
    """A binary stdout on a raw fd (the server's writes, unbuffered)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def flush(self) -> None:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
