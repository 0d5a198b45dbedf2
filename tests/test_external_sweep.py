"""Sweeps over engines run out of process (docs/sut-protocol.md), on a real local Ray:
the built-in text engine through the Python library, the C engine, and the same
workload in process beside them, under both deliveries and both anchored plans."""

from __future__ import annotations

import json
import sys

import pyarrow.parquet as pq
import pytest

from cancelbench import native
from cancelbench.orchestrator.config import load_config
from cancelbench.orchestrator.runner import run_sweep
from cancelbench.sink import read_records

# A prefill of three long step calls (128 tokens each, tens of ms on the small fixture): a cancel
# aimed at prefill, by a fraction of its time (phase plan) or inside a step call (progress plan),
# lands while a llama_decode runs, so every engine has in-flight aborts for the abort reader to see.
PROMPT_TOKENS, N_BATCH = 384, 128
SETTINGS = f"prompt_tokens = {PROMPT_TOKENS}, max_tokens = 4, n_batch = {N_BATCH}"


def config_text(plan: str, c_engine: str) -> str:
    return f"""
[sweep]
seed = 5
trials_per_cell = 2
reference_runs = 3
mechanisms = ["between_calls", "abort_callback"]
deliveries = ["driver", "agent"]
ping_samples = 5
[offsets]
plan = "{plan}"
min_per_phase = 2
[[workload]]
name = "text-in"
engine = "text"
engine_process = "agent"
model = "fixture:text-qwen3-14m"
prompt_tokens = {PROMPT_TOKENS}
max_tokens = 4
n_batch = {N_BATCH}
[[workload]]
name = "text-out"
engine = "external"
command = ["{sys.executable}", "-m", "cancelbench.sut.builtin", "text"]
model = "fixture:text-qwen3-14m"
settings = {{{SETTINGS}}}
[[workload]]
name = "c-text"
engine = "external"
command = ["{c_engine}"]
model = "fixture:text-qwen3-14m"
settings = {{{SETTINGS}}}
"""


@pytest.fixture(scope="module")
def c_engine() -> str:
    path = native.sut_text_engine_path()
    if not path.exists():
        pytest.fail(f"{path} is not built: `make setup` builds it (native/build_sut_engine.sh)")
    return str(path)


