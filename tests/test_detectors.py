"""Barge-in detectors (issue 28) on the real models and the committed clips: both kinds
fire on speech after its onset and never on digital silence, min_speech_ms delays the
decision by whole frames, the chunking never changes a decision, bad settings are one
clear message each, and evaluate() returns sane numbers."""

from __future__ import annotations

import numpy as np
import pytest

from cancelbench.datasets import bargein_clips as B
from cancelbench.datasets.bargein_mic import MicStream
from cancelbench.device_agents.detectors import DetectorSettings, evaluate, make_detector

ONSET = B.RATE  # the user's onset, 1 s into the stream
SILERO = DetectorSettings("silero", 32, 64, threshold=0.5)
WEBRTC = DetectorSettings("webrtc", 30, 90, webrtc_mode=2)
BOTH = pytest.mark.parametrize("settings", [SILERO, WEBRTC], ids=["silero", "webrtc"])


def _speech(clip: str = "hold-on", total: int = 3 * B.RATE) -> np.ndarray:
    s = MicStream(B.load_clip(clip), None, snr_db=None, echo_level_db=None)
    s.set_onset(ONSET)
    return s.chunk(0, total)


def _decide(settings: DetectorSettings, pcm: np.ndarray, chunk: int = 320) -> int | None:
    det = make_detector(settings)
    for i in range(0, len(pcm), chunk):
        if (d := det.feed(pcm[i:i + chunk])) is not None:
            return d
    return None


@BOTH
@pytest.mark.parametrize("clip", ["hold-on", "no-listen"])
def test_fires_on_speech_after_its_onset_and_never_on_digital_silence(settings, clip):
    decision = _decide(settings, _speech(clip))
    # the tolerance: the clip's 100 ms lead-in before the labelled onset holds faint speech
    assert decision is not None and ONSET - B.LEAD_SAMPLES <= decision <= ONSET + B.RATE // 2
    assert decision % settings.frame_samples == 0  # the end of a frame
    assert _decide(settings, np.zeros(3 * B.RATE, np.int16)) is None


@BOTH
def test_min_speech_ms_delays_the_decision_by_whole_frames(settings):
    pcm = _speech()
    f = settings.frame_ms
    short = DetectorSettings(settings.kind, f, f, settings.threshold, settings.webrtc_mode)
    long = DetectorSettings(settings.kind, f, 4 * f, settings.threshold, settings.webrtc_mode)
    # 4 consecutive speech frames ending at d contain 1 ending 3 frames before it
    assert _decide(long, pcm) >= _decide(short, pcm) + 3 * settings.frame_samples


@BOTH
def test_chunking_and_reset_never_change_the_decision(settings):
    pcm = _speech("excuse-me")
    want = _decide(settings, pcm, 160)
    assert want is not None
    assert _decide(settings, pcm, 512) == _decide(settings, pcm, 7) == want
    det = make_detector(settings)
    for _ in range(2):  # one detector, reset between trials: the same decision again
        det.reset()
        got = next(d for i in range(0, len(pcm), 333) if (d := det.feed(pcm[i:i + 333])) is not None)
        assert got == want == det.decision
        assert det.feed(pcm[:480]) is None  # decided once: no second decision


def test_webrtc_calls_a_fresh_stream_speech_until_it_adapts_and_warmup_covers_it():
    # WebRTC VAD judges the first ~100 ms of any stream speech (its noise model is empty):
    # warmup_ms lets those frames adapt it without counting towards a decision.
    noise = MicStream(None, None, snr_db=20.0, echo_level_db=None, noise="white", seed=3).chunk(0, 3 * B.RATE)
    cold = DetectorSettings("webrtc", 30, 90, webrtc_mode=3)
    assert _decide(cold, noise) <= 150 * 16
    assert _decide(DetectorSettings("webrtc", 30, 90, webrtc_mode=3, warmup_ms=300), noise) is None
    assert _decide(DetectorSettings("webrtc", 30, 90, webrtc_mode=3, warmup_ms=300), _speech()) >= ONSET


