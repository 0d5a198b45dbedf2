"""Speech fixture models: tiny random-weight GGUFs of the real speech architectures.

No model can be downloaded, so ``cancelbench fixtures`` writes these with the
``gguf`` package. Every key, tensor name and tensor layout is taken from the
llama.cpp vendored in llama-cpp-python 0.3.36:

* TTS (Qwen3-TTS-12Hz): a ``qwen3tts`` talker (``src/models/qwen3vl.cpp``:
  ``llama_model_qwen3tts`` reuses the qwen3vl graph, output head fixed at 3072
  codec rows [TAG_LLAMA_N_VOCAB_OUT], IMROPE) plus a ``clip`` mmproj holding a
  ``qwen3tts_spkenc`` audio encoder (ECAPA-TDNN, needed because mtmd refuses an
  mmproj without vision or audio input) and a ``qwen3tts_gen`` gen-audio
  encoder (code predictor + code2wav, ``tools/mtmd/models/qwen3tts-gen.cpp``;
  code2wav's layer/block counts are hard-coded in ``clip.cpp``: 8 transformer
  layers with 16 heads, 2 upsample blocks, 4 DAC blocks of 3 residual units,
  a 72-frame window). Vocab layout as ``conversion/qwen3tts.py`` writes it:
  ``[text vocab | 3072 codec tokens]`` with ``<|codec_N|>`` names, the named
  codec ids from ``talker_config`` and ``tokenizer.ggml.suppress_tokens``.
* ASR (Qwen3-ASR): a ``qwen3vl`` text model (``conversion/qwen3vl.py``
  ``Qwen3ASRTextModel``: 0 deepstack layers, chatml template, eos = <|im_end|>)
  plus a ``clip`` mmproj with a ``qwen3a`` audio encoder
  (``tools/mtmd/models/qwen3a.cpp``: 3 stride-2 conv2d, conv_out, per-chunk
  sinusoid positions, a whisper-style ViT, 2-layer GELU projector).

Sizes are free where llama.cpp reads them from tensor shapes and are chosen so
every phase takes measurable time on 2 cores while each file loads in well
under a second. One deliberate difference: the DAC upsample strides are read
from the ConvTranspose kernels (stride = kernel / 2), and the fixture uses
(2, 2, 2, 2) instead of the real (8, 5, 4, 3), i.e. 64 instead of 1920 samples
per 12.5 Hz frame. With the real strides a 72-frame code2wav window of even a
tiny-channel decoder took 1-8 s here (138,240 samples through the DAC); with
(2, 2, 2, 2) it takes ~60-150 ms, the same graph, layer counts and window.
The engine reads samples-per-frame from the mmproj, so a real model gets 1920. Weights come from raw PCG64 bits (``random_raw``), so the bytes
do not depend on numpy's distribution code and the committed lock
``locks/speech_fixtures.json`` stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .fixtures import DATASETS_DIR, MODELS_DIR, close_gguf

SPEECH_LOCK = DATASETS_DIR / "locks" / "speech_fixtures.json"

# Named codec ids of talker_config (the conversion names row i of the codec
# vocab "<|prefix|>" for every "<prefix>_id" key). codec_bos (2149), codec_eos
# (2150) and the chinese language id (2055) are the ids quoted in
# conversion/qwen3tts.py; the others are fixture choices in the same range.
TTS_CODEC_IDS: dict[str, int] = {
    "codec_pad": 2148,
    "codec_bos": 2149,
    "codec_eos_token": 2150,
    "codec_think": 2154,
    "codec_nothink": 2155,
    "codec_think_bos": 2156,
    "codec_think_eos": 2157,
}
TTS_LANGUAGE_IDS: dict[str, int] = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
    "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069,
}
N_CODEC_VOCAB = 3072       # llama_model_qwen3vl::load_arch_tensors: n_vocab_out = 3072 for QWEN3TTS
N_SEMANTIC_CODES = 2048    # codec rows the talker may sample (others suppressed, except eos)
N_ACOUSTIC = 15            # code predictor codebooks 1..15 (code0 comes from the talker)
C2W_TFM_LAYERS = 8         # clip.cpp QWEN3TTS_GEN: wav_tfm_n_layer
C2W_TFM_HEADS = 16         # wav_tfm_n_head == wav_tfm_n_head_kv
C2W_UPSAMPLE_BLOCKS = 2    # wav_upsample_n_block
C2W_DAC_BLOCKS = 4         # wav_dac_n_block
C2W_DAC_RES = 3            # wav_dac_n_res
C2W_WINDOW_FRAMES = 72     # wav_tfm_swa, frames per code2wav call
TTS_SAMPLE_RATE = 24000    # mtmd_gen_audio_get_info for QWEN3TTS
SAMPLES_PER_FRAME_REAL = 1920  # real Qwen3-TTS: 2 * 2 * 8*5*4*3 = 24000 / 12.5 Hz


@dataclass(frozen=True)
class TtsFixtureSpec:
    name: str = "qwen3tts-fixture"
    seed: int = 31337
    # talker (qwen3tts = qwen3vl graph)
    n_embd: int = 384
    n_layer: int = 4
    n_head: int = 6
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 1024
    rope_sections: tuple[int, int, int, int] = (12, 10, 10, 0)  # sum = head_dim / 2, as 24/20/20 for 128
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
    def mmproj_file(self) -> str:
        return f"{self.name}-mmproj.gguf"


@dataclass(frozen=True)
class AsrFixtureSpec:
    name: str = "qwen3asr-fixture"
    seed: int = 27182
    n_embd: int = 384
    n_layer: int = 6
    n_head: int = 6
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 1024
    rope_sections: tuple[int, int, int, int] = (12, 10, 10, 0)
    # qwen3a encoder
    n_mel: int = 128
    conv_channels: int = 64
    d_model: int = 256
    a_layers: int = 6
    a_heads: int = 4
    a_ff: int = 1024

    @property
    def text_file(self) -> str:
        return f"{self.name}-text.gguf"

    @property
    def mmproj_file(self) -> str:
        return f"{self.name}-mmproj.gguf"


TTS_FIXTURE = TtsFixtureSpec()
ASR_FIXTURE = AsrFixtureSpec()


# --------------------------------------------------------------------------- weights

class _Rng:
    """Uniform weights from raw PCG64 output (stable across numpy versions)."""

    def __init__(self, seed: int) -> None:
        self.bg = np.random.PCG64(seed)

    def uniform(self, shape: tuple[int, ...], scale: float, lo: float | None = None) -> np.ndarray:
        n = int(np.prod(shape))
        raw = self.bg.random_raw(n) >> np.uint64(40)  # 24 random bits
        u = raw.astype(np.float64) / float(1 << 24)
        if lo is None:
            out = (u * 2.0 - 1.0) * scale
        else:
            out = lo + u * (scale - lo)
        return out.astype(np.float32).reshape(shape)

    def linear(self, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        """A torch-layout Linear weight (out, in) -> ggml ne [in, out]."""
        return self.uniform((n_out, n_in), gain * np.sqrt(3.0 / n_in))

    def conv(self, n_out: int, n_in: int, k: int, gain: float = 1.0, f16: bool = False) -> np.ndarray:
        """A torch Conv1d weight (OC, IC, K) -> ggml ne [K, IC, OC]."""
        w = self.uniform((n_out, n_in, k), gain * np.sqrt(3.0 / (n_in * k)))
        return w.astype(np.float16) if f16 else w

    def bias(self, n: int, scale: float = 0.02) -> np.ndarray:
        return self.uniform((n,), scale)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


# --------------------------------------------------------------------------- vocab

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode map (what byte-level BPE vocabs store)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_MERGES = ["Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "Ġ s", "r e", "a n"]


def _bpe_vocab(specials: list[str]) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocab (tokenizer.ggml.model = gpt2, pre = qwen2): 256 byte
    tokens, the merge results, then the special tokens (CONTROL)."""
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [1] * 256
    for m in _MERGES:
        merged = m.replace(" ", "")
        if merged not in tokens:
            tokens.append(merged)
            types.append(1)
    for s in specials:
        tokens.append(s)
        types.append(3)  # CONTROL
    return tokens, types, list(_MERGES)


