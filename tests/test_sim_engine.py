"""The simulated engine: a native timed wait that honours the token, and the
known answers that follow from it (no wall-clock bounds: ordering and step
indices on the waits' own stamps)."""

from __future__ import annotations

import threading

import pytest

from cancelbench import native
from cancelbench.device_agents.engines.base import CancelControl, EngineInputError, Progress
from cancelbench.device_agents.engines.registry import ENGINES, engine_spec
from cancelbench.device_agents.engines.sim import SimEngine, expected_return_ns
from cancelbench.request import TrialRequest


def _set_during_wait(token: native.CancelToken, in_wait: threading.Event) -> threading.Thread:
    """Set the token once the wait has visibly started (observable state, no fixed sleep)."""
    def fire():
        in_wait.wait()
        token.set()
    th = threading.Thread(target=fire)
    th.start()
    return th


def test_sim_wait_without_cancel_runs_its_duration_and_checks_every_step():
    t = native.CancelToken()
    k, start, end = native.sim_wait(t, 10_000, 1_000)
    assert k == 0 and end - start >= 10_000_000
    assert t.polls == 10  # checks at start + 1..10 ms, the last at its end


def test_sim_wait_without_token_never_checks():
    k, start, end = native.sim_wait(None, 5_000, 1_000)
    assert k == 0 and end - start >= 5_000_000


def test_sim_wait_stops_at_the_first_check_after_the_set():
    """Known answer: the wait stops no later than its first check scheduled at or after
    the set (a check that woke late may see it earlier, never a later one), its reader
    stamp lies between the set and the return, and the residue is one step plus that
    check's measured lateness."""
    granularity_us = 2_000
    for _ in range(3):
        t = native.CancelToken()
        started = threading.Event()
        box = {}

        def wait():
            box["r"] = native.sim_wait(t, 2_000_000, granularity_us)

        th = threading.Thread(target=wait)
        th.start()
        # the wait has started once the reader has polled (observable, no fixed sleep)
        while t.polls == 0 and th.is_alive():
            started.wait(0.001)
        set_ns = t.set()
        th.join()
        k, start, end = box["r"]
        assert k >= 1, "a wait with checks must stop on the token"
        expected = native.sim_expected_check(start, set_ns, granularity_us)
        assert 1 <= k <= expected  # never misses the first scheduled check after the set
        assert set_ns <= t.seen_ns <= end
        lateness = t.seen_ns - (start + k * granularity_us * 1000)
        assert lateness >= 0  # never checks before its schedule
        # the residue: at most one step plus the stopping check's own measured wake-up lateness
        assert t.seen_ns - set_ns <= granularity_us * 1000 + lateness
        assert t.polls == k
        assert end - start < 2_000_000_000  # stopped: never ran its full duration


def test_sim_expected_check_is_the_ceiling_step():
    assert native.sim_expected_check(0, 1, 1_000) == 1
    assert native.sim_expected_check(0, 1_000_000, 1_000) == 1
    assert native.sim_expected_check(0, 1_000_001, 1_000) == 2
    assert native.sim_expected_check(100, 50, 1_000) == 1  # set before the start: the first check


def _engine(**kw) -> SimEngine:
    return engine_spec("sim").make({"sim_phase_us": 300_000, "sim_granularity_us": 1_000, "sim_steps": 3, **kw})


def _cancelled_trial(engine: SimEngine, mechanism: str):
    """Run one trial and cancel it once its first wait (prefill) is in flight."""
    ctl = CancelControl(native.CancelToken(), Progress())
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", engine.run(TrialRequest(mechanism, ""), ctl)))
    th.start()
    while ctl.progress.native_call is None and th.is_alive():
        threading.Event().wait(0.001)
    ctl.request(native.now_ns())
    th.join()
    return box["r"], ctl


def test_registry_marks_sim_as_simulated_and_model_free():
    spec = ENGINES["sim"]
    assert spec.simulated and not spec.needs_model
    assert spec.phases == ("prefill", "generate")
    assert not any(s.simulated for n, s in ENGINES.items() if n != "sim")


def test_between_calls_waits_out_the_rest_of_the_wait_in_flight():
    """between_calls: no reader inside the wait, so it returns at the wait's own end
    (the rest of the wait is the residue), after the set and before the next wait."""
    engine = _engine()
    result, ctl = _cancelled_trial(engine, "between_calls")
    assert result.outcome == "cancelled" and result.phase_at_terminal == "prefill"
    assert len(engine.last_waits) == 1
    wait = engine.last_waits[0]
    assert wait["k"] == 0 and wait["granularity_us"] == 0
    assert ctl.token.seen_ns == 0 and ctl.token.polls == 0  # no native reader saw it
    assert ctl.token.set_ns < wait["start_ns"] + 300_000_000 <= wait["end_ns"] <= ctl.native_returned_ns
    assert expected_return_ns(wait, ctl.token.set_ns) == wait["start_ns"] + 300_000_000
    assert result.output["known_answer_error_ms"] >= 0


