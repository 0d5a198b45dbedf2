"""What the Qwen3 speech recipes share: codec constants, byte-level BPE vocab, the qwen3vl text block.

Every key, tensor name and layout follows the llama.cpp vendored in
llama-cpp-python 0.3.36 (see :mod:`.tts_recipes` and :mod:`.asr_recipes`).
"""

from __future__ import annotations

from .gguf_out import FixtureWriter, Rng, ones

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


def write_qwen_text_block(w: FixtureWriter, rng: Rng, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                           head_dim: int, n_ff: int) -> None:
    """blk.* of the qwen3vl graph (llama_model_qwen3vl::load_arch_tensors)."""
    for i in range(n_layer):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", ones(n_embd))
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(n_head * head_dim, n_embd))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"{p}.attn_output.weight", rng.linear(n_embd, n_head * head_dim, 0.5))
        w.add_tensor(f"{p}.attn_q_norm.weight", ones(head_dim))
        w.add_tensor(f"{p}.attn_k_norm.weight", ones(head_dim))
        w.add_tensor(f"{p}.ffn_norm.weight", ones(n_embd))
        w.add_tensor(f"{p}.ffn_gate.weight", rng.linear(n_ff, n_embd))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(n_ff, n_embd))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(n_embd, n_ff, 0.5))


def write_qwen_text_hparams(w: FixtureWriter, arch: str, name: str, n_embd: int, n_layer: int, n_head: int, n_head_kv: int,
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

