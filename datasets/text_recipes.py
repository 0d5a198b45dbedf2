"""Text fixture recipes: random-weight llama / qwen3 GGUFs for the text engine.

Weights come from raw PCG64 bits (:mod:`.gguf_out`), so the bytes are
reproducible and checked against the committed lock ``locks/text_fixtures.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .gguf_out import FixtureWriter, Rng, ones
from .paths import MODELS_DIR


@dataclass(frozen=True)
class TextFixtureSpec:
    name: str
    arch: str  # "llama" | "qwen3"
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 4096
    seed: int = 1234
    head_dim: int | None = None  # default n_embd // n_head; Qwen3-0.6B has 128 with n_embd 1024, 16 heads

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf"

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


# Sized so a 256-token prefill takes a few hundred ms with 2 threads on this
# class of machine (f32): long enough that a cancel lands mid-graph. The names
# are historical: text-llama-57m has 51.3M parameters (8 layers of 6.29M plus a
# 594 x 768 embedding and output), text-qwen3-14m has 9.9M; they stay because
# locks, configs and docs use them (docs/cli.md's fixture table states the true counts).
TEXT_FIXTURES: dict[str, TextFixtureSpec] = {
    "text-llama-57m": TextFixtureSpec("text-llama-57m", "llama", n_embd=768, n_layer=8, n_head=12,
                                      n_head_kv=4, n_ff=2048),
    # Qwen3 layout (q/k norms); the small size keeps fixture generation fast.
    "text-qwen3-14m": TextFixtureSpec("text-qwen3-14m", "qwen3", n_embd=384, n_layer=6, n_head=6,
                                      n_head_kv=2, n_ff=1024, seed=4321),
}


def fixture_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece-style vocab: specials, 256 byte tokens, ASCII chars, words."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # unknown, control, control
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)  # byte
    chars = [chr(c) for c in range(33, 127)]
    words = ("the of and to in is that for it as with was on be by at this are from or have an they "
             "which one you were her all she there would their we him been has when who will more no if "
             "out so said what up its about into than them can only other new some could time these two "
             "may then do first any my now such like our over man me even most made after also did many "
             "before must through back years where much your way well down should because each just "
             "those people how too little state good very make world still own see men work long get "
             "here between both life being under never day same another know while last might us great "
             "old year off come since against go came right used take three speech cancel stop voice").split()
    pieces = ["\u2581"] + chars + ["\u2581" + c for c in chars] + ["\u2581" + w for w in words]
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(1)  # normal
    # Longer pieces score higher so the SPM merge prefers whole words.
    scores = [0.0] * 259 + [float(-1000 + 10 * len(t)) for t in tokens[259:]]
    return tokens, scores, types


def _hparams(w: FixtureWriter, spec: TextFixtureSpec, n_vocab: int) -> None:
    import gguf

    hd = spec.dim_head
    w.add_name(spec.name)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)


def write_text_fixture(spec: TextFixtureSpec, out_dir: Path | None = None, *, q8: bool = False,
                       data: bool = True, progress: bool = False) -> Path:
    """Write the fixture GGUF (atomically) and return its path."""
    out_dir = Path(out_dir or MODELS_DIR)
    tokens, scores, types = fixture_vocab()
    n_vocab = len(tokens)
    hd = spec.dim_head
    rng = Rng(spec.seed)

    w = FixtureWriter(out_dir / spec.file_name, spec.arch, q8=q8, data=data, progress=progress)
    _hparams(w, spec, n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    s_in = 1.0 / np.sqrt(spec.n_embd)
    norm = ones(spec.n_embd)
    w.add_tensor("token_embd.weight", rng.uniform((n_vocab, spec.n_embd), 0.5))
    for i in range(spec.n_layer):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", norm)
        w.add_tensor(f"{p}.attn_q.weight", rng.uniform((spec.n_head * hd, spec.n_embd), s_in))
        w.add_tensor(f"{p}.attn_k.weight", rng.uniform((spec.n_head_kv * hd, spec.n_embd), s_in))
        w.add_tensor(f"{p}.attn_v.weight", rng.uniform((spec.n_head_kv * hd, spec.n_embd), s_in))
        w.add_tensor(f"{p}.attn_output.weight", rng.uniform((spec.n_embd, spec.n_head * hd), s_in))
        if spec.arch == "qwen3":
            w.add_tensor(f"{p}.attn_q_norm.weight", ones(hd))
            w.add_tensor(f"{p}.attn_k_norm.weight", ones(hd))
        w.add_tensor(f"{p}.ffn_norm.weight", norm)
        w.add_tensor(f"{p}.ffn_gate.weight", rng.uniform((spec.n_ff, spec.n_embd), s_in))
        w.add_tensor(f"{p}.ffn_up.weight", rng.uniform((spec.n_ff, spec.n_embd), s_in))
        w.add_tensor(f"{p}.ffn_down.weight", rng.uniform((spec.n_embd, spec.n_ff), 1.0 / np.sqrt(spec.n_ff)))
    w.add_tensor("output_norm.weight", norm)
    w.add_tensor("output.weight", rng.uniform((n_vocab, spec.n_embd), s_in))
    return w.finish()
