"""The speech fixture GGUFs: reproducible bytes (lock) and the real load path."""

from __future__ import annotations

import llama_cpp
import pytest
from llama_cpp import mtmd_cpp as M

from cancelbench.datasets import speech_fixtures as SF
from cancelbench.datasets.locks import LockError, load_lock, verify_against, verify_file
from cancelbench.device_agents import model_check
from cancelbench.device_agents.engines import llama_runtime as rt
from cancelbench.device_agents.engines import mtmd_ext as X


def test_generation_is_byte_reproducible_and_matches_the_lock(tmp_path):
    paths = {**SF.write_tts_fixture(tmp_path), **{f"asr-{k}": v for k, v in SF.write_asr_fixture(tmp_path).items()}}
    locked = load_lock(SF.SPEECH_LOCK)
    assert len(locked) == 4
    for p in paths.values():
        assert p.name in locked
        verify_against(p, SF.SPEECH_LOCK)  # raises on any size / sha256 difference
        assert p.stat().st_size < 64 * 1024 * 1024


def test_headers_carry_the_real_architectures():
    paths = SF.ensure_speech_fixtures()
    tts, asr = paths["tts"], paths["asr"]
    assert model_check.gguf_metadata(tts["model"])["general.architecture"] == "qwen3tts"
    assert model_check.gguf_metadata(asr["model"])["general.architecture"] == "qwen3vl"
    assert model_check.projector_types(model_check.gguf_metadata(tts["mmproj"])) == {
        "audio": "qwen3tts_spkenc", "gen_audio": "qwen3tts_gen", "vision": None}
    assert model_check.projector_types(model_check.gguf_metadata(asr["mmproj"])) == {
        "audio": "qwen3a", "gen_audio": None, "vision": None}
    shapes = X.read_gguf_tensor_shapes(tts["model"])
    assert shapes["output.weight"][1] == SF.N_CODEC_VOCAB  # codec head, padded to the full vocab in-graph
    c2w = X.read_gguf_tensor_shapes(tts["mmproj"])
    assert sum(1 for n in c2w if n.startswith("a.gen.wav.tfm.blk.") and n.endswith("attn_q.weight")) == \
        SF.C2W_TFM_LAYERS
    assert c2w["a.gen.code.head.weight"][2] == SF.N_ACOUSTIC


@pytest.mark.parametrize("kind", ["tts", "asr"])
def test_loads_through_the_real_llama_and_mtmd_path(kind):
    paths = SF.ensure_speech_fixtures()[kind]
    rt.quiet_logs()
    X.quiet_mtmd_logs()
    model = rt.load_model(paths["model"], 0)
    try:
        mctx = X.init_mtmd(paths["mmproj"], model, n_threads=1, use_gpu=False, warmup=True)
        try:
            if kind == "tts":
                info = M.mtmd_gen_audio_get_info(mctx)
                assert info.type == M.MTMD_GEN_AUDIO_TYPE_QWEN3TTS
                assert info.sample_rate == 24000
                assert llama_cpp.llama_model_rope_type(model) == llama_cpp.LLAMA_ROPE_TYPE_IMROPE
            else:
                assert M.mtmd_support_audio(mctx)
                assert M.mtmd_get_audio_sample_rate(mctx) == 16000
                assert M.mtmd_decode_use_mrope(mctx)
        finally:
            M.mtmd_free(mctx)
    finally:
        llama_cpp.llama_model_free(model)


def test_real_model_lock_examples_are_well_formed_and_never_match(tmp_path):
    """The example locks' placeholders match no file: not an empty one (size 0 is the
    placeholder size, so only the sha256 can refuse it), not a fixture model."""
    fixture = SF.ensure_speech_fixtures()["tts"]["model"]
    for name in ("qwen3-tts-real.example.json", "qwen3-asr-real.example.json"):
        locks = load_lock(SF.DATASETS_DIR / "locks" / name)
        assert len(locks) == 2
        for file_name, lock in locks.items():
            assert len(lock.sha256) == 64
            empty = tmp_path / file_name
            empty.write_bytes(b"")
            with pytest.raises(LockError, match="sha256"):
                verify_file(empty, lock)
            with pytest.raises(LockError, match="size"):
                verify_file(fixture, lock)


def test_fixture_hooks_used_by_the_cli_and_the_agent():
    from cancelbench.datasets import fixtures as F

    assert SF.ensure_fixture("qwen3tts-fixture", "mmproj").name == SF.TTS_FIXTURE.mmproj_file
    assert SF.ensure_fixture("qwen3asr-fixture", "model").name == SF.ASR_FIXTURE.text_file
    assert F.ensure_fixture("qwen3asr-fixture", "mmproj").name == SF.ASR_FIXTURE.mmproj_file
    names = [p.name for p in F.generate_all(which="speech")]
    assert sorted(names) == sorted(load_lock(SF.SPEECH_LOCK))
    with pytest.raises(KeyError):
        SF.ensure_fixture("no-such-fixture")
