"""Field-scale fixtures: the published dimensions, the real code2wav strides, reproducible bytes.

Normal runs (seconds): the field recipes are written *shape-only* (header + sparse
zero data, no weight drawn) and read back with ``gguf.GGUFReader``; the real
strides (8, 5, 4, 3) + (2, 2) run through llama.cpp/mtmd on a tiny-channel
model. ``slow`` (~1.9 GB of files): the real field sets against their committed
locks, and one code2wav window of the field TTS pair.
"""

from __future__ import annotations

import ctypes

import gguf
import llama_cpp
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M

from cancelbench.datasets import field
from cancelbench.datasets.locks import load_lock, sha256_file
from cancelbench.datasets.tts_recipes import write_tts_fixture
from cancelbench.device_agents.engines import llama_runtime as rt
from cancelbench.device_agents.engines import mtmd_ext as X
from cancelbench.device_agents.engines.tts import TtsEngine

WINDOW = 72
SAMPLES_PER_FRAME = 1920  # 2 * 2 * 8 * 5 * 4 * 3: 24 kHz at 12.5 Hz


def _read(path):
    r = gguf.GGUFReader(path)
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}  # ggml ne order
    types = {t.name: t.tensor_type for t in r.tensors}
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    return shapes, types, kv


@pytest.fixture(scope="module")
def shape_only(tmp_path_factory):
    d = tmp_path_factory.mktemp("field-shapes")
    return {name: {role: _read(p) for role, p in field.write_set(name, d, data=False).items()}
            | {"_paths": field.write_set(name, d, data=False)} for name in field.FIELD_SETS}


def _n_blocks(shapes, prefix, suffix="attn_q.weight"):
    return sum(1 for n in shapes if n.startswith(prefix) and n.endswith(suffix))


