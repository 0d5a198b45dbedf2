"""The C protocol engine (native/sut_text_engine.c), written from docs/sut-protocol.md
alone: built by ``make setup`` (native/build_sut_engine.sh), then driven through a
whole conversation over its stdin/stdout on the small real text fixture model.

:func:`c_engine_command` is the argv that starts it (for sut-check and sweep tests).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cancelbench import native
from cancelbench.native import sut_text_engine_path
from cancelbench.sut import cancel_word

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / "native" / "build_sut_engine.sh"
SCHEMA_PATH = ROOT / "cancelbench" / "sut" / "schema.json"

# Small and fast: 64 prompt tokens in 8 prefill steps of 8, then 8 generate steps.
SETTINGS = {"n_threads": 2, "n_ctx": 256, "n_batch": 8, "prompt_tokens": 64, "max_tokens": 8}
PREFILL_STEPS = 8
GENERATE_STEPS = 8
INPUT = "The quick brown fox jumps over the lazy dog."
HANG_GUARD_S = 120  # only against a hung engine; nothing here is a timing assertion


def c_engine_command(model_path: str | os.PathLike | None = None) -> list[str]:
    """The argv that starts the C engine. The model is not an argument: the protocol's
    ``load`` message carries it (``models = {"model": model_path}``)."""
    return [str(sut_text_engine_path())]


def _engine_binary() -> Path:
    """The built engine; build it once if it is missing (``make setup`` normally has)."""
    path = sut_text_engine_path()
    if not path.exists():
        result = subprocess.run(["bash", str(BUILD_SCRIPT)], cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0 or not path.exists():
            pytest.skip(f"the C engine could not be built here (native/build_sut_engine.sh: "
                        f"{(result.stderr or result.stdout).strip()[-400:]})")
    return path


def _validator():
    try:
        import jsonschema
    except ImportError:  # optional: the structural asserts below still run
        return None
    return jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


class Engine:
    """The engine process with a thread that turns its stdout into parsed messages. With ``word``
    (cancelbench.sut.cancel_word, the agent's own region) the engine inherits the word's read-only
    descriptor, named in CANCELBENCH_CANCEL_WORD_FD, as the agent hands it over."""

    def __init__(self, word: cancel_word.CancelWord | None = None) -> None:
        env, fds = None, ()
        if word is not None:
            env, fds = {**os.environ, **word.env()}, (word.engine_fd,)
        self.proc = subprocess.Popen(c_engine_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, env=env, pass_fds=fds)
        if word is not None:
            word.engine_started()  # the engine holds its copy
        self.lines: queue.Queue = queue.Queue()
        self.validator = _validator()
        self.stderr = b""
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _pump(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put((time.monotonic_ns(), raw))
        self.lines.put((time.monotonic_ns(), None))

    def _drain_stderr(self) -> None:
        self.stderr = self.proc.stderr.read()

    def send(self, message: dict | str) -> int:
        line = message if isinstance(message, str) else json.dumps(message)
        t = time.monotonic_ns()
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        return t

    def recv(self) -> tuple[int, dict]:
        """(receipt time, message): every stdout line must be one schema-valid JSON object."""
        try:
            t, raw = self.lines.get(timeout=HANG_GUARD_S)
        except queue.Empty:
            pytest.fail(f"the engine said nothing for {HANG_GUARD_S} s; stderr: {self.stderr[-2000:]!r}")
        assert raw is not None, f"the engine closed stdout; stderr: {self.stderr[-2000:]!r}"
        assert raw.endswith(b"\n")
        message = json.loads(raw)
        assert isinstance(message, dict)
        if self.validator is not None:
            errors = [e.message for e in self.validator.iter_errors(message)]
            assert not errors, (message, errors)
        return t, message

    def ping(self, ident: int) -> tuple[int, dict, int]:
        sent = self.send({"type": "ping", "id": ident, "t": time.monotonic_ns()})
        received, pong = self.recv()
        return sent, pong, received

    def run(self, trial: str, mechanism: str, *, cancel_at_step: int | None = None,
            settings: dict | None = None, cancel_seq: int | None = None,
            cancel=None) -> tuple[int, list[dict], int | None]:
        """Send a run (with ``cancel_seq`` if given); with cancel_at_step=k, cancel it when the k-th
        step start arrives: ``cancel()`` (default: send the cancel line), which returns when it
        cancelled. Returns (time run was sent, the events up to and including done, that time)."""
        run = {"type": "run", "trial": trial, "mechanism": mechanism, "input": INPUT,
               "settings": settings or SETTINGS, "output_path": None}
        if cancel_seq is not None:
            run["cancel_seq"] = cancel_seq
        sent = self.send(run)
        cancel = cancel or (lambda: self.send({"type": "cancel", "trial": trial}))
        events, starts, cancel_sent = [], 0, None
        while True:
            received, message = self.recv()
            events.append(message)
            assert message.get("trial") == trial, message
            # every event lies between the run's sending and its receipt, on our clock
            assert sent <= message["t"] <= received, message
            if message["type"] == "step" and message["edge"] == "start":
                starts += 1
                if starts == cancel_at_step:
                    cancel_sent = cancel()
            if message["type"] == "done":
                return sent, events, cancel_sent

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


@pytest.fixture
def engine():
    _engine_binary()
    eng = Engine()
    yield eng
    eng.close()


def _check_run_shape(events: list[dict]) -> dict[str, int]:
    """Phases in declared order, steps alternating start/end inside a phase, event times not
    going backwards, one done last. Returns the step count of each phase."""
    assert events[0]["type"] == "phase" and events[0]["phase"] == "prefill", events[0]
    assert [e["type"] for e in events].count("done") == 1 and events[-1]["type"] == "done"
    phases = [e["phase"] for e in events if e["type"] == "phase"]
    assert phases in (["prefill"], ["prefill", "generate"]), phases
    steps: dict[str, int] = {}
    current, open_step, last_t = None, False, 0
    for e in events[:-1]:
        assert e["t"] >= last_t, ("timestamps went backwards", e)
        last_t = e["t"]
        if e["type"] == "phase":
            assert not open_step, "phase changed inside a step"
            current = e["phase"]
        elif e["type"] == "step":
            assert e["phase"] == current
            assert e["edge"] == ("end" if open_step else "start"), e
            open_step = not open_step
            steps[current] = steps.get(current, 0) + open_step
        else:
            assert e["type"] == "cancel_seen", e
    assert not open_step, "a step started and never ended"
    assert events[-1]["t"] >= last_t
    return steps


def _check_at_receipt(done: dict, events: list[dict]) -> dict:
    """done.at_receipt (protocol 1.2, native_call 1.5) against the run's own events, for a cancel
    received in prefill: prompt tokens decoded by then, a whole number of n_batch steps, at least
    every step but the last one started before the receipt (the progress is counted before the next
    step starts) and at most the steps that ended before it (counted after a step's end); nothing
    generated; native_call only while a step had started. Returns it."""
    at, rcv, n_batch = done["at_receipt"], done["cancel_received_t"], SETTINGS["n_batch"]
    prefill = [e for e in events if e["type"] == "step" and e["phase"] == "prefill"]
    started = sum(e["edge"] == "start" and e["t"] < rcv for e in prefill)
    ended = sum(e["edge"] == "end" and e["t"] <= rcv for e in prefill)
    assert set(at) <= {"input_tokens_done", "tokens_generated", "native_call"}, at
    assert at["input_tokens_done"] % n_batch == 0 and at["tokens_generated"] == 0, at
    assert n_batch * (started - 1) <= at["input_tokens_done"] <= n_batch * ended, (at, started, ended)
    assert at.get("native_call", "llama_decode") == "llama_decode" and ("native_call" not in at or started > 0), at
    return at


def test_build_exists():
    path = _engine_binary()
    assert os.access(path, os.X_OK)
    assert path == ROOT / "build" / "sut" / "cancelbench-text-engine"


def test_conversation_on_the_real_fixture_model(engine, small_text_model):
    # --- hello: the declaration
    _, hello = engine.recv()
    assert hello["type"] == "hello" and hello["protocol"] == 1
    assert hello["engine"]["name"] == "c-text" and hello["engine"]["version"]
    assert hello["clock"] == "CLOCK_MONOTONIC" and hello["input"] == "text"
    assert hello["phases"] == [{"name": "prefill", "steps": True}, {"name": "generate", "steps": True}]
    assert {m["name"] for m in hello["mechanisms"]} == {"between_calls", "abort_callback", "graph_eval"}
    assert hello["capabilities"] == ["cancel_word"]  # compiled in: declared with or without a word handed over
    declared = {s["name"]: s for s in hello["settings"]}
    assert {k: declared[k]["default"] for k in SETTINGS} == {
        "n_threads": 2, "n_ctx": 512, "n_batch": 64, "prompt_tokens": 64, "max_tokens": 8}
    assert all(declared[k]["type"] == "int" for k in SETTINGS)
    assert (declared["n_threads"]["min"], declared["n_threads"]["max"]) == (1, 512)
    # graph_eval's slice: the built-in engines' setting, the default they use (native.DEFAULT_GRAPH_SLICE_US)
    slice_decl = declared["graph_slice_us"]
    assert (slice_decl["type"], slice_decl["default"], slice_decl["min"]) == ("int", native.DEFAULT_GRAPH_SLICE_US, 0)
    from cancelbench.engine_decls import DECLARATIONS
    builtin = {s.name: s for s in DECLARATIONS["text"].settings}["graph_slice_us"]
    assert (slice_decl["min"], slice_decl["max"], slice_decl["doc"]) == (builtin.min, builtin.max, builtin.doc)
    assert "CPU" in hello["build"]["ggml_backends"] and hello["build"]["compiler"]
    assert hello["build"]["eval_reader_calibrated"] == "yes"  # the eval reader weighs nodes by their shapes

    # --- pings: answered with the id and a time on our clock
    for ident in range(4):
        sent, pong, received = engine.ping(ident)
        assert pong == {"type": "pong", "id": ident, "t": pong["t"]}
        assert sent <= pong["t"] <= received

    # --- load
    engine.send({"type": "load", "models": {"model": small_text_model}, "settings": SETTINGS})
    _, loaded = engine.recv()
    assert loaded["type"] == "loaded", loaded
    assert loaded["settings"]["n_batch"] == SETTINGS["n_batch"]
    assert loaded["settings"]["n_ctx"] >= SETTINGS["prompt_tokens"] + SETTINGS["max_tokens"]

    # --- a reference run to completion (the abort reader registered, never firing)
    _, events, _ = engine.run("ref-1", "abort_callback")
    done = events[-1]
    assert done["outcome"] == "completed", done
    assert _check_run_shape(events) == {"prefill": PREFILL_STEPS, "generate": GENERATE_STEPS}
    assert done["phase"] == "generate"
    assert re.fullmatch(r"[0-9a-f]{64}", done["output_sha256"])
    assert "cancel_received_t" not in done and "cancel_seen" not in [e["type"] for e in events]
    assert "at_receipt" not in done  # no receipt, no progress at one
    counters = done["counters"]
    assert counters["tokens_generated"] == SETTINGS["max_tokens"]
    assert counters["n_input_tokens"] == SETTINGS["prompt_tokens"]
    assert counters["decode_rc"] == 0
    assert counters["abort_polls"] > 0  # the reader is registered and polled inside llama_decode
    reference_digest = done["output_sha256"]

    # --- the same work under between_calls: same greedy output (the KV cache is cleared
    # between runs), and no abort reader in the graph
    _, events, _ = engine.run("ref-2", "between_calls")
    done = events[-1]
    assert done["outcome"] == "completed" and done["output_sha256"] == reference_digest
    assert done["counters"]["abort_polls"] == 0

    # --- abort_callback, cancelled at the first prefill step: the reader stops llama_decode
    _, events, cancel_sent = engine.run("abort-1", "abort_callback", cancel_at_step=1)
    done = events[-1]
    assert cancel_sent is not None
    assert done["outcome"] == "cancelled", done
    _check_run_shape(events)
    assert done["counters"]["decode_rc"] == 2  # llama_decode's "aborted"
    assert done["counters"]["tokens_generated"] < SETTINGS["max_tokens"]
    assert "output_sha256" not in done
    seen = [e for e in events if e["type"] == "cancel_seen"]
    assert len(seen) == 1
    # the cancel was read after we sent it; the reader saw it after that; the aborted call
    # returned after that; the terminal state came last
    assert cancel_sent <= done["cancel_received_t"] <= seen[0]["t"] <= done["native_returned_t"] <= done["t"]
    _check_at_receipt(done, events)

    # --- between_calls, cancelled at the first prefill step: stops before the next decode
    _, events, cancel_sent = engine.run("between-1", "between_calls", cancel_at_step=1)
    done = events[-1]
    assert done["outcome"] == "cancelled", done
    steps = _check_run_shape(events)
    assert sum(steps.values()) < PREFILL_STEPS + GENERATE_STEPS
    assert done["counters"]["decode_rc"] == 0 and done["counters"]["abort_polls"] == 0
    assert "cancel_seen" not in [e["type"] for e in events]  # no native reader here
    assert cancel_sent <= done["cancel_received_t"] <= done["t"]
    _check_at_receipt(done, events)

    # --- a cancel before its run is latched: the run ends cancelled without its work
    before = engine.send({"type": "cancel", "trial": "latched-1"})
    _, events, _ = engine.run("latched-1", "abort_callback")
    done = events[-1]
    assert done["outcome"] == "cancelled", done
    assert [e["type"] for e in events if e["type"] == "step"] == []
    assert done["counters"]["decode_calls"] == 0 and done["counters"]["tokens_generated"] == 0
    assert done["at_receipt"] == {"input_tokens_done": 0, "tokens_generated": 0}  # before any work, no call
    assert before <= done["cancel_received_t"] <= done["t"]

    # --- a cancel after its run's done is ignored: no answer, the next run completes
    engine.send({"type": "cancel", "trial": "ref-1"})
    engine.send({"type": "cancel", "trial": "latched-1"})
    _, pong, _ = engine.ping(100)
    assert pong["type"] == "pong" and pong["id"] == 100  # nothing was said before the pong
    _, events, _ = engine.run("ref-3", "abort_callback")
    assert events[-1]["outcome"] == "completed" and events[-1]["output_sha256"] == reference_digest

    # --- a mechanism it did not declare: the trial ends in error, with one done
    _, events, _ = engine.run("bad-mech", "telepathy")
    assert events[-1]["outcome"] == "error" and "telepathy" in events[-1]["error"]

    # --- malformed input: answered with error, and the engine carries on
    engine.send("this is not json {")
    _, err = engine.recv()
    assert err["type"] == "error" and err["of"] is None and err["message"]
    engine.send({"type": "frobnicate"})
    _, err = engine.recv()
    assert err == {"type": "error", "of": "frobnicate", "message": err["message"]}
    engine.send({"type": "run", "mechanism": "between_calls", "input": "x"})  # no trial
    _, err = engine.recv()
    assert err["type"] == "error" and err["of"] == "run"
    engine.send({"type": "ping", "id": "seven", "t": 1})  # id of the wrong type
    _, err = engine.recv()
    assert err["type"] == "error" and err["of"] == "ping"
    _, pong, _ = engine.ping(101)
    assert pong["id"] == 101

    # --- shutdown: exit status 0
    engine.send({"type": "shutdown"})
    assert engine.proc.wait(timeout=HANG_GUARD_S) == 0


def test_failed_load_and_run_before_load_then_eof(engine, small_text_model, tmp_path):
    _, hello = engine.recv()
    assert hello["type"] == "hello"
    # a run before any load ends in error, with a done
    _, events, _ = engine.run("early", "between_calls")
    assert events[-1]["outcome"] == "error" and events[-1]["error"]
    # a missing model, a value out of bounds, a wrong type, a prompt that cannot fit: error of load
    for models, settings in (
            ({"model": str(tmp_path / "missing.gguf")}, SETTINGS),
            ({"model": small_text_model}, {**SETTINGS, "n_threads": 0}),
            ({"model": small_text_model}, {**SETTINGS, "n_batch": "eight"}),
            ({"model": small_text_model}, {**SETTINGS, "prompt_tokens": 250, "max_tokens": 10})):
        engine.send({"type": "load", "models": models, "settings": settings})
        _, err = engine.recv()
        assert err["type"] == "error" and err["of"] == "load", (settings, err)
    # then a good load works
    engine.send({"type": "load", "models": {"model": small_text_model}, "settings": SETTINGS})
    _, loaded = engine.recv()
    assert loaded["type"] == "loaded"
    # end of input (the agent died): exit 0
    engine.proc.stdin.close()
    assert engine.proc.wait(timeout=HANG_GUARD_S) == 0


# --------------------------------------------------------------------- graph_eval

# 4 prefill steps of 32 tokens, then 8 generate steps. Slice 0: every node is its own synced range,
# so a cancel read while a decode runs meets the eval reader at the next node's sync (no unsynced tail).
GRAPH_SETTINGS = {**SETTINGS, "n_batch": 32, "prompt_tokens": 128, "graph_slice_us": 0}


def _load(engine: Engine, model: str, settings: dict) -> None:
    engine.send({"type": "load", "models": {"model": model}, "settings": settings})
    _, loaded = engine.recv()
    assert loaded["type"] == "loaded", loaded


def _received_in_flight(events: list[dict]) -> bool:
    """Whether the engine read the cancel while its last step call ran (its own stamps)."""
    steps = [e for e in events if e["type"] == "step"]
    return bool(steps) and steps[-2]["t"] <= events[-1]["cancel_received_t"] <= steps[-1]["t"]


def test_graph_eval_cancel_mid_prefill_is_seen_and_stopped_by_the_eval_reader(engine, small_text_model):
    _, hello = engine.recv()
    _load(engine, small_text_model, GRAPH_SETTINGS)
    _, events, _ = engine.run("ge-ref", "graph_eval", settings=GRAPH_SETTINGS)
    ref = events[-1]
    assert ref["outcome"] == "completed", ref
    assert _check_run_shape(events) == {"prefill": 4, "generate": GENERATE_STEPS}
    rc = ref["counters"]
    assert rc["eval_syncs"] == rc["abort_polls"] > 0  # slice 0: every node asked was synced
    assert rc["eval_seen_where"] == 0 and rc["decode_rc"] == 0 and "cancel_seen" not in [e["type"] for e in events]
    # the hooked context computes what the plain one does
    _, plain, _ = engine.run("plain-ref", "between_calls", settings=GRAPH_SETTINGS)
    assert plain[-1]["output_sha256"] == ref["output_sha256"]

    # cancels at the second prefill step's start, until one was read while that step's decode ran
    found = None
    for i in range(5):
        _, events, cancel_sent = engine.run(f"ge-{i}", "graph_eval", cancel_at_step=2, settings=GRAPH_SETTINGS)
        done = events[-1]
        assert done["outcome"] == "cancelled" and done["phase"] == "prefill", done
        assert done["cancel_via"] == "line" and cancel_sent <= done["cancel_received_t"] <= done["t"]
        assert "output_sha256" not in done and done["counters"]["tokens_generated"] == 0
        assert done["counters"]["decode_rc"] == 0  # the stop is silent: llama_decode reports success
        _check_run_shape(events)
        if _received_in_flight(events):
            found = (events, cancel_sent)
            break
    assert found, "no cancel of 5 was read while a prefill decode ran"
    events, cancel_sent = found
    done, c = events[-1], events[-1]["counters"]
    seen = [e for e in events if e["type"] == "cancel_seen"]
    assert len(seen) == 1, events  # the eval reader saw the flag inside the decode ...
    assert c["eval_seen_where"] in (1, 2)  # ... at a node's sync (1) or the next node's ask (2)
    # ... after the cancel was read, and the decode it stopped returned after that
    assert cancel_sent <= done["cancel_received_t"] <= seen[0]["t"] <= done["native_returned_t"] <= done["t"]
    assert c["decode_calls"] == 2  # stopped in the decode the cancel was read in: none started after it
    assert c["trial_cpu_after_receipt_ns"] >= 0  # the stop's work on the graph thread, from the line's read
    # protocol 1.3: where and on which CPU clock the reader saw it, and the trial thread's readings
    assert seen[0]["where"] == {1: "range_end", 2: "next_ask"}[c["eval_seen_where"]] and seen[0]["cpu_t"] > 0
    cpu = done["cpu"]
    assert cpu["terminal_cpu"] - cpu["receipt_cpu"] == c["trial_cpu_after_receipt_ns"]  # the same two readings
    assert cpu["run_cpu"] <= seen[0]["cpu_t"] <= cpu["terminal_cpu"] <= cpu["end_cpu"]
    assert cpu["run_t"] <= cpu["receipt_t"] <= cpu["terminal_t"] <= cpu["end_t"] and "receipt_wait" in cpu
    assert 0 < c["eval_syncs"] <= c["abort_polls"] < rc["abort_polls"]  # nodes asked and synced, fewer than a run's

    # the context is reusable: the next graph_eval run completes with the reference output
    _, events, _ = engine.run("ge-after", "graph_eval", settings=GRAPH_SETTINGS)
    assert events[-1]["outcome"] == "completed" and events[-1]["output_sha256"] == ref["output_sha256"]


# --------------------------------------------------------------------- the shared cancel word

@pytest.fixture
def word():
    w = cancel_word.create()  # the agent's own region: a sealed memfd, the engine's descriptor read-only
    if w is None:
        pytest.skip("no private shared-memory region on this platform")
    yield w
    w.close()


@pytest.fixture
def word_engine(word):
    _engine_binary()
    eng = Engine(word)
    yield eng
    eng.close()


# Larger prefill steps than SETTINGS': a store at the first step's start lands in the run's work.
WORD_SETTINGS = {**SETTINGS, "n_batch": 32, "prompt_tokens": 128}


def test_a_word_only_cancel_stops_a_running_trial_under_every_mechanism(word_engine, word, small_text_model):
    _, hello = word_engine.recv()
    assert "cancel_word" in hello["capabilities"]
    _load(word_engine, small_text_model, WORD_SETTINGS)
    full = WORD_SETTINGS["prompt_tokens"] // WORD_SETTINGS["n_batch"] + WORD_SETTINGS["max_tokens"]  # decodes
    seq = 0
    for mech in ("between_calls", "abort_callback", "graph_eval"):
        found = None
        for attempt in range(3):  # until the store stopped the run before its work was done
            seq += 1
            _, events, stored = word_engine.run(f"word-{mech}-{attempt}", mech, cancel_at_step=1, cancel_seq=seq,
                                                cancel=lambda s=seq: word.store(s), settings=WORD_SETTINGS)
            done = events[-1]  # no cancel line was ever sent
            assert done["outcome"] == "cancelled" and done["cancel_via"] == "word", (mech, done)
            assert stored <= done["cancel_received_t"] <= done["t"], (mech, done)
            assert "output_sha256" not in done
            assert "trial_cpu_after_receipt_ns" not in done["counters"]  # no CPU reading at the agent's store
            # ... but the latching reader's own stamp on this (the main) thread, its run delay included
            # (libcancelbench 1.3: the main thread watched the word, so its schedstat was open at the latch)
            assert done["cpu"]["receipt_t"] == done["cancel_received_t"], done
            assert 0 <= done["cpu"]["receipt_wait"] <= done["cpu"]["terminal_wait"], done
            assert done["cpu"]["run_cpu"] <= done["cpu"]["receipt_cpu"] <= done["cpu"]["terminal_cpu"], done
            _check_run_shape(events)
            # between_calls latches the word before the next llama_decode; a native reader inside the
            # decode it stops (graph_eval's check after a decode could latch it too: not counted here)
            if done["counters"]["decode_calls"] < full and (mech == "between_calls" or _received_in_flight(events)):
                found = events
                break
        assert found, f"{mech}: no store of 3 stopped the run before its work was done"
        done = found[-1]
        seen = [e for e in found if e["type"] == "cancel_seen"]
        if mech == "between_calls":  # the check before the next llama_decode latched it; no native reader
            assert seen == [] and "native_returned_t" not in done
        else:  # the native reader latched the word at its poll: received and seen there
            assert len(seen) == 1 and done["cancel_received_t"] <= seen[0]["t"] <= done["native_returned_t"]
            assert done["counters"]["abort_polls"] > 0
        if mech == "abort_callback":
            assert done["counters"]["decode_rc"] == 2
        if mech == "graph_eval":
            assert done["counters"]["eval_seen_where"] in (1, 2)


def test_a_stale_word_never_cancels_a_later_trial(word_engine, word, small_text_model):
    _, hello = word_engine.recv()
    _load(word_engine, small_text_model, WORD_SETTINGS)
    _, events, _ = word_engine.run("ref", "between_calls", settings=WORD_SETTINGS)
    digest = events[-1]["output_sha256"]
    # trial 1 is cancelled by the word alone; the word then stays at 1
    _, events, _ = word_engine.run("t1", "abort_callback", cancel_at_step=1, cancel_seq=1,
                                   cancel=lambda: word.store(1), settings=WORD_SETTINGS)
    assert events[-1]["outcome"] == "cancelled" and events[-1]["cancel_via"] == "word"
    assert word.load() == 1
    # trials 2-4 under every reader: the word left at 1 is not theirs
    for seq, mech in enumerate(("between_calls", "abort_callback", "graph_eval"), start=2):
        _, events, _ = word_engine.run(f"t{seq}", mech, cancel_seq=seq, settings=WORD_SETTINGS)
        done = events[-1]
        assert done["outcome"] == "completed" and done["output_sha256"] == digest, (mech, done)
        assert "cancel_received_t" not in done and "cancel_via" not in done
        assert "cancel_seen" not in [e["type"] for e in events]
    # a word already at a trial's number when its run arrives: ended without its work, as a latched line
    word.store(5)
    _, events, _ = word_engine.run("t5", "abort_callback", cancel_seq=5, settings=WORD_SETTINGS)
    done = events[-1]
    assert done["outcome"] == "cancelled" and done["cancel_via"] == "word"
    assert done["counters"]["decode_calls"] == 0
    # the line still works beside the word: read first, it is the receipt
    _, events, sent = word_engine.run("t6", "abort_callback", cancel_at_step=1, cancel_seq=6, settings=WORD_SETTINGS)
    done = events[-1]
    assert done["outcome"] == "cancelled" and done["cancel_via"] == "line" and sent <= done["cancel_received_t"]


def test_without_cancel_seq_the_word_is_ignored(word_engine, word, small_text_model):
    _, hello = word_engine.recv()
    _load(word_engine, small_text_model, WORD_SETTINGS)
    word.store(1)  # a run that carries no cancel_seq watches nothing, whatever the word holds
    for mech in ("between_calls", "abort_callback", "graph_eval"):
        _, events, _ = word_engine.run(f"noseq-{mech}", mech, settings=WORD_SETTINGS)
        done = events[-1]
        assert done["outcome"] == "completed" and "cancel_via" not in done, (mech, done)
    # and a cancel line for such a run works as before
    _, events, sent = word_engine.run("noseq-line", "graph_eval", cancel_at_step=1, settings=WORD_SETTINGS)
    assert events[-1]["outcome"] == "cancelled" and events[-1]["cancel_via"] == "line"


def test_no_word_handed_over_cancel_seq_is_harmless_and_bad_ones_are_refused(engine, small_text_model):
    _, hello = engine.recv()
    assert hello["capabilities"] == ["cancel_word"]  # declared even when no word was handed over
    _load(engine, small_text_model, WORD_SETTINGS)
    _, events, _ = engine.run("seq-only", "abort_callback", cancel_seq=1, settings=WORD_SETTINGS)
    assert events[-1]["outcome"] == "completed"
    _, events, sent = engine.run("seq-line", "abort_callback", cancel_at_step=1, cancel_seq=2, settings=WORD_SETTINGS)
    assert events[-1]["outcome"] == "cancelled" and events[-1]["cancel_via"] == "line"
    for bad in (0, -1, 1.5, "7", None, 2**53):
        engine.send({"type": "run", "trial": "bad-seq", "mechanism": "between_calls", "input": "x", "cancel_seq": bad})
        _, err = engine.recv()
        assert err["type"] == "error" and err["of"] == "run" and "cancel_seq" in err["message"], (bad, err)


# --------------------------------------------------------------------- graph_eval's bound, through a sweep

# One llama.cpp thread (bench_residue.py's setup): the engine process's CPU is then the graph thread's
# work, not a peer's barrier spin. Three prefill step calls of 128 tokens: cancels aimed at them land
# while a graph runs.
BOUND_SETTINGS = {"n_threads": 1, "n_ctx": 512, "n_batch": 128, "prompt_tokens": 384, "max_tokens": 4}
BOUND_CANCELS = 8
NODE_PROFILES = 5


def _largest_node_cpu_ns(model: str) -> int:
    """graph_eval's bound is slice + 2 x the largest node (benchmarks/bench_residue.py): a calibration,
    not a trial. The median over NODE_PROFILES uncancelled slice-0 runs (each node its own range) of
    the longest range's CPU time on the graph thread (cb_token_max_range_cpu_ns, the engine's
    eval_max_range_cpu_ns), in a C engine process of its own with the sweep's model and sizes."""
    eng = Engine()
    try:
        eng.recv()
        settings = {**BOUND_SETTINGS, "graph_slice_us": 0}
        _load(eng, model, settings)
        profiles = []
        for i in range(NODE_PROFILES):
            _, events, _ = eng.run(f"node-{i}", "graph_eval", settings=settings)
            done = events[-1]
            assert done["outcome"] == "completed", done
            c = done["counters"]
            assert c["eval_syncs"] == c["abort_polls"] > 0  # every node synced: each range is one node
            profiles.append(c["eval_max_range_cpu_ns"])
        return int(statistics.median(profiles))
    finally:
        eng.close()


def test_c_engine_graph_eval_stop_in_a_sweep_is_within_slice_plus_two_largest_nodes(local_ray, tmp_path,
                                                                                      small_text_model):
    from cancelbench.orchestrator.config import load_config
    from cancelbench.orchestrator.runner import run_sweep
    from cancelbench.sink import read_records

    node_ns = _largest_node_cpu_ns(small_text_model)
    settings = ", ".join(f"{k} = {v}" for k, v in BOUND_SETTINGS.items())  # graph_slice_us: the default
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(f"""
[sweep]
seed = 11
trials_per_cell = {BOUND_CANCELS}
reference_runs = 3
mechanisms = ["graph_eval"]
deliveries = ["agent"]
ping_samples = 5
[offsets]
plan = "progress"
phases = ["prefill"]
min_per_phase = {BOUND_CANCELS}
[[workload]]
name = "c-text"
engine = "external"
command = {json.dumps(c_engine_command())}
model = "fixture:text-qwen3-14m"
settings = {{{settings}}}
""")
    out = tmp_path / "out"
    result = run_sweep(load_config(cfg), out, progress=False)
    df = read_records(out)
    assert result.exit_code == 0 and set(df.outcome) <= {"cancelled", "completed"}, df.error.dropna().tolist()
    slice_us = json.loads(df.engine_settings_json.iloc[0])["graph_slice_us"]
    assert slice_us == native.DEFAULT_GRAPH_SLICE_US  # the declared default, sent by the agent
    cancels = df[df.trial_kind == "cancel"]
    assert len(cancels) == BOUND_CANCELS and set(cancels.target_phase) == {"prefill"}
    counters = cancels.engine_counters_json.map(json.loads)
    where = counters.map(lambda c: c["eval_seen_where"])
    # in flight: a step call ran at the agent's receipt, and the C engine's eval reader saw the cancel
    # the engine's progress at its receipt (done.at_receipt), never the agent's 0: every row with a receipt
    # has it; nothing is generated before the whole prompt is decoded
    took = cancels[cancels.t_received_ns.notna()]
    assert len(took) > 0 and took[["input_tokens_done_at_receipt", "tokens_generated_at_receipt"]].notna().all().all()
    assert (took.input_tokens_done_at_receipt <= BOUND_SETTINGS["prompt_tokens"]).all()
    mid_prompt = took[took.input_tokens_done_at_receipt < BOUND_SETTINGS["prompt_tokens"]]
    assert len(mid_prompt) > 0 and (mid_prompt.tokens_generated_at_receipt == 0).all()
    landed = cancels[(cancels.outcome == "cancelled") & cancels.native_call_at_receipt.notna()]
    # the engine's name for its call in flight (1.5), over the agent's "step" where the engine sent none
    assert "llama_decode" in set(landed.native_call_at_receipt) <= {"llama_decode", "step"}, landed.native_call_at_receipt
    seen = landed[landed.t_native_observed_ns.notna()]
    assert len(seen) > 0, cancels[["outcome", "phase_at_receipt", "native_call_at_receipt"]]
    assert (where[seen.index] > 0).all() and (counters[seen.index].map(lambda c: c["abort_polls"]) > 0).all()
    assert ((seen.t_received_ns <= seen.t_native_observed_ns) & (seen.t_native_observed_ns <= seen.t_terminal_ns)).all()
    # the bound, for cancels seen at a range's sync: the stop's engine work within slice + 2 x the largest
    # node. The work is the C engine's graph thread's CPU from its receipt to its terminal decision
    # (trial_cpu_after_receipt_ns, that thread's own clock, up to date when read). Not the agent's
    # engine_cpu_ms: a process's CPU clock read from outside lags a thread running on another CPU by up
    # to a scheduler tick, and the agent reads it after forwarding the cancel (rows over the wall residue
    # and rows near 0 both seen here).
    # A receipt by the shared word (the agent stores it before the line) is latched at the reader's sync,
    # where the engine cannot read its CPU at the agent's store: only receipts by the line are judged.
    at_sync = seen[(where[seen.index] == 1) & (seen.engine_cancel_via == "line")]
    assert len(at_sync) > 0, seen[["engine_cancel_via"]].assign(where=where[seen.index]).to_dict("records")
    work_ns = counters[at_sync.index].map(lambda c: c["trial_cpu_after_receipt_ns"])
    bound_ns = slice_us * 1000 + 2 * node_ns
    over = work_ns[work_ns > bound_ns]
    assert over.empty, (f"bound {bound_ns / 1e6:.3f} ms (slice {slice_us} us, largest node {node_ns / 1e6:.3f} ms CPU)",
                        (over / 1e6).tolist(), at_sync.latency_ms[over.index].tolist())