def tts_codec_token_names() -> list[str]:
    """conversion/qwen3tts.py _codec_token_names() for the fixture's talker_config."""
    names = [f"<|codec_{i}|>" for i in range(N_CODEC_VOCAB)]
    for prefix, idx in TTS_CODEC_IDS.items():
        names[idx] = f"<|{prefix}|>"
    for lang, idx in TTS_LANGUAGE_IDS.items():
        names[idx] = f"<|codec_language_{lang}|>"
    return names


TTS_TEXT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
ASR_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                   "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# --------------------------------------------------------------------------- writers

def _open(path: Path, arch: str):
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    return gguf.GGUFWriter(str(tmp), arch), tmp


_close = close_gguf


def _write_qwen_text_block(w, rng: _Rng, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                           head_dim: int, n_ff: int) -> None:
    """blk.* of the qwen3vl graph (llama_model_qwen3vl::load_arch_tensors)."""
    for i in range(n_layer):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", _ones(n_embd))
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(n_head * head_dim, n_embd))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"{p}.attn_output.weight", rng.linear(n_embd, n_head * head_dim, 0.5))
        w.add_tensor(f"{p}.attn_q_norm.weight", _ones(head_dim))
        w.add_tensor(f"{p}.attn_k_norm.weight", _ones(head_dim))
        w.add_tensor(f"{p}.ffn_norm.weight", _ones(n_embd))
        w.add_tensor(f"{p}.ffn_gate.weight", rng.linear(n_ff, n_embd))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(n_ff, n_embd))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(n_embd, n_ff, 0.5))


