"""An external engine's own account of its trial thread (protocol 1.3: ``done.cpu``, ``cancel_seen.where``
and ``cpu_t``; device_agents/engines/engine_cpu.py): the agent's checks, and a real graph_eval sweep of the
built-in text engine out of process and the C engine, whose records carry where the eval reader saw each
cancel and the work before it, engine-reported."""

from __future__ import annotations

import sys

import pytest

from cancelbench import native
from cancelbench.device_agents.engines import engine_cpu
from cancelbench.orchestrator.config import load_config
from cancelbench.orchestrator.runner import run_sweep
from cancelbench.sink import read_records

MS = 1_000_000
# One thread's readings over a 10 ms run: 1 ms of CPU to the receipt, 2 ms more to the terminal.
GOOD = {"run_t": 0, "run_cpu": 5 * MS, "run_wait": 100, "receipt_t": 2 * MS, "receipt_cpu": 6 * MS,
        "receipt_wait": 100, "terminal_t": 5 * MS, "terminal_cpu": 8 * MS, "terminal_wait": 600,
        "end_t": 6 * MS, "end_cpu": 9 * MS, "end_wait": 700}


def test_readings_become_the_residue_split_columns():
    cols = engine_cpu.columns(GOOD, {"where": "next_ask", "cpu_t": 7 * MS}, received=True)
    assert cols == {"native_seen_where": "next_ask", "trial_cpu_ms": 2.0, "cpu_window_ms": 3.0,
                    "trial_cpu_wait_ms": 0.0005, "trial_observe_cpu_ms": 1.0, "trial_run_cpu_ms": 4.0,
                    "trial_run_wall_ms": 6.0, "trial_run_wait_ms": 0.0006, "trial_cpu_source": "engine-reported"}
    engine_cpu.check(GOOD, 7 * MS, True, 10 * MS)
    # the receipt's reading, taken by the cancel's thread, may pair a stale clock read with a later CPU read
    engine_cpu.check({**GOOD, "receipt_t": 100_000, "receipt_cpu": 7 * MS}, None, True, 10 * MS)
    # a receipt with no run delay (an engine that reads none): work, and no wait; absent readings: no columns
    latched = {k: v for k, v in GOOD.items() if k != "receipt_wait"}
    assert "trial_cpu_wait_ms" not in engine_cpu.columns(latched, None, True)
    assert engine_cpu.columns({}, {"where": "range_end"}, True) == {"native_seen_where": "range_end"}
    assert engine_cpu.columns({}, None, False) == {}
    no_receipt = engine_cpu.columns(GOOD, None, received=False)  # a receipt's reading without one is unused
    assert "trial_cpu_ms" not in no_receipt and no_receipt["trial_run_cpu_ms"] == 4.0


@pytest.mark.parametrize("change, says", [
    ({"terminal_cpu": 5 * MS}, "done.cpu.terminal_cpu (5000000) is less than done.cpu.receipt_cpu"),
    ({"receipt_t": 6 * MS}, "done.cpu.terminal_t (5000000) is less than done.cpu.receipt_t"),
    ({"terminal_wait": 50}, "done.cpu.terminal_wait (50) is less than done.cpu.receipt_wait"),
    ({"end_cpu": 30 * MS}, "ran 22.000 ms of CPU between terminal and end, 1.000 ms apart"),
    ({"end_t": 20 * MS, "end_cpu": 9 * MS}, "done.cpu.end_t - run_t = 20.000 ms, more than the 10.000 ms"),
    ({"receipt_cpu": None}, "done.cpu.receipt_t and receipt_cpu come together"),
])
def test_readings_one_thread_cannot_have_are_refused(change, says):
    cpu = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=None) as exc:
        engine_cpu.check(cpu, None, True, 10 * MS)
    assert says in str(exc.value), str(exc.value)


