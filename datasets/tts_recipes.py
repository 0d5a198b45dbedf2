"""Qwen3-TTS-12Hz recipe: a ``qwen3tts`` talker + a ``clip`` mmproj (speaker encoder, code predictor, code2wav).

Every key, tensor name and tensor layout is taken from the llama.cpp vendored
in llama-cpp-python 0.3.36: a ``qwen3tts`` talker (``src/models/qwen3vl.cpp``:
``llama_model_qwen3tts`` reuses the qwen3vl graph, output head fixed at 3072
codec rows [TAG_LLAMA_N_VOCAB_OUT], IMROPE) plus a ``clip`` mmproj holding a
``qwen3tts_spkenc`` audio encoder (ECAPA-TDNN, needed because mtmd refuses an
mmproj without vision or audio input) and a ``qwen3tts_gen`` gen-audio encoder
(code predictor + code2wav, ``tools/mtmd/models/qwen3tts-gen.cpp``; code2wav's
layer/block counts are hard-coded in ``clip.cpp``: 8 transformer layers with
16 heads, 2 upsample blocks, 4 DAC blocks of 3 residual units, a 72-frame
window). Vocab layout as ``conversion/qwen3tts.py`` writes it: ``[text vocab |
3072 codec tokens]`` with ``<|codec_N|>`` names, the named codec ids from
``talker_config`` and ``tokenizer.ggml.suppress_tokens``.

Sizes are free where llama.cpp reads them from tensor shapes. The default spec
(``qwen3tts-fixture``) is chosen so every phase takes measurable time on 2
cores while each file loads in well under a second, with one deliberate
difference: the DAC upsample strides are read from the ConvTranspose kernels
(stride = kernel / 2), and the fixture uses (2, 2, 2, 2) instead of the real
(8, 5, 4, 3), i.e. 64 instead of 1920 samples per 12.5 Hz frame, so a code2wav
window takes ~60-150 ms here instead of seconds. The engine reads
samples-per-frame from the mmproj, so a real model (and the field-scale recipe
in :mod:`.field`) gets 1920.

Samples per frame = 2 ** C2W_UPSAMPLE_BLOCKS (each upsample block doubles the
frame rate; clip.cpp hard-codes the ratio 2) x the product of the DAC strides
(:func:`.qwen_common.samples_per_frame`): 4 x 16 = 64 for ``qwen3tts-fixture``
(2.67 ms of 24 kHz audio per frame, so its codec hands over audio slower than
real time and a barge-in's playback buffer never fills), 4 x 480 = 1920 for the
real codec (80 ms per frame).

``qwen3tts-bargein`` (:data:`TTS_BARGEIN_FIXTURE`) is the fixture with the
real codec's rate: the same seed, so the same talker, code predictor, RVQ,
code2wav transformer and upsample weights (the same tensor bytes; the DAC's
are drawn after them), and the real DAC strides (8, 5, 4, 3) on a narrow DAC
(``dac_dim`` 16: channels 16 -> 8 -> 4 -> 2 -> 1 over the four blocks, the
real one 1536 -> 96; the spec of :data:`.field.REAL_STRIDES_SMALL` under its
own name), so one 72-frame window decodes to 72 x 1920 = 138,240 samples
(5.76 s of audio) in about 0.10-0.13 s on one CPU thread of a 2-core VM
(``dac_dim`` 32: 0.25-0.37 s): the engine is faster than real time and a
playback buffer fills, as with a real model on a fast device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf_out import FixtureWriter, Rng, ones
from .qwen_common import (C2W_DAC_RES, C2W_TFM_HEADS, C2W_TFM_LAYERS, C2W_UPSAMPLE_BLOCKS, DAC_STRIDES_REAL,
                          N_ACOUSTIC, N_CODEC_VOCAB, N_SEMANTIC_CODES, TTS_CODEC_IDS, TTS_SAMPLE_RATE,
                          TTS_TEXT_SPECIALS, bpe_vocab, QwenSpec, samples_per_frame, tts_codec_token_names,
                          write_pair, write_qwen_text_block, write_qwen_text_hparams)

@dataclass(frozen=True)
class TtsFixtureSpec(QwenSpec):
    name: str = "qwen3tts-fixture"
    seed: int = 31337
    # talker (qwen3tts = qwen3vl graph): the QwenSpec fields
    # code predictor (a.gen.code.*)
    pred_embd: int = 128
    pred_layers: int = 5
    pred_heads: int = 4
    pred_heads_kv: int = 2
    pred_head_dim: int = 32
    pred_ff: int = 256
    acoustic_vocab: int = 256   # real: 2048; the code graph reads it from a.gen.code.head
    # code2wav (a.gen.wav.*)
    cb_dim: int = 16
    quant_dim: int = 64
    latent: int = 64
    tfm_hidden: int = 64
    tfm_head_dim: int = 4
    tfm_ff: int = 128
    dac_dim: int = 128
    dac_strides: tuple[int, int, int, int] = (2, 2, 2, 2)  # real: (8, 5, 4, 3); see module doc
    # speaker encoder (a.*, qwen3tts_spkenc)
    spk_channels: int = 32
    spk_attn: int = 16

    @property
    def talker_file(self) -> str:
        return f"{self.name}-talker.gguf"

    @property
    def samples_per_frame(self) -> int:
        """PCM samples per codec frame (module doc): 64 for the default spec, 1920 at the real strides."""
        return samples_per_frame(self.dac_strides)

    @property
    def frame_audio_ms(self) -> float:
        """Audio one codec frame hands over, ms at 24 kHz (2.67 for the default spec, 80 at the real rate)."""
        return 1000.0 * self.samples_per_frame / TTS_SAMPLE_RATE


TTS_FIXTURE = TtsFixtureSpec()
# The barge-in fixture (module doc): the real codec rate, 1920 samples per frame.
TTS_BARGEIN_FIXTURE = TtsFixtureSpec(name="qwen3tts-bargein", dac_strides=DAC_STRIDES_REAL, dac_dim=16)


def write_tts_fixture(out_dir: Path | None = None, spec: TtsFixtureSpec = TTS_FIXTURE,
                      **opts) -> dict[str, Path]:
    """Write the talker + mmproj pair; returns {"model": path, "mmproj": path}.

    ``opts`` go to :class:`FixtureWriter` (``q8``, ``data``, ``progress``).
    """
    return write_pair(out_dir, spec, (spec.talker_file, "qwen3tts", _write_tts_talker), _write_tts_mmproj, opts)


def _write_tts_talker(w: FixtureWriter, s: TtsFixtureSpec) -> Path:
    rng = Rng(s.seed)
    text_tokens, text_types, merges = bpe_vocab(TTS_TEXT_SPECIALS)
    n_text = len(text_tokens)
    tokens = text_tokens + tts_codec_token_names()
    types = text_types + [3] * N_CODEC_VOCAB
    n_vocab = len(tokens)
    codec_eos = n_text + TTS_CODEC_IDS["codec_eos_token"]

    write_qwen_text_hparams(w, "qwen3tts", s.name + "-talker", s, n_vocab, (tokens, types, merges))
    w.add_bos_token_id(text_tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    # conversion/qwen3tts.py set_gguf_parameters: suppress the last 1024 codec rows except eos
    w.add_array("tokenizer.ggml.suppress_tokens",
                [i for i in range(n_vocab - 1024, n_vocab) if i != codec_eos])
    w.add_eos_token_id(codec_eos)
    w.add_add_eos_token(False)

    # [text_vocab | codec_vocab] embedding table (text MLP folded in at conversion time)
    w.add_tensor("token_embd.weight", rng.uniform((n_vocab, s.n_embd), 0.5))
    w.add_tensor("output_norm.weight", ones(s.n_embd))
    w.add_tensor("output.weight", rng.linear(N_CODEC_VOCAB, s.n_embd, 2.0))  # codec_head
    write_qwen_text_block(w, rng, s)
    return w.finish()



def _write_tts_mmproj(w: FixtureWriter, s: TtsFixtureSpec) -> Path:
    import gguf

    rng = Rng(s.seed + 1)
    w.add_name(s.name + "-mmproj")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _speaker_encoder(w, rng, s)
    _code_predictor(w, rng, s)
    _code2wav(w, rng, s)
    return w.finish()


def _speaker_encoder(w: FixtureWriter, rng: Rng, s: TtsFixtureSpec) -> None:
    """Audio modality, qwen3tts_spkenc (ECAPA-TDNN)."""
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.audio.projector_type", "qwen3tts_spkenc")
    w.add_uint32("clip.audio.projection_dim", s.n_embd)
    w.add_uint32("clip.audio.num_mel_bins", 128)
    w.add_uint32("clip.audio.block_count", 3)
    w.add_uint32("clip.audio.embedding_length", 1536)   # dummy, as the conversion writes it
    w.add_uint32("clip.audio.attention.head_count", 1)
    w.add_uint32("clip.audio.feed_forward_length", 1536)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)

    C, mfa = s.spk_channels, 3 * s.spk_channels
    cs = C // 8  # SPK_RES2NET_SCALE = 8
    w.add_tensor("a.conv1d.0.weight", rng.conv(C, 128, 5))
    w.add_tensor("a.conv1d.0.bias", rng.bias(C))
    for bid in range(1, 4):
        w.add_tensor(f"a.blk.{bid}.conv_pw1.weight", rng.conv(C, C, 1))
        w.add_tensor(f"a.blk.{bid}.conv_pw1.bias", rng.bias(C))
        w.add_tensor(f"a.blk.{bid}.conv_pw2.weight", rng.conv(C, C, 1))
        w.add_tensor(f"a.blk.{bid}.conv_pw2.bias", rng.bias(C))
        w.add_tensor(f"a.blk.{bid}.se_conv1.weight", rng.conv(C // 4, C, 1))
        w.add_tensor(f"a.blk.{bid}.se_conv1.bias", rng.bias(C // 4))
        w.add_tensor(f"a.blk.{bid}.se_conv2.weight", rng.conv(C, C // 4, 1))
        w.add_tensor(f"a.blk.{bid}.se_conv2.bias", rng.bias(C))
        for xid in range(7):
            w.add_tensor(f"a.blk.{bid}.res2.{xid}.weight", rng.conv(cs, cs, 3))
            w.add_tensor(f"a.blk.{bid}.res2.{xid}.bias", rng.bias(cs))
    w.add_tensor("a.conv_out.weight", rng.conv(mfa, 3 * C, 1))
    w.add_tensor("a.conv_out.bias", rng.bias(mfa))
    w.add_tensor("a.asp_tdnn.weight", rng.conv(s.spk_attn, 3 * mfa, 1))
    w.add_tensor("a.asp_tdnn.bias", rng.bias(s.spk_attn))
    w.add_tensor("a.asp_attn.weight", rng.conv(mfa, s.spk_attn, 1))
    w.add_tensor("a.asp_attn.bias", rng.bias(mfa))
    w.add_tensor("mm.a.fc.weight", rng.conv(s.n_embd, 2 * mfa, 1))  # ne [1, 2*mfa, n_embd]: n_mmproj_embd = ne[2]
    w.add_tensor("mm.a.fc.bias", rng.bias(s.n_embd))


def _code_predictor(w: FixtureWriter, rng: Rng, s: TtsFixtureSpec) -> None:
    """Gen-audio modality, qwen3tts_gen: the code predictor (a.gen.code.*)."""
    w.add_bool("clip.has_gen_audio_encoder", True)
    w.add_string("clip.gen.audio.projector_type", "qwen3tts_gen")
    w.add_uint32("clip.gen.audio.projection_dim", s.n_embd)
    w.add_uint32("clip.gen.audio.embedding_length", s.pred_embd)
    w.add_uint32("clip.gen.audio.feed_forward_length", s.pred_ff)
    w.add_uint32("clip.gen.audio.block_count", s.pred_layers)
    w.add_uint32("clip.gen.audio.attention.head_count", s.pred_heads)
    w.add_uint32("clip.gen.audio.attention.head_count_kv", s.pred_heads_kv)
    w.add_float32("clip.gen.audio.attention.layer_norm_epsilon", 1e-6)

    P, hd = s.pred_embd, s.pred_head_dim
    w.add_tensor("a.gen.code.proj_in.weight", rng.linear(P, s.n_embd))
    w.add_tensor("a.gen.code.proj_in.bias", rng.bias(P))
    # [n_acoustic, vocab, n_embd_talker] -> ne [n_embd_talker, vocab, 15]
    w.add_tensor("a.gen.code.embd.weight", rng.uniform((N_ACOUSTIC, s.acoustic_vocab, s.n_embd), 0.1))
    w.add_tensor("a.gen.code.head.weight", rng.uniform((N_ACOUSTIC, s.acoustic_vocab, P), 2.0 * np.sqrt(3.0 / P)))
    w.add_tensor("a.gen.code.out_embd.weight", rng.uniform((N_CODEC_VOCAB, s.n_embd), 0.1))  # talker codec_embedding
    w.add_tensor("a.gen.code.output_norm.weight", ones(P))
    for i in range(s.pred_layers):
        p = f"a.gen.code.blk.{i}"
        w.add_tensor(f"{p}.ln1.weight", ones(P))
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(s.pred_heads * hd, P))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(s.pred_heads_kv * hd, P))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(s.pred_heads_kv * hd, P))
        w.add_tensor(f"{p}.attn_out.weight", rng.linear(P, s.pred_heads * hd, 0.5))
        w.add_tensor(f"{p}.attn_q_norm.weight", ones(hd))
        w.add_tensor(f"{p}.attn_k_norm.weight", ones(hd))
        w.add_tensor(f"{p}.ln2.weight", ones(P))
        w.add_tensor(f"{p}.ffn_gate.weight", rng.linear(s.pred_ff, P))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(s.pred_ff, P))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(P, s.pred_ff, 0.5))


def _code2wav(w: FixtureWriter, rng: Rng, s: TtsFixtureSpec) -> None:
    """The speech tokenizer's decoder (a.gen.wav.*): RVQ, pre-conv, transformer; then :func:`_upsample_dac`."""
    Q, L, H = s.quant_dim, s.latent, s.tfm_hidden
    w.add_tensor("a.gen.wav.quant.first.in_proj.weight", rng.linear(s.cb_dim, Q))
    w.add_tensor("a.gen.wav.quant.first.out_proj.weight", rng.linear(Q, s.cb_dim))
    w.add_tensor("a.gen.wav.quant.first.codebook.weight", rng.uniform((N_SEMANTIC_CODES, s.cb_dim), 1.0))
    w.add_tensor("a.gen.wav.quant.rest.in_proj.weight", rng.linear(s.cb_dim, Q))
    w.add_tensor("a.gen.wav.quant.rest.out_proj.weight", rng.linear(Q, s.cb_dim, 0.3))
    w.add_tensor("a.gen.wav.quant.rest.codebook.weight", rng.uniform((N_ACOUSTIC, s.acoustic_vocab, s.cb_dim), 1.0))
    w.add_tensor("a.gen.wav.pre_conv.weight", rng.conv(L, Q, 3, f16=True))
    w.add_tensor("a.gen.wav.pre_conv.bias", rng.bias(L))
    w.add_tensor("a.gen.wav.tfm.in_proj.weight", rng.linear(H, L))
    w.add_tensor("a.gen.wav.tfm.in_proj.bias", rng.bias(H))
    w.add_tensor("a.gen.wav.tfm.out_proj.weight", rng.linear(L, H))
    w.add_tensor("a.gen.wav.tfm.out_proj.bias", rng.bias(L))
    w.add_tensor("a.gen.wav.tfm.output_norm.weight", ones(H))
    qd = C2W_TFM_HEADS * s.tfm_head_dim
    for i in range(C2W_TFM_LAYERS):
        p = f"a.gen.wav.tfm.blk.{i}"
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(qd, H))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(qd, H))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(qd, H))
        w.add_tensor(f"{p}.attn_out.weight", rng.linear(H, qd, 0.5))
        w.add_tensor(f"{p}.ln1.weight", ones(H))
        w.add_tensor(f"{p}.ln2.weight", ones(H))
        w.add_tensor(f"{p}.ls1.weight", np.full(H, 0.1, dtype=np.float32))
        w.add_tensor(f"{p}.ls2.weight", np.full(H, 0.1, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", rng.linear(s.tfm_ff, H))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(s.tfm_ff, H))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(H, s.tfm_ff, 0.5))
    _upsample_dac(w, rng, s)


def _upsample_dac(w: FixtureWriter, rng: Rng, s: TtsFixtureSpec) -> None:
    """ConvNeXt upsample blocks (ratios 2, 2) and the DAC decoder (strides ``s.dac_strides``)."""
    L = s.latent
    for i in range(C2W_UPSAMPLE_BLOCKS):
        p = f"a.gen.wav.up.blk.{i}"
        # ConvTranspose1d weight (IC, OC, K=2) -> ne [K, OC, IC], kernel == stride: no overlap tail
        w.add_tensor(f"{p}.conv.weight", rng.uniform((L, L, 2), np.sqrt(3.0 / L)))
        w.add_tensor(f"{p}.conv.bias", rng.bias(L))
        w.add_tensor(f"{p}.dwconv.weight", rng.conv(L, 1, 7, f16=True))
        w.add_tensor(f"{p}.dwconv.bias", rng.bias(L))
        w.add_tensor(f"{p}.norm.weight", ones(L))
        w.add_tensor(f"{p}.norm.bias", np.zeros(L, dtype=np.float32))
        w.add_tensor(f"{p}.pw1.weight", rng.linear(4 * L, L))
        w.add_tensor(f"{p}.pw1.bias", rng.bias(4 * L))
        w.add_tensor(f"{p}.pw2.weight", rng.linear(L, 4 * L))
        w.add_tensor(f"{p}.pw2.bias", rng.bias(L))
        w.add_tensor(f"{p}.gamma", np.full(L, 0.1, dtype=np.float32))
    w.add_tensor("a.gen.wav.dac.entry.weight", rng.conv(s.dac_dim, L, 7, f16=True))
    w.add_tensor("a.gen.wav.dac.entry.bias", rng.bias(s.dac_dim))
    ch = s.dac_dim
    for i, stride in enumerate(s.dac_strides):
        p = f"a.gen.wav.dac.blk.{i}"
        out = ch // 2
        w.add_tensor(f"{p}.snake.alpha", rng.uniform((ch,), 1.5, lo=0.5))
        w.add_tensor(f"{p}.snake.beta", rng.uniform((ch,), 1.5, lo=0.5))
        # ConvTranspose1d (IC, OC, 2*stride) -> ne [2*stride, OC, IC], F32 as the conversion forces
        w.add_tensor(f"{p}.conv.weight", rng.uniform((ch, out, 2 * stride), np.sqrt(3.0 / (ch * 2))))
        w.add_tensor(f"{p}.conv.bias", rng.bias(out))
        for r in range(C2W_DAC_RES):
            q = f"{p}.res.{r}"
            w.add_tensor(f"{q}.act1.alpha", rng.uniform((out,), 1.5, lo=0.5))
            w.add_tensor(f"{q}.act1.beta", rng.uniform((out,), 1.5, lo=0.5))
            w.add_tensor(f"{q}.conv1.weight", rng.conv(out, out, 7, 0.5, f16=True))
            w.add_tensor(f"{q}.conv1.bias", rng.bias(out))
            w.add_tensor(f"{q}.act2.alpha", rng.uniform((out,), 1.5, lo=0.5))
            w.add_tensor(f"{q}.act2.beta", rng.uniform((out,), 1.5, lo=0.5))
            w.add_tensor(f"{q}.conv2.weight", rng.conv(out, out, 1, 0.5, f16=True))
            w.add_tensor(f"{q}.conv2.bias", rng.bias(out))
        ch = out
    w.add_tensor("a.gen.wav.dac.post_snake.alpha", rng.uniform((ch,), 1.5, lo=0.5))
    w.add_tensor("a.gen.wav.dac.post_snake.beta", rng.uniform((ch,), 1.5, lo=0.5))
    w.add_tensor("a.gen.wav.dac.post_conv.weight", rng.conv(1, ch, 7, f16=True))
    w.add_tensor("a.gen.wav.dac.post_conv.bias", np.zeros(1, dtype=np.float32))
