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

import numpy as np
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
min_per_phase = 6
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


def _same_offsets_from_the_event(anchored: pd.DataFrame) -> None:
    """Driver and agent delivery of one plan give the same offsets from the engine's event,
    within the event hop: the planned delays (as a share of the target's window) are drawn
    alike for both (two-sample KS distance under its 0.1% critical value), and no cancel is
    issued before its event + delay, on the agent's clock, however it was delivered (the old
    driver, scheduling from its own submit time, issued early by the submission hop)."""
    planned = (anchored.t_cancel_scheduled_ns - anchored.t_anchor_ns) / 1e6
    share = planned / anchored.target_window_ms
    a, d = (np.sort(share[anchored.delivery == k].to_numpy()) for k in ("agent", "driver"))
    grid = np.union1d(a, d)
    ks = np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(d, grid, "right") / len(d)).max()
    assert ks < 1.95 * np.sqrt((len(a) + len(d)) / (len(a) * len(d))), ks
    issued = anchored[anchored.t_issued_ns.notna()]  # the others ended before their cancel was due
    early = issued.t_issued_ns - issued.t_cancel_scheduled_ns + issued.clock_uncertainty_ns.fillna(0)
    assert len(issued) > len(anchored) / 2 and (early >= 0).all(), issued[early < 0][["trial_id", "delivery"]]


def _reachable(cancels: pd.DataFrame) -> pd.DataFrame:
    """The cancels their delivery could reach in time (``target_reachable``), after checking
    the column says what it claims: a cancel is unreachable exactly when its target does not
    outlast the planned delay by its delivery's measured reach, and the driver's reach (a
    round trip) is longer than the agent's (its own timer)."""
    assert cancels.delivery_reach_ms.notna().all() and (cancels.target_window_ms > 0).all()
    left = cancels.target_window_ms - cancels.offset_target_ms
    assert cancels.target_reachable.eq(left > cancels.delivery_reach_ms).all()
    reach = cancels.groupby("delivery").delivery_reach_ms.median()
    assert reach["driver"] > reach["agent"] >= 0, reach.to_dict()
    return cancels[cancels.target_reachable.astype(bool)]


def test_event_anchored_cancels_land_in_their_target_phase_under_variance(tmp_path):
    rates, reach, totals, anchored_reachable = {}, {}, {}, {}
    for plan in ("phase", "progress", "phase_time"):
        cancels = _sweep(tmp_path, plan)
        # every engine and delivery has its cancels, each aimed at a phase
        assert set(cancels.engine) == {"text", "tts", "stt"} and set(cancels.delivery) == {"driver", "agent"}
        assert cancels.target_phase.notna().all() and len(cancels) >= 6 * 2 * (2 + 4 + 5)
        rates[plan], totals[plan] = _hit_rates(cancels), cancels
        if plan != "phase_time":
            anchored = cancels[cancels.t_anchor_ns.notna()]
            # the cancel was due at its anchor + the delay; both deliveries measured from the same event
            assert (anchored.t_cancel_scheduled_ns >= anchored.t_anchor_ns).all()
            assert anchored.anchor_hop_ms[anchored.delivery == "driver"].notna().all()
            _same_offsets_from_the_event(anchored)
            reachable = anchored_reachable[plan] = _reachable(cancels)
            rates[f"{plan} (reachable)"] = _hit_rates(reachable)
            reach[plan] = reachable.groupby([reachable.engine, reachable.delivery]).size()
    print("\nshare of cancels received in their target phase (one trial in two 3x slower):")
    print(pd.DataFrame(rates).to_string(float_format=lambda v: f"{v:.0%}"))
    print("cancels their delivery could reach (the target outlasts the delay by the delivery's reach), of",
          {plan: len(c) for plan, c in totals.items()})
    print(pd.DataFrame(reach).to_string())
    # Of the phase- and progress-anchored cancels their delivery could reach, >= 95% landed in
    # their target phase, per engine and delivery (both anchored plans together: a cell of one
    # plan holds 4-30 reachable cancels, where one round trip in the tail is a 7% miss).
    anchored = pd.concat([anchored_reachable["phase"], anchored_reachable["progress"]])
    pooled = _hit_rates(anchored)
    print("both anchored plans, reachable:", pooled.to_dict())
    assert len(pooled) == 6 and (pooled >= 0.95).all(), pooled.to_dict()
    for plan in ("phase", "progress"):
        # a rate over enough cancels in every cell: the rule leaves targets longer than a round trip in
        assert len(reach[plan]) == 6 and (reach[plan] >= 2).all(), (plan, reach[plan].to_dict())
        assert reach[plan].xs("driver", level="delivery").sum() >= 20, (plan, reach[plan].to_dict())


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


