"""The engine side of the protocol (cancelbench.sut.server) through real engine processes:
``python -m cancelbench.sut.builtin sim|text`` and ``python -m cancelbench.sut.defective``,
spoken to by a minimal raw JSON client written here (not cancelbench's own client), so a
bug in either side cannot hide the other's.

Nothing here sleeps or bounds a duration: every step waits for an observable message
(the queue timeout only keeps a broken engine from hanging the suite)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from cancelbench.sut.declaration import Declaration
from cancelbench.sut.protocol import ENGINE_TYPES, MAX_LINE_BYTES, validate

HANG = 120  # s: only a hung engine reaches it
LONG_US = 60_000_000  # a sim phase no test waits out: only a cancel ends it

now = time.monotonic_ns


class RawEngine:
    """An engine process and a line-level JSON conversation with it."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.messages: queue.Queue = queue.Queue()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.hello = self.recv()

    def _read(self) -> None:
        for line in self.proc.stdout:
            assert len(line) <= MAX_LINE_BYTES and line.endswith(b"\n"), line[:200]
            self.messages.put((json.loads(line), now()))
        self.messages.put((None, now()))

    def send_raw(self, line: bytes) -> int:
        t = now()
        self.proc.stdin.write(line)
        self.proc.stdin.flush()
        return t

    def send(self, msg: dict) -> int:
        """The time just before the line was written (test clock: CLOCK_MONOTONIC)."""
        return self.send_raw(json.dumps(msg).encode() + b"\n")

    def recv_at(self) -> tuple[dict, int]:
        """The next message, validated against the schema, and when it was read here."""
        try:
            msg, t = self.messages.get(timeout=HANG)
        except queue.Empty:
            pytest.fail(f"the engine said nothing for {HANG} s; stderr: {self.err()}")
        assert msg is not None, f"the engine closed stdout (exit {self.proc.poll()}); stderr: {self.err()}"
        validate(msg, ENGINE_TYPES)
        return msg, t

    def recv(self) -> dict:
        return self.recv_at()[0]

    def until(self, pred) -> list[dict]:
        """Messages up to and including the first that satisfies ``pred``."""
        return [msg for msg, _ in self.until_at(pred)]

    def until_at(self, pred) -> list[tuple[dict, int]]:
        """:meth:`until` with when each message was read here."""
        got = []
        while True:
            got.append(self.recv_at())
            if pred(got[-1][0]):
                return got

    def err(self) -> str:
        return b"".join(self.stderr).decode(errors="replace")[-2000:]

    def load(self, models: dict | None = None, **settings) -> dict:
        decl = Declaration.from_hello(self.hello)
        self.send({"type": "load", "models": models or {}, "settings": decl.resolve(settings, "test")})
        msg = self.recv()
        assert msg["type"] == "loaded", msg
        return msg

    def run(self, trial: str, mechanism: str, input: str = "") -> int:
        return self.send({"type": "run", "trial": trial, "mechanism": mechanism, "input": input,
                          "settings": {}, "output_path": None})

    def trial(self, trial: str) -> tuple[list[dict], dict]:
        """The events of ``trial`` up to its done, and the done; any other message fails."""
        events = self.until(lambda m: m["type"] == "done")
        assert all(m.get("trial") == trial for m in events), events
        return events[:-1], events[-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def engines():
    started: list[RawEngine] = []

    def start(*argv: str) -> RawEngine:
        e = RawEngine(*argv)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


def sim(start) -> RawEngine:
    return start("-m", "cancelbench.sut.builtin", "sim")


def assert_well_formed(events: list[dict], decl: Declaration, t_run: int, t_done_read: int) -> None:
    """Phases in declared order, steps paired in step phases, timestamps in the run and
    never backwards."""
    assert events and events[0]["type"] == "phase", events[:2]
    order = decl.phase_names
    phases = [m["phase"] for m in events if m["type"] == "phase"]
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases), phases
    current, open_step, last_t = None, False, t_run
    for m in events:
        assert last_t <= m["t"] <= t_done_read, (m, last_t, t_done_read)
        last_t = m["t"]
        if m["type"] == "phase":
            assert not open_step, f"phase changed inside a step: {m}"
            current = m["phase"]
        elif m["type"] == "step":
            assert m["phase"] == current and current in decl.step_phases, m
            assert m["edge"] == ("end" if open_step else "start"), m
            open_step = not open_step
    assert not open_step, "a step started and never ended"