def _write_qwen_text_hparams(w, arch: str, name: str, n_embd: int, n_layer: int, n_head: int, n_head_kv: int,
                             head_dim: int, n_ff: int, sections: tuple[int, ...], rope_base: float) -> None:
    import gguf

    w.add_name(name)
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_array(f"{arch}.rope.dimension_sections", list(sections))
    w.add_uint32(f"{arch}.n_deepstack_layers", 0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def write_tts_fixture(out_dir: Path | None = None, spec: TtsFixtureSpec = TTS_FIXTURE) -> dict[str, Path]:
    """Write the talker + mmproj pair; returns {"model": path, "mmproj": path}."""
    out_dir = Path(out_dir or MODELS_DIR)
    return {"model": _write_tts_talker(out_dir / spec.talker_file, spec),
            "mmproj": _write_tts_mmproj(out_dir / spec.mmproj_file, spec)}


def _write_tts_talker(path: Path, s: TtsFixtureSpec) -> Path:
    rng = _Rng(s.seed)
    text_tokens, text_types, merges = _bpe_vocab(TTS_TEXT_SPECIALS)
    n_text = len(text_tokens)
    tokens = text_tokens + tts_codec_token_names()
    types = text_types + [3] * N_CODEC_VOCAB
    n_vocab = len(tokens)
    codec_eos = n_text + TTS_CODEC_IDS["codec_eos_token"]

    w, tmp = _open(path, "qwen3tts")
    _write_qwen_text_hparams(w, "qwen3tts", s.name + "-talker", s.n_embd, s.n_layer, s.n_head, s.n_head_kv,
                             s.head_dim, s.n_ff, s.rope_sections, 1000000.0)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(text_tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    # conversion/qwen3tts.py set_gguf_parameters: suppress the last 1024 codec rows except eos
    w.add_array("tokenizer.ggml.suppress_tokens",
                [i for i in range(n_vocab - 1024, n_vocab) if i != codec_eos])
    w.add_eos_token_id(codec_eos)
    w.add_add_eos_token(False)

    # [text_vocab | codec_vocab] embedding table (text MLP folded in at conversion time)
    w.add_tensor("token_embd.weight", rng.uniform((n_vocab, s.n_embd), 0.5))
    w.add_tensor("output_norm.weight", _ones(s.n_embd))
    w.add_tensor("output.weight", rng.linear(N_CODEC_VOCAB, s.n_embd, 2.0))  # codec_head
    _write_qwen_text_block(w, rng, s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_ff)
    return _close(w, tmp, path)


def _write_tts_mmproj(path: Path, s: TtsFixtureSpec) -> Path:
    import gguf

    rng = _Rng(s.seed + 1)
    w, tmp = _open(path, "clip")
    w.add_name(s.name + "-mmproj")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    # --- speaker encoder (audio modality, qwen3tts_spkenc) ---
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

    # --- code predictor (gen.audio modality, qwen3tts_gen) ---
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
    w.add_tensor("a.gen.code.output_norm.weight", _ones(P))
    for i in range(s.pred_layers):
        p = f"a.gen.code.blk.{i}"
        w.add_tensor(f"{p}.ln1.weight", _ones(P))
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(s.pred_heads * hd, P))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(s.pred_heads_kv * hd, P))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(s.pred_heads_kv * hd, P))
        w.add_tensor(f"{p}.attn_out.weight", rng.linear(P, s.pred_heads * hd, 0.5))
        w.add_tensor(f"{p}.attn_q_norm.weight", _ones(hd))
        w.add_tensor(f"{p}.attn_k_norm.weight", _ones(hd))
        w.add_tensor(f"{p}.ln2.weight", _ones(P))
        w.add_tensor(f"{p}.ffn_gate.weight", rng.linear(s.pred_ff, P))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(s.pred_ff, P))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(P, s.pred_ff, 0.5))

    # --- code2wav (speech tokenizer decoder) ---
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
    w.add_tensor("a.gen.wav.tfm.output_norm.weight", _ones(H))
    qd = C2W_TFM_HEADS * s.tfm_head_dim
    for i in range(C2W_TFM_LAYERS):
        p = f"a.gen.wav.tfm.blk.{i}"
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(qd, H))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(qd, H))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(qd, H))
        w.add_tensor(f"{p}.attn_out.weight", rng.linear(H, qd, 0.5))
        w.add_tensor(f"{p}.ln1.weight", _ones(H))
        w.add_tensor(f"{p}.ln2.weight", _ones(H))
        w.add_tensor(f"{p}.ls1.weight", np.full(H, 0.1, dtype=np.float32))
        w.add_tensor(f"{p}.ls2.weight", np.full(H, 0.1, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", rng.linear(s.tfm_ff, H))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(s.tfm_ff, H))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(H, s.tfm_ff, 0.5))
    for i in range(C2W_UPSAMPLE_BLOCKS):
        p = f"a.gen.wav.up.blk.{i}"
        # ConvTranspose1d weight (IC, OC, K=2) -> ne [K, OC, IC], kernel == stride: no overlap tail
        w.add_tensor(f"{p}.conv.weight", rng.uniform((L, L, 2), np.sqrt(3.0 / L)))
        w.add_tensor(f"{p}.conv.bias", rng.bias(L))
        w.add_tensor(f"{p}.dwconv.weight", rng.conv(L, 1, 7, f16=True))
        w.add_tensor(f"{p}.dwconv.bias", rng.bias(L))
        w.add_tensor(f"{p}.norm.weight", _ones(L))
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
    return _close(w, tmp, path)


def write_asr_fixture(out_dir: Path | None = None, spec: AsrFixtureSpec = ASR_FIXTURE) -> dict[str, Path]:
    """Write the Qwen3-ASR text model + qwen3a mmproj; returns {"model", "mmproj"} paths."""
    out_dir = Path(out_dir or MODELS_DIR)
    return {"model": _write_asr_text(out_dir / spec.text_file, spec),
            "mmproj": _write_asr_mmproj(out_dir / spec.mmproj_file, spec)}


def _write_asr_text(path: Path, s: AsrFixtureSpec) -> Path:
    rng = _Rng(s.seed)
    tokens, types, merges = _bpe_vocab(ASR_SPECIALS)
    n_vocab = len(tokens)
    w, tmp = _open(path, "qwen3vl")
    _write_qwen_text_hparams(w, "qwen3vl", s.name + "-text", s.n_embd, s.n_layer, s.n_head, s.n_head_kv,
                             s.head_dim, s.n_ff, s.rope_sections, 1000000.0)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    im_end = tokens.index("<|im_end|>")
    w.add_bos_token_id(im_end)  # Qwen3ASRTextModel.set_vocab: bos = eos = <|im_end|>
    w.add_eos_token_id(im_end)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    w.add_tensor("token_embd.weight", rng.uniform((n_vocab, s.n_embd), 0.5))
    w.add_tensor("output_norm.weight", _ones(s.n_embd))
    w.add_tensor("output.weight", rng.linear(n_vocab, s.n_embd, 2.0))
    _write_qwen_text_block(w, rng, s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.head_dim, s.n_ff)
    return _close(w, tmp, path)


def _sinusoids(length: int, channels: int) -> np.ndarray:
    """Qwen25AudioModel.generate_extra_tensors: audio_tower.embed_positions."""
    inc = np.log(10000.0) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2, dtype=np.float64))
    t = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def _write_asr_mmproj(path: Path, s: AsrFixtureSpec) -> Path:
    import gguf

    rng = _Rng(s.seed + 1)
    w, tmp = _open(path, "clip")
    w.add_name(s.name + "-mmproj")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.audio.projector_type", "qwen3a")
    w.add_uint32("clip.audio.projection_dim", s.n_embd)
    w.add_uint32("clip.audio.embedding_length", s.d_model)
    w.add_uint32("clip.audio.feed_forward_length", s.a_ff)
    w.add_uint32("clip.audio.block_count", s.a_layers)
    w.add_uint32("clip.audio.attention.head_count", s.a_heads)
    w.add_uint32("clip.audio.num_mel_bins", s.n_mel)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)

    C, D = s.conv_channels, s.d_model
    # conv2d (OC, IC, 3, 3) -> ne [3, 3, IC, OC], F16 (Qwen25AudioModel.tensor_force_quant); bias [1, 1, C]
    w.add_tensor("a.conv2d.1.weight", (rng.uniform((C, 1, 3, 3), np.sqrt(3.0 / 9))).astype(np.float16))
    w.add_tensor("a.conv2d.1.bias", rng.uniform((C, 1, 1), 0.02))
    w.add_tensor("a.conv2d.2.weight", (rng.uniform((C, C, 3, 3), np.sqrt(3.0 / (9 * C)))).astype(np.float16))
    w.add_tensor("a.conv2d.2.bias", rng.uniform((C, 1, 1), 0.02))
    w.add_tensor("a.conv2d.3.weight", (rng.uniform((C, C, 3, 3), np.sqrt(3.0 / (9 * C)))).astype(np.float16))
    w.add_tensor("a.conv2d.3.bias", rng.uniform((C, 1, 1), 0.02))
    w.add_tensor("a.conv_out.weight", rng.linear(D, 16 * C))  # 128 mel / 8 = 16 rows per channel
    w.add_tensor("a.position_embd.weight", _sinusoids(1500, D))
    for i in range(s.a_layers):
        p = f"a.blk.{i}"
        w.add_tensor(f"{p}.ln1.weight", _ones(D))
        w.add_tensor(f"{p}.ln1.bias", np.zeros(D, dtype=np.float32))
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(D, D))
        w.add_tensor(f"{p}.attn_q.bias", rng.bias(D))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(D, D))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(D, D))
        w.add_tensor(f"{p}.attn_v.bias", rng.bias(D))
        w.add_tensor(f"{p}.attn_out.weight", rng.linear(D, D, 0.5))
        w.add_tensor(f"{p}.attn_out.bias", rng.bias(D))
        w.add_tensor(f"{p}.ln2.weight", _ones(D))
        w.add_tensor(f"{p}.ln2.bias", np.zeros(D, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(s.a_ff, D))
        w.add_tensor(f"{p}.ffn_up.bias", rng.bias(s.a_ff))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(D, s.a_ff, 0.5))
        w.add_tensor(f"{p}.ffn_down.bias", rng.bias(D))
    w.add_tensor("a.post_ln.weight", _ones(D))
    w.add_tensor("a.post_ln.bias", np.zeros(D, dtype=np.float32))
    w.add_tensor("mm.a.mlp.1.weight", rng.linear(D, D))
    w.add_tensor("mm.a.mlp.1.bias", rng.bias(D))
    w.add_tensor("mm.a.mlp.2.weight", rng.linear(s.n_embd, D))
    w.add_tensor("mm.a.mlp.2.bias", rng.bias(s.n_embd))
    return _close(w, tmp, path)


