"""Barge-in on an engine out of process (protocol 1.4's audio events): the built-in TTS engine
run as an external workload through the engine library, the detector issuing the cancel
over the protocol, the playback model fed from the engine's own audio events on the
agent's clock, the reference runs' audio written where the agent asked."""

from __future__ import annotations

import sys
import wave

import numpy as np
import pytest

from cancelbench.datasets import speech_fixtures as SF
from cancelbench.device_agents.engines.tts import WINDOW_FRAMES
from cancelbench.orchestrator.config import load_config
from cancelbench.orchestrator.runner import run_sweep
from cancelbench.sink import read_records

from test_bargein_sweep import HOPS, SPANS, STAMPS, _ms

BUFFER_MS = 80
WINDOW_SAMPLES = WINDOW_FRAMES * SF.TTS_FIXTURE.samples_per_frame  # one code2wav window's audio
# Onsets aimed at code2wav's entry: a between_calls engine cannot stop inside a window, so the
# window in flight at the onset runs to its end (handed over or discarded: see the playback test).
CONFIG = f"""
[sweep]
seed = 5
trials_per_cell = 6
reference_runs = 3
mechanisms = ["between_calls", "graph_eval"]
ping_samples = 5
[offsets]
plan = "phase"
phases = ["code2wav"]
min_per_phase = 6
[[workload]]
name = "tts-out"
engine = "external"
command = ["{sys.executable}", "-m", "cancelbench.sut.builtin", "tts"]
model = "fixture:qwen3tts-fixture"
mmproj = "fixture:qwen3tts-fixture"
inputs = "tts_texts"
settings = {{ n_threads = 1, max_frames = 200 }}
bargein = {{ clips = "bargein-ci", chunk_ms = 16, playback_buffer_ms = {BUFFER_MS} }}
"""


@pytest.fixture(scope="module")
def sweep(local_ray, tmp_path_factory):
    out = tmp_path_factory.mktemp("bargein-external") / "out"
    cfg = out.parent / "bargein.toml"
    cfg.write_text(CONFIG)
    config = load_config(cfg)
    assert config.deliveries == ("detector",)
    run_sweep(config, out, progress=False)
    return out, read_records(out)


def test_an_external_engine_that_streams_audio_gives_every_hop(sweep):
    _, df = sweep
    cancels = df[df.trial_kind == "cancel"]
    assert len(cancels) == 12 and (cancels.engine == "external").all()
    assert (cancels.engine_name == "cancelbench-tts").all() and (cancels.audio_sample_rate == 24000).all()
    silenced = cancels[(cancels.outcome == "cancelled") & (cancels.detector_fired == True)  # noqa: E712
                       & (cancels.false_barge_in == False)]  # noqa: E712
    for mech in ("between_calls", "graph_eval"):
        assert (silenced.mechanism == mech).sum() >= 1, cancels[["mechanism", "outcome", "bargein_clip"]]
    assert silenced[STAMPS].notna().all().all() and silenced[HOPS].notna().all().all()
    for a, b in zip(STAMPS, STAMPS[1:]):
        assert (silenced[a] <= silenced[b]).all(), (a, b, silenced[[a, b]])
    for hop, (a, b) in SPANS.items():
        assert np.allclose(silenced[hop], _ms(silenced, a, b), atol=1e-6, rtol=0), hop
    assert np.allclose(silenced[HOPS].sum(axis=1), _ms(silenced, "t_onset_ns", "t_silence_ns"), atol=1e-6, rtol=0)
    # the protocol hop is inside the engine's stop, and the residue split came with the done (1.3)
    assert (silenced.protocol_hop_ms.notna() & (silenced.protocol_hop_ms <= silenced.latency_ms + 1e-6)).all()
    assert (silenced.trial_cpu_source == "engine-reported").all() and silenced.trial_cpu_ms.notna().all()


def test_the_playback_model_hears_the_engines_audio_events(sweep):
    _, df = sweep
    cancels = df[df.trial_kind == "cancel"]
    # between_calls cannot stop inside the window in flight at a code2wav onset. A cancel that came
    # after that window ended (the engine back in generate) finds it handed over; one that came while
    # it ran finds it discarded (the check after the call), so audio goes out in whole windows only.
    # Which of the two a cancel meets is the machine's timing (a window is longer on a loaded one).
    window = cancels[(cancels.mechanism == "between_calls") & (cancels.phase_at_onset == "code2wav")
                     & (cancels.outcome == "cancelled")]
    assert len(window) >= 1, cancels[["mechanism", "phase_at_onset", "outcome"]]
    inside = window[window.phase_at_receipt != "output"]  # before the final flush handed the rest
    assert (inside.audio_samples_handed % WINDOW_SAMPLES == 0).all(), inside[["trial_id", "audio_samples_handed"]]
    after = window[window.phase_at_receipt == "generate"]
    assert (after.audio_samples_handed > 0).all(), after[["trial_id", "audio_samples_handed"]]
    heard = cancels[cancels.audio_samples_handed > 0]
    assert len(heard) >= 1, cancels[["mechanism", "phase_at_receipt", "outcome", "audio_samples_handed"]]
    # on the agent's clock: a sample is heard a buffer after the engine handed it over, inside the trial,
    # and what still plays once the engine stopped is at most the device's buffer
    assert (heard.t_playback_start_ns >= heard.t_start_ns + BUFFER_MS * 1e6).all()
    stopped = heard[heard.outcome == "cancelled"]
    assert (stopped.t_playback_start_ns <= stopped.t_terminal_ns + BUFFER_MS * 1e6).all()
    assert (stopped.drain_ms <= BUFFER_MS + 1e-6).all() and (stopped.audio_samples_heard <= stopped.audio_samples_handed).all()


def test_the_reference_runs_write_their_audio_where_the_agent_asked(sweep):
    out, df = sweep
    refs = df[df.trial_kind == "reference"]
    assert len(refs) == 6 and (refs.outcome == "completed").all()
    for trial in refs.trial_id:
        with wave.open(str(out / "audio" / f"{trial}.wav")) as w:
            assert w.getframerate() == 24000 and w.getnframes() > 0