# ------------------------------------------------------------------------ sim

def test_sim_hello_is_the_registry_declaration(engines):
    from cancelbench.device_agents.engines.registry import ENGINES

    e = sim(engines)
    decl = Declaration.from_hello(e.hello)
    assert decl.name == "cancelbench-sim"
    assert decl.phase_names == ENGINES["sim"].phases == ("prefill", "generate")
    assert decl.mechanism_names == ENGINES["sim"].mechanisms
    assert decl.input == "none" and decl.clock == "CLOCK_MONOTONIC"
    assert {s.name for s in decl.settings} >= {"sim_phase_us", "sim_granularity_us", "sim_steps"}


def test_completed_run_phases_in_order_steps_paired_and_counted(engines):
    e = sim(engines)
    decl = Declaration.from_hello(e.hello)
    loaded = e.load(sim_phase_us=20_000, sim_steps=3)
    assert loaded["settings"]["sim_steps"] == 3  # the engine was built from the sent settings
    t_run = e.run("c.1", "chunked")
    events, done = e.trial("c.1")
    t_done_read = now()
    assert_well_formed(events, decl, t_run, t_done_read)
    assert [m["phase"] for m in events if m["type"] == "phase"] == ["prefill", "generate"]
    starts = [m["phase"] for m in events if m["type"] == "step" and m["edge"] == "start"]
    assert starts == ["prefill"] * 3 + ["generate"] * 3  # chunked: prefill in sim_steps waits
    assert done["outcome"] == "completed" and done["phase"] == "generate"
    assert "cancel_received_t" not in done
    assert events[-1]["t"] <= done["t"] <= t_done_read
    assert done["counters"]["tokens_generated"] == 3


def test_ping_answered_and_cancel_honoured_mid_run(engines):
    e = sim(engines)
    e.load(sim_phase_us=LONG_US, sim_granularity_us=1_000)
    t_run = e.run("m.1", "abort_callback")
    before = e.until(lambda m: m["type"] == "step")  # inside the minute-long native wait
    first = before[0]
    assert first == {**first, "type": "phase", "trial": "m.1", "phase": "prefill"}
    t_ping = e.send({"type": "ping", "id": 7, "t": now()})
    pong, t_pong_read = e.recv_at()  # the run waits a minute: only a reader thread answers now
    assert pong["type"] == "pong" and pong["id"] == 7
    assert t_ping <= pong["t"] <= t_pong_read  # the agent's clock: the engine stamps CLOCK_MONOTONIC
    t_cancel = e.send({"type": "cancel", "trial": "m.1"})
    events, done = e.trial("m.1")
    t_done_read = now()
    assert_well_formed(before + events, Declaration.from_hello(e.hello), t_run, t_done_read)
    assert done["outcome"] == "cancelled" and done["phase"] == "prefill"
    assert t_cancel <= done["cancel_received_t"] <= done["t"] <= t_done_read
    assert t_run <= first["t"] <= done["cancel_received_t"]
    seen = [m for m in events if m["type"] == "cancel_seen"]
    assert len(seen) == 1 and done["cancel_received_t"] <= seen[0]["t"] <= done["t"]  # the native reader saw it
    assert done["counters"]["abort_polls"] >= 1
    assert "native_returned_t" in done and seen[0]["t"] <= done["native_returned_t"] <= done["t"]


def test_a_trials_events_after_its_cancel_are_written_after_its_terminal_decision(engines):
    """The engine library holds a trial's events from its cancel's receipt to its done (Trial.hold_events):
    the stop writes nothing to the pipe, as an engine in the agent's own process writes nothing. What is
    held keeps its own t and its order and comes before the done."""
    e = sim(engines)
    e.load(sim_phase_us=LONG_US, sim_granularity_us=1_000)
    t_run = e.run("h.1", "abort_callback")
    before = e.until(lambda m: m["type"] == "step")  # inside the minute-long native wait
    e.send({"type": "cancel", "trial": "h.1"})
    read = e.until_at(lambda m: m["type"] == "done")
    done = read[-1][0]
    assert done["outcome"] == "cancelled"
    after = [(m, t_read) for m, t_read in read[:-1] if m["t"] >= done["cancel_received_t"]]
    assert [m["type"] for m, _ in after] == ["cancel_seen", "step"], after  # the reader's sight, the call's end
    assert all(t_read >= done["t"] for _, t_read in after), (done["t"], after)  # same host, same clock
    assert_well_formed(before + [m for m, _ in read[:-1]], Declaration.from_hello(e.hello), t_run, read[-1][1])


