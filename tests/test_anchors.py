"""Cancels anchored to engine events land where they were planned, even when
trials run slower than their reference: every step call of one trial in two is
made 3x longer (CANCELBENCH_TEST_STEP_DELAY, busy inside the call), on the text,
TTS and STT engines, for both deliveries. The time-anchored phase plan
(phase_time) runs beside them and its hit rate is printed, not asserted: it is
what the anchors fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from cancelbench.sink import read_records

WORKLOADS = """
[[workload]]
name = "text"
model = "fixture:text-qwen3-14m"
prompt_tokens = 64
max_tokens = 6
n_batch = 16
n_threads = 1

[[workload]]
name = "tts"
engine = "tts"
model = "fixture:qwen3tts-fixture"
mmproj = "fixture:qwen3tts-fixture"
inputs = "tts_texts"
n_threads = 1
max_frames = 6
n_batch = 8

[[workload]]
name = "stt"
engine = "stt"
model = "fixture:qwen3asr-fixture"
mmproj = "fixture:qwen3asr-fixture"
inputs = "stt_clips"
n_threads = 1
max_tokens = 6
n_batch = 32
"""


def _sweep(tmp_path: Path, plan: str) -> pd.DataFrame:
    toml = tmp_path / f"{plan}.toml"
    toml.write_text(f"""
[sweep]
seed = 5
trials_per_cell = 1
reference_runs = 3
mechanisms = ["between_calls"]
deliveries = ["driver", "agent"]
ping_samples = 5

[offsets]
plan = "{plan}"
min_per_phase = 2
{WORKLOADS}""")
    out = tmp_path / plan
    env = {**os.environ, "CANCELBENCH_TEST_STEP_DELAY": "3,2"}
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "sweep", "--config", str(toml), "--out", str(out),
                        "--quiet", "--no-summary"], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    df = read_records(out)
    return df[df.trial_kind == "cancel"]


def _hit_rates(cancels: pd.DataFrame) -> pd.Series:
    hit = cancels.phase_at_receipt.eq(cancels.target_phase)
    return hit.groupby([cancels.engine, cancels.delivery]).mean()


def test_event_anchored_cancels_land_in_their_target_phase_under_variance(tmp_path):
    rates = {}
    for plan in ("phase", "progress", "phase_time"):
        cancels = _sweep(tmp_path, plan)
        # every engine and delivery has its cancels, each aimed at a phase
        assert set(cancels.engine) == {"text", "tts", "stt"} and set(cancels.delivery) == {"driver", "agent"}
        assert cancels.target_phase.notna().all() and len(cancels) >= 2 * 2 * (2 + 4 + 5)
        rates[plan] = _hit_rates(cancels)
        if plan != "phase_time":
            anchored = cancels[cancels.t_anchor_ns.notna()]
            # the cancel was due at its anchor + the delay; both deliveries measured from the same event
            assert (anchored.t_cancel_scheduled_ns >= anchored.t_anchor_ns).all()
            assert anchored.anchor_hop_ms[anchored.delivery == "driver"].notna().all()
    print("\nshare of cancels received in their target phase (one trial in two 3x slower):")
    print(pd.DataFrame(rates).to_string(float_format=lambda v: f"{v:.0%}"))
    for plan in ("phase", "progress"):
        assert (rates[plan] >= 0.95).all(), (plan, rates[plan].to_dict())


def test_a_phase_anchor_shrinks_its_delay_for_a_fast_trial_and_never_stretches_it():
    """Known answers: the planned 10 ms after entry into generate, whose reference entry was
    100 ms after hand-back. A trial 3x slower keeps 10 ms (a stretched delay could land after
    the phase); one twice as fast waits 5 ms."""
    from cancelbench.device_agents.anchors import AnchorWatch
    from cancelbench.request import TrialRequest

    def delay(entry_ms: float) -> int:
        req = TrialRequest(mechanism="between_calls", input="x", trial_kind="cancel", delivery="agent",
                           offset_ms=10.0, anchor_phase="generate", anchor_ref_ms=100.0)
        w = AnchorWatch(req, t_handback_ns=0)
        w("phase", "generate", int(entry_ms * 1e6))
        return w.delay_ns

    assert delay(300.0) == 10_000_000
    assert delay(50.0) == 5_000_000
    assert delay(100.0) == 10_000_000


def test_phase_stays_are_the_shortest_over_every_mechanisms_references():
    """Known answer: the cell's reference run is its own (graph_eval, lower median), but the
    shortest prompt stay comes from every mechanism's references of the workload: three slow
    graph_eval runs do not make a 600 ms prompt "at least 1.6 s"."""
    import json

    from cancelbench.orchestrator.plan import ReferenceTimeline

    def ref(mech: str, tid: str, prompt_ms: float, steps: int) -> dict:
        tl = [["prompt", 0.0, prompt_ms], ["code2wav", prompt_ms, prompt_ms + 5000.0]]
        return {"trial_id": tid, "mechanism": mech, "outcome": "completed", "duration_ms": prompt_ms + 5000.0,
                "phase_timeline_json": json.dumps(tl), "phase_steps_json": json.dumps({"prompt": steps})}

    own = [ref("graph_eval", f"g{i}", ms, 4) for i, ms in enumerate((1624.0, 17584.0, 21185.0))]
    pooled = own + [ref("between_calls", f"b{i}", ms, 4) for i, ms in enumerate((598.0, 677.0, 693.0))]
    alone, pool = ReferenceTimeline.from_rows(own), ReferenceTimeline.from_rows(own, pooled)
    assert alone.first_stay_ms["prompt"] == 1624.0 and pool.first_stay_ms["prompt"] == 598.0
    assert pool.step_ms["prompt"] == 598.0 / 4
    assert pool.duration_ms == alone.duration_ms == 17584.0 + 5000.0  # the cell's own reference run


def test_anchor_watch_fires_on_the_kth_step_with_the_previous_steps_length():
    """The progress anchor's delay follows the trial's own step length (known answer)."""
    from cancelbench.device_agents.anchors import AnchorWatch
    from cancelbench.request import TrialRequest

    req = TrialRequest(mechanism="between_calls", input="x", trial_kind="cancel", delivery="agent", offset_ms=1.0,
                       anchor_phase="generate", anchor_step=3, step_fraction=0.5)
    w = AnchorWatch(req, t_handback_ns=0)
    events = [("phase", "prefill", 10), ("step", "prefill", 11), ("step_end", "prefill", 50),
              ("phase", "generate", 100), ("step", "generate", 100), ("step_end", "generate", 140),
              ("step", "generate", 150), ("step_end", "generate", 350), ("step", "generate", 400)]
    for e in events:
        w(*e)
    assert w.done.is_set() and w.t_anchor_ns == 400
    assert w.delay_ns == 20  # half the shortest earlier step of the phase (100 -> 140), not the reference's 1 ms
    phase = AnchorWatch(TrialRequest(mechanism="between_calls", input="x", trial_kind="cancel", delivery="driver",
                                     offset_ms=2.0, anchor_phase="generate"), t_handback_ns=0)
    for e in events:
        phase(*e)
    assert (phase.t_anchor_ns, phase.delay_ns) == (100, 2_000_000)
    handback = AnchorWatch(TrialRequest(mechanism="between_calls", input="x", trial_kind="cancel",
                                        delivery="agent", offset_ms=3.0), t_handback_ns=7)
    assert handback.due_ns == 7 + 3_000_000
    never = AnchorWatch(req, t_handback_ns=0)
    never.finish()
    assert never.done.is_set() and never.due_ns is None