def test_a_progress_delay_follows_a_faster_live_step_but_never_a_longer_one():
    """Known answers: a phase's steps differ (STT decode_embd: full batches, then the rest),
    so a long first step must not push the cancel past a short last one. Planned: 0.5 of the
    references' shortest step, 30 ns; the trial's earlier step took 200 ns (slower): 30 ns,
    not 100. Had it taken 40 ns (faster): 20 ns."""
    from cancelbench.device_agents.anchors import AnchorWatch
    from cancelbench.request import TrialRequest

    def delay(first_step_ns: int) -> int:
        req = TrialRequest(mechanism="between_calls", input="x", trial_kind="cancel", delivery="agent",
                           offset_ms=30e-6, anchor_phase="decode_embd", anchor_step=2, step_fraction=0.5)
        w = AnchorWatch(req, t_handback_ns=0)
        for e in [("phase", "decode_embd", 1000), ("step", "decode_embd", 1000),
                  ("step_end", "decode_embd", 1000 + first_step_ns), ("step", "decode_embd", 5000)]:
            w(*e)
        return w.delay_ns

    assert delay(200) == 30
    assert delay(40) == 20


def test_the_progress_plan_draws_on_the_shortest_timed_step_call_not_the_phases_time_over_its_steps():
    """Known answers: TTS set_input is 3-9 ms around one 0.2 ms step call. The progress delay
    and its window come from the timed step (the shortest over every reference), so a cancel
    aimed inside it is not planned milliseconds after the phase has ended. A record without
    the timed steps (written before the column) falls back on the phase's time over its steps."""
    import json

    from cancelbench.orchestrator.plan import ReferenceTimeline, TrialSpec, resolve_offset

    def ref(tid: str, set_input_ms: float, step_ms: float | None) -> dict:
        tl = [["set_input", 0.0, set_input_ms], ["prompt", set_input_ms, set_input_ms + 40.0]]
        row = {"trial_id": tid, "mechanism": "between_calls", "outcome": "completed",
               "duration_ms": set_input_ms + 40.0, "phase_timeline_json": json.dumps(tl),
               "phase_steps_json": json.dumps({"set_input": 1, "prompt": 4})}
        if step_ms is not None:
            row["phase_step_ms_json"] = json.dumps({"set_input": step_ms, "prompt": 9.0})
        return row

    timed = ReferenceTimeline.from_rows([ref("r0", 9.0, 0.4), ref("r1", 3.0, 0.2), ref("r2", 4.0, 0.3)])
    assert timed.step_ms == {"set_input": 0.2, "prompt": 9.0}
    untimed = ReferenceTimeline.from_rows([ref("r0", 9.0, None), ref("r1", 3.0, None)])
    assert untimed.step_ms == {"set_input": 3.0, "prompt": 10.0}

    def trial(phase: str, fraction: float, plan: str = "progress") -> TrialSpec:
        return TrialSpec(trial_id="t", trial_index=0, device="h/cpu:0", workload="tts", trial_kind="cancel",
                         mechanism="between_calls", delivery="driver", offset_plan=plan, input_id="i",
                         input_seed=0, offset_seed=0, offset_fraction=fraction, target_phase=phase)

    at = resolve_offset(trial("set_input", 0.5), timed)
    assert (at.anchor_step, at.offset_ms, at.window_ms) == (1, 0.5 * 0.9 * 0.2, 0.2)
    # prompt: 4 steps in one stay; aimed into the 2nd, the 2nd to 4th (each at least 9 ms) are left
    at = resolve_offset(trial("prompt", 0.3), timed)
    assert at.anchor_step == 2 and at.window_ms == 3 * 9.0
    # the phase plan's window is the shortest first stay, whatever the delay
    at = resolve_offset(trial("set_input", 0.5, "phase"), timed)
    assert (at.offset_ms, at.window_ms) == (1.5, 3.0)


