"""The text engine on real llama.cpp calls with the fixture model.

Every cancel lands by construction (inside a chosen native call, on the engine's own
thread: helpers.cancel_inside_call), so no claim here depends on how busy the host is.
"""

import pytest

from cancelbench.request import TrialRequest
from cancelbench import native
from cancelbench.device_agents.engines.base import CancelControl, EngineInputError, Progress
from cancelbench.device_agents.engines.text import TextEngine

from helpers import cancel_inside_call

PROMPT = "The quick brown fox jumps over the lazy dog while the engine keeps talking about cancel latency."


def new_ctl():
    return CancelControl(native.CancelToken(), Progress())


@pytest.fixture(scope="module")
def engine(text_model):
    e = TextEngine({"model": text_model, "n_threads": 2, "n_batch": 256, "n_ubatch": 64, "prompt_tokens": 256,
                    "max_tokens": 8, "chunk_tokens": 32})
    yield e
    e.close()


def run(engine, mechanism, ctl=None):
    ctl = ctl or new_ctl()
    return engine.run(TrialRequest(input=PROMPT, mechanism=mechanism), ctl), ctl


def test_uncancelled_run_completes_both_phases(engine):
    res, ctl = run(engine, "between_calls")
    assert res.outcome == "completed"
    assert res.decode_rc == 0
    assert set(res.phase_durations_ms) == {"prefill", "generate"}
    assert len(res.output) == 8
    assert res.n_input_tokens == 256
    assert [s[0] for s in res.phase_segments] == ["prefill", "generate"]


def test_abort_callback_stops_prefill_mid_decode_and_engine_is_reusable(engine, text_model):
    fresh, _ = run(engine, "abort_callback")
    ctl = new_ctl()
    # The cancel lands inside the 256-token prefill decode (4 ubatches of 64), before its graph runs.
    cancel_inside_call(ctl, "llama_decode")
    res, ctl = run(engine, "abort_callback", ctl)
    assert res.outcome == "cancelled"
    assert ctl.at_receipt["phase_at_receipt"] == "prefill" and ctl.at_receipt["input_tokens_done_at_receipt"] == 0
    assert res.decode_rc == 2, "llama_decode must return 2 when the native reader aborts it"
    assert ctl.token.polls > 0
    # the native reader saw the byte after the cancel set it, and before llama_decode returned
    assert ctl.native_returned_ns >= ctl.token.seen_ns >= ctl.token.set_ns >= ctl.received_ns > 0
    # llama.cpp removed the aborted ubatch's positions; whole earlier ubatches (64) may stay.
    pos_max = engine.kv_pos_max()
    assert pos_max == -1 or (pos_max + 1) % 64 == 0
    assert (pos_max + 1) < 256
    again, _ = run(engine, "abort_callback")
    assert again.outcome == "completed"
    assert again.output_sha256 == fresh.output_sha256  # no leaked state


def test_cancelled_then_normal_matches_a_fresh_engine(engine, text_model):
    for mech in ("between_calls", "chunked", "abort_callback", "graph_eval"):
        ctl = new_ctl()
        cancel_inside_call(ctl, "llama_decode", when=lambda p: p.tokens_generated >= 2)
        res, _ = run(engine, mech, ctl)
        assert res.outcome == "cancelled" and res.phase_at_terminal == "generate", mech
    after, _ = run(engine, "between_calls")
    other = TextEngine({"model": text_model, "n_threads": 2, "n_batch": 256, "n_ubatch": 64,
                        "prompt_tokens": 256, "max_tokens": 8})
    try:
        fresh, _ = run(other, "between_calls")
    finally:
        other.close()
    assert after.output_sha256 == fresh.output_sha256


def test_latched_cancel_before_first_native_call_is_honoured(engine):
    ctl = new_ctl()
    ctl.request(native.now_ns())  # arrives before the engine is active
    res, _ = run(engine, "between_calls", ctl)
    assert res.outcome == "cancelled"
    assert res.phase_at_terminal == "prefill"
    assert ctl.progress.input_tokens_done == 0  # not one decode ran


def test_abort_callback_stops_the_decode_that_between_calls_runs_out(engine):
    """The same cancel, landed inside the prefill decode, for both mechanisms: abort_callback
    stops that decode from inside (rc 2, the reader saw the byte before it returned, part of the
    prompt left in the KV cache); between_calls lets it run out (rc 0, the whole 256-token
    batch decoded, nothing read the byte) and stops right after it. The evidence is state and
    the order of the agent's own stamps, not a latency."""
    for mech in ("abort_callback", "between_calls"):
        ctl = new_ctl()
        cancel_inside_call(ctl, "llama_decode")
        res, ctl = run(engine, mech, ctl)
        assert res.outcome == "cancelled", mech
        assert ctl.at_receipt["native_call_at_receipt"] == "llama_decode", mech
        assert ctl.at_receipt["phase_at_receipt"] == "prefill", mech
        assert res.t_terminal_ns >= ctl.native_returned_ns >= ctl.received_ns, mech
        if mech == "abort_callback":
            assert res.decode_rc == 2 and ctl.native_returned_ns >= ctl.token.seen_ns >= ctl.received_ns
            assert engine.kv_pos_max() + 1 < 256
        else:
            assert res.decode_rc == 0 and ctl.token.seen_ns == 0 and ctl.token.polls == 0
            assert engine.kv_pos_max() == 255  # the decode in flight at receipt ran to its end
            assert ctl.progress.tokens_generated == 0  # ... and nothing after it


