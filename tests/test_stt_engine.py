"""STT engine on the Qwen3-ASR fixture, chunk by chunk through real libmtmd calls.

The committed clips in datasets/audio are verified against their lock. A second
thread issues the cancel when Progress reaches the target phase; no wall-clock
bounds are asserted.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from cancelbench.request import TrialRequest
from cancelbench import native
from cancelbench.datasets import speech_fixtures as SF
from cancelbench.device_agents.engines import mtmd_ext as X
from cancelbench.device_agents.engines.base import CancelControl, EngineInputError, Progress
from cancelbench.device_agents.engines.stt import SttEngine

from helpers import cancel_when, LEAK_BOUND_KB_PER_CYCLE, leak_kb_per_cycle, rss_kb


@pytest.fixture(scope="module")
def asr_paths():
    return SF.ensure_speech_fixtures()["asr"]


@pytest.fixture(scope="module")
def clip():
    return str(SF.audio_clip("speech-medium"))


def _workload(paths, **kw):
    wl = {"name": "stt-fixture", "engine": "stt", "model": str(paths["model"]), "mmproj": str(paths["mmproj"]),
          "n_threads": 1, "n_batch": 256, "chunk_tokens": 8, "max_tokens": 12}
    wl.update(kw)
    return wl


@pytest.fixture(scope="module")
def engine(asr_paths):
    eng = SttEngine(_workload(asr_paths))
    yield eng
    eng.close()


def _ctl() -> CancelControl:
    return CancelControl(native.CancelToken(), Progress())


def _run(engine, clip, mechanism="between_calls", ctl=None, **trial):
    ctl = ctl or _ctl()
    return engine.run(TrialRequest(input=clip, input_id="c0", mechanism=mechanism, **trial), ctl), ctl


@pytest.fixture(scope="module")
def reference(engine, clip):
    res, _ = _run(engine, clip)
    assert res.outcome == "completed"
    return res


def test_uncancelled_run_produces_text(reference):
    out = reference.output
    assert len(out["tokens"]) > 0 and out["text"]
    kinds = [c["type"] for c in out["chunks"]]
    assert kinds == ["text", "audio", "text"]
    for phase in ("preprocess", "prefill", "encode", "decode_embd", "generate"):
        assert reference.phase_durations_ms.get(phase, 0) > 0, phase


def test_every_mechanism_gives_the_same_text(engine, clip, reference):
    for mech in ("abort_callback", "chunked", "graph_eval"):
        res, _ = _run(engine, clip, mech)
        assert res.outcome == "completed"
        assert res.output_sha256 == reference.output_sha256, mech


def test_long_audio_is_evaluated_window_by_window(engine, tmp_path):
    t = np.arange(16000 * 10) / 16000.0
    path = tmp_path / "ten-seconds.wav"
    X.write_wav16(path, 0.3 * np.sin(2 * np.pi * 300 * t), 16000)
    res, _ = _run(engine, str(path), "chunked")
    assert res.outcome == "completed"
    audio = [c for c in res.output["chunks"] if c["type"] == "audio"]
    assert len(audio) == 2  # 8 s + 2 s mel windows, each its own mtmd_encode_chunk


PHASE_TARGETS = {
    "encode": lambda p: p.phase == "encode" and p.native_call == "mtmd_encode_chunk",
    "decode_embd": lambda p: p.phase == "decode_embd" and p.native_call is not None,
    "generate": lambda p: p.phase == "generate" and (p.tokens_generated or 0) >= 2,
}


@pytest.mark.parametrize("phase", ["encode", "decode_embd", "generate"])
@pytest.mark.parametrize("mechanism", ["between_calls", "abort_callback", "chunked", "graph_eval"])
def test_phase_targeted_cancel_lands_in_that_phase(engine, clip, phase, mechanism):
    ctl = _ctl()
    cancel_when(ctl, PHASE_TARGETS[phase])
    res, ctl = _run(engine, clip, mechanism, ctl=ctl)
    assert res.outcome == "cancelled"
    assert ctl.at_receipt["phase_at_receipt"] == phase
    assert res.phase_at_terminal == phase
    if phase == "encode":
        assert ctl.at_receipt["heavy_graph_at_receipt"] == "clip_encode"
        if mechanism == "graph_eval":
            assert ctl.token.seen_ns >= ctl.token.set_ns > 0  # clip's eval reader saw it mid-graph
        else:
            assert ctl.token.seen_ns == 0  # nothing reaches the clip graph
    if mechanism == "between_calls":
        assert ctl.token.seen_ns == 0


def test_latched_cancel_before_the_first_native_call(engine, clip):
    ctl = _ctl()
    ctl.request(native.now_ns())
    res, _ = _run(engine, clip, ctl=ctl)
    assert res.outcome == "cancelled"
    assert res.phase_at_terminal == "preprocess"
    assert ctl.native_returned_ns is None


def test_hundred_immediate_cancels_none_dropped(engine, clip):
    outcomes = []
    for i in range(100):
        ctl = _ctl()
        if i % 2:
            ctl.request(native.now_ns())
        else:
            threading.Thread(target=ctl.request, args=(native.now_ns(),), daemon=True).start()
        res, _ = _run(engine, clip, ["between_calls", "abort_callback", "chunked", "graph_eval"][i % 4], ctl=ctl)
        outcomes.append(res.outcome)
    assert outcomes.count("cancelled") == 100


@pytest.mark.parametrize("phase", ["encode", "decode_embd", "generate"])
def test_no_leaked_state_after_a_cancel(engine, clip, reference, phase):
    for mech in ("abort_callback", "graph_eval"):
        ctl = _ctl()
        cancel_when(ctl, PHASE_TARGETS[phase])
        res, _ = _run(engine, clip, mech, ctl=ctl)
        assert res.outcome == "cancelled"
        again, _ = _run(engine, clip)
        assert again.output_sha256 == reference.output_sha256, (phase, mech)


def test_fresh_engine_matches(asr_paths, clip, reference):
    eng = SttEngine(_workload(asr_paths))
    try:
        res, _ = _run(eng, clip)
        assert res.output_sha256 == reference.output_sha256
    finally:
        eng.close()


def test_memory_flat_over_30_cancel_run_cycles(asr_paths):
    eng = SttEngine(_workload(asr_paths, max_tokens=4))
    short = str(SF.audio_clip("speech-short"))
    try:
        rss = []
        for i in range(30):
            ctl = _ctl()
            cancel_when(ctl, PHASE_TARGETS[("encode", "decode_embd")[i % 2]])
            eng.run(TrialRequest(input=short, mechanism=("abort_callback", "graph_eval")[i % 2]), ctl)
            res, _ = _run(eng, short)
            assert res.outcome == "completed"
            rss.append(rss_kb())
        growth = leak_kb_per_cycle(rss)
        assert growth < LEAK_BOUND_KB_PER_CYCLE, (growth, rss)
    finally:
        eng.close()


# ----------------------------------------------------------------------------- bad input

def test_committed_clips_match_their_lock_and_format():
    for clip_id in SF.AUDIO_CLIPS:
        path = SF.audio_clip(clip_id)
        assert path.stat().st_size < 200_000
        x = X.read_wav_mono_f32(path, 16000)
        assert len(x) > 16000


def test_unsupported_sample_rate(engine, tmp_path):
    path = tmp_path / "8k.wav"
    X.write_wav16(path, np.zeros(8000), 8000)
    with pytest.raises(EngineInputError, match="8000 Hz is not supported"):
        _run(engine, str(path))


def test_missing_audio_and_non_wav(engine, tmp_path):
    with pytest.raises(EngineInputError, match="not found"):
        _run(engine, str(tmp_path / "nope.wav"))
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"not a wav at all")
    with pytest.raises(EngineInputError, match="not a PCM WAV"):
        _run(engine, str(junk))


def test_missing_mmproj(asr_paths):
    wl = _workload(asr_paths)
    wl.pop("mmproj")
    with pytest.raises(EngineInputError, match="needs an mmproj"):
        SttEngine(wl)


def test_mmproj_of_the_wrong_projector_type(asr_paths):
    tts = SF.ensure_speech_fixtures()["tts"]
    with pytest.raises(EngineInputError, match="qwen3a"):
        SttEngine(_workload(asr_paths, mmproj=str(tts["mmproj"])))


def test_size_mismatch_is_caught_on_the_agent_before_load(asr_paths):
    from cancelbench.datasets.locks import LockError
    from cancelbench.device_agents.models import resolve_models

    locks = json.loads(SF.SPEECH_LOCK.read_text())["files"]
    name = asr_paths["model"].name
    bad = {**locks, name: {**locks[name], "size": locks[name]["size"] + 1}}
    with pytest.raises(LockError, match="does not match lock"):
        resolve_models({**_workload(asr_paths), "locks": bad})


def test_agent_style_shared_token_is_polled_by_clip_directly(asr_paths, clip):
    """The agent keeps one token and resets it per trial: the hooked mtmd context binds
    to it, so no swap happens and the agent's own token carries seen_ns."""
    eng = SttEngine(_workload(asr_paths))
    agent_token = native.CancelToken()
    try:
        for _ in range(2):
            agent_token.reset()
            ctl = CancelControl(agent_token, Progress())
            cancel_when(ctl, PHASE_TARGETS["encode"])
            res, ctl = _run(eng, clip, "graph_eval", ctl=ctl)
            assert res.outcome == "cancelled"
            assert ctl.token is agent_token
            assert agent_token.seen_ns >= agent_token.set_ns > 0
    finally:
        eng.close()