def test_a_progress_window_in_a_phase_entered_twice_is_one_step():
    """STT enters prefill twice (before and after the audio): the k-th step of the phase may be
    the last of its stay, so only that step is counted as the window."""
    import json

    from cancelbench.orchestrator.plan import ReferenceTimeline, TrialSpec, resolve_offset

    tl = [["prefill", 0.0, 4.0], ["encode", 4.0, 30.0], ["prefill", 30.0, 36.0]]
    row = {"trial_id": "r", "mechanism": "between_calls", "outcome": "completed", "duration_ms": 36.0,
           "phase_timeline_json": json.dumps(tl), "phase_steps_json": json.dumps({"prefill": 2, "encode": 1}),
           "phase_step_ms_json": json.dumps({"prefill": 3.5, "encode": 26.0})}
    spec = TrialSpec(trial_id="t", trial_index=0, device="h/cpu:0", workload="stt", trial_kind="cancel",
                     mechanism="between_calls", delivery="agent", offset_plan="progress", input_id="i",
                     input_seed=0, offset_seed=0, offset_fraction=0.2, target_phase="prefill")
    assert resolve_offset(spec, ReferenceTimeline.from_rows([row])).window_ms == 3.5


def test_the_reach_is_the_95th_percentile_of_the_samples_and_the_slowest_of_a_few():
    from cancelbench.orchestrator.device_run import reach_ns

    assert reach_ns(range(1, 101)) == 95
    assert reach_ns([5, 1, 3]) == 5  # under 20 samples: the slowest
    assert reach_ns(list(range(1, 20)) + [1000]) == 19  # 20 samples: one outlier is not the reach
    assert reach_ns([7]) == 7


def test_the_targeting_report_counts_unreachable_cancels_apart(tmp_path):
    """A cell of 10 reachable cancels, all in their phase, and 4 aimed at a target shorter
    than the driver's reach, one of which landed anyway: the cell reads 100% over 10 with
    "1/4" unreachable, is not MISSED, and the note says why those 4 are not in the share. The
    same rows with the 4 counted would have read 79% and MISSED."""
    from report_fixtures import cancel_row, write_dataset

    from cancelbench.reports.targeting import load_targeting, targeting_section

    rows = [cancel_row(f"in-{i}", phase="prefill", target_phase="prefill", offset_plan="phase",
                       native_call_at_receipt="llama_decode", target_reachable=True) for i in range(10)]
    rows += [cancel_row(f"far-{i}", phase="prefill" if i == 0 else "generate", target_phase="prefill",
                        offset_plan="phase", native_call_at_receipt="llama_decode", target_reachable=False)
             for i in range(4)]
    [cell] = load_targeting([write_dataset(tmp_path / "d", rows)])
    assert (cell.n, cell.in_phase, cell.in_flight, cell.unreachable, cell.unreachable_in_phase) == (10, 1.0, 1.0, 4, 1)
    assert not cell.missed
    section = targeting_section([cell])
    assert section.rows[0][-2:] == ["1/4", ""] and "4 cancel(s) aimed at a target shorter" in section.note


def test_a_phase_feed_answers_with_the_first_entry_after_the_question_and_none_at_the_end():
    """Known answers: entries at 10, 20, 30 ns; a question asked at 15 gets the entry at 20 (not
    10, which happened before it was asked: its round trip would count a wait); one asked
    after the last entry waits and gets None when the run ends. The terminal "done" phase is
    not an entry a cancel could be anchored to."""
    import threading

    from cancelbench.device_agents.anchors import PhaseFeed

    feed = PhaseFeed()
    for phase, t in (("prefill", 10), ("generate", 20), ("output", 30)):
        feed("phase", phase, t)
    feed("step", "output", 31)
    assert feed.next_after(15) == ("generate", 20) and feed.next_after(5) == ("prefill", 10)
    answers = []
    asker = threading.Thread(target=lambda: answers.append(feed.next_after(30)))
    asker.start()
    feed("phase", "done", 40)
    feed.finish()
    asker.join(timeout=60)
    assert answers == [None]