@pytest.mark.parametrize("plan", ["phase", "progress"])
def test_python_c_and_in_process_engines_sweep_alike(local_ray, tmp_path, plan, c_engine):
    cfg_path = tmp_path / "sweep.toml"
    cfg_path.write_text(config_text(plan, c_engine))
    config = load_config(cfg_path)  # starts each external engine once for its hello
    out = tmp_path / plan
    result = run_sweep(config, out, progress=False)
    df = read_records(out)
    planned = pq.read_table(out / "plan.parquet", columns=["trial_id"]).column("trial_id").to_pylist()
    assert sorted(df.trial_id) == sorted(planned) and len(set(planned)) == len(planned)  # every trial once
    odd = df[~df.outcome.isin(["cancelled", "completed"])]
    assert result.exit_code == 0 and odd.empty, odd[["workload", "outcome", "error", "drop_margin_ms", "cancel_reach_ns",
                                                     "cancel_stall_ns", "t_engine_received_ns", "t_terminal_ns"]]

    by = {w: df[df.workload == w] for w in ("text-in", "text-out", "c-text")}
    assert set(by["text-in"].engine_name) == {"cancelbench-text"} and by["text-in"].engine_settings_json.isna().all()
    assert set(by["text-out"].engine_name) == {"cancelbench-text"} and set(by["c-text"].engine_name) == {"c-text"}
    for w in ("text-out", "c-text"):
        rows = by[w]
        assert (rows.engine == "external").all() and rows.engine_version.notna().all()
        assert (rows.engine_clock == "same").all()  # both stamp CLOCK_MONOTONIC, as the agent does
        settings = json.loads(rows.engine_settings_json.iloc[0])
        assert (settings["prompt_tokens"], settings["max_tokens"]) == (PROMPT_TOKENS, 4)
        assert json.loads(by["c-text"].engine_build_json.iloc[0])  # its build facts travel on every row
    # Same model, same prompt, greedy: every completed run of the three engines agrees on its output length.
    for w, rows in by.items():
        refs = rows[rows.trial_kind == "reference"]
        assert (refs.outcome == "completed").all() and len(refs) == 6
        assert refs.phase_timeline_json.map(lambda s: [p for p, *_ in json.loads(s)]).map(
            lambda ps: ps[0] == "prefill" and "generate" in ps).all()
        assert refs.phase_steps_json.map(lambda s: json.loads(s)["prefill"]).eq(PROMPT_TOKENS // N_BATCH).all()
        cancels = rows[rows.trial_kind == "cancel"]
        assert set(cancels.delivery) == {"driver", "agent"} and set(cancels.target_phase) == {"prefill", "generate"}
        assert cancels.t_anchor_ns.notna().all()  # anchored on the engine's own phase/step events
        if plan == "progress":
            assert cancels.anchor_step.notna().all()
        landed = cancels[cancels.outcome == "cancelled"]
        assert len(landed) >= len(cancels) // 2, cancels[["outcome", "target_phase", "phase_at_receipt"]]
        assert (landed.t_received_ns <= landed.t_terminal_ns).all()
        if w != "text-in":  # the engine's own receipt of the cancel: after the agent's, before the stop
            assert (landed.t_engine_received_ns >= landed.t_received_ns).all()
            assert (landed.t_engine_received_ns <= landed.t_terminal_ns).all()
            assert (landed.protocol_hop_ms >= 0).all()
            # the kernel's run delay over each forwarded cancel (the outcome rule's allowance), on Linux
            forwarded = cancels[cancels.t_cancel_forwarded_ns.notna()]
            assert len(forwarded) and (forwarded.cancel_stall_ns >= 0).all(), forwarded.cancel_stall_ns
        # Progress at receipt: the in-process engine's own snapshot, the engine library's and the C
        # engine's done.at_receipt (protocol 1.2; never the agent's 0 where an engine sends none)
        took = landed[landed.t_received_ns.notna()]
        assert took.tokens_generated_at_receipt.between(0, 4).all(), took.tokens_generated_at_receipt
        assert took.input_tokens_done_at_receipt.between(0, PROMPT_TOKENS).all()
        in_generate = took[took.phase_at_receipt == "generate"]  # the prompt was decoded before it
        assert len(in_generate) and (in_generate.input_tokens_done_at_receipt == PROMPT_TOKENS).all()
        assert took.frames_generated_at_receipt.isna().all()  # a text engine has no frames
        # The residue split for every cancelled trial: the agent's own reading of its thread in process,
        # the engine's trial-thread readings out of process (protocol 1.3 done.cpu, checked by the agent)
        source = "agent" if w == "text-in" else "engine-reported"
        assert (took.trial_cpu_source == source).all() and (took.trial_cpu_ms >= 0).all(), \
            took[["engine_cancel_via", "mechanism", "trial_cpu_ms", "trial_cpu_source"]]
        assert (took.trial_cpu_ms <= took.cpu_window_ms + 1).all()  # one thread's CPU in its window (engine_cpu)
        # and its wait: a receipt the native reader latched from the word reads it too (libcancelbench 1.3)
        assert (took.trial_cpu_wait_ms >= 0).all(), took[["engine_cancel_via", "trial_cpu_wait_ms"]]
        assert (rows.trial_run_cpu_ms >= 0).all() and (rows.trial_run_cpu_ms <= rows.trial_run_wall_ms + 1).all()
        # Cancels aimed at the long prefill under the abort reader: received while a step call ran
        # (the agent's view of the engine), and stopped inside llama_decode by the engine's own reader.
        aborts = cancels[(cancels.mechanism == "abort_callback") & (cancels.target_phase == "prefill")]
        assert len(aborts) == 4, aborts[["delivery", "target_phase"]]  # 2 deliveries x 2 aimed at prefill
        aborted = landed[(landed.mechanism == "abort_callback") & landed.native_call_at_receipt.notna()]
        assert len(aborted) > 0, cancels[["mechanism", "target_phase", "outcome", "phase_at_receipt",
                                          "native_call_at_receipt"]]
        assert (aborted.abort_polls > 0).all()  # the reader was armed and polled in every one
        seen = aborted[aborted.t_native_observed_ns.notna()]
        assert len(seen) > 0, aborted[["phase_at_receipt", "native_call_at_receipt", "abort_polls"]]
        assert (seen.t_received_ns <= seen.t_native_observed_ns).all()
        assert (seen.t_native_observed_ns <= seen.t_terminal_ns).all()
