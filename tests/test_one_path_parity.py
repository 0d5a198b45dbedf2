"""The one engine path's precondition (issue 34): a built-in engine in a child process
(``engine_process = "child"``: the agent runs ``python -m cancelbench.sut.builtin ENGINE`` through
the engine protocol) fills every record column the same engine fills in the agent's process. One
real sweep runs the text, TTS, STT, probe and sim engines both ways side by side; per engine and
trial kind, a column set in any in-process row is set in the child's rows too, the settings that
shape a trial (typed columns, the sampling seed) are the same values, and the rows say where each
engine ran. The probe's child rows once lacked the native-return columns beside a busy machine:
its reader latched the shared cancel word inside the call before the line was read, and the
receipt was taken only after the call returned (tests/test_contract.py has that case alone). Such a
receipt once had no run delay reading, and a child's rows lacked trial_cpu_wait_ms wherever every
receipt was latched that way (a quiet full suite had all sim child cancels so); the latch now reads
it (libcancelbench 1.3), so every cancelled child row has the whole residue split."""

from __future__ import annotations


import pytest

from cancelbench.orchestrator.config import load_config
from cancelbench.orchestrator.runner import run_sweep
from cancelbench.sink import read_records

SEED = 5
PAIRS = {  # engine: (its workload's model keys, its settings)
    "text": ('model = "fixture:text-llama-57m"\ninputs = "text_prompts"', "n_threads = 1, max_tokens = 8"),
    "tts": ('model = "fixture:qwen3tts-fixture"\nmmproj = "fixture:qwen3tts-fixture"\ninputs = "tts_texts"',
            "n_threads = 1, max_frames = 100"),
    "stt": ('model = "fixture:qwen3asr-fixture"\nmmproj = "fixture:qwen3asr-fixture"\ninputs = "stt_clips"',
            "n_threads = 1"),
    "probe": ("", "duration_us = 60000"),
    "sim": ("", "sim_phase_us = 20000"),
}
# Columns only the protocol has: the engine process's own stamps, clock and counters, the cancel's trip,
# which process it was (engine_restarts: the agent's process is never started again).
PROTOCOL_ONLY = {"cancel_reach_ns", "cancel_stall_ns", "engine_build_json", "engine_cancel_path",
                 "engine_cancel_via", "engine_clock", "engine_clock_offset_ns", "engine_clock_uncertainty_ns",
                 "engine_counters_json", "engine_settings_json", "protocol_hop_ms", "t_cancel_forwarded_ns",
                 "t_engine_done_read_ns", "t_engine_received_ns", "engine_stderr", "engine_restarts"}
PROTOCOL_ONLY -= {"engine_build_json", "engine_settings_json"}  # a built-in engine's: its typed columns, the agent's build
TYPED = ["n_threads", "max_frames", "max_tokens", "sampling_seed", "n_batch", "n_ctx", "chunk_tokens",
         "sim_phase_us", "sim_steps", "mmproj_offload", "n_gpu_layers"]


def config_text() -> str:
    text = f"""
[sweep]
seed = {SEED}
trials_per_cell = 2
reference_runs = 3
mechanisms = ["graph_eval"]
deliveries = ["agent"]
ping_samples = 5
[offsets]
plan = "phase"
min_per_phase = 1
"""
    for engine, (keys, settings) in PAIRS.items():
        text += f"""
[[workload]]
name = "{engine}-in"
engine = "{engine}"
engine_process = "agent"
{keys}
{settings.replace(", ", chr(10))}
[[workload]]
name = "{engine}-out"
engine = "{engine}"
engine_process = "child"
{keys}
{settings.replace(", ", chr(10))}
"""
    keys, settings = PAIRS["sim"]  # the simulated engine's own path: the protocol over the in-process channel
    return text + f"""
[[workload]]
name = "sim-channel"
engine = "sim"
engine_process = "channel"
{settings.replace(", ", chr(10))}
"""


@pytest.fixture(scope="module")
def records(local_ray, tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "out"
    cfg = out.parent / "parity.toml"
    cfg.write_text(config_text())
    result = run_sweep(load_config(cfg), out, progress=False)
    df = read_records(out)
    assert result.exit_code == 0, df[["workload", "outcome", "error"]]
    return df


@pytest.mark.parametrize("engine", list(PAIRS))
def test_out_of_process_rows_fill_every_column_the_in_process_rows_fill(records, engine):
    df = records
    for kind in ("reference", "cancel"):
        inside = df[(df.workload == f"{engine}-in") & (df.trial_kind == kind)]
        outside = df[(df.workload == f"{engine}-out") & (df.trial_kind == kind)]
        assert len(inside) and len(inside) == len(outside), (engine, kind, len(inside), len(outside))
        set_in, set_out = inside.notna().any(), outside.notna().any()
        missing = sorted(c for c in df.columns if set_in[c] and not set_out[c])
        assert not missing, (engine, kind, missing)
        # the residue split whole wherever it is: a receipt the native reader latched from the shared
        # word reads the trial thread's run delay too (cb_token_word_wait_ns), not only its CPU clock
        split = outside[outside.trial_cpu_ms.notna()]
        assert split.trial_cpu_wait_ms.notna().all(), (engine, kind, split[["engine_cancel_via", "trial_cpu_wait_ms"]])
        extra = sorted(c for c in df.columns if set_out[c] and not set_in[c])
        assert set(extra) <= PROTOCOL_ONLY, (engine, kind, extra)  # the rest is what both paths record
        # the engine names its own call in flight at receipt (1.5), not the agent's "step"
        assert "step" not in set(outside.native_call_at_receipt.dropna()), (engine, kind)
    both = df[df.workload.isin([f"{engine}-in", f"{engine}-out"])]
    for col in TYPED:  # the same settings shaped both: typed, resolved, the sweep's seed where none is set
        if col in both and both[col].notna().any():
            assert both.groupby("workload")[col].nunique(dropna=False).max() == 1, (engine, col)
            assert both[col].nunique(dropna=False) == 1, (engine, col, both[["workload", col]].drop_duplicates())
    assert set(both.groupby("workload").engine_process.unique().map(tuple)) == {("agent",), ("child",)}
    assert (both.engine == engine).all() and both.engine_build_json.isna().all()  # a built-in row, both ways
    if engine == "tts":
        assert (both.sampling_seed == SEED).all()  # the sweep's seed in both (a TTS workload sets none)


def test_the_channel_fills_every_column_a_child_process_fills(records):
    """The sim engine over the in-process channel is the one path with another transport: its rows fill
    exactly the columns the same engine's rows fill from a process of its own, with the same settings."""
    df = records
    for kind in ("reference", "cancel"):
        child = df[(df.workload == "sim-out") & (df.trial_kind == kind)]
        channel = df[(df.workload == "sim-channel") & (df.trial_kind == kind)]
        assert len(channel) and len(channel) == len(child), (kind, len(channel), len(child))
        set_child, set_channel = child.notna().any(), channel.notna().any()
        assert sorted(c for c in df.columns if set_child[c] != set_channel[c]) == [], kind
    channel = df[df.workload == "sim-channel"]
    assert (channel.engine_process == "channel").all() and (channel.engine == "sim").all()
    assert (channel.engine_restarts == 0).all()
    cancelled = channel[channel.outcome == "cancelled"]
    assert len(cancelled) and cancelled.trial_cpu_ms.notna().all() and cancelled.trial_cpu_wait_ms.notna().all()
    for col in TYPED:
        if df[df.workload == "sim-out"][col].notna().any():
            assert df[df.workload.isin(["sim-out", "sim-channel"])][col].nunique(dropna=False) == 1, col