def test_held_events_are_written_in_order_after_the_terminal_decision_and_before_the_done():
    """Trial's own rule, on a server that records what the trial writes and when (decided or not)."""
    from helpers import RecordingServer

    from cancelbench.sut.trial import Result

    server = RecordingServer("abort_callback")
    trial = server.run()
    written = lambda: [(m["type"], m.get("edge"), decided) for m, decided in server.sent]  # noqa: E731
    trial.phase("prefill", 2)
    trial.step_start(3)
    assert trial._deliver(4)  # the stdin thread reads the cancel
    trial.cancel_seen(5, "next_ask")
    trial.step_end(6)
    assert written() == [("phase", None, False), ("step", "start", False)]  # nothing since the receipt
    done = trial._done(Result("cancelled"))
    assert written()[2:] == [("cancel_seen", None, True), ("step", "end", True)]  # in order, once decided
    assert done["type"] == "done" and done["cancel_received_t"] == 4
    assert [m["t"] for m, _ in server.sent] == [2, 3, 5, 6]  # each with its own time


def test_a_receipt_the_engines_own_cancel_state_took_holds_the_trials_events():
    """A built-in engine's native reader latches the shared word: its CancelControl takes the cancel, and
    the trial learns of it only when run returns. The engine's receipt hook holds the events from then on
    (cancelbench.sut.builtin._ThreadReadings.at_receipt), so that stop writes nothing either."""
    from helpers import RecordingServer

    from cancelbench import native
    from cancelbench.device_agents.engines.base import CancelControl, Progress
    from cancelbench.sut.builtin import _ThreadReadings

    server = RecordingServer("abort_callback")
    trial = server.run()
    ctl = CancelControl(native.CancelToken(), Progress())
    ctl.cpu = _ThreadReadings(trial, ctl)
    trial.phase("prefill", 2)
    assert ctl.request(native.now_ns())  # the engine's own cancel state: the trial is not told
    assert trial.cancel_received_ns is None
    trial.step_start(3)
    trial.step_end(4)
    assert [m["type"] for m, _ in server.sent] == ["phase"]


def test_cancel_before_run_is_latched(engines):
    e = sim(engines)
    e.load(sim_phase_us=LONG_US)
    t_cancel = e.send({"type": "cancel", "trial": "l.1"})
    e.run("l.1", "between_calls")  # between_calls: only a latched flag stops it before the minute-long wait
    events, done = e.trial("l.1")
    assert done["outcome"] == "cancelled"
    assert t_cancel <= done["cancel_received_t"] <= done["t"]
    assert not [m for m in events if m["type"] == "step"], "a latched run did work"


def test_cancel_after_done_is_ignored(engines):
    e = sim(engines)
    e.load(sim_phase_us=20_000, sim_steps=2)
    e.run("a.1", "abort_callback")
    _, done = e.trial("a.1")
    assert done["outcome"] == "completed"
    e.send({"type": "cancel", "trial": "a.1"})  # after its done: no answer, no effect
    e.run("a.2", "abort_callback")
    first = e.recv()
    assert first["type"] == "phase" and first["trial"] == "a.2", first  # nothing answered the cancel
    e.send({"type": "cancel", "trial": "a.1"})  # again, now while a.2 runs: not a.2's cancel
    events, done = e.trial("a.2")
    assert done["outcome"] == "completed" and "cancel_received_t" not in done, done
    # and it was not latched either: a later run with that id is not cancelled at start
    e.run("a.1", "abort_callback")
    _, again = e.trial("a.1")
    assert again["outcome"] == "completed" and "cancel_received_t" not in again


