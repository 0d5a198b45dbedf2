"""A small barge-in sweep, for real: the TTS fixture on a local Ray, the microphone stream
fed in real time to Silero VAD, the detector issuing the cancel, the playback model, the
record's hops and the report's Barge-in section (docs/bargein.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cancelbench.bargein import MIC_RATE
from cancelbench.orchestrator.config import load_config
from cancelbench.orchestrator.runner import run_sweep
from cancelbench.sink import read_records

CONFIG = """
[sweep]
seed = 5
trials_per_cell = 6
reference_runs = 3
mechanisms = ["between_calls", "graph_eval"]
ping_samples = 5
[offsets]
plan = "phase"
phases = ["generate"]
min_per_phase = 6
[[workload]]
name = "tts-bargein"
engine = "tts"
model = "fixture:qwen3tts-fixture"
mmproj = "fixture:qwen3tts-fixture"
inputs = "tts_texts"
n_threads = 1
max_frames = 200
bargein = { clips = "bargein-ci", chunk_ms = 16, playback_buffer_ms = 80 }
"""

HOPS = ["detect_ms", "issue_ms", "deliver_ms", "latency_ms", "drain_ms"]


@pytest.fixture(scope="module")
def sweep(local_ray, tmp_path_factory):
    out = tmp_path_factory.mktemp("bargein") / "out"
    cfg = out.parent / "bargein.toml"
    cfg.write_text(CONFIG)
    config = load_config(cfg)
    assert config.deliveries == ("detector",)  # a barge-in sweep's default delivery
    run_sweep(config, out, progress=False)
    return out, read_records(out)


def test_every_barge_in_records_its_microphone_detector_and_settings(sweep):
    _, df = sweep
    cancels = df[df.trial_kind == "cancel"]
    assert len(cancels) == 12 and (cancels.delivery == "detector").all()
    assert (cancels.bargein_detector == "silero").all() and (cancels.mic_chunk_ms == 16).all()
    assert (cancels.playback_buffer_ms == 80).all() and cancels.bargein_clip.notna().all()
    assert (cancels.mic_chunks > 0).all() and cancels.t_mic_start_ns.notna().all()
    refs = df[df.trial_kind == "reference"]
    assert len(refs) == 2 * 3  # reference_runs per mechanism: the checks below are not vacuous
    assert refs.t_mic_start_ns.isna().all()  # no microphone in a reference run
    # a completed reference hands over all its audio: every window and the final flush
    assert (refs.outcome == "completed").all()


def test_the_onset_lands_where_the_plan_said_on_the_stream_clock(sweep):
    _, df = sweep
    speech = df[(df.trial_kind == "cancel") & df.onset_sample.notna()]
    assert len(speech) >= 6
    assert (speech.phase_at_onset == "generate").mean() >= 0.5  # the plan aims the onsets at generate
    # never before its due time, and on the stream's own sample grid
    assert (speech.t_onset_ns >= speech.t_cancel_scheduled_ns - 1e9 / MIC_RATE).all()
    grid = (speech.t_onset_ns - speech.t_mic_start_ns) * MIC_RATE / 1e9
    assert np.allclose(grid, speech.onset_sample, atol=1.0)
    noise = df[(df.trial_kind == "cancel") & df.bargein_clip.str.startswith("noise-only")]
    assert len(noise) >= 2 and noise.t_onset_ns.isna().all()
    assert (noise.false_barge_in == noise.detector_fired).all()


# Each hop and the raw agent-clock stamps it spans (docs/bargein.md: onset -> detected -> issued ->
# received -> stopped -> silence), restated here from the docs, not from the derive code.
SPANS = {"detect_ms": ("t_onset_ns", "t_detected_ns"), "issue_ms": ("t_detected_ns", "t_issued_ns"),
         "deliver_ms": ("t_issued_ns", "t_received_ns"), "latency_ms": ("t_received_ns", "t_terminal_ns"),
         "drain_ms": ("t_terminal_ns", "t_silence_ns"), "onset_to_silence_ms": ("t_onset_ns", "t_silence_ns")}
STAMPS = ["t_onset_ns", "t_detected_ns", "t_issued_ns", "t_received_ns", "t_terminal_ns", "t_silence_ns"]


def _ms(df, a: str, b: str):
    """b - a in ms from the integer ns stamps (exact: the difference is taken in int64)."""
    return (df[b].astype("int64") - df[a].astype("int64")) / 1e6


def test_silenced_barge_ins_have_every_hop_and_the_hops_add_up(sweep):
    _, df = sweep
    silenced = df[(df.outcome == "cancelled") & (df.detector_fired == True) & (df.false_barge_in == False)]  # noqa: E712
    for mech in ("between_calls", "graph_eval"):  # not vacuous for either mechanism
        assert (silenced.mechanism == mech).sum() >= 1, df[["mechanism", "outcome", "bargein_clip", "detector_fired"]]
    assert silenced[STAMPS].notna().all().all() and silenced[HOPS].notna().all().all()
    for a, b in zip(STAMPS, STAMPS[1:]):  # in this order, on one clock
        assert (silenced[a] <= silenced[b]).all(), (a, b, silenced[[a, b]])
    for hop, (a, b) in SPANS.items():  # every hop is its own two stamps' span, none another's
        assert np.allclose(silenced[hop], _ms(silenced, a, b), atol=1e-6, rtol=0), hop
    # silence is the later of the engine's stop and the end of the last sample heard (these barge-ins
    # mostly stop the engine before its first audio window: then it is the stop itself)
    heard = silenced.t_last_heard_ns.fillna(silenced.t_terminal_ns).astype("int64")
    assert (silenced.t_silence_ns.astype("int64") == np.maximum(silenced.t_terminal_ns.astype("int64"), heard)).all()
    # the hops add up to onset -> silence, as the stamps give it
    assert np.allclose(silenced[HOPS].sum(axis=1), _ms(silenced, "t_onset_ns", "t_silence_ns"), atol=1e-6, rtol=0)
    assert (silenced.detected_sample >= silenced.onset_sample).all()
    assert np.allclose(silenced.detection_error_ms,
                       (silenced.detected_sample - silenced.onset_sample) * 1000.0 / MIC_RATE, atol=1e-9, rtol=0)
    # what was heard after the onset never outlasts the wait for silence
    assert (silenced.audio_after_onset_ms <= _ms(silenced, "t_onset_ns", "t_silence_ns") + 1e-6).all()


def test_the_report_opens_with_the_barge_in_section(sweep, tmp_path):
    out, df = sweep
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "report", str(out), "--format", "json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr
    cells = json.loads(r.stdout)["bargein"]["cells"]
    assert {c["mechanism"] for c in cells} == {"between_calls", "graph_eval"}
    silenced = df[(df.outcome == "cancelled") & (df.detector_fired == True) & (df.false_barge_in == False)]  # noqa: E712
    for c in cells:  # the counts are the records', cell by cell
        assert c["n_silenced"] == (silenced.mechanism == c["mechanism"]).sum()
        assert c["hops_p50"]["engine stop"] is not None
    md = subprocess.run([sys.executable, "-m", "cancelbench.cli", "report", str(out), "--format", "markdown"],
                        capture_output=True, text=True, timeout=300).stdout
    first = next(line for line in md.splitlines() if line.startswith("### "))
    assert first.startswith("### Barge-in"), first


@pytest.mark.parametrize("table, said", [
    ('engine = "text"\nbargein = {}', "barge-in needs an engine that streams audio"),
    ('engine = "tts"\nmodel = "fixture:qwen3tts-fixture"\nmmproj = "fixture:qwen3tts-fixture"\n'
     'bargein = { detector = "silero", frame_ms = 20 }', "frame_ms"),
    ('engine = "tts"\nmodel = "fixture:qwen3tts-fixture"\nmmproj = "fixture:qwen3tts-fixture"\n'
     'bargein = { clips = "nope" }', "unknown clip set"),
    # an external engine streams audio only if its hello says so (audio_out, protocol 1.4)
    (f'engine = "external"\ncommand = ["{sys.executable}", "-m", "cancelbench.sut.builtin", "sim"]\nbargein = {{}}',
     "the external engine cancelbench-sim does not"),
])
def test_a_bad_bargein_table_is_one_line_and_exit_2(tmp_path, table, said):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[[workload]]\nname = "w"\n{table}\n')
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "sweep", "--config", str(cfg), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()