@pytest.mark.parametrize("kwargs,message", [
    ({"kind": "rnnoise"}, "detector kind must be one of silero, webrtc, got 'rnnoise'"),
    ({"frame_ms": 30}, r"silero frame_ms must be 32 \(the model's 512-sample window at 16 kHz\), got 30"),
    ({"threshold": 1.0}, r"silero threshold must be a speech probability in \(0, 1\), got 1.0"),
    ({"threshold": None}, r"silero threshold must be a speech probability in \(0, 1\), got None"),
    ({"webrtc_mode": 2}, "webrtc_mode is a webrtc setting; a silero detector takes threshold"),
    ({"min_speech_ms": 50}, r"min_speech_ms must be a whole number of 32 ms frames from 32 to 992 .*got 50"),
    ({"min_speech_ms": 0}, "min_speech_ms must be a whole number of 32 ms frames"),
    ({"min_speech_ms": 64.0}, "min_speech_ms must be a whole number of 32 ms frames"),
    ({"warmup_ms": 100}, "warmup_ms must be a whole number of 32 ms frames from 0 to 1984"),
    ({"kind": "webrtc", "frame_ms": 32, "threshold": None, "webrtc_mode": 2},
     "webrtc frame_ms must be one of 10, 20, 30, got 32"),
    ({"kind": "webrtc", "frame_ms": 30, "webrtc_mode": 2, "min_speech_ms": 90},
     r"threshold is a silero setting \(a speech probability\); a webrtc detector takes webrtc_mode 0-3"),
    ({"kind": "webrtc", "frame_ms": 30, "threshold": None, "webrtc_mode": 4, "min_speech_ms": 90},
     "webrtc_mode must be an integer 0-3 \\(aggressiveness\\), got 4"),
    ({"kind": "webrtc", "frame_ms": 30, "threshold": None, "webrtc_mode": True, "min_speech_ms": 90},
     "webrtc_mode must be an integer 0-3"),
])
def test_bad_settings_are_one_clear_message(kwargs, message):
    args = {"kind": "silero", "frame_ms": 32, "min_speech_ms": 64, "threshold": 0.5, **kwargs}
    with pytest.raises(ValueError, match=message) as exc:
        DetectorSettings(**args)
    assert "\n" not in str(exc.value)


def test_feed_takes_int16_pcm_only():
    det = make_detector(WEBRTC)
    with pytest.raises(ValueError, match="feed takes a 1-D int16 numpy array"):
        det.feed(np.zeros(480, np.float32))


def test_evaluate_returns_sane_numbers():
    entries = tuple(e for e in B.clip_set("bargein-v1") if e.echo_level_db != -6.0)[::2]
    for settings in (SILERO, DetectorSettings("webrtc", 10, 100, webrtc_mode=3, warmup_ms=300)):
        result = evaluate(settings, entries, chunk_ms=20)
        rows, summary = result["clips"], result["summary"]
        assert len(rows) == len(entries) and result["name"] == settings.name
        for row, entry in zip(rows, entries):
            assert row["entry"] == entry.name
            if entry.user is None:
                assert row["outcome"] in ("quiet", "false_barge_in") and row["latency_ms"] is None
            else:
                assert row["onset_sample"] == ONSET and row["outcome"] in ("detected", "early", "missed")
        latencies = [r["latency_ms"] for r in rows if r["outcome"] == "detected"]
        assert summary["detected"] == len(latencies) >= summary["speech_clips"] // 2
        assert all(0 <= v <= 500 for v in latencies)
        assert summary["latency_ms_p50"] <= summary["latency_ms_p90"] <= summary["latency_ms_max"]
        assert (summary["detected"] + summary["early"] + summary["missed"] == summary["speech_clips"]
                and summary["speech_clips"] + summary["noise_clips"] == len(entries))
        again = evaluate(settings, entries, chunk_ms=32)  # another chunking, the same decisions
        assert [r["decision_sample"] for r in again["clips"]] == [r["decision_sample"] for r in rows]
    with pytest.raises(ValueError, match="chunk_ms must be an integer from 10 to 32, got 40"):
        evaluate(SILERO, entries, chunk_ms=40)