def _check_qwen3_0_6b(shapes, types, kv, arch):
    """Qwen3-0.6B text stack: 28 layers, hidden 1024, 16 / 8 heads of 128, FFN 3072."""
    assert kv[f"{arch}.block_count"] == 28 and _n_blocks(shapes, "blk.") == 28
    assert kv[f"{arch}.embedding_length"] == 1024
    assert (kv[f"{arch}.attention.head_count"], kv[f"{arch}.attention.head_count_kv"]) == (16, 8)
    assert kv[f"{arch}.attention.key_length"] == 128
    assert shapes["blk.27.attn_q.weight"] == [1024, 16 * 128]
    assert shapes["blk.27.attn_k.weight"] == [1024, 8 * 128]
    assert shapes["blk.27.ffn_gate.weight"] == [1024, 3072]
    assert shapes["blk.27.ffn_down.weight"] == [3072, 1024]
    # quantized the way users run them: Q8_0 weights, F32 norms
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_q_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_field_tts_recipe_has_the_published_qwen3_tts_0_6b_dimensions(shape_only):
    s = shape_only[field.FIELD_TTS.name]
    _check_qwen3_0_6b(*s["model"], "qwen3tts")
    assert s["model"][2]["qwen3tts.rope.dimension_sections"] == [24, 20, 20, 0]
    assert s["model"][0]["output.weight"] == [1024, 3072]  # codec head
    shapes, types, kv = s["mmproj"]
    # code predictor: 5 layers, hidden 1024, 16 / 8 heads of 128, FFN 3072, 15 codebooks of 2048
    assert kv["clip.gen.audio.block_count"] == 5 and _n_blocks(shapes, "a.gen.code.blk.") == 5
    assert (kv["clip.gen.audio.attention.head_count"], kv["clip.gen.audio.attention.head_count_kv"]) == (16, 8)
    assert shapes["a.gen.code.blk.4.attn_q.weight"] == [1024, 2048]
    assert shapes["a.gen.code.blk.4.ffn_up.weight"] == [1024, 3072]
    assert shapes["a.gen.code.head.weight"] == [1024, 2048, 15]
    assert types["a.gen.code.blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.F32  # as the converter forces
    # code2wav: codebook_dim 512, latent 1024, decoder_dim 1536, transformer 512 x 8 layers, 16 heads of 64, FFN 1024
    assert shapes["a.gen.wav.quant.first.in_proj.weight"] == [512, 256]
    assert shapes["a.gen.wav.pre_conv.weight"] == [3, 512, 1024]
    assert shapes["a.gen.wav.tfm.in_proj.weight"] == [1024, 512]
    assert _n_blocks(shapes, "a.gen.wav.tfm.blk.") == 8
    assert shapes["a.gen.wav.tfm.blk.7.attn_q.weight"] == [512, 16 * 64]
    assert shapes["a.gen.wav.tfm.blk.7.ffn_gate.weight"] == [512, 1024]
    assert shapes["a.gen.wav.dac.entry.weight"] == [7, 1024, 1536]
    strides = [shapes[f"a.gen.wav.dac.blk.{i}.conv.weight"][0] // 2 for i in range(4)]
    assert strides == [8, 5, 4, 3]
    assert [shapes[f"a.gen.wav.dac.blk.{i}.conv.weight"][1] for i in range(4)] == [768, 384, 192, 96]
    assert [shapes[f"a.gen.wav.up.blk.{i}.conv.weight"][0] for i in range(2)] == [2, 2]
    assert TtsEngine._samples_per_frame(s["_paths"]["mmproj"]) == SAMPLES_PER_FRAME
    # speaker encoder: ECAPA channels 512, MFA 1536, enc_dim 1024
    assert shapes["a.conv1d.0.weight"] == [5, 128, 512]
    assert shapes["a.conv_out.weight"] == [1, 1536, 1536]
    assert shapes["mm.a.fc.weight"] == [1, 3072, 1024]


def test_field_asr_and_text_recipes_have_the_published_sizes(shape_only):
    s = shape_only[field.FIELD_ASR.name]
    _check_qwen3_0_6b(*s["model"], "qwen3vl")
    shapes, types, kv = s["mmproj"]
    # qwen3a encoder of Qwen3-ASR-0.6B: 18 layers, d_model 896, 14 heads, FFN 3584, conv 480, projector to 1024
    assert kv["clip.audio.block_count"] == 18 and _n_blocks(shapes, "a.blk.") == 18
    assert kv["clip.audio.embedding_length"] == 896 and kv["clip.audio.attention.head_count"] == 14
    assert shapes["a.blk.17.attn_q.weight"] == [896, 896]
    assert shapes["a.blk.17.ffn_up.weight"] == [896, 3584]
    assert shapes["a.conv2d.1.weight"] == [3, 3, 1, 480]
    assert shapes["a.conv_out.weight"] == [16 * 480, 896]
    assert shapes["mm.a.mlp.2.weight"] == [896, 1024]
    assert types["a.blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["a.position_embd.weight"] == gguf.GGMLQuantizationType.F32
    _check_qwen3_0_6b(*shape_only[field.FIELD_TEXT.name]["model"], "qwen3")


def test_shape_only_files_have_the_locked_sizes(shape_only):
    """Same header and layout as the real files: any drift of the recipe from the committed
    lock (a shape, a type, a key) changes the size before a single weight is drawn."""
    for name in field.FIELD_SETS:
        locks = load_lock(field.lock_path(name))
        paths = shape_only[name]["_paths"]
        assert sorted(locks) == sorted(p.name for p in paths.values())
        for p in paths.values():
            assert p.stat().st_size == locks[p.name].size, p.name


def _code2wav(mctx, n_frames: int) -> np.ndarray:
    inp = M.mtmd_gen_inp_default(mctx)
    inp.type = M.MTMD_GEN_PROCESS_TYPE_GEN_WAV
    inp.seed = 5
    n = n_frames * 16
    codes = (ctypes.c_int32 * n)(*[(7 * i) % 256 for i in range(n)])
    inp.codes = codes
    inp.n_codes = n
    out = M.mtmd_gen_out()
    assert M.mtmd_gen_audio_process(mctx, ctypes.byref(inp), ctypes.byref(out)) == 0
    return np.ctypeslib.as_array(out.audio, shape=(out.n_samples,)).copy()


def _one_window(paths) -> np.ndarray:
    rt.quiet_logs()
    X.quiet_mtmd_logs()
    model = rt.load_model(paths["model"], 0)
    try:
        mctx = X.init_mtmd(paths["mmproj"], model, n_threads=2, use_gpu=False, warmup=False)
        try:
            return _code2wav(mctx, WINDOW)
        finally:
            M.mtmd_free(mctx)
    finally:
        llama_cpp.llama_model_free(model)


def test_real_strides_run_one_code2wav_window_of_138240_samples(tmp_path):
    """The real DAC strides (8, 5, 4, 3) and upsampling (2, 2), tiny channels: llama.cpp/mtmd
    load the pair and one 72-frame window decodes to 72 x 1920 samples."""
    paths = write_tts_fixture(tmp_path / "a", field.REAL_STRIDES_SMALL)
    again = write_tts_fixture(tmp_path / "b", field.REAL_STRIDES_SMALL)
    assert [sha256_file(p) for p in paths.values()] == [sha256_file(p) for p in again.values()]
    assert TtsEngine._samples_per_frame(paths["mmproj"]) == SAMPLES_PER_FRAME
    pcm = _one_window(paths)
    assert pcm.shape == (WINDOW * SAMPLES_PER_FRAME,) == (138_240,)
    assert np.isfinite(pcm).all() and np.abs(pcm).max() > 0


def test_field_sets_match_their_locks_and_the_tts_pair_decodes_a_window(tmp_path):
    """~1.9 GB written: every field set, verified against the committed locks, then one
    code2wav window of the field TTS pair. 25 s on an idle 2-core machine, 2-3 min when
    it is shared; marked slow for the disk space and the load, not for correctness."""
    from cancelbench.cli import main

    assert main(["fixtures", "--scale", "field", "--out", str(tmp_path)]) == 0  # verifies against the locks
    pcm = _one_window(field.set_paths(field.FIELD_TTS.name, tmp_path))
    assert pcm.shape == (138_240,) and np.isfinite(pcm).all()


def test_a_cached_field_file_that_no_longer_matches_its_lock_is_one_line_exit_2(tmp_path, capsys):
    from cancelbench.cli import main

    stale = tmp_path / field.FIELD_TEXT.file_name
    stale.write_bytes(b"GGUF truncated")
    assert main(["fixtures", "--scale", "field", "--which", "text", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match lock" in err[0] and stale.name in err[0]
    assert stale.read_bytes() == b"GGUF truncated"  # nothing rewritten