# --------------------------------------------------------------------------- ensure + locks

def fixture_paths(out_dir: Path | None = None) -> dict[str, dict[str, Path]]:
    d = Path(out_dir or MODELS_DIR)
    return {"tts": {"model": d / TTS_FIXTURE.talker_file, "mmproj": d / TTS_FIXTURE.mmproj_file},
            "asr": {"model": d / ASR_FIXTURE.text_file, "mmproj": d / ASR_FIXTURE.mmproj_file}}


def ensure_speech_fixtures(out_dir: Path | None = None, verify: bool = True) -> dict[str, dict[str, Path]]:
    """Generate missing speech fixtures into ``out_dir`` and verify them against the lock."""
    from .locks import verify_against

    paths = fixture_paths(out_dir)
    if not all(p.exists() for p in paths["tts"].values()):
        write_tts_fixture(out_dir)
    if not all(p.exists() for p in paths["asr"].values()):
        write_asr_fixture(out_dir)
    if verify and SPEECH_LOCK.exists():
        for pair in paths.values():
            for p in pair.values():
                verify_against(p, SPEECH_LOCK)
    return paths


def write_speech_lock(out_dir: Path | None = None) -> Path:
    """Regenerate the fixtures and rewrite ``locks/speech_fixtures.json`` (recipe changes only)."""
    from .locks import write_lock

    paths = {**{f"tts-{k}": v for k, v in write_tts_fixture(out_dir).items()},
             **{f"asr-{k}": v for k, v in write_asr_fixture(out_dir).items()}}
    write_lock(SPEECH_LOCK, "speech_fixtures", paths,
               "generated by datasets/speech_fixtures.py (random weights, PCG64 raw bits)")
    return SPEECH_LOCK