def test_malformed_lines_are_answered_and_the_engine_carries_on(engines):
    e = sim(engines)
    e.load(sim_phase_us=10_000, sim_steps=1)
    cases = [(b"this is not json\n", None), (b'{"type": "frobnicate"}\n', "frobnicate"),
             (b'{"type": "run", "trial": "x"}\n', "run"), (b'{"type": "ping"}\n', "ping"),
             (b"[1, 2]\n", None), (b'{"pad": "' + b"y" * MAX_LINE_BYTES + b'"}\n', None)]
    for line, of in cases:
        e.send_raw(line)
        msg = e.recv()
        assert msg["type"] == "error" and msg["of"] == of, (line[:40], msg)
        assert msg["message"] and "\n" not in msg["message"]
    e.send({"type": "ping", "id": 1, "t": now()})
    assert e.recv()["type"] == "pong"
    e.run("x.1", "between_calls")
    _, done = e.trial("x.1")
    assert done["outcome"] == "completed"


def test_bad_run_is_a_done_error_and_bad_load_an_error(engines):
    e = sim(engines)
    e.run("early", "between_calls")  # before load
    _, done = e.trial("early")
    assert done["outcome"] == "error" and "load" in done["error"], done
    e.send({"type": "load", "models": {}, "settings": {"sim_phase_us": 0}})  # below the engine's minimum
    msg = e.recv()
    assert msg["type"] == "error" and msg["of"] == "load" and "sim_phase_us" in msg["message"], msg
    e.load(sim_phase_us=10_000, sim_steps=1)
    e.run("bad", "no_such_mechanism")
    _, done = e.trial("bad")
    assert done["outcome"] == "error" and "no_such_mechanism" in done["error"], done


def test_shutdown_exits_0_and_stdin_eof_ends_a_run(engines):
    e = sim(engines)
    e.load(sim_phase_us=10_000, sim_steps=1)
    e.send({"type": "shutdown"})
    assert e.proc.wait(timeout=HANG) == 0
    assert e.messages.get(timeout=HANG)[0] is None  # nothing after the shutdown

    e = sim(engines)
    e.load(sim_phase_us=LONG_US)
    e.run("eof.1", "abort_callback")
    assert e.recv()["type"] == "phase"
    e.proc.stdin.close()  # the agent died mid-run: the minute-long run is cancelled, the engine exits
    assert e.proc.wait(timeout=HANG) == 0, e.err()


# ------------------------------------------------------------------ defective

def test_defective_engine_drops_an_early_cancel_and_honours_a_late_one(engines):
    e = engines("-m", "cancelbench.sut.defective")
    decl = Declaration.from_hello(e.hello)
    assert decl.name == "cancelbench-defective-sim" and decl.setting("activate_ms").default == 30
    e.load(sim_phase_us=50_000, sim_steps=2, activate_ms=30)
    t_cancel = e.send({"type": "cancel", "trial": "d.1"})
    e.run("d.1", "abort_callback")
    events, done = e.trial("d.1")
    # the defect: read (stamped) and yet completed, which the harness calls dropped
    assert done["outcome"] == "completed", done
    assert t_cancel <= done["cancel_received_t"] <= events[0]["t"] <= done["t"]
    assert [m["phase"] for m in events if m["type"] == "phase"] == ["prefill", "generate"]
    # after the activation (the first step call starts after it) a cancel works
    e.run("d.2", "abort_callback")
    first_step = e.until(lambda m: m["type"] == "step")[-1]
    t_cancel = e.send({"type": "cancel", "trial": "d.2"})
    events, done = e.trial("d.2")
    assert done["outcome"] == "cancelled", done
    assert first_step["t"] <= t_cancel <= done["cancel_received_t"] <= done["t"]


# ----------------------------------------------------------------------- text

