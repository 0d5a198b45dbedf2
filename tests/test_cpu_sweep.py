"""A small real sweep carries the cpu columns (device_agents/cpu_account.py): the engine's
threads from the cancel's receipt to its stop, in process and out of process, on a real
local Ray."""

from __future__ import annotations

import sys

import pytest

from cancelbench.orchestrator.config import load_config
from cancelbench.orchestrator.runner import run_sweep
from cancelbench.sink import read_records

CPU = ("engine_cpu_ms", "engine_cpu_wait_ms", "engine_involuntary_switches", "engine_threads", "host_loadavg_1m",
       "host_procs_running", "cpu_snapshot_us")

CONFIG = f"""
[sweep]
seed = 3
trials_per_cell = 4
reference_runs = 3
mechanisms = ["between_calls", "abort_callback"]
deliveries = ["agent"]
ping_samples = 5
[offsets]
plan = "progress"
phases = ["prefill"]
[[workload]]
name = "text-in"
engine = "text"
engine_process = "agent"
model = "fixture:text-qwen3-14m"
prompt_tokens = 48
max_tokens = 4
n_batch = 8
[[workload]]
name = "text-out"
engine = "external"
command = ["{sys.executable}", "-m", "cancelbench.sut.builtin", "text"]
model = "fixture:text-qwen3-14m"
settings = {{prompt_tokens = 48, max_tokens = 4, n_batch = 8}}
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")
def test_sweep_records_carry_the_engines_cpu_from_receipt_to_stop(local_ray, tmp_path):
    path = tmp_path / "cpu.toml"
    path.write_text(CONFIG)
    run_sweep(load_config(path), tmp_path / "out", progress=False)
    df = read_records(tmp_path / "out")
    refs, received = df[df.trial_kind == "reference"], df[df.t_received_ns.notna()]
    assert len(refs) > 0 and refs.cpu_account_source.isna().all()  # no cancel, no window
    assert refs[list(CPU)].isna().all().all()
    assert (received.cpu_account_source == "schedstat").all(), received.cpu_account_source.value_counts().to_dict()
    assert received[list(CPU)].notna().all().all()
    in_flight = received[(received.outcome == "cancelled") & received.native_call_at_receipt.notna()]
    for workload in ("text-in", "text-out"):  # the checks below are not vacuous for either engine
        assert (in_flight.workload == workload).sum() > 0, workload
    # >= 0 per trial, > 0 in some for each engine: an external engine's process CPU clock, read from
    # outside, lags a thread running on another CPU by up to a scheduler tick, and beside two busy
    # loops one window read 0.0 (so would a vCPU the hypervisor took: clock_task stands still)
    assert (in_flight.engine_cpu_ms >= 0).all(), in_flight[["workload", "engine_cpu_ms"]]
    assert (in_flight.groupby("workload").engine_cpu_ms.max() > 0).all(), in_flight[["workload", "engine_cpu_ms"]]
    assert (received.engine_cpu_wait_ms >= 0).all() and (received.engine_involuntary_switches >= 0).all()
    assert (received.host_procs_running >= 1).all() and (received.cpu_snapshot_us > 0).all()
    # Each engine's own process: the agent (a Ray worker: its threads and llama.cpp's) for the
    # in-process engine, the engine's process for the external one; never the same count
    threads = received.groupby("workload").engine_threads.agg(["min", "max"])
    assert threads.loc["text-in", "min"] > threads.loc["text-out", "max"], threads