def test_a_receipt_reading_without_a_receipt_and_a_sight_off_the_thread_are_refused():
    with pytest.raises(ValueError, match="a receipt's reading in a done that says no cancel was received"):
        engine_cpu.check(GOOD, None, False, 10 * MS)
    with pytest.raises(ValueError, match=r"cancel_seen.cpu_t \(1\) lies outside"):
        engine_cpu.check(GOOD, 1, True, 10 * MS)


def config_text(c_engine: str) -> str:
    # run_timeout_s: beside two busy loops a 0.1 s reference run of these engines took 3.5-5 s (their
    # two compute threads starved), and the default bound (10 x the longest completed run, at least
    # 5 s) killed one; this test is about where the reader saw the cancel, not the run bound
    settings = "prompt_tokens = 384, max_tokens = 4, n_batch = 128"
    workloads = "".join(f"""
[[workload]]
name = "{name}"
engine = "external"
command = {command}
model = "fixture:text-qwen3-14m"
settings = {{{settings}}}
run_timeout_s = 600
""" for name, command in (("text-out", f'["{sys.executable}", "-m", "cancelbench.sut.builtin", "text"]'),
                          ("c-text", f'["{c_engine}"]')))
    return f"""
[sweep]
seed = 11
trials_per_cell = 3
reference_runs = 3
mechanisms = ["graph_eval"]
deliveries = ["agent"]
ping_samples = 5
[offsets]
plan = "progress"
min_per_phase = 3
""" + workloads


def test_graph_eval_out_of_process_records_where_the_reader_saw_the_cancel(local_ray, tmp_path):
    c_engine = native.sut_text_engine_path()
    if not c_engine.exists():
        pytest.fail(f"{c_engine} is not built: `make setup` builds it (native/build_sut_engine.sh)")
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(config_text(str(c_engine)))
    out = tmp_path / "out"
    result = run_sweep(load_config(cfg), out, progress=False)
    df = read_records(out)
    assert result.exit_code == 0 and set(df.outcome) <= {"cancelled", "completed"}, df[["workload", "outcome", "error"]]
    for w in ("text-out", "c-text"):
        rows = df[df.workload == w]
        assert (rows.trial_cpu_source == "engine-reported").all() and (rows.trial_run_cpu_ms >= 0).all()
        cancels = rows[(rows.trial_kind == "cancel") & (rows.outcome == "cancelled")]
        seen = cancels[cancels.t_native_observed_ns.notna()]
        assert len(seen) > 0, (w, cancels[["phase_at_receipt", "native_call_at_receipt", "t_native_observed_ns"]])
        # the eval reader's stamp, sent in cancel_seen: where, and the trial thread's work before it,
        # within the stop's work (one thread's CPU clock: the sight came between receipt and terminal)
        assert seen.native_seen_where.isin(["range_end", "next_ask"]).all(), (w, seen.native_seen_where)
        assert ((seen.trial_observe_cpu_ms >= 0) & (seen.trial_observe_cpu_ms <= seen.trial_cpu_ms)).all(), \
            (w, seen[["trial_observe_cpu_ms", "trial_cpu_ms", "engine_cancel_via"]])
        assert cancels[cancels.t_native_observed_ns.isna()].native_seen_where.isna().all()
        assert (cancels.trial_cpu_ms >= 0).all(), (w, cancels[["engine_cancel_via", "trial_cpu_ms"]])
    # the residue split of these rows: a receipt with no run-delay reading (a word latch) is counted as such
    import pyarrow as pa

    from cancelbench.reports.residue import residue_of, residue_section

    split = df[(df.trial_kind == "cancel") & (df.outcome == "cancelled") & df.trial_cpu_ms.notna()]
    cells = residue_of(pa.Table.from_pandas(df, preserve_index=False))
    assert sum(c.n for c in cells) == len(split) > 0
    assert sum(c.wait_unknown_n for c in cells) == split.trial_cpu_wait_ms.isna().sum()
    if split.trial_cpu_wait_ms.isna().any():
        assert "have no run-delay reading" in residue_section(cells).note
