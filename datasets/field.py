"""Field-scale fixtures: random weights at the published Qwen3-TTS / Qwen3-ASR / Qwen3 sizes.

``cancelbench fixtures --scale field`` writes three model sets with the same
recipes as the small fixtures (:mod:`.tts_recipes`, :mod:`.asr_recipes`,
:mod:`.text_recipes`: the same keys and tensor names, which load in llama.cpp
and mtmd), only with the published dimensions, and Q8_0 weights where
llama.cpp's converter writes Q8_0 (:func:`.gguf_out.q8_eligible`; norms,
biases, conv kernels and position tables stay F32/F16). About 1.9 GB in all,
cached in the models directory (git-ignored, never committed), streamed one
tensor at a time, and verified against the committed ``locks/field_*.json``.
The text vocabulary stays small (it changes no compute that matters).

Sources of the dimensions (the models' config.json files on Hugging Face):

* Qwen3-TTS-12Hz-0.6B-Base ``config.json`` (talker_config, code_predictor_config,
  speaker_encoder_config; as mirrored at huggingface.co/simone00/it4 and
  /simone00/Qwen-TTS-Best-Model, whose code predictor is the same 1024 / 3072 /
  head_dim 128 network; the 0.6B talker sizes as tabulated in
  github.com/ivan-digital/qwen3-asr-swift docs/tts-model.md): talker 28 layers,
  hidden 1024, 16 heads / 8 KV heads, head_dim 128, FFN 3072, MRoPE sections
  24/20/20; code predictor 5 layers, hidden 1024, 16 / 8 heads, head_dim 128,
  FFN 3072, 15 acoustic codebooks of 2048; speaker encoder ECAPA-TDNN channels
  512 x 4 + 1536, attention 128, SE 128, enc_dim 1024.
* ``speech_tokenizer/config.json`` decoder_config (huggingface.co/simone00/
  italian_multi/blob/main/speech_tokenizer/config.json): codebook_dim 512
  (codebook entries 256, Mimi's split RVQ), latent_dim 1024, decoder_dim 1536,
  hidden_size 512, 8 layers, 16 heads, head_dim 64, intermediate 1024,
  sliding_window 72, upsample_rates (8, 5, 4, 3), upsampling_ratios (2, 2):
  2 * 2 * 8 * 5 * 4 * 3 = 1920 samples per 12.5 Hz frame at 24 kHz.
* Qwen3-ASR-0.6B ``config.json`` thinker_config.audio_config (as tabulated in
  github.com/ivan-digital/qwen3-asr-swift docs/asr-model.md; field names as in
  docs.rs/rlx-models qwen3_asr::AudioEncoderConfig): d_model 896, 18 layers,
  14 heads, encoder_ffn_dim 3584, output_dim 1024, downsample_hidden_size 480,
  128 mel bins; text model = Qwen3-0.6B (28 layers, 1024, 16 / 8 heads,
  head_dim 128, FFN 3072).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .asr_recipes import AsrFixtureSpec, write_asr_fixture
from .locks import LOCKS_DIR, verify_against
from .paths import MODELS_DIR
from .text_recipes import TextFixtureSpec, write_text_fixture
from .tts_recipes import TtsFixtureSpec, write_tts_fixture

FIELD_TTS = TtsFixtureSpec(
    name="qwen3tts-0.6b-field", seed=60601,
    n_embd=1024, n_layer=28, n_head=16, n_head_kv=8, head_dim=128, n_ff=3072, rope_sections=(24, 20, 20, 0),
    pred_embd=1024, pred_layers=5, pred_heads=16, pred_heads_kv=8, pred_head_dim=128, pred_ff=3072,
    acoustic_vocab=2048,
    cb_dim=256, quant_dim=512, latent=1024, tfm_hidden=512, tfm_head_dim=64, tfm_ff=1024, dac_dim=1536,
    dac_strides=(8, 5, 4, 3),
    spk_channels=512, spk_attn=128)
FIELD_ASR = AsrFixtureSpec(
    name="qwen3asr-0.6b-field", seed=60602,
    n_embd=1024, n_layer=28, n_head=16, n_head_kv=8, head_dim=128, n_ff=3072, rope_sections=(24, 20, 20, 0),
    n_mel=128, conv_channels=480, d_model=896, a_layers=18, a_heads=14, a_ff=3584)
FIELD_TEXT = TextFixtureSpec("text-qwen3-0.6b-field", "qwen3", n_embd=1024, n_layer=28, n_head=16, n_head_kv=8,
                             n_ff=3072, head_dim=128, seed=60603)

# The real code2wav DAC strides with a tiny channel count: the same graph and
# 1920 samples per frame in a file of a few MB (the acceptance test's model).
REAL_STRIDES_SMALL = TtsFixtureSpec(name="qwen3tts-realstrides-small", dac_strides=(8, 5, 4, 3), dac_dim=16)

FIELD_SETS: dict[str, str] = {FIELD_TTS.name: "tts", FIELD_ASR.name: "asr", FIELD_TEXT.name: "text"}
_WHICH = {"all": ("tts", "asr", "text"), "speech": ("tts", "asr"), "text": ("text",)}


def lock_path(name: str) -> Path:
    return LOCKS_DIR / f"field_{FIELD_SETS[name]}.json"


def set_paths(name: str, out_dir: Path | None = None) -> dict[str, Path]:
    d = Path(out_dir or MODELS_DIR)
    kind = FIELD_SETS[name]
    if kind == "tts":
        return {"model": d / FIELD_TTS.talker_file, "mmproj": d / FIELD_TTS.mmproj_file}
    if kind == "asr":
        return {"model": d / FIELD_ASR.text_file, "mmproj": d / FIELD_ASR.mmproj_file}
    return {"model": d / FIELD_TEXT.file_name}


def write_set(name: str, out_dir: Path | None = None, *, data: bool = True, progress: bool = False) -> dict[str, Path]:
    """Write one field set (Q8_0); ``data=False`` writes shapes only (sparse zeros, for dimension checks)."""
    opts = {"q8": True, "data": data, "progress": progress}
    kind = FIELD_SETS[name]
    if kind == "tts":
        return write_tts_fixture(out_dir, FIELD_TTS, **opts)
    if kind == "asr":
        return write_asr_fixture(out_dir, FIELD_ASR, **opts)
    return {"model": write_text_fixture(FIELD_TEXT, out_dir, **opts)}


def ensure_set(name: str, out_dir: Path | None = None, verify: bool = True, progress: bool = False) -> dict[str, Path]:
    """The set's paths, generated if any file is missing, verified against its committed lock."""
    paths = set_paths(name, out_dir)
    if not all(p.exists() for p in paths.values()):
        if progress:
            print(f"generating {name} (field scale, Q8_0) into {next(iter(paths.values())).parent}",
                  file=sys.stderr, flush=True)
        write_set(name, out_dir, progress=progress)
    if verify:
        for p in paths.values():
            verify_against(p, lock_path(name))
    return paths


def generate_all(out_dir: Path | None = None, which: str = "all") -> list[Path]:
    """``cancelbench fixtures --scale field``: every field set of ``which``, verified."""
    names = [n for n, kind in FIELD_SETS.items() if kind in _WHICH[which]]
    return [p for n in names for p in ensure_set(n, out_dir, verify=True, progress=True).values()]
