"""The in-process channel (``engine_process = "channel"``, cancelbench.sut.channel): the simulated engine
behind the engine protocol on a thread of the agent's process. The agent's own engine class and control
(no Ray): a cancel mid-wait goes through the shared cancel word and the line, the done comes back over the
pipe with the engine's stamps and counters, no process is started, and ending it leaves no thread or
descriptor behind. The sweep-level check (every column a child's rows fill) is in test_one_path_parity."""

from __future__ import annotations

import json
import os
import threading

import psutil
import pytest

from cancelbench import native
from cancelbench.device_agents import cpu_account
from cancelbench.device_agents.engines.base import CancelControl, Progress
from cancelbench.device_agents.engines.registry import make_engine
from cancelbench.orchestrator.config import ConfigError, load_config
from cancelbench.request import TrialRequest
from cancelbench.sut.client import EngineError
from helpers import cancel_at_first_step

WAIT_S = 60.0  # a bound on waiting for observable state, never a timing assertion


def _open_fds() -> set[str]:
    """This process's pipes and memfds, by what they are."""
    out = set()
    for n in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            continue
        if target.startswith(("pipe:", "/memfd:")):
            out.add(f"{n} {target}")
    return out


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("engine-sim") or t.name == "sut-stdin"]


def test_a_sim_engine_over_the_channel_is_cancelled_mid_wait_and_starts_no_process():
    make_engine({"engine": "sim", "engine_process": "channel"}).close()  # what the first one opens for good (imports)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    fds = _open_fds()
    engine = make_engine({"engine": "sim", "engine_process": "channel", "sim_phase_us": 2_000_000,
                          "sim_granularity_us": 1_000, "sim_steps": 2})
    thread_engine = engine.proc.proc
    engine_tid = thread_engine._thread.native_id
    try:
        assert type(engine).__name__ == "BuiltinChannelEngine"
        assert engine.proc.proc.pid == os.getpid()  # the engine's threads are the agent's
        assert engine.proc.uses_word  # the shared word, its address handed over directly
        # the stall reads the engine's two threads, not every thread of the agent's process
        assert len(engine.proc.proc.engine_tids) == 2 and os.getpid() not in engine.proc.proc.engine_tids
        result, cols = cancel_at_first_step(engine, "ch.0", wait_s=WAIT_S)  # inside the first 1 s wait
        assert result.outcome == "cancelled", cols
        # handed over through the shared word (its address given directly), then the line; the engine took it
        # from whichever it saw first
        assert cols["engine_cancel_path"] == "word" and cols["engine_cancel_via"] in ("word", "line"), cols
        assert cols["engine_clock"] == "same" and cols["engine_restarts"] == 0, cols
        assert cols["cancel_stall_ns"] is not None and cols["cancel_stall_ns"] >= 0, cols  # read on those threads
        counters = json.loads(cols["engine_counters_json"])
        assert counters["known_answer_error_ns"] >= 0  # the sim's known answer came over the pipe
        assert {p.pid for p in psutil.Process().children(recursive=True)} == children  # no process started
    finally:
        engine.close()
    assert thread_engine.poll() == 0  # the server returned (shutdown), its thread is gone
    assert not [t for t in _engine_threads() if t.is_alive()]
    assert _open_fds() <= fds  # every pipe end and the word's descriptor closed
    # the engine's threads' kept-open schedstat too (its trial thread's readings, the stall's)
    assert not {engine_tid, thread_engine.server.reader_tid} & set(cpu_account._SCHEDSTAT_FDS)


def test_only_a_simulated_engine_may_run_over_the_channel(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[workload]]\nname = "t"\nengine = "text"\nengine_process = "channel"\n')
    with pytest.raises(ConfigError, match="only a simulated engine runs over the in-process channel"):
        load_config(cfg)
    cfg.write_text('[[workload]]\nname = "s"\nengine = "sim"\n')
    (workload,) = load_config(cfg).workloads
    assert workload.process == "channel" and workload.engine_params()["engine_process"] == "channel"


def test_a_crash_failpoint_is_refused_in_the_agents_process(monkeypatch):
    """A failpoint that signals the engine's process would end the agent here: the trial errs instead."""
    from cancelbench.failpoints import CRASH_SIGNAL

    monkeypatch.setenv(CRASH_SIGNAL, "SIGILL,.0")
    engine = make_engine({"engine": "sim", "engine_process": "channel", "sim_phase_us": 20_000})
    try:
        with pytest.raises(EngineError, match="would end the agent"):
            engine.run(TrialRequest("abort_callback", "", trial_id="ch.0", trial_kind="reference",
                                    delivery="agent"), CancelControl(native.CancelToken(), Progress()))
        # the agent (this process) lives; the engine, whose trial failed, is started again for the next
        result = engine.run(TrialRequest("abort_callback", "", trial_id="ch.1", trial_kind="reference",
                                         delivery="agent"), CancelControl(native.CancelToken(), Progress()))
        assert result.outcome == "completed" and engine.restarts == 1
    finally:
        engine.close()
