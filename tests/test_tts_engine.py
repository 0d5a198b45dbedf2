"""TTS engine on the Qwen3-TTS fixture, through the real libmtmd gen-audio helper.

Every test drives real native calls (llama talker, clip code predictor, clip
code2wav). A second thread issues the cancel when the engine's Progress reaches
the target state. No wall-clock bounds are asserted: where a mechanism should
stop *inside* a native call, the test checks the native evidence instead (the
reader stamped ``seen_ns``, llama_decode returned 2, the step was discarded).
"""

from __future__ import annotations

import json
import threading
import wave

import pytest

from cancelbench.request import TrialRequest
from cancelbench import native
from cancelbench.datasets import speech_fixtures as SF
from cancelbench.device_agents.engines.base import CancelControl, EngineInputError, Progress
from cancelbench.device_agents.engines.tts import WINDOW_FRAMES, TtsEngine

from helpers import cancel_inside_call, cancel_when, LEAK_BOUND_KB_PER_CYCLE, leak_kb_per_cycle, rss_kb

TEXT = "Cancel this sentence while it is being spoken."
FRAMES = WINDOW_FRAMES + 8  # one code2wav window inside generation + a final partial one


@pytest.fixture(scope="module")
def tts_paths():
    return SF.ensure_speech_fixtures()["tts"]


def _workload(paths, **kw):
    wl = {"name": "tts-fixture", "engine": "tts", "model": str(paths["model"]), "mmproj": str(paths["mmproj"]),
          "n_threads": 1, "n_batch": 16, "chunk_tokens": 4, "max_frames": FRAMES, "seed": 7}
    wl.update(kw)
    return wl


@pytest.fixture(scope="module")
def engine(tts_paths):
    eng = TtsEngine(_workload(tts_paths))
    yield eng
    eng.close()


def _ctl() -> CancelControl:
    return CancelControl(native.CancelToken(), Progress())


def _run(engine, mechanism="between_calls", ctl=None, **trial):
    ctl = ctl or _ctl()
    return engine.run(TrialRequest(input=TEXT, input_id="t0", mechanism=mechanism, **trial), ctl), ctl


@pytest.fixture(scope="module")
def reference(engine):
    res, _ = _run(engine)
    assert res.outcome == "completed"
    return res


