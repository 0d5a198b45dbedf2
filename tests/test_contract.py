"""The trial contract: the driver stays free of native code, every setting that
shapes a trial is a column of its record, offsets run from one origin for both
deliveries, and diff refuses to compare different experiments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from cancelbench.device_agents.engines.registry import ENGINES, MECHANISMS
from cancelbench.orchestrator.config import OffsetSpec, SweepConfig, WorkloadSpec
from cancelbench.orchestrator.runner import run_sweep
from cancelbench.schema import AGENT_COLUMNS, DRIVER_COLUMNS, FIELDS, GROUPS, SETTINGS_COLUMNS, columns_of
from cancelbench.sink import read_records

REPO = Path(__file__).resolve().parents[1]


def test_the_driver_imports_no_native_or_engine_code():
    """Planning and preparing a sweep on the driver loads neither the cancel-token
    library nor llama.cpp: a driver host needs no C compiler and no llama.cpp."""
    code = (
        "import sys\n"
        "import cancelbench.cli, cancelbench.orchestrator.runner, cancelbench.orchestrator.device_run\n"
        "from cancelbench.orchestrator.config import SweepConfig\n"
        "from cancelbench.orchestrator.plan import build_plan\n"
        "from cancelbench.orchestrator import cluster\n"
        "cluster.remote_agent_class()\n"
        "build_plan(SweepConfig(), ['h/cpu:0'], {'text-prefill': ['a', 'b']})\n"
        "bad = sorted(m for m in sys.modules if m == 'llama_cpp' or m.startswith(('cancelbench.native', "
        "'cancelbench.device_agents.engines.text', 'cancelbench.device_agents.engines.llama')))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_every_column_has_a_group_and_an_owner_and_the_halves_cover_the_record():
    assert {c.group for c in FIELDS} == set(GROUPS)
    derived = {c.name for c in FIELDS if c.owner == "derived"}  # the derived group, and barge-in's hops
    assert set(columns_of("derived")) <= derived and {"onset_to_silence_ms", "drain_ms"} <= derived
    assert AGENT_COLUMNS | DRIVER_COLUMNS | derived == {c.name for c in FIELDS}
    assert not derived & (AGENT_COLUMNS | DRIVER_COLUMNS)
    # the settings the issue names are columns, so two sweeps that differ in them diff as different
    for name in ("graph_slice_us", "prompt_tokens", "max_frames", "temp", "top_k", "sampling_seed",
                 "offset_max_fraction", "offset_min_per_phase", "offset_fixed_ms_json", "offset_phases_json", "use_extra_bufts", "n_threads", "model_sha256"):
        assert name in SETTINGS_COLUMNS, name


def test_mechanisms_are_objects_read_by_their_flags():
    assert set(MECHANISMS) == {"between_calls", "abort_callback", "chunked", "graph_eval"}
    g = MECHANISMS["graph_eval"]
    # graph_eval is the eval reader on every graph, and nothing else, in every engine
    assert g.eval_hook and not g.abort_callback and not g.chunked
    assert MECHANISMS["abort_callback"].abort_callback and not MECHANISMS["abort_callback"].eval_hook
    assert MECHANISMS["chunked"].prompt_step(256, 32) == 32 and g.prompt_step(256, 32) == 256
    for spec in ENGINES.values():
        assert set(spec.mechanisms) <= set(MECHANISMS)


TEXT = WorkloadSpec(name="text-slice", model="fixture:text-llama-57m", prompt_tokens=48, max_tokens=3,
                    n_batch=64, chunk_tokens=16, graph_slice_us=700)
TTS = WorkloadSpec(name="tts-sampling", engine="tts", model="fixture:qwen3tts-fixture",
                   mmproj="fixture:qwen3tts-fixture", inputs="tts_texts", n_threads=1, n_batch=16, chunk_tokens=4,
                   use_extra_bufts=False, max_frames=2, temp=0.7, top_k=17, seed=4242)


def test_records_carry_every_setting_and_offsets_run_from_the_hand_back(local_ray, tmp_path):
    cfg = SweepConfig(seed=3, trials_per_cell=3, reference_runs=3, mechanisms=("graph_eval",),
                      deliveries=("driver", "agent"), offsets=OffsetSpec(plan="uniform", max_fraction=0.6),
                      workloads=(TEXT, TTS), ping_samples=5)
    out = tmp_path / "settings"
    result = run_sweep(cfg, out, progress=False)
    assert result.written == 2 * (3 + 2 * 3)
    df = read_records(out)
    text, tts = df[df.workload == "text-slice"], df[df.workload == "tts-sampling"]
    assert len(text) == len(tts) == 9
    assert set(text.graph_slice_us) == {700} and set(text.prompt_tokens) == {48}
    assert set(text.n_batch) == {64} and set(text.chunk_tokens) == {16}
    assert set(tts.max_frames) == {2} and set(tts.temp) == {0.7} and set(tts.top_k) == {17}
    assert set(tts.sampling_seed) == {4242}
    assert set(text.use_extra_bufts) == {True} and set(tts.use_extra_bufts) == {False}  # the engine's, as loaded
    assert set(df.agent_niceness) == {0}  # the agent at normal priority, not at Ray's worker default of 15
    assert tts.prompt_tokens.isna().all()  # a text-only setting is no column of a tts trial
    assert set(text.model) == {"text-llama-57m"} and text.mmproj.isna().all()
    assert set(tts.model) == set(tts.mmproj) == {"qwen3tts-fixture"}
    assert df.model_sha256.str.fullmatch(r"[0-9a-f]{64}").all()
    cancels, refs = df[df.trial_kind == "cancel"], df[df.trial_kind == "reference"]
    assert set(cancels.offset_max_fraction) == {0.6} and refs.offset_max_fraction.isna().all()
    assert set(df.reference_runs) == {3}
    assert set(refs.delivery) == set(refs.offset_plan) == {"none"}
    # One origin for both deliveries: the cancel was due at hand-back + the planned offset.
    due = (cancels.t_cancel_scheduled_ns - cancels.t_handback_ns) / 1e6
    assert len(cancels) == 12 and set(cancels.delivery) == {"driver", "agent"}
    assert ((due - cancels.offset_target_ms).abs() < 1e-3).all(), (due - cancels.offset_target_ms).tolist()
    driver = cancels[cancels.delivery == "driver"]
    # the driver learned of the hand-back after it happened (within the clock conversion's bound)
    assert (driver.t_anchor_seen_ns >= driver.t_handback_ns - driver.clock_uncertainty_ns).all()
    assert driver.anchor_hop_ms.notna().all() and cancels[cancels.delivery == "agent"].anchor_hop_ms.isna().all()
    # graph_eval's reader saw each in-flight cancel on the trial thread: where, and the work before it
    seen = cancels[cancels.t_native_observed_ns.notna()]
    assert len(seen) > 0 and seen.native_seen_where.isin(["range_end", "next_ask"]).all(), seen.native_seen_where
    assert ((seen.trial_observe_cpu_ms >= 0) & (seen.trial_observe_cpu_ms <= seen.trial_cpu_ms)).all(), \
        seen[["trial_observe_cpu_ms", "trial_cpu_ms"]]
    assert cancels[cancels.t_native_observed_ns.isna()].native_seen_where.isna().all()


def _small_sweep(tmp_path: Path, name: str, slice_us: int) -> Path:
    toml = tmp_path / f"{name}.toml"
    toml.write_text(f"""
