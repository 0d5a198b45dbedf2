"""Fixture text models: tiny random-weight GGUFs of real architectures.

No model is downloaded: ``cancelbench fixtures`` writes these with the
``gguf`` package. Weights come from raw PCG64 bits (stable across numpy
versions), so the bytes are reproducible and checked against the committed
lock ``locks/text_fixtures.json`` before every load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .paths import DATASETS_DIR, MODELS_DIR
TEXT_LOCK = DATASETS_DIR / "locks" / "text_fixtures.json"


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

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf"


# Sized so a 256-token prefill takes a few hundred ms with 2 threads on this
# class of machine (f32, ~57M params): long enough that a cancel lands mid-graph.
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


def _weights(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Uniform(-scale, scale) float32 from raw PCG64 bits (version-stable)."""
    n = int(np.prod(shape))
    raw = rng.bit_generator.random_raw(n) >> np.uint64(40)  # 24 random bits
    u = raw.astype(np.float64) / float(1 << 24)
    return ((u * 2.0 - 1.0) * scale).astype(np.float32).reshape(shape)


def write_text_fixture(spec: TextFixtureSpec, out_dir: Path | None = None) -> Path:
    """Write the fixture GGUF (atomically) and return its path."""
    import gguf  # imported here: only fixture generation needs it

    out_dir = Path(out_dir or MODELS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / spec.file_name
    tmp = out_dir / f".{spec.file_name}.tmp"
    tokens, scores, types = fixture_vocab()
    n_vocab = len(tokens)
    head_dim = spec.n_embd // spec.n_head
    rng = np.random.Generator(np.random.PCG64(spec.seed))

    w = gguf.GGUFWriter(str(tmp), spec.arch)
    w.add_name(spec.name)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
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
    ones = np.ones(spec.n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", _weights(rng, (n_vocab, spec.n_embd), 0.5))
    for i in range(spec.n_layer):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", ones)
        w.add_tensor(f"{p}.attn_q.weight", _weights(rng, (spec.n_head * head_dim, spec.n_embd), s_in))
        w.add_tensor(f"{p}.attn_k.weight", _weights(rng, (spec.n_head_kv * head_dim, spec.n_embd), s_in))
        w.add_tensor(f"{p}.attn_v.weight", _weights(rng, (spec.n_head_kv * head_dim, spec.n_embd), s_in))
        w.add_tensor(f"{p}.attn_output.weight", _weights(rng, (spec.n_embd, spec.n_head * head_dim), s_in))
        if spec.arch == "qwen3":
            w.add_tensor(f"{p}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(f"{p}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_norm.weight", ones)
        w.add_tensor(f"{p}.ffn_gate.weight", _weights(rng, (spec.n_ff, spec.n_embd), s_in))
        w.add_tensor(f"{p}.ffn_up.weight", _weights(rng, (spec.n_ff, spec.n_embd), s_in))
        w.add_tensor(f"{p}.ffn_down.weight", _weights(rng, (spec.n_embd, spec.n_ff), 1.0 / np.sqrt(spec.n_ff)))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", _weights(rng, (n_vocab, spec.n_embd), s_in))

    return close_gguf(w, tmp, path)


def close_gguf(w, tmp: Path, path: Path) -> Path:
    """Finish a GGUFWriter writing to ``tmp`` and move it into place atomically."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def ensure_text_fixture(name: str, out_dir: Path | None = None, verify: bool = True) -> Path:
    """Return the fixture's path, generating it if missing; verified against its lock."""
    from .locks import verify_against

    if name not in TEXT_FIXTURES:
        raise KeyError(f"unknown text fixture {name!r} (known: {', '.join(TEXT_FIXTURES)})")
    spec = TEXT_FIXTURES[name]
    path = Path(out_dir or MODELS_DIR) / spec.file_name
    if not path.exists():
        write_text_fixture(spec, out_dir)
    if verify and TEXT_LOCK.exists():
        verify_against(path, TEXT_LOCK)
    return path


def fixture_lock_entries(name: str) -> dict:
    """Lock entries (file name -> {size, sha256, source}) for every file of a fixture."""
    from .locks import load_lock

    if name in TEXT_FIXTURES:
        lock_path, files = TEXT_LOCK, [TEXT_FIXTURES[name].file_name]
    else:
        from . import speech_fixtures as sf  # speech fixtures live in their own module

        if name not in sf.SPEECH_FIXTURES:
            known = ", ".join([*TEXT_FIXTURES, *sf.SPEECH_FIXTURES])
            raise KeyError(f"unknown fixture {name!r} (known: {known})")
        lock_path = sf.SPEECH_LOCK
        files = [p.name for p in sf.fixture_paths()[sf.SPEECH_FIXTURES[name]].values()]
    locks = load_lock(lock_path)
    missing = [f for f in files if f not in locks]
    if missing:
        raise KeyError(f"{lock_path}: no lock for {', '.join(missing)}")
    return {f: {"size": locks[f].size, "sha256": locks[f].sha256, "source": locks[f].source} for f in files}


def ensure_fixture(name: str, role: str = "model") -> Path:
    """Generate (if missing) and return a fixture file by name; the caller verifies it."""
    if name in TEXT_FIXTURES:
        return ensure_text_fixture(name, verify=False)
    from . import speech_fixtures

    return speech_fixtures.ensure_fixture(name, role)


def generate_all(out_dir: Path | None = None, which: str = "all") -> list[Path]:
    """Generate every fixture model (``cancelbench fixtures``); existing files are checked, not rewritten."""
    from .locks import verify_against

    paths: list[Path] = []
    if which in ("all", "text"):
        for name, spec in TEXT_FIXTURES.items():
            path = Path(out_dir or MODELS_DIR) / spec.file_name
            if not path.exists():
                write_text_fixture(spec, out_dir)
            verify_against(path, TEXT_LOCK)
            paths.append(path)
    if which in ("all", "speech"):
        try:
            from . import speech_fixtures
        except ImportError:
            return paths
        paths.extend(speech_fixtures.generate_all(out_dir))
    return paths