def test_text_engine_out_of_process(engines, small_text_model):
    e = engines("-m", "cancelbench.sut.builtin", "text")
    decl = Declaration.from_hello(e.hello)
    assert decl.name == "cancelbench-text" and decl.input == "text"
    loaded = e.load({"model": small_text_model}, prompt_tokens=32, max_tokens=4, n_batch=32, n_threads=1)
    assert loaded["settings"]["n_batch"] == 32
    digests = []
    for i in range(2):
        t_run = e.run(f"t.{i}", "abort_callback", "The quick brown fox jumps over the lazy dog.")
        events, done = e.trial(f"t.{i}")
        assert_well_formed(events, decl, t_run, now())
        assert done["outcome"] == "completed", done
        assert [m["phase"] for m in events if m["type"] == "phase"] == ["prefill", "generate"]
        starts = [m["phase"] for m in events if m["type"] == "step" and m["edge"] == "start"]
        assert starts.count("prefill") == 1 and starts.count("generate") >= 3, starts  # 32 tokens, n_batch 32
        assert done["counters"]["n_input_tokens"] == 32 and done["counters"]["tokens_generated"] == 4
        digests.append(done["output_sha256"])
    assert digests[0] == digests[1]  # greedy: the same output twice
    e.send({"type": "cancel", "trial": "t.latched"})
    e.run("t.latched", "abort_callback", "The quick brown fox jumps over the lazy dog.")
    events, done = e.trial("t.latched")
    assert done["outcome"] == "cancelled" and "cancel_received_t" in done and "output_sha256" not in done
    assert not [m for m in events if m["type"] == "step"]
    e.send({"type": "shutdown"})
    assert e.proc.wait(timeout=HANG) == 0


# ------------------------------------------------------------------------ tts

def test_tts_engine_out_of_process_hands_its_audio_over(engines, tmp_path):
    """1.4: the built-in TTS engine declares audio_out, says its model's rate when loaded, and hands each
    window's audio over as an audio event while it runs: in all exactly the samples of the WAV it writes
    at output_path, each hand-over after the code2wav step that made it; none after a latched cancel."""
    import wave

    from cancelbench.datasets import speech_fixtures as SF

    paths = SF.ensure_speech_fixtures()["tts"]
    e = engines("-m", "cancelbench.sut.builtin", "tts")
    decl = Declaration.from_hello(e.hello)
    assert decl.can("audio_out") and decl.can("cancel_word")
    loaded = e.load({"model": str(paths["model"]), "mmproj": str(paths["mmproj"])}, n_threads=1, max_frames=100)
    assert loaded["audio_sample_rate"] == 24000  # the fixture's code2wav rate (mtmd_gen_audio_get_info)
    wav = tmp_path / "ref.wav"
    t_run = e.send({"type": "run", "trial": "a.0", "mechanism": "graph_eval", "input": "Hello there, world.",
                    "settings": {}, "output_path": str(wav)})
    events, done = e.trial("a.0")
    assert done["outcome"] == "completed", done
    audio = [m for m in events if m["type"] == "audio"]
    stamps = [m["t"] for m in events]
    assert stamps == sorted(stamps) and t_run <= stamps[0] and stamps[-1] <= done["t"] <= now()  # in line order
    with wave.open(str(wav)) as w:
        assert w.getframerate() == 24000 and sum(m["samples"] for m in audio) == w.getnframes() > 0
    assert len(audio) >= 2  # a window inside generation and the final one: handed over as made, not at the end
    for m in audio:  # each after the end of a code2wav step (or the output step's flush) that came before it
        before = [x for x in events[:events.index(m)] if x["type"] == "step" and x["edge"] == "end"]
        assert before and before[-1]["phase"] in ("code2wav", "output") and before[-1]["t"] <= m["t"], (m, before)
    e.send({"type": "cancel", "trial": "a.latched"})
    e.send({"type": "run", "trial": "a.latched", "mechanism": "graph_eval", "input": "Hello.", "settings": {},
            "output_path": None})
    events, done = e.trial("a.latched")
    assert done["outcome"] == "cancelled" and not [m for m in events if m["type"] == "audio"]
    e.send({"type": "shutdown"})
    assert e.proc.wait(timeout=HANG) == 0


def test_misbehave_script_knows_its_modes():
    """The bad-engine script the agent's tests use: every mode is accepted, an unknown one is exit 2."""
    script = os.path.join(os.path.dirname(__file__), "data", "engines", "misbehave.py")
    out = subprocess.run([sys.executable, script, "exit_at_start"], capture_output=True, timeout=HANG)
    assert out.returncode == 3 and out.stdout == b"" and b"before hello" in out.stderr
    out = subprocess.run([sys.executable, script, "no_such_mode"], capture_output=True, timeout=HANG)
    assert out.returncode == 2 and b"usage" in out.stderr