if __name__ == "__main__":  # pragma: no cover
    import sys

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    for kind, pair in {"tts": write_tts_fixture(out), "asr": write_asr_fixture(out)}.items():
        for role, p in pair.items():
            print(kind, role, p, p.stat().st_size)


# --------------------------------------------------------------------------- committed audio clips

AUDIO_DIR = DATASETS_DIR / "audio"
AUDIO_LOCK = DATASETS_DIR / "locks" / "speech_audio.json"
AUDIO_RATE = 16000
# (clip id, text for espeak-ng, or None for a synthesized tone). Each clip stays
# under 6 s (16-bit mono at 16 kHz: < 200 KB), i.e. one 8 s qwen3a window.
AUDIO_CLIPS: dict[str, str | None] = {
    "speech-short": "Stop the speech engine now.",
    "speech-medium": "Cancelling a speech engine should take one graph node, not a whole synthesis.",
    "tone-3s": None,
}


def _resample_linear(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    n = int(round(len(x) * dst / src))
    return np.interp(np.arange(n) * (src / dst), np.arange(len(x)), x)


def _write_wav16(path: Path, x: np.ndarray, rate: int) -> Path:
    import wave

    pcm = (np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def write_audio_clips(out_dir: Path | None = None) -> dict[str, Path]:
    """Offline generator of ``datasets/audio/*.wav`` (espeak-ng for speech, numpy for the tone).

    Run once and commit the outputs with their lock; espeak-ng versions differ in
    their output bytes, so the lock, not this recipe, defines the clips.
    """
    import subprocess
    import tempfile
    import wave

    out_dir = Path(out_dir or AUDIO_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for clip_id, text in AUDIO_CLIPS.items():
        path = out_dir / f"{clip_id}.wav"
        if text is None:
            t = np.arange(int(AUDIO_RATE * 3.0)) / AUDIO_RATE
            x = 0.3 * np.sin(2 * np.pi * 440.0 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 2.0 * t))
        else:
            with tempfile.TemporaryDirectory() as td:
                raw = Path(td) / "raw.wav"
                subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(raw), text], check=True)
                with wave.open(str(raw), "rb") as w:
                    src = w.getframerate()
                    data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float64) / 32768.0
            x = _resample_linear(data, src, AUDIO_RATE)
        paths[clip_id] = _write_wav16(path, x, AUDIO_RATE)
    return paths


