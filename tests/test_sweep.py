"""End-to-end sweeps on a real local Ray cluster with the real text engine."""

import json

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from cancelbench.orchestrator.config import OffsetSpec, SweepConfig, WorkloadSpec, load_config, with_trials
from cancelbench.orchestrator.runner import SweepInputError, run_sweep
from cancelbench.schema import RECORD_SCHEMA, SCHEMA_VERSION
from cancelbench.sink import RecordSink, open_dataset, read_manifest, read_records

SMALL_TEXT = WorkloadSpec(name="text-small", model="fixture:text-llama-57m", prompt_tokens=64, max_tokens=4,
                          n_batch=64, n_ubatch=64, chunk_tokens=16)


def config(**kw) -> SweepConfig:
    base = dict(seed=11, trials_per_cell=2, reference_runs=3, workloads=(SMALL_TEXT,), ping_samples=5)
    base.update(kw)
    return SweepConfig(**base)


def test_hundred_immediate_cancels_are_never_dropped(local_ray, tmp_path):
    cfg = config(trials_per_cell=17, offsets=OffsetSpec(plan="immediate"))
    result = run_sweep(cfg, tmp_path / "imm", progress=False)
    df = read_records(tmp_path / "imm")
    cancels = df[df.trial_kind == "cancel"]
    assert len(cancels) == 3 * 2 * 17  # every planned cancel has its row: 102
    assert (cancels.outcome == "dropped").sum() == 0
    # Every immediate cancel is honoured (a cancel before the engine is active is latched).
    assert set(cancels.outcome) == {"cancelled"}, cancels.outcome.value_counts().to_dict()
    assert cancels.t_received_ns.notna().all() and cancels.latency_ms.notna().all()
    assert result.exit_code == 0 and result.outcomes["cancelled"] == len(cancels)


def test_uniform_sweep_writes_the_documented_dataset(local_ray, tmp_path):
    out = tmp_path / "uni"
    result = run_sweep(config(), out, progress=False)
    manifest = read_manifest(out)
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert manifest["seeds"] == {"seed": 11, "input_seed": 23, "offset_seed": 24}
    assert manifest["status"] == "complete"
    # Hive-partitioned, readable with the documented schema by pyarrow and pandas.
    table = open_dataset(out).to_table()
    assert table.schema.names == RECORD_SCHEMA.names
    assert all(p.startswith("backend=cpu") for p in
               {f.split("records/")[1].split("/")[0] for f in ds.dataset(str(out / "records")).files})
    df = table.to_pandas()
    plan = pq.read_table(out / "plan.parquet").to_pandas()
    assert sorted(df.trial_id) == sorted(plan.trial_id)  # every planned trial exactly once
    assert len(df) == result.written == 9 + 12
    refs = df[df.trial_kind == "reference"]
    assert (refs.outcome == "completed").all()
    assert refs.phase_durations_json.map(lambda s: set(json.loads(s))).eq({"prefill", "generate"}).all()
    c = df[(df.trial_kind == "cancel") & (df.outcome == "cancelled")]
    assert len(c) > 0
    # Derived numbers are traceable to the timestamps.
    assert ((c.t_terminal_ns - c.t_received_ns) / 1e6 - c.latency_ms).abs().max() < 1e-6
    assert ((c.t_terminal_ns - c.t_issued_ns) / 1e6 - c.end_to_end_ms).abs().max() < 1e-6
    assert (c.cost_ratio - c.latency_ms / c.reference_ms).abs().max() < 1e-9
    driver, agent = c[c.delivery == "driver"], c[c.delivery == "agent"]
    assert len(driver) > 0 and len(agent) > 0  # the checks below are not vacuous
    assert driver.t_issued_driver_ns.notna().all() and (driver.clock_uncertainty_ns > 0).all()
    assert ((driver.t_issued_ns - driver.t_issued_driver_ns) == driver.clock_offset_ns).all()
    assert agent.t_issued_driver_ns.isna().all() and (agent.clock_uncertainty_ns == 0).all()
    assert c.phase_at_receipt.isin(["idle", "prefill", "generate"]).all()
    abort = c[c.mechanism == "abort_callback"]
    assert (abort.abort_polls > 0).any()
    for col in ("hostname", "cpu_model", "llama_cpp_python_version", "cancelbench_version", "model_sha256"):
        assert df[col].notna().all(), col
    # The end-of-sweep summary: one row per device x workload x mechanism x delivery.
    from cancelbench.reports import build_report
    pooled = build_report([out]).pooled
    assert len(pooled) == 3 * 2
    assert {(c.mechanism, c.delivery) for c in pooled} == {(m, d) for m in ("between_calls", "abort_callback",
                                                                             "chunked") for d in ("driver", "agent")}
    assert sum(c.n_trials for c in pooled) == 12
    # DuckDB reads the same files with hive partitioning.
    duckdb = pytest.importorskip("duckdb")
    n = duckdb.sql(f"select count(*) from read_parquet('{out}/records/**/*.parquet', hive_partitioning=true)"
                   ).fetchall()[0][0]
    assert n == len(df)