def test_uncancelled_run_writes_a_wav_of_the_expected_length(engine, tmp_path):
    wav = tmp_path / "ref.wav"
    res, _ = _run(engine, wav_out=str(wav))
    assert res.outcome == "completed"
    out = res.output
    frames = out["frames"]
    assert frames > WINDOW_FRAMES  # so one window ran inside generation
    assert out["n_samples"] == frames * engine.samples_per_frame
    assert out["window_rule_consistent"]
    assert len(out["pcm"]) == out["n_samples"]
    with wave.open(str(wav), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == out["n_samples"]
    # every phase of the issue ran and has a duration
    for phase in ("set_input", "prompt", "generate", "code2wav", "output"):
        assert res.phase_durations_ms.get(phase, 0) > 0, phase
    steps = out["steps"]
    assert [s["frames"] for s in steps if s["code2wav"] and not s.get("final")] == [WINDOW_FRAMES]
    assert steps[-1]["final"] and steps[-1]["code2wav"]
    assert any(s["phase"] == "prompt" and s["prompt_remaining"] > 0 for s in steps)


def test_same_seed_same_audio_and_mechanisms_agree(engine, reference, tts_paths):
    for mech in ("abort_callback", "chunked", "graph_eval"):
        res, _ = _run(engine, mech)
        assert res.outcome == "completed"
        assert res.output_sha256 == reference.output_sha256, mech
    res, _ = _run(engine, "graph_eval")
    # measured from the clip eval reader's node polls, not from the frame count
    assert res.output["code2wav_measured"] == [WINDOW_FRAMES]
    reseeded = TtsEngine(_workload(tts_paths, seed=8))  # the sampling seed is a workload setting
    try:
        other, _ = _run(reseeded)
    finally:
        reseeded.close()
    assert other.output_sha256 != reference.output_sha256


PHASE_TARGETS = {
    "prompt": lambda p: p.phase == "prompt" and p.native_call is not None,
    "generate": lambda p: p.phase == "generate" and (p.frames_generated or 0) >= 3 and p.native_call is not None,
    "code2wav": lambda p: p.heavy_graph == "code2wav",
}


@pytest.mark.parametrize("phase", ["prompt", "generate", "code2wav"])
@pytest.mark.parametrize("mechanism", ["between_calls", "abort_callback", "graph_eval"])
def test_phase_targeted_cancel_lands_in_that_phase(engine, phase, mechanism):
    ctl = _ctl()
    cancel_when(ctl, PHASE_TARGETS[phase])
    res, ctl = _run(engine, mechanism, ctl=ctl)
    assert res.outcome == "cancelled"
    assert ctl.at_receipt["phase_at_receipt"] == phase
    assert res.phase_at_terminal == phase
    assert ctl.at_receipt["native_call_at_receipt"] is not None
    if phase == "code2wav":
        assert ctl.at_receipt["heavy_graph_at_receipt"] == "code2wav"
        assert ctl.at_receipt["frames_generated_at_receipt"] == WINDOW_FRAMES - 1
    if mechanism == "graph_eval" and phase == "code2wav":
        # the clip scheduler's eval reader saw the token inside the code2wav graph
        assert ctl.token.seen_ns >= ctl.token.set_ns > 0
    if mechanism == "between_calls":
        assert ctl.token.seen_ns == 0  # nothing native looked at the token
    if mechanism in ("abort_callback", "graph_eval"):
        # the talker's abort reader was armed: it polled during the run, and if it saw
        # the token it saw it after the cancel set it
        assert ctl.token.polls > 0
        assert ctl.token.seen_ns == 0 or ctl.token.seen_ns >= ctl.token.set_ns > 0
        if phase == "prompt" and res.decode_rc == -1:
            # step_prompt failed because llama_decode returned 2: only the reader can cause that
            assert ctl.token.seen_ns > 0


def test_latched_cancel_before_set_input(engine):
    ctl = _ctl()
    ctl.request(native.now_ns())
    res, _ = _run(engine, ctl=ctl)
    assert res.outcome == "cancelled"
    assert res.phase_at_terminal == "set_input"
    assert ctl.native_returned_ns is None  # no native call ran


def test_cancel_inside_set_input_is_honoured_at_the_first_opportunity(engine):
    ctl = _ctl()
    cancel_inside_call(ctl, "mtmd_helper_gen_audio_set_input")  # the one call no mechanism can stop
    res, ctl = _run(engine, ctl=ctl)
    assert res.outcome == "cancelled"
    assert ctl.at_receipt["phase_at_receipt"] == "set_input"
    assert ctl.at_receipt["native_call_at_receipt"] == "mtmd_helper_gen_audio_set_input"
    assert res.phase_at_terminal == "set_input"  # honoured right after the call returned
    assert ctl.native_returned_ns >= ctl.received_ns


def test_hundred_immediate_cancels_none_dropped(engine):
    outcomes = []
    for i in range(100):
        ctl = _ctl()
        if i % 2:
            ctl.request(native.now_ns())  # latched before the trial starts
        else:
            threading.Thread(target=ctl.request, args=(native.now_ns(),), daemon=True).start()
        res, _ = _run(engine, ["between_calls", "abort_callback", "chunked", "graph_eval"][i % 4], ctl=ctl)
        outcomes.append(res.outcome)
    assert outcomes.count("cancelled") == 100


@pytest.mark.parametrize("phase", ["prompt", "generate", "code2wav"])
def test_no_leaked_state_after_a_cancel(engine, reference, phase):
    for mech in ("between_calls", "graph_eval"):
        ctl = _ctl()
        cancel_when(ctl, PHASE_TARGETS[phase])
        res, _ = _run(engine, mech, ctl=ctl)
        assert res.outcome == "cancelled"
        again, _ = _run(engine)
        assert again.outcome == "completed"
        assert again.output_sha256 == reference.output_sha256, (phase, mech)


def test_fresh_engine_matches(tts_paths, reference):
    eng = TtsEngine(_workload(tts_paths))
    try:
        res, _ = _run(eng)
        assert res.output_sha256 == reference.output_sha256
    finally:
        eng.close()



def test_memory_flat_over_30_cancel_run_cycles(tts_paths):
    eng = TtsEngine(_workload(tts_paths, max_frames=6))
    try:
        rss = []
        for i in range(30):
            ctl = _ctl()
            cancel_when(ctl, PHASE_TARGETS["generate"] if i % 2 else PHASE_TARGETS["prompt"])
            eng.run(TrialRequest(input=TEXT, mechanism=("abort_callback", "graph_eval")[i % 2]), ctl)
            res, _ = _run(eng)
            assert res.outcome == "completed"
            rss.append(rss_kb())
        growth = leak_kb_per_cycle(rss)
        assert growth < LEAK_BOUND_KB_PER_CYCLE, (growth, rss)
    finally:
        eng.close()


# ----------------------------------------------------------------------------- bad input

def test_empty_text(engine):
    with pytest.raises(EngineInputError, match="empty text"):
        engine.run(TrialRequest(input="   ", mechanism="between_calls"), _ctl())


def test_missing_mmproj(tts_paths):
    wl = _workload(tts_paths)
    wl.pop("mmproj")
    with pytest.raises(EngineInputError, match="needs an mmproj"):
        TtsEngine(wl)
    with pytest.raises(EngineInputError, match="not found"):
        TtsEngine(_workload(tts_paths, mmproj=str(tts_paths["mmproj"]) + ".missing"))


def test_mmproj_of_the_wrong_projector_type(tts_paths):
    asr = SF.ensure_speech_fixtures()["asr"]
    with pytest.raises(EngineInputError, match="qwen3tts_gen"):
        TtsEngine(_workload(tts_paths, mmproj=str(asr["mmproj"])))


def test_lock_mismatch_is_caught_on_the_agent_before_load(tts_paths):
    """Locks are verified once, by the agent's model resolution, before llama.cpp sees a file."""
    from cancelbench.datasets.locks import LockError
    from cancelbench.device_agents.models import resolve_models

    locks = json.loads(SF.SPEECH_LOCK.read_text())["files"]
    good = resolve_models({**_workload(tts_paths), "locks": locks})
    assert good["mmproj_sha256"] == locks[tts_paths["mmproj"].name]["sha256"]
    bad = {**locks, tts_paths["mmproj"].name: {**locks[tts_paths["mmproj"].name], "sha256": "0" * 64}}
    with pytest.raises(LockError, match="does not match lock"):
        resolve_models({**_workload(tts_paths), "locks": bad})


def test_agent_refuses_the_talker_as_a_text_model_before_load(tts_paths):
    """The agent checks each verified file against its engine too (remote hosts' own copies)."""
    from cancelbench.device_agents.model_check import ModelMismatchError
    from cancelbench.device_agents.models import resolve_models

    locks = json.loads(SF.SPEECH_LOCK.read_text())["files"]
    as_text = {"engine": "text", "model": str(tts_paths["model"]), "locks": locks}
    with pytest.raises(ModelMismatchError, match="TTS talker"):
        resolve_models(as_text)


def test_unknown_mechanism(engine):
    with pytest.raises(EngineInputError, match="no mechanism"):
        _run(engine, "magic")
