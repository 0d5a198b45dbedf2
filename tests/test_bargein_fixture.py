"""The barge-in fixture (``qwen3tts-bargein``): the TTS fixture at the real codec rate.

Its code2wav hands over 1920 samples of 24 kHz audio per codec frame (80 ms, real
Qwen3-TTS at 12.5 Hz), against the TTS fixture's 64 (2.67 ms), so an engine that makes
frames faster than one per 80 ms is faster than real time and a playback buffer fills.
No wall-clock bound is asserted: the tests check the structural fact (the samples the
real engine hands over per frame, through the same ``Progress.hand_audio`` the barge-in
playback model listens to) and the bytes (the committed lock).
"""

from __future__ import annotations

from cancelbench import native
from cancelbench.datasets import fixtures as F
from cancelbench.datasets import speech_fixtures as SF
from cancelbench.datasets.locks import load_lock, sha256_file, verify_against
from cancelbench.datasets.qwen_common import SAMPLES_PER_FRAME_REAL, TTS_SAMPLE_RATE
from cancelbench.device_agents import model_check
from cancelbench.device_agents.engines import mtmd_ext as X
from cancelbench.device_agents.engines.base import CancelControl, Progress
from cancelbench.device_agents.engines.tts import WINDOW_FRAMES, TtsEngine
from cancelbench.request import TrialRequest

FRAMES = WINDOW_FRAMES + 8  # one code2wav window inside generation, then a final partial one


def test_generation_is_byte_reproducible_and_matches_its_lock(tmp_path):
    paths = SF.write_tts_fixture(tmp_path, SF.TTS_BARGEIN_FIXTURE)
    locked = load_lock(SF.BARGEIN_LOCK)
    assert sorted(locked) == sorted(p.name for p in paths.values())
    for p in paths.values():
        verify_against(p, SF.BARGEIN_LOCK)  # raises on any size / sha256 difference
    # the cached copy (what a sweep loads) is the same bytes
    cached = SF.ensure_bargein_fixture(verify=True)
    assert [sha256_file(p) for p in cached.values()] == [sha256_file(p) for p in paths.values()]
    # the TTS fixture's own files and lock are another pair, untouched by this one
    assert not set(locked) & set(load_lock(SF.SPEECH_LOCK))


def test_registered_as_a_fixture_by_name():
    """``fixture:qwen3tts-bargein`` resolves through the registry the driver and the agent use,
    and ``cancelbench fixtures`` (all) writes it; the speech set (``--which speech``) does not."""
    entries = F.fixture_lock_entries(SF.TTS_BARGEIN_FIXTURE.name)
    assert sorted(entries) == sorted(load_lock(SF.BARGEIN_LOCK))
    assert F.ensure_fixture(SF.TTS_BARGEIN_FIXTURE.name, "model").name == SF.TTS_BARGEIN_FIXTURE.talker_file
    assert F.ensure_fixture(SF.TTS_BARGEIN_FIXTURE.name, "mmproj").name == SF.TTS_BARGEIN_FIXTURE.mmproj_file
    assert set(entries) <= {p.name for p in F.generate_all(which="all")}
    assert not set(entries) & {p.name for p in F.generate_all(which="speech")}


def test_the_real_architecture_with_the_real_codec_strides():
    paths = SF.ensure_bargein_fixture()
    assert model_check.gguf_metadata(paths["model"])["general.architecture"] == "qwen3tts"
    assert model_check.projector_types(model_check.gguf_metadata(paths["mmproj"])) == {
        "audio": "qwen3tts_spkenc", "gen_audio": "qwen3tts_gen", "vision": None}
    shapes = X.read_gguf_tensor_shapes(paths["mmproj"])
    # each DAC block's ConvTranspose kernel is 2 x its stride: the real (8, 5, 4, 3)
    assert [shapes[f"a.gen.wav.dac.blk.{i}.conv.weight"][0] // 2 for i in range(4)] == [8, 5, 4, 3]
    assert sum(1 for n in shapes if n.startswith("a.gen.wav.up.blk.") and n.endswith(".conv.weight")) == \
        SF.C2W_UPSAMPLE_BLOCKS
    assert SF.TTS_BARGEIN_FIXTURE.samples_per_frame == SAMPLES_PER_FRAME_REAL == 1920
    assert TtsEngine._samples_per_frame(paths["mmproj"]) == SAMPLES_PER_FRAME_REAL


def test_the_real_engine_hands_over_1920_samples_per_frame():
    """The TTS engine on the fixture, uncancelled: the code2wav window inside generation hands
    over 72 x 1920 samples, the final partial window 8 x 1920, and the PCM is that long: 80 ms
    of 24 kHz audio per frame, 30 times the TTS fixture's 2.67 ms."""
    paths = SF.ensure_bargein_fixture()
    engine = TtsEngine({"name": "tts-bargein", "engine": "tts", "model": str(paths["model"]),
                        "mmproj": str(paths["mmproj"]), "n_threads": 1, "n_batch": 16, "chunk_tokens": 4,
                        "max_frames": FRAMES, "seed": 7})
    try:
        assert engine.samples_per_frame == SAMPLES_PER_FRAME_REAL
        assert engine.sample_rate == TTS_SAMPLE_RATE == 24000
        handed: list[tuple[int, int, str]] = []  # (total samples so far, frames done, phase) at each hand-over
        progress = Progress()
        progress.audio_listener = lambda total, t_ns: handed.append((total, progress.frames_generated,
                                                                     progress.phase))
        ctl = CancelControl(native.CancelToken(), progress)
        res = engine.run(TrialRequest(input="Barge in while this is being spoken.", input_id="t0",
                                      mechanism="between_calls"), ctl)
    finally:
        engine.close()
    assert res.outcome == "completed"
    out = res.output
    assert out["frames"] == FRAMES and out["samples_per_frame"] == SAMPLES_PER_FRAME_REAL
    assert handed == [(WINDOW_FRAMES * 1920, WINDOW_FRAMES, "code2wav"), (FRAMES * 1920, FRAMES, "code2wav")]
    per_frame = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip([(0, 0, "")] + handed, handed)]
    assert per_frame == [1920.0, 1920.0]
    assert 1000.0 * per_frame[0] / engine.sample_rate == 80.0  # ms of audio per codec frame
    pcm = out["pcm"]
    assert out["n_samples"] == len(pcm) == FRAMES * 1920 and out["window_rule_consistent"]
    assert bool((abs(pcm) > 0).any()) and bool((pcm == pcm).all())  # decoded samples, no NaN