def test_probe_workload_calibrates_the_harness(local_ray, tmp_path):
    """The known-answer probe through the whole harness: a cancel received during the busy
    call is seen by the probe's own check (the native reader) and the harness's stamps of that
    trial are in causal order around it; the known answer is computed for every such row."""
    probe = WorkloadSpec(name="probe", engine="probe", duration_us=150_000, period_us=2_000)
    cfg = config(workloads=(probe,), mechanisms=("abort_callback",), deliveries=("agent",), trials_per_cell=10,
                 offsets=OffsetSpec(plan="uniform", max_fraction=0.8))
    run_sweep(cfg, tmp_path / "probe", progress=False)
    df = read_records(tmp_path / "probe")
    c = df[(df.trial_kind == "cancel") & (df.outcome == "cancelled")]
    busy = c[c.native_call_at_receipt == "cb_probe_busy"]
    assert len(busy) > 0, c.native_call_at_receipt.value_counts(dropna=False).to_dict()
    assert (busy.decode_rc == 1).all()  # the probe itself stopped, not a check after it returned
    assert busy.known_answer_error_ms.notna().all() and busy.t_native_observed_ns.notna().all()
    assert (busy.t_start_ns <= busy.t_received_ns).all()
    assert (busy.t_received_ns <= busy.t_native_observed_ns).all()
    assert (busy.t_native_observed_ns <= busy.t_native_returned_ns).all()
    assert (busy.t_native_returned_ns <= busy.t_terminal_ns).all()
    assert (busy.abort_polls >= 1).all()


def test_existing_results_are_never_overwritten(local_ray, tmp_path):
    out = tmp_path / "keep"
    run_sweep(config(mechanisms=("between_calls",), deliveries=("agent",), trials_per_cell=1), out, progress=False)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SweepInputError, match="already holds a sweep"):
        run_sweep(config(mechanisms=("between_calls",), deliveries=("agent",)), out, progress=False)
    with pytest.raises(SweepInputError, match="different config"):
        run_sweep(config(mechanisms=("chunked",), deliveries=("agent",)), out, progress=False, resume=True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_skips_completed_trials(local_ray, tmp_path):
    out = tmp_path / "resume"
    cfg = config(mechanisms=("between_calls",), deliveries=("agent",), trials_per_cell=3)
    run_sweep(cfg, out, progress=False)
    # Pretend the driver died mid-sweep: only the first 5 records reached disk.
    table = open_dataset(out).to_table()
    df_all = table.to_pandas()
    for f in out.joinpath("records").rglob("*.parquet"):
        f.unlink()
    sink = RecordSink(out)
    for row in sorted(table.to_pylist(), key=lambda r: r["trial_index"])[:5]:
        sink.add(row)
    sink.close()
    again = run_sweep(cfg, out, progress=False, resume=True)
    df = read_records(out)
    assert sorted(df.trial_id) == sorted(df_all.trial_id)  # each planned trial exactly once
    assert again.written == len(df_all) - 5
    assert read_manifest(out)["resumed"] == 1


def test_the_demo_sweep_leaves_one_file_per_partition(local_ray, tmp_path):
    """`make demo`'s sweep (the built-in default) at 2 trials per cell: 21 records, so the sink
    wrote at least two files (it flushes every 16); the sweep's end compacts them into one."""
    out = tmp_path / "demo"
    result = run_sweep(with_trials(load_config(None), 2), out, progress=False)
    files = list(out.joinpath("records").rglob("*.parquet"))
    assert result.written == 21 and len(files) == 1, files
    assert all(len(list(f.parent.iterdir())) == 1 for f in files)  # nothing else left beside it
    assert sorted(read_records(out).trial_id) == sorted(pq.read_table(out / "plan.parquet").column("trial_id")
                                                        .to_pylist())
