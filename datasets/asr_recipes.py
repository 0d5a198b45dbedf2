"""Qwen3-ASR recipe: a ``qwen3vl`` text model + a ``clip`` mmproj with the ``qwen3a`` audio encoder.

As the llama.cpp vendored in llama-cpp-python 0.3.36 reads them: the text
model as ``conversion/qwen3vl.py`` ``Qwen3ASRTextModel`` writes it (0 deepstack
layers, chatml template, eos = <|im_end|>); the encoder as
``tools/mtmd/models/qwen3a.cpp`` builds it (3 stride-2 conv2d, conv_out,
per-chunk sinusoid positions, a whisper-style ViT, 2-layer GELU projector).
Sizes are free where llama.cpp reads them from tensor shapes; the default
spec (``qwen3asr-fixture``) is small, :mod:`.field` has the published ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf_out import FixtureWriter, Rng, ones
from .qwen_common import (ASR_SPECIALS, CHATML_TEMPLATE, QwenSpec, bpe_vocab, write_pair, write_qwen_text_block,
                          write_qwen_text_hparams)

@dataclass(frozen=True)
class AsrFixtureSpec(QwenSpec):
    name: str = "qwen3asr-fixture"
    seed: int = 27182
    n_layer: int = 6  # the other text-stack fields: QwenSpec's defaults
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


ASR_FIXTURE = AsrFixtureSpec()


def write_asr_fixture(out_dir: Path | None = None, spec: AsrFixtureSpec = ASR_FIXTURE,
                      **opts) -> dict[str, Path]:
    """Write the Qwen3-ASR text model + qwen3a mmproj; returns {"model", "mmproj"} paths.

    ``opts`` go to :class:`FixtureWriter` (``q8``, ``data``, ``progress``).
    """
    return write_pair(out_dir, spec, (spec.text_file, "qwen3vl", _write_asr_text), _write_asr_mmproj, opts)


def _write_asr_text(w: FixtureWriter, s: AsrFixtureSpec) -> Path:
    rng = Rng(s.seed)
    tokens, types, merges = bpe_vocab(ASR_SPECIALS)
    n_vocab = len(tokens)
    write_qwen_text_hparams(w, "qwen3vl", s.name + "-text", s, n_vocab, (tokens, types, merges))
    im_end = tokens.index("<|im_end|>")
    w.add_bos_token_id(im_end)  # Qwen3ASRTextModel.set_vocab: bos = eos = <|im_end|>
    w.add_eos_token_id(im_end)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    w.add_tensor("token_embd.weight", rng.uniform((n_vocab, s.n_embd), 0.5))
    w.add_tensor("output_norm.weight", ones(s.n_embd))
    w.add_tensor("output.weight", rng.linear(n_vocab, s.n_embd, 2.0))
    write_qwen_text_block(w, rng, s)
    return w.finish()


def _sinusoids(length: int, channels: int) -> np.ndarray:
    """Qwen25AudioModel.generate_extra_tensors: audio_tower.embed_positions."""
    inc = np.log(10000.0) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2, dtype=np.float64))
    t = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def _write_asr_mmproj(w: FixtureWriter, s: AsrFixtureSpec) -> Path:
    import gguf

    rng = Rng(s.seed + 1)
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
        w.add_tensor(f"{p}.ln1.weight", ones(D))
        w.add_tensor(f"{p}.ln1.bias", np.zeros(D, dtype=np.float32))
        w.add_tensor(f"{p}.attn_q.weight", rng.linear(D, D))
        w.add_tensor(f"{p}.attn_q.bias", rng.bias(D))
        w.add_tensor(f"{p}.attn_k.weight", rng.linear(D, D))
        w.add_tensor(f"{p}.attn_v.weight", rng.linear(D, D))
        w.add_tensor(f"{p}.attn_v.bias", rng.bias(D))
        w.add_tensor(f"{p}.attn_out.weight", rng.linear(D, D, 0.5))
        w.add_tensor(f"{p}.attn_out.bias", rng.bias(D))
        w.add_tensor(f"{p}.ln2.weight", ones(D))
        w.add_tensor(f"{p}.ln2.bias", np.zeros(D, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_up.weight", rng.linear(s.a_ff, D))
        w.add_tensor(f"{p}.ffn_up.bias", rng.bias(s.a_ff))
        w.add_tensor(f"{p}.ffn_down.weight", rng.linear(D, s.a_ff, 0.5))
        w.add_tensor(f"{p}.ffn_down.bias", rng.bias(D))
    w.add_tensor("a.post_ln.weight", ones(D))
    w.add_tensor("a.post_ln.bias", np.zeros(D, dtype=np.float32))
    w.add_tensor("mm.a.mlp.1.weight", rng.linear(D, D))
    w.add_tensor("mm.a.mlp.1.bias", rng.bias(D))
    w.add_tensor("mm.a.mlp.2.weight", rng.linear(s.n_embd, D))
    w.add_tensor("mm.a.mlp.2.bias", rng.bias(s.n_embd))
    return w.finish()

