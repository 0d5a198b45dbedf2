"""The shared cancel word (issue 35, docs/sut-protocol.md "The shared cancel word"): private to
the agent and its engine, a stale word never cancels a later trial, a word-only cancel stops a
real engine before any line is read, and sut-check fails an engine that declares the word but
never reads it."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cancelbench import native
from cancelbench.sut import cancel_word
from cancelbench.sut.check import run_checks
from cancelbench.sut.client import EngineProcess

HERE = Path(__file__).resolve().parent
MISBEHAVE = [sys.executable, str(HERE / "data" / "engines" / "misbehave.py")]
SIM = [sys.executable, "-m", "cancelbench.sut.builtin", "sim"]
TEXT_MODEL = Path(__file__).resolve().parents[1] / "datasets" / "models" / "text-llama-57m.gguf"

needs_memfd = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the Linux region (memfd)")


@needs_memfd
def test_the_region_has_no_name_and_the_engines_descriptor_cannot_write_or_resize_it():
    word = cancel_word.create()
    try:
        assert word is not None and word.kind == "memfd"
        fd = word.engine_fd
        # no name anywhere: an anonymous memfd, not a file in /dev/shm that another process could open
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:cancelbench-cancel-word")
        assert not any("cancelbench" in n for n in os.listdir("/dev/shm"))
        assert os.fstat(fd).st_nlink == 0
        # read-only for the engine: its descriptor cannot write, map writable, or resize the region
        assert (os.O_ACCMODE & _flags(fd)) == os.O_RDONLY
        with pytest.raises(OSError):
            os.write(fd, b"\x01")
        with pytest.raises(OSError):
            mmap.mmap(fd, cancel_word.REGION_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)  # the seals: an engine that shrinks it cannot make the agent's store fault
        # and a writable descriptor reopened from it cannot map it writable (F_SEAL_FUTURE_WRITE)
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR) if _can_reopen_rw(fd) else None
        if rw is not None:
            try:
                with pytest.raises(OSError):
                    mmap.mmap(rw, cancel_word.REGION_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
            finally:
                os.close(rw)
        # the engine's read-only mapping sees the agent's stores
        addr = native.word_map(fd)
        assert native.word_load(addr) == 0
        word.store(41)
        assert native.word_load(addr) == 41 == word.load()
    finally:
        word.close()


def _flags(fd: int) -> int:
    import fcntl
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _can_reopen_rw(fd: int) -> bool:
    try:
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
        return True
    except OSError:
        return False


@needs_memfd
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_cannot_open_the_region():
    word = cancel_word.create()
    try:
        path = f"/proc/{os.getpid()}/fd/{word.engine_fd}"
        opener = ["/bin/sh", "-c", 'exec 3<"$1"', "sh", path]  # (nobody cannot run this venv's python)
        assert subprocess.run(opener, timeout=60).returncode == 0  # the control: this user can open it
        rc = subprocess.run(opener, user=65534, group=65534, extra_groups=[], stderr=subprocess.DEVNULL,
                            timeout=60).returncode
        assert rc != 0, "a process of another user opened the agent's cancel word"
    finally:
        word.close()


def _until_done(proc: EngineProcess, trial: str) -> list:
    """Every line read up to and including ``trial``'s done (Received: the message, when it was read)."""
    read = []
    while not read or not (read[-1].msg["type"] == "done" and read[-1].msg["trial"] == trial):
        read.append(proc.check(proc.messages.get(timeout=60), f"the done of {trial}"))
    return read


def _done(proc: EngineProcess, trial: str) -> dict:
    return _until_done(proc, trial)[-1].msg


def _run(proc: EngineProcess, trial: str, seq: int | None) -> None:
    msg = {"type": "run", "trial": trial, "mechanism": "flag", "input": "x"}
    if seq is not None:
        msg["cancel_seq"] = seq
    proc.send(msg)