[sweep]
seed = 1
trials_per_cell = 3
reference_runs = 3
mechanisms = ["graph_eval"]
deliveries = ["agent"]
ping_samples = 5

[[workload]]
name = "text"
model = "fixture:text-qwen3-14m"
prompt_tokens = 32
max_tokens = 2
n_batch = 32
graph_slice_us = {slice_us}
""")
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}  # what the CLI itself sets
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "sweep", "--config", str(toml), "--out", str(out), "--quiet", "--no-summary"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(read_records(out).agent_niceness) == {0}  # a Ray the CLI starts runs its agents at nice 0
    return out


def test_diff_of_sweeps_differing_only_in_graph_slice_says_so(tmp_path):
    a = _small_sweep(tmp_path, "a", 2000)
    b = _small_sweep(tmp_path, "b", 500)
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "diff", str(a), str(b)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cancelbench diff: error:")
    assert "graph_slice_us: 2000 -> 500" in lines[0] and "--ignore-setting graph_slice_us" in lines[0]
    assert r.stdout == ""
    # asked to, it compares: a verdict (0 or 1), with the ignored setting said in the JSON
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "diff", str(a), str(b), "--ignore-setting", "graph_slice_us",
                        "--format", "json"], capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr
    verdict = json.loads(r.stdout)
    assert verdict["ignore_settings"] == ["graph_slice_us"] and verdict["cells"]
    # a setting that is no column is bad input
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "diff", str(a), str(b), "--ignore-setting", "colour"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "not a settings column" in r.stderr


def test_a_schema_1_dataset_still_reads_and_diffs_against_a_schema_2_one(tmp_path):
    """Version 1 files lack the settings columns: they read as nulls, and a setting
    recorded on one side only is not a difference diff refuses."""
    import pyarrow.parquet as pq

    sys.path.insert(0, str(Path(__file__).parent))
    from report_fixtures import cell_rows, write_dataset

    from cancelbench.reports.diff import DiffSpec, run_diff
    from cancelbench.reports.load import scan_table

    v1_only = [c for c in SETTINGS_COLUMNS if c not in ("workload", "engine", "model", "model_sha256", "n_threads",
                                                       "n_ctx", "n_batch", "n_ubatch", "chunk_tokens", "max_tokens",
                                                       "n_gpu_layers")]
    old = write_dataset(tmp_path / "v1", cell_rows("o", [2.0] * 40), schema_version=1)
    for f in (old / "records").rglob("*.parquet"):  # rewrite as a version-1 writer left it
        table = pq.read_table(f)
        pq.write_table(table.drop_columns([c for c in table.column_names if c in v1_only]), f)
    new = write_dataset(tmp_path / "v2", cell_rows("n", [2.0] * 40, graph_slice_us=2000))
    assert "graph_slice_us" not in pq.read_schema(next((old / "records").rglob("*.parquet"))).names
    frame = scan_table([old], ["trial_id", "latency_ms", "graph_slice_us"]).to_pandas()
    assert len(frame) == 40 and frame.graph_slice_us.isna().all() and frame.latency_ms.notna().all()
    result = run_diff([old], [new], DiffSpec())
    assert result.cells and all(c.verdict != "regressed" for c in result.cells)


def test_a_cancel_after_the_engines_terminal_decision_is_refused_not_dropped():
    """The terminal decision and a cancel's receipt are atomic (CancelControl.close):
    a cancel that comes after the engine decided it completed is not recorded as received
    before the terminal state, so the outcome rule cannot call it dropped."""
    from cancelbench import native
    from cancelbench.device_agents.engines.base import CancelControl, Progress
    from cancelbench.schema import TrialRecord, finalize

    ctl = CancelControl(native.CancelToken(), Progress())
    received_before = native.now_ns()  # stamped on entry to cancel(), before the lock
    requested, t_terminal = ctl.close()
    assert not requested and received_before < t_terminal
    assert ctl.request(received_before) is False and ctl.received_ns is None and not ctl.token.is_set()
    row = finalize(TrialRecord(outcome="completed", t_terminal_ns=t_terminal, t_received_ns=ctl.received_ns))
    assert row["outcome"] == "completed"
    # before the decision, the same cancel is honoured
    ctl = CancelControl(native.CancelToken(), Progress())
    assert ctl.request(native.now_ns()) is True
    requested, t_terminal = ctl.close()
    assert requested and ctl.received_ns <= t_terminal


def test_a_cancel_a_native_reader_latched_from_the_shared_word_inside_a_call_stamps_its_return():
    """An engine process's native reader can latch the shared cancel word inside a call before the
    cancel line is read (a busy host's stdin thread wakes late): that receipt came while the call
    was in flight, so the call's return is stamped (t_native_returned_ns, return_ms, settle_ms), as
    when the line comes first. Taken only after the call, it left those columns null."""
    import threading
    import time

    import pytest

    from cancelbench import native
    from cancelbench.device_agents.engines.base import CancelControl, Cancelled, Progress
    from cancelbench.sut import cancel_word

    word = cancel_word.create()
    if word is None:
        pytest.skip("no shared cancel word on this platform")
    try:
        ctl = CancelControl(native.CancelToken(), Progress())
        ctl.token.watch(word.address, 7)
        stored = []

        def store_once_in_flight() -> None:  # no line, no request(): only the reader inside the call sees it
            while ctl.progress.native_call is None:
                time.sleep(0.001)
            stored.append(word.store(7))

        storer = threading.Thread(target=store_once_in_flight)
        storer.start()
        with pytest.raises(Cancelled):
            ctl.call("cb_probe_busy", native.probe_busy, ctl.token, 10_000_000, 100)
        storer.join()
        assert ctl.requested and ctl.token.set_by_word
        assert ctl.at_receipt["native_call_at_receipt"] == "cb_probe_busy"
        assert ctl.native_returned_ns is not None and stored[0] <= ctl.received_ns <= ctl.native_returned_ns
    finally:
        word.close()


def test_a_receipt_stamped_inside_a_call_but_taken_after_it_names_that_call():
    """An engine process reads a cancel line on its stdin thread (the receipt's stamp) and takes it a
    moment later; the call in flight at the stamp may have returned by then. The receipt names the call
    in flight at its stamp and times that call's return, and a call begun after the stamp is not the one
    in flight (CI at 477be62: a child's STT row said the agent's "step" where the engine said none)."""
    from cancelbench import native
    from cancelbench.device_agents.engines.base import CancelControl, Progress

    ctl = CancelControl(native.CancelToken(), Progress())
    stamps = {}
    with ctl.native_call("mtmd_encode_chunk"):
        stamps["read"] = native.now_ns()  # the line read while the encode runs
    with ctl.native_call("llama_process"):  # the next call began before the request ran
        assert ctl.request(stamps["read"]) is True
    assert ctl.at_receipt["native_call_at_receipt"] == "mtmd_encode_chunk"
    assert stamps["read"] <= ctl.native_returned_ns < ctl._call_t0  # the encode's return, not llama_process's
    # a stamp between two calls names neither, and no return is timed
    ctl = CancelControl(native.CancelToken(), Progress())
    with ctl.native_call("mtmd_tokenize"):
        pass
    between = native.now_ns()
    with ctl.native_call("llama_process"):
        assert ctl.request(between) is True
    assert ctl.at_receipt["native_call_at_receipt"] is None and ctl.native_returned_ns is None
    # the call in flight at the stamp and still in flight at the request: its return, when it comes
    ctl = CancelControl(native.CancelToken(), Progress())
    with ctl.native_call("llama_decode"):
        assert ctl.request(native.now_ns()) is True
        assert ctl.native_returned_ns is None
    assert ctl.at_receipt["native_call_at_receipt"] == "llama_decode" and ctl.native_returned_ns is not None


def test_a_receipt_stamped_inside_a_heavy_graph_but_taken_after_it_names_that_graph():
    """heavy_graph_at_receipt follows the call in flight at the receipt's stamp, as native_call_at_receipt
    does: a code2wav window's receipt taken once the engine has cleared its heavy graph and begun the
    next call still says code2wav; one stamped between calls says none, though the next is named."""
    from cancelbench import native
    from cancelbench.device_agents.engines.base import CancelControl, Progress

    progress = Progress()
    ctl = CancelControl(native.CancelToken(), progress)
    progress.heavy_graph = "code2wav"
    with ctl.native_call("mtmd_helper_gen_audio_step_gen"):
        read = native.now_ns()  # the line read while the window runs
    progress.heavy_graph = None  # the engine clears it after the call (tts.py), then samples
    with ctl.native_call("llama_sampler_sample"):
        assert ctl.request(read) is True
    assert ctl.at_receipt["heavy_graph_at_receipt"] == "code2wav"
    assert ctl.at_receipt["native_call_at_receipt"] == "mtmd_helper_gen_audio_step_gen"
    # stamped between two calls, taken once the next window is named: no heavy graph was in flight
    progress = Progress()
    ctl = CancelControl(native.CancelToken(), progress)
    with ctl.native_call("llama_sampler_sample"):
        pass
    between = native.now_ns()
    progress.heavy_graph = "clip_encode"
    assert ctl.request(between) is True
    assert ctl.at_receipt["heavy_graph_at_receipt"] is None and ctl.at_receipt["native_call_at_receipt"] is None
    # in flight at the stamp and still at the request: the graph now running
    ctl = CancelControl(native.CancelToken(), progress)
    with ctl.native_call("mtmd_encode_chunk"):
        assert ctl.request(native.now_ns()) is True
    assert ctl.at_receipt["heavy_graph_at_receipt"] == "clip_encode"