@pytest.mark.parametrize("mechanism", ["abort_callback", "graph_eval"])
def test_in_wait_mechanisms_stop_at_the_next_check(mechanism):
    """In-wait: the wait checks every granularity, so it stops at the first check after
    the set, long before the end of the wait between_calls would wait out."""
    engine = _engine()
    result, ctl = _cancelled_trial(engine, mechanism)
    assert result.outcome == "cancelled" and result.phase_at_terminal == "prefill"
    wait = engine.last_waits[-1]
    set_ns, seen_ns = ctl.token.set_ns, ctl.token.seen_ns
    expected_k = native.sim_expected_check(wait["start_ns"], set_ns, 1_000)
    assert 1 <= wait["k"] <= expected_k
    lateness = seen_ns - (wait["start_ns"] + wait["k"] * 1_000_000)
    assert lateness >= 0 and seen_ns - set_ns <= 1_000_000 + lateness
    assert set_ns <= seen_ns <= wait["end_ns"] <= ctl.native_returned_ns
    assert wait["end_ns"] < wait["start_ns"] + 300_000_000  # it did not wait out the phase
    assert result.output["known_answer_error_ms"] >= 0


def test_chunked_splits_prefill_into_shorter_waits():
    engine = _engine()
    assert [d for p, d in engine._waits(chunked=True) if p == "prefill"] == [100_000] * 3
    assert [d for p, d in engine._waits(chunked=False) if p == "prefill"] == [300_000]
    assert [d for p, d in engine._waits(chunked=False) if p == "generate"] == [100_000] * 3


def test_uncancelled_trial_runs_both_phases():
    engine = _engine(sim_phase_us=3_000)
    ctl = CancelControl(native.CancelToken(), Progress())
    result = engine.run(TrialRequest("abort_callback", ""), ctl)
    assert result.outcome == "completed"
    assert set(result.phase_durations_ms) == {"prefill", "generate"}
    assert [s[0] for s in result.phase_segments] == ["prefill", "generate"]
    assert engine.describe() == {"engine": "sim", "sim_phase_us": 3_000, "sim_granularity_us": 1_000,
                                 "sim_steps": 3}


def test_bad_settings_are_input_errors():
    with pytest.raises(EngineInputError):
        SimEngine({"sim_steps": -1})


# -- config and a local sweep on simulated devices ------------------------------------------

SIM = {"name": "sim", "engine": "sim", "sim_phase_us": 20_000, "sim_granularity_us": 1_000, "sim_steps": 2}


def test_config_accepts_sim_settings_and_sim_per_host_only_for_sim_workloads():
    from cancelbench.orchestrator.config import ConfigError, parse_config

    cfg = parse_config({"devices": {"sim_per_host": 8}, "workload": [SIM]})
    assert cfg.devices.sim_per_host == 8 and cfg.workloads[0].sim_phase_us == 20_000
    with pytest.raises(ConfigError, match="real engine"):
        parse_config({"devices": {"sim_per_host": 2}, "workload": [SIM, {"name": "t", "engine": "text"}]})
    with pytest.raises(ConfigError, match="takes no devices.backends"):
        parse_config({"devices": {"sim_per_host": 2, "backends": ["cpu"]}, "workload": [SIM]})
    for bad in ({"sim_granularity_us": 0}, {"sim_phase_us": -1}, {"sim_steps": 1.5}):
        with pytest.raises(ConfigError):
            parse_config({"workload": [{**SIM, **bad}]})
    with pytest.raises(ConfigError):
        parse_config({"devices": {"sim_per_host": -1}, "workload": [SIM]})


def test_sweep_on_eight_simulated_devices_runs_every_trial_once_and_reports_say_simulated(local_ray, tmp_path):
    import pyarrow.parquet as pq

    from cancelbench.orchestrator.config import DeviceSelector, OffsetSpec, SweepConfig, WorkloadSpec
    from cancelbench.orchestrator.runner import run_sweep
    from cancelbench.reports import build_report
    from cancelbench.reports.sections import headline
    from cancelbench.sink import read_records

    wl = WorkloadSpec(name="sim", engine="sim", sim_phase_us=20_000, sim_granularity_us=1_000, sim_steps=2)
    cfg = SweepConfig(seed=3, trials_per_cell=2, reference_runs=3, ping_samples=3, workloads=(wl,),
                      mechanisms=("between_calls", "abort_callback"), deliveries=("driver", "agent"),
                      offsets=OffsetSpec(plan="uniform"), devices=DeviceSelector(sim_per_host=8))
    out = tmp_path / "sim8"
    result = run_sweep(cfg, out, progress=False)
    df = read_records(out)
    planned = pq.read_table(out / "plan.parquet", columns=["trial_id", "device"]).to_pandas()
    assert planned.device.nunique() == 8
    assert len(planned) == 8 * 2 * (3 + 2 * 2)
    assert sorted(df.trial_id) == sorted(planned.trial_id)  # every planned trial exactly once
    assert set(df.device) == {f"sim:{i}" for i in range(8)} and set(df.backend) == {"sim"}
    assert set(df.engine) == {"sim"} and (df.sim_phase_us == 20_000).all() and (df.sim_granularity_us == 1_000).all()
    assert result.exit_code == 0, result.outcomes
    assert (df.outcome != "dropped").all() and df.llama_cpp_python_version.isna().all()
    report = build_report([out])
    assert report.simulated == ["sim"] and "SIMULATED" in headline(report)