def _first_step(proc: EngineProcess, trial: str) -> None:
    while True:
        got = proc.check(proc.messages.get(timeout=60), f"a step of {trial}")
        if got.msg["type"] == "step" and got.msg["trial"] == trial:
            return


@needs_memfd
def test_a_word_only_cancel_stops_the_run_and_a_stale_word_never_cancels_the_next():
    proc = EngineProcess(MISBEHAVE + ["sigill", "1000"])  # a working engine until its 1000th run
    try:
        proc.start()
        assert proc.declaration.can("cancel_word") and proc.uses_word
        proc.load({}, {"steps": 200, "step_ms": 5})
        seq = proc.next_seq()
        _run(proc, "w1", seq)
        _first_step(proc, "w1")
        t_store = proc.word.store(seq)  # the word alone: no cancel line is ever sent for w1
        done = _done(proc, "w1")
        assert done["outcome"] == "cancelled" and done["cancel_via"] == "word"
        assert done["cancel_received_t"] >= t_store  # same clock (pongs on the agent's clock)
        # the word still holds w1's number, and is set again to it between the trials: w2 runs to the end
        proc.word.store(seq)
        seq2 = proc.next_seq()
        assert seq2 != seq
        _run(proc, "w2", seq2)
        done2 = _done(proc, "w2")  # 200 steps of 5 ms: the word is looked at every step and every 0.5 ms
        assert done2["outcome"] == "completed" and "cancel_received_t" not in done2
        # a run sent without cancel_seq ignores the word, even at the number it would have had
        proc.word.store(seq2 + 1)
        _run(proc, "w3", None)
        assert _done(proc, "w3")["outcome"] == "completed"
    finally:
        proc.close()


@needs_memfd
def test_the_agent_stores_the_word_before_it_writes_the_line():
    proc = EngineProcess(MISBEHAVE + ["sigill", "1000"])
    try:
        proc.start()
        proc.load({}, {"steps": 400, "step_ms": 5})
        seq = proc.next_seq()
        _run(proc, "o1", seq)
        _first_step(proc, "o1")
        t = proc.send_cancel("o1", seq)
        assert proc.word.load() == seq
        done = _done(proc, "o1")
        assert done["outcome"] == "cancelled" and done["cancel_received_t"] >= t
    finally:
        proc.close()


@needs_memfd
@pytest.mark.parametrize("mechanism", ["abort_callback", "graph_eval"])
def test_a_native_reader_of_the_text_engine_sees_the_word_before_the_line(mechanism):
    """The built-in text engine out of process: the reader inside llama_decode sees the word alone
    (rc 2 for the abort reader), the receipt is the token's latch from the word."""
    proc = EngineProcess([sys.executable, "-m", "cancelbench.sut.builtin", "text"], startup_timeout_s=120)
    try:
        proc.start()
        proc.load({"model": str(TEXT_MODEL)}, {"n_threads": 1, "n_batch": 64, "prompt_tokens": 384,
                                              "max_tokens": 4})
        seq = proc.next_seq()
        proc.send({"type": "run", "trial": "n1", "mechanism": mechanism, "input": "hello " * 200,
                   "cancel_seq": seq})
        _first_step(proc, "n1")
        t_store = proc.word.store(seq)
        read = _until_done(proc, "n1")
        done = read[-1].msg
        assert done["outcome"] == "cancelled" and done["cancel_via"] == "word"
        assert done["cancel_received_t"] >= t_store
        if mechanism == "abort_callback":
            assert done["counters"]["decode_rc"] == 2  # stopped inside llama_decode by the reader
        # the reader's latch is the receipt, which the trial learns of only when run returns: its events
        # from the latch on (the sight, the stopped call's end) were held and written after the terminal
        # decision (cancelbench.sut.builtin, Trial.hold_events), as an engine in the agent writes nothing
        terminal = proc.clock.to_agent(done["t"]) - proc.clock.uncertainty_ns
        after = [got for got in read[:-1] if got.msg.get("trial") == "n1"
                 and got.msg["t"] >= done["cancel_received_t"]]
        assert "cancel_seen" in [got.msg["type"] for got in after], [got.msg for got in read]
        assert all(got.t_read_ns >= terminal for got in after), (terminal, [(g.msg, g.t_read_ns) for g in after])
    finally:
        proc.close()