def write_audio_lock(paths: dict[str, Path]) -> Path:
    from .locks import write_lock

    write_lock(AUDIO_LOCK, "speech_audio", paths,
               "espeak-ng 1.51 (en-us, 160 wpm) resampled to 16 kHz mono s16 / numpy tone; datasets/speech_fixtures.py")
    return AUDIO_LOCK


def audio_clip(clip_id: str, verify: bool = True) -> Path:
    """Path of a committed clip, verified against ``locks/speech_audio.json``."""
    from .locks import verify_against

    path = AUDIO_DIR / f"{clip_id}.wav"
    if verify:
        verify_against(path, AUDIO_LOCK)
    return path


# --------------------------------------------------------------------------- hooks used by datasets/fixtures.py

SPEECH_FIXTURES = {TTS_FIXTURE.name: "tts", ASR_FIXTURE.name: "asr"}


def ensure_fixture(name: str, role: str = "model", out_dir: Path | None = None) -> Path:
    """Path of a speech fixture file, generated if missing (the caller verifies it).

    ``name`` is a fixture name (``qwen3tts-fixture`` / ``qwen3asr-fixture``, as in
    ``model = "fixture:qwen3tts-fixture"``) or one of its file names; ``role`` is
    ``model`` or ``mmproj``.
    """
    paths = fixture_paths(out_dir)
    for kind, pair in paths.items():
        for r, p in pair.items():
            if name == p.name:
                kind_name, role = kind, r
                break
        else:
            continue
        break
    else:
        if name not in SPEECH_FIXTURES:
            raise KeyError(f"unknown speech fixture {name!r} (known: {', '.join(SPEECH_FIXTURES)})")
        kind_name = SPEECH_FIXTURES[name]
    if role not in ("model", "mmproj"):
        raise KeyError(f"unknown fixture role {role!r} (model or mmproj)")
    path = paths[kind_name][role]
    if not path.exists():
        (write_tts_fixture if kind_name == "tts" else write_asr_fixture)(out_dir)
    return path


def generate_all(out_dir: Path | None = None) -> list[Path]:
    """Every speech fixture file (generated if missing), verified against the lock."""
    paths = ensure_speech_fixtures(out_dir, verify=True)
    return [p for pair in paths.values() for p in pair.values()]