def test_a_cancel_latched_before_the_start_stops_in_the_first_phase_without_a_wait():
    engine = _engine()
    ctl = CancelControl(native.CancelToken(), Progress())
    ctl.request(native.now_ns())
    result = engine.run(TrialRequest("abort_callback", ""), ctl)
    assert result.outcome == "cancelled" and result.phase_at_terminal == "prefill"
    assert engine.last_waits == [] and result.output is None


def test_the_driver_cancel_timer_never_spins_holding_the_gil(monkeypatch):
    """Every pass of the driver's wait-for-deadline loop sleeps (time.sleep releases the
    GIL; 0 yields it): a spin loop holding the GIL starves every other device thread."""
    from cancelbench.orchestrator import cancel_timer

    now = [0]
    reads = []
    calls = []

    def fake_now():
        now[0] += 30_000  # each clock read: 30 us later
        reads.append(now[0])
        return now[0]

    def fake_sleep(s):
        calls.append(s)
        now[0] += int(s * 1e9)

    monkeypatch.setattr(cancel_timer, "driver_now_ns", fake_now)
    monkeypatch.setattr(cancel_timer.time, "sleep", fake_sleep)
    cancel_timer.sleep_until_driver(5_000_000)
    assert reads[-1] >= 5_000_000 > reads[-2]  # returns at the first read past the deadline
    assert len(calls) == len(reads) - 1  # every pass but the returning one slept (or yielded)
    assert calls[0] * 1e9 >= 5_000_000 - 30_000 - cancel_timer.SPIN_NS - 1  # most of the wait in one sleep


def test_a_long_trial_is_asked_for_its_phase_and_a_short_one_is_not(local_ray, monkeypatch):
    """The driver asks a running trial for its phase only once it has run STATUS_EVERY_S (so a
    trial lost to an agent death says where it died, and short trials cost no status call)."""
    import asyncio
    from types import SimpleNamespace

    from cancelbench.device_agents.agent import remote_agent_class
    from cancelbench.orchestrator import device_run

    agent = remote_agent_class().options(num_cpus=0).remote(device_id="sim:0")
    try:
        local_ray.get(agent.load.remote({**SIM, "sim_phase_us": 200_000, "locks": {}}))
        calls = []
        real_status = agent.status

        class Counting:  # the agent handle, counting status calls
            def __getattr__(self, name):
                if name == "status":
                    calls.append(1)
                    return real_status
                return getattr(agent, name)

        watcher = SimpleNamespace(agent=Counting(), last_phase=None)
        monkeypatch.setattr(device_run, "STATUS_EVERY_S", 0.02)
        def watch(ref):  # the driver's coroutine, on an event loop of its own
            async def main():
                return await device_run.DeviceRun._watch(watcher, asyncio.ensure_future(device_run._awaitable(ref)))
            return asyncio.run(main())

        ref = agent.run_trial.remote(TrialRequest("abort_callback", "", trial_id="long"))
        row = watch(ref)
        assert row.outcome == "completed" and calls  # 200 ms+ trial, 20 ms period: asked
        assert watcher.last_phase in {"prefill", "generate"}
        calls.clear()
        monkeypatch.setattr(device_run, "STATUS_EVERY_S", 600.0)
        ref = agent.run_trial.remote(TrialRequest("abort_callback", "", trial_id="short"))
        assert watch(ref).outcome == "completed"
        assert not calls and watcher.last_phase is None  # done before the first ask
    finally:
        local_ray.kill(agent)


def test_overlapping_cancel_timers_restore_the_switch_interval_only_when_the_last_closes():
    """Known answers: the process's switch interval is 0.1 ms while any timer is open, and is
    back to what it was after the last one closes, whatever order they close in (closing one
    twice counts once)."""
    import sys

    from cancelbench.orchestrator.cancel_timer import SWITCH_INTERVAL_S, CancelTimer

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        first = CancelTimer()
        second = CancelTimer()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)  # held in whole microseconds
        first.close()
        first.close()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)  # the second timer is still open
        second.close()
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)
