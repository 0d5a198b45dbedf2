"""model_check: a GGUF's architecture and role against the engine that will load it (real fixture files)."""

import pytest

from cancelbench.device_agents.model_check import ModelMismatchError, check_model


@pytest.fixture(scope="module")
def fixture_files():
    from cancelbench.datasets.fixtures import ensure_fixture

    return {"llama": ensure_fixture("text-llama-57m"),
            "talker": ensure_fixture("qwen3tts-fixture", "model"),
            "tts_mmproj": ensure_fixture("qwen3tts-fixture", "mmproj"),
            "asr_text": ensure_fixture("qwen3asr-fixture", "model"),
            "asr_mmproj": ensure_fixture("qwen3asr-fixture", "mmproj")}


FITS = [("llama", "text", "model"), ("asr_text", "text", "model"), ("talker", "tts", "model"),
        ("tts_mmproj", "tts", "mmproj"), ("asr_text", "stt", "model"), ("asr_mmproj", "stt", "mmproj")]
MISFITS = [("talker", "text", "model", "TTS talker"), ("tts_mmproj", "text", "model", "an mmproj"),
           ("llama", "tts", "model", "needs a TTS talker"), ("asr_text", "tts", "model", "needs a TTS talker"),
           ("asr_mmproj", "tts", "mmproj", "no 'qwen3tts_gen' projector"),
           ("llama", "tts", "mmproj", "not an mmproj"), ("talker", "stt", "model", "TTS talker"),
           ("tts_mmproj", "stt", "mmproj", "no 'qwen3a' projector")]


@pytest.mark.parametrize("name,engine,role", FITS)
def test_model_check_accepts_the_right_files(fixture_files, name, engine, role):
    check_model(fixture_files[name], engine, role)


@pytest.mark.parametrize("name,engine,role,message", MISFITS)
def test_model_check_refuses_the_wrong_files(fixture_files, name, engine, role, message):
    with pytest.raises(ModelMismatchError, match=message):
        check_model(fixture_files[name], engine, role)


def test_model_check_on_a_directory_and_a_non_gguf(tmp_path):
    with pytest.raises(ModelMismatchError, match="is a directory"):
        check_model(tmp_path, "text")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelMismatchError, match="not a readable GGUF"):
        check_model(tmp_path / "x.gguf", "text")
