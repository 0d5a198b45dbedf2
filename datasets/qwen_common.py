"""What the Qwen3 speech recipes share: codec constants, byte-level BPE vocab, the qwen3vl text block.

Every key, tensor name and layout follows the llama.cpp vendored in
llama-cpp-python 0.3.36 (see :mod:`.tts_recipes` and :mod:`.asr_recipes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .gguf_out import FixtureWriter, Rng, ones
from .paths import MODELS_DIR

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
C2W_UPSAMPLE_RATIO = 2     # qwen3tts-gen.cpp decode(): each upsample block's ConvTranspose1d has stride 2
C2W_DAC_BLOCKS = 4         # wav_dac_n_block
C2W_DAC_RES = 3            # wav_dac_n_res
C2W_WINDOW_FRAMES = 72     # wav_tfm_swa, frames per code2wav call
TTS_SAMPLE_RATE = 24000    # mtmd_gen_audio_get_info for QWEN3TTS
SAMPLES_PER_FRAME_REAL = 1920  # real Qwen3-TTS: 2 * 2 * 8*5*4*3 = 24000 / 12.5 Hz
DAC_STRIDES_REAL = (8, 5, 4, 3)  # speech_tokenizer decoder_config upsample_rates


def samples_per_frame(dac_strides: tuple[int, ...]) -> int:
    """PCM samples code2wav makes per codec frame: the upsample blocks' ratio, then each DAC
    block's stride (qwen3tts-gen.cpp decode(); a DAC block's stride is its ConvTranspose
    kernel / 2, which is how the engine reads it back from the mmproj)."""
    n = C2W_UPSAMPLE_RATIO ** C2W_UPSAMPLE_BLOCKS
    for stride in dac_strides:
        n *= stride
    return n


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


def bpe_vocab(specials: list[str]) -> tuple[list[str], list[int], list[str]]:
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


@dataclass(frozen=True)
class QwenSpec:
    """The qwen3vl text stack both speech recipes write (TTS talker, ASR text model) and the pair's name."""

    name: str
    seed: int
    n_embd: int = 384
    n_layer: int = 4
    n_head: int = 6
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 1024
    rope_sections: tuple[int, int, int, int] = (12, 10, 10, 0)  # sum = head_dim / 2, as 24/20/20 for 128

    @property
    def mmproj_file(self) -> str:
        return f"{self.name}-mmproj.gguf"


def write_pair(out_dir: Path | None, spec: QwenSpec, model: tuple[str, str, Callable], mmproj: Callable,
               opts: dict) -> dict[str, Path]:
    """Write a (text model, clip mmproj) pair; ``model`` is (file name, arch, writer function)."""
    out_dir = Path(out_dir or MODELS_DIR)
    file_name, arch, write_model = model
    return {"model": write_model(FixtureWriter(out_dir / file_name, arch, **opts), spec),
            "mmproj": mmproj(FixtureWriter(out_dir / spec.mmproj_file, "clip", **opts), spec)}


def write_qwen_text_block(w: FixtureWriter, rng: Rng, s: QwenSpec) -> None:
    """blk.* of the qwen3vl graph (llama_model_qwen3vl::load_arch_tensors)."""
    hd = s.head_dim
    for i in range(s.n_layer):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", ones(s.n_embd))
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(s.n_head * hd, s.n_embd))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(s.n_head_kv * hd, s.n_embd))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(s.n_head_kv * hd, s.n_embd))
        w.add_tensor(f"{p}.attn_output.weight", rng.linear(s.n_embd, s.n_head * hd, 0.5))
        w.add_tensor(f"{p}.attn_q_norm.weight", ones(hd))
        w.add_tensor(f"{p}.attn_k_norm.weight", ones(hd))
        w.add_tensor(f"{p}.ffn_norm.weight", ones(s.n_embd))
        w.add_tensor(f"{p}.ffn_gate.weight", rng.linear(s.n_ff, s.n_embd))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(s.n_ff, s.n_embd))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(s.n_embd, s.n_ff, 0.5))


def write_qwen_text_hparams(w: FixtureWriter, arch: str, name: str, s: QwenSpec, n_vocab: int,
                            vocab: tuple[list[str], list[int], list[str]]) -> None:
    """Hyperparameters of the qwen3vl text stack, then the byte-level BPE tokenizer (gpt2 / qwen2)."""
    import gguf

    w.add_name(name)
    w.add_context_length(8192)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_array(f"{arch}.rope.dimension_sections", list(s.rope_sections))
    w.add_uint32(f"{arch}.n_deepstack_layers", 0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types, merges = vocab
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