def test_chunked_prefill_checks_between_chunks(engine):
    ctl = new_ctl()
    # lands inside the decode of the third 32-token chunk (tokens 64..95)
    cancel_inside_call(ctl, "llama_decode", when=lambda p: p.input_tokens_done >= 64)
    res, _ = run(engine, "chunked", ctl)
    assert res.outcome == "cancelled"
    assert ctl.at_receipt["input_tokens_done_at_receipt"] == 64
    assert res.decode_rc == 0  # stopped at a chunk boundary, not by aborting a decode
    assert ctl.progress.input_tokens_done == 96  # that chunk ran out; the next one never started
    assert engine.kv_pos_max() == 95


def test_bad_inputs(engine, tmp_path):
    with pytest.raises(EngineInputError, match="mechanism"):
        run(engine, "no_such_mechanism")
    with pytest.raises(EngineInputError, match="graph_slice_us"):
        TextEngine({"model": engine.workload["model"], "graph_slice_us": -5})
    with pytest.raises(EngineInputError, match="empty prompt"):
        engine.run(TrialRequest(input="  ", mechanism="between_calls"), new_ctl())
    with pytest.raises(EngineInputError, match="not found"):
        TextEngine({"model": str(tmp_path / "missing.gguf")})
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(EngineInputError, match="not a GGUF"):
        TextEngine({"model": str(bogus)})


def test_small_vocabulary_yielding_more_tokens_than_bytes_tokenizes(tmp_path, monkeypatch):
    """A vocabulary without the SentencePiece space piece spells each space with three
    byte tokens (byte fallback for U+2581), so a text of spaced letters yields about
    twice as many tokens as it has bytes; the first llama_tokenize call asks for more room."""
    from cancelbench.datasets import fixtures, text_recipes
    from cancelbench.device_agents.engines import llama_runtime as rt

    tokens, scores, types = fixtures.fixture_vocab()
    keep = [i for i, t in enumerate(tokens) if i < 259 or (len(t) == 1 and t != "\u2581")]  # no space piece
    small = ([tokens[i] for i in keep], [scores[i] for i in keep], [types[i] for i in keep])
    assert "\u2581" not in small[0] and len(small[0]) < len(tokens)
    monkeypatch.setattr(text_recipes, "fixture_vocab", lambda: small)  # where the writer looks it up
    spec = fixtures.TextFixtureSpec("tiny-small-vocab", "llama", n_embd=64, n_layer=1, n_head=4, n_head_kv=2,
                                    n_ff=128, n_ctx_train=512, seed=11)
    model = fixtures.write_text_fixture(spec, tmp_path)
    text = " ".join("abcdefghij" * 3)
    eng = TextEngine({"model": str(model), "n_threads": 1, "n_batch": 64, "prompt_tokens": 200, "max_tokens": 2})
    try:
        toks = rt.tokenize(eng.vocab, text)
        assert len(toks) > len(text.encode()) + 8  # more than the first buffer held
        space = [t for t in range(len(small[0])) if small[0][t] in ("<0xE2>", "<0x96>", "<0x81>")]
        assert sum(t in space for t in toks) == 3 * text.count(" ") + 3  # every space + the prefix space
        res = eng.run(TrialRequest(input=text, mechanism="between_calls"), new_ctl())
        assert res.outcome == "completed" and res.n_input_tokens == 200 and len(res.output) == 2
    finally:
        eng.close()


def test_gguf_header_reading_with_gguf_reader(text_model, tmp_path):
    """Headers are read with gguf.GGUFReader: the architecture (model_check), tensor shapes
    (ggml ne order, mtmd_ext), one clear error for a file cut short or not GGUF at all."""
    from cancelbench.device_agents import model_check
    from cancelbench.device_agents.engines import mtmd_ext as X

    assert model_check.gguf_metadata(text_model)["general.architecture"] == "llama"
    shapes = X.read_gguf_tensor_shapes(text_model)
    assert shapes["blk.0.ffn_up.weight"] == (768, 2048)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(text_model, "rb").read(4096))
    with pytest.raises(EngineInputError, match="not a readable GGUF"):
        X.read_gguf_tensor_shapes(cut)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(EngineInputError, match="not a readable GGUF"):
        X.read_gguf_tensor_shapes(bogus)
    with pytest.raises(model_check.ModelMismatchError, match="not a readable GGUF"):
        model_check.gguf_metadata(bogus)