@needs_memfd
def test_sut_check_passes_the_word_of_an_engine_that_reads_it_and_fails_one_that_does_not():
    _, checks = run_checks(SIM, models={}, settings={}, text="x", mechanism="abort_callback")
    by = {c.name: c for c in checks}
    assert by["cancel_word"].ok and not by["cancel_word"].skipped, by["cancel_word"].detail
    _, checks = run_checks(MISBEHAVE + ["ignores_word"], models={}, settings={"steps": 200, "step_ms": 5},
                           text="x", mechanism="flag")
    by = {c.name: c for c in checks}
    assert not by["cancel_word"].ok and "not honoured" in by["cancel_word"].detail
    assert all(c.ok for n, c in by.items() if n != "cancel_word"), [c for c in checks if not c.ok]



def test_a_recorded_declaration_keeps_its_capabilities():
    """A manifest's external workload comes back with the capabilities its engine declared (else a
    resummarised or resumed sweep's config differs from the one it ran with)."""
    import dataclasses
    import json

    from cancelbench.orchestrator.workloads import recorded_declaration
    from cancelbench.sut.declaration import Declaration
    hello = {"type": "hello", "protocol": 1, "engine": {"name": "e", "version": "1"}, "build": {}, "clock": "monotonic",
             "input": "text", "phases": [{"name": "prefill", "steps": True}],
             "mechanisms": [{"name": "abort_callback", "reaches": "in_call"}], "settings": [],
             "capabilities": ["cancel_word"]}
    decl = Declaration.from_hello(hello)
    assert decl.can("cancel_word")
    recorded = json.loads(json.dumps({"declaration": dataclasses.asdict(decl)}))  # as a manifest holds it
    assert recorded_declaration(recorded) == decl


def _own_run_delay() -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        return int(f.read().split()[1])


@needs_memfd
def test_a_latch_reads_the_run_delay_of_the_thread_that_watched_and_of_no_other():
    """The residue split of a receipt the native reader latched from the word needs that thread's
    run delay at the latch (done.cpu.receipt_wait, ABI 1.3): the latch, on the thread that watched
    the word, reads it between this thread's own reads before and after; a latch on a thread that
    never watched one reads none (no schedstat open there), and says which thread latched."""
    word = cancel_word.create()
    try:
        token, seen = native.CancelToken(), {}

        def watch_and_latch() -> None:
            token.watch(word.address, 5)
            word.store(5)
            before = _own_run_delay()
            assert token.is_set()  # the latch: this reader found the word at the trial's number
            seen.update(latch=token.word_latch, before=before, after=_own_run_delay(),
                        tid=threading.get_native_id())

        _in_thread(watch_and_latch)
        cpu, tid, wait = seen["latch"]
        assert tid == seen["tid"] and cpu > 0 and wait is not None
        assert seen["before"] <= wait <= seen["after"]
        # watched here, latched by a thread that never watched a word: its stamp, no run delay
        token.reset()
        word.store(0)
        token.watch(word.address, 6)
        word.store(6)
        other = {}
        _in_thread(lambda: other.update(set=token.is_set(), tid=threading.get_native_id()))
        assert other["set"] and token.word_latch[1] == other["tid"] and token.word_latch[2] is None
        token.reset()  # a reset forgets the latch, its run delay included
        assert token.word_latch is None and native._lib().cb_token_word_wait_ns(token.address) == -1
    finally:
        word.close()


def _in_thread(fn) -> None:
    errors = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (re-raised on the test's thread)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]
