"""STT engine: Qwen3-ASR (qwen3vl text model + ``qwen3a`` audio mmproj) through libmtmd.

One trial = read the 16 kHz mono WAV → ``mtmd_tokenize`` (log-mel, the audio
split into 8 s windows, one mtmd chunk each) → for each chunk in order: a text
chunk is decoded (``prefill``), an audio chunk is encoded by clip
(``mtmd_encode_chunk``, phase ``encode``) and its embeddings decoded by the text
model (``decode_embd``, M-RoPE positions as mtmd-helper sets them) → greedy
``generate`` until end-of-generation or ``max_tokens``.

Chunk by chunk rather than one ``mtmd_helper_eval_chunks``, so the cancel is
checked between every encode and every decode batch, and — with the mechanisms
that arm them — inside them:

* ``between_calls`` — ``ctl.requested`` before and after every native call.
* ``abort_callback`` — plus the native token on the llama context: text prefill,
  embedding decode and token decode stop after the current graph node. The clip
  encode is not reached.
* ``chunked`` — between_calls with ``chunk_tokens``-sized decode batches (text and
  embeddings). ``mtmd_context_params.batch_max_tokens`` only groups whole media
  chunks for ``mtmd_batch_encode`` ("the first image will always be added even
  if it exceeds this limit"), so it cannot split an encode; the encode stays one
  call per 8 s window.
* ``graph_eval`` — the hooked context set (``llama_base``): the llama context
  and the mtmd context are both created with the native ``cb_eval`` reader, so
  every decode and the clip encode run in node ranges and stop at the next range
  once the token is set; the call returns 0 with half-computed outputs, which
  the engine discards (``Cancelled``). No abort callback.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
from llama_cpp import mtmd_cpp as M

from cancelbench import native

from . import llama_runtime as rt
from . import mtmd_ext as X
from cancelbench.engine_decls import settings_record
from cancelbench.request import TrialRequest

from .base import (Cancelled, CancelControl, EngineInputError, EngineResult, PhaseClock,
                   finish_trial, sha256_of)
from .llama_base import ContextSet, LlamaEngine
from .registry import ENGINES

N_POS_MROPE = 4


@dataclass
class _SttTrial:
    """One transcription in progress: what the phases hand each other."""

    ctl: CancelControl
    mctx: object
    step: int  # decode batch: n_batch, or chunk_tokens for the chunked mechanism
    max_tokens: int
    bitmap: object = None
    chunks: object = None
    n_input: int = 0
    generated: list = field(default_factory=list)
    chunk_log: list = field(default_factory=list)


class SttEngine(LlamaEngine):
    kind = "stt"
    phases = ENGINES["stt"].phases

    def __init__(self, workload: dict) -> None:
        super().__init__(workload)  # the resolved settings (n_batch, n_ctx, ...) as attributes
        self.max_tokens = self.settings["max_tokens"]
        self.system_prompt = self.settings["system_prompt"] or ""  # None: no system prompt

        model_path = rt.check_gguf(Path(workload["model"]), "model")
        mmproj = X.check_mmproj(workload.get("mmproj"), engine="stt")
        self.mmproj_path = mmproj

        rt.quiet_logs()
        X.quiet_mtmd_logs()
        self.model = rt.load_model(model_path, self.n_gpu_layers, self.use_extra_bufts)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_embd_inp = llama_cpp.llama_model_n_embd_inp(self.model)
        self.use_gpu = self.n_gpu_layers > 0
        self.mmproj_offload = self.settings["mmproj_offload"]
        m0 = self._sets[False] = self._build_set(None)
        m0 = m0.handles["mctx"]
        if not M.mtmd_support_audio(m0):
            raise EngineInputError(f"mmproj {mmproj.name} has no audio input")
        self.sample_rate = int(M.mtmd_get_audio_sample_rate(m0))
        self.mrope = bool(M.mtmd_decode_use_mrope(m0))
        self.marker = M.mtmd_default_marker().decode()
        self.sampler = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(self.sampler, llama_cpp.llama_sampler_init_greedy())
        self._audio_cache: dict[str, object] = {}

    def _build_set(self, eval_token: native.CancelToken | None) -> ContextSet:
        """The text model's context, its batch, and the mtmd (audio encoder) context."""
        ctx = rt.new_context(self.model, n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                             n_threads=self.n_threads, offload=self.use_gpu, eval_token=eval_token)
        mctx = X.init_mtmd(self.mmproj_path, self.model, n_threads=self.n_threads,
                           use_gpu=self.use_gpu and self.mmproj_offload,
                           eval_token=eval_token)
        return ContextSet(eval_token is not None, ctx, {"mctx": mctx, "batch": llama_cpp.llama_batch_ext_init(ctx)})

    def _free_handles(self, s: ContextSet) -> None:
        llama_cpp.llama_batch_ext_free(s.handles.pop("batch"))
        M.mtmd_free(s.handles.pop("mctx"))

    @property
    def batch(self):
        return (self.active or self._sets[False]).handles["batch"]

    def describe(self) -> dict:
        return {"engine": self.kind, **settings_record(self.kind, self.settings), "sample_rate": self.sample_rate}

    def load_audio(self, path: str):
        """16 kHz mono float samples of a WAV (validated and cached; no native call)."""
        key = str(Path(path).resolve())
        if key not in self._audio_cache:
            self._audio_cache[key] = X.read_wav_mono_f32(Path(path), self.sample_rate)
        return self._audio_cache[key]

    def prompt_text(self) -> str:
        return (f"<|im_start|>system\n{self.system_prompt}<|im_end|>\n<|im_start|>user\n{self.marker}"
                "<|im_end|>\n<|im_start|>assistant\n")

    # ------------------------------------------------------------------ decode helpers

    def _decode_text(self, ctl: CancelControl, tokens, pos: int, logits_last: bool) -> None:
        b = self.batch
        llama_cpp.llama_batch_ext_clear(b)
        idx = -1
        p = llama_cpp.llama_pos(0)
        for i, tok in enumerate(tokens):
            idx = llama_cpp.llama_batch_ext_add_token(b, 0, int(tok))
            if idx < 0:
                raise RuntimeError(f"llama_batch_ext_add_token failed ({idx})")
            p.value = pos + i
            llama_cpp.llama_batch_ext_set_pos(b, idx, ctypes.byref(p))
        self._process(ctl, idx, logits_last)

    def _decode_embd(self, ctl: CancelControl, base: int, first: int, n: int, pos0: int,
                     logits_last: bool) -> None:
        """Embedding rows [first, first + n) of the chunk, positions like decode_embd_batch."""
        b = self.batch
        llama_cpp.llama_batch_ext_clear(b)
        row_bytes = self.n_embd_inp * ctypes.sizeof(ctypes.c_float)
        pos = (llama_cpp.llama_pos * N_POS_MROPE)()
        idx = -1
        for i in range(first, first + n):
            e = llama_cpp.llama_embd(ctypes.cast(ctypes.c_void_p(base + i * row_bytes), ctypes.POINTER(ctypes.c_float)),
                                     1, self.n_embd_inp)
            idx = llama_cpp.llama_batch_ext_add_embd(b, 0, e)
            if idx < 0:
                raise RuntimeError(f"llama_batch_ext_add_embd failed ({idx})")
            for j in range(N_POS_MROPE):  # set_position_mrope_1d: every section = pos; else one position
                pos[j] = pos0 + i if (self.mrope or j == 0) else 0
            llama_cpp.llama_batch_ext_set_pos(b, idx, pos)
        self._process(ctl, idx, logits_last)

    def _process(self, ctl: CancelControl, last_idx: int, logits_last: bool) -> None:
        """Decode the filled batch, timed to llama_synchronize. An aborted decode (2)
        surfaces as Cancelled; any other failure is an error."""
        if logits_last:
            llama_cpp.llama_batch_ext_set_output_logits(self.batch, last_idx, True)
        rc = ctl.call_rc("llama_process", self._process_synchronized)
        if rc != 0:
            raise RuntimeError(f"llama_process returned {rc} ({ctl.progress.phase})")

    def _process_synchronized(self) -> int:
        rc = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        llama_cpp.llama_synchronize(self.ctx)  # GPU backends return before the device is done
        return rc

    def _piece(self, tok: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, tok, buf, len(buf), 0, False)
        return buf.raw[:max(0, n)]

    # ------------------------------------------------------------------ the trial

    def run(self, request: TrialRequest, ctl: CancelControl) -> EngineResult:
        samples = self.load_audio(request.input)
        mech, cset = self.prepare(request, ctl)
        st = _SttTrial(ctl=ctl, mctx=cset.handles["mctx"], step=mech.prompt_step(self.n_batch, self.chunk_tokens),
                       max_tokens=self.max_tokens)
        ctl.progress.heavy_graph = None
        clock = PhaseClock(ctl.progress)
        t_start = native.now_ns()
        stopped = False
        try:
            clock.enter("preprocess")
            self._preprocess(st, samples)
            n_past = 0
            for ci in range(M.mtmd_input_chunks_size(st.chunks)):
                n_past = self._eval_chunk(st, clock, ci, n_past)
            clock.enter("generate")
            self._generate(st, n_past)
        except Cancelled:
            stopped = True
        finally:
            ctl.progress.heavy_graph = None
            if st.chunks:
                M.mtmd_input_chunks_free(st.chunks)
            if st.bitmap:
                M.mtmd_bitmap_free(st.bitmap)
        text_out = b"".join(self._piece(t) for t in st.generated).decode("utf-8", "replace")
        return finish_trial(ctl, clock, stopped=stopped, t_start_ns=t_start, decode_rc=ctl.last_rc,
                            n_input_tokens=st.n_input,
                            output={"text": text_out, "tokens": st.generated, "chunks": st.chunk_log},
                            output_sha256=sha256_of(text_out.encode("utf-8")))

    def _preprocess(self, st: _SttTrial, samples) -> None:
        """Reset, then mtmd_tokenize: the log-mel and the split into chunks (one uncheckable call)."""
        ctl = st.ctl
        ctl.call("llama_memory_clear", self._reset)
        audio = (ctypes.c_float * len(samples)).from_buffer_copy(samples.tobytes())
        st.bitmap = ctl.call("mtmd_bitmap_init_from_audio", M.mtmd_bitmap_init_from_audio, len(samples), audio)
        st.chunks = M.mtmd_input_chunks_init()
        text = self.prompt_text().encode()
        itext = M.mtmd_input_text(text, len(text), False, True)
        bitmaps = (ctypes.c_void_p * 1)(st.bitmap)
        rc = ctl.call_rc("mtmd_tokenize", M.mtmd_tokenize, st.mctx, st.chunks, ctypes.byref(itext), bitmaps, 1)
        if rc != 0:
            raise EngineInputError(f"mtmd_tokenize rejected the audio ({rc})")

    def _reset(self) -> None:
        llama_cpp.llama_memory_clear(self.active.mem, True)
        llama_cpp.llama_sampler_reset(self.sampler)

    def _eval_chunk(self, st: _SttTrial, clock: PhaseClock, ci: int, n_past: int) -> int:
        """One mtmd chunk: text is decoded (prefill); audio is encoded by clip, then its
        embeddings decoded by the text model. Returns the next position."""
        ctl = st.ctl
        chunk = M.mtmd_input_chunks_get(st.chunks, ci)
        last = ci == M.mtmd_input_chunks_size(st.chunks) - 1
        if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            clock.enter("prefill")
            n_tok = ctypes.c_size_t(0)
            ptr = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n_tok))
            toks = [int(ptr[i]) for i in range(n_tok.value)]
            for i in range(0, len(toks), st.step):
                part = toks[i:i + st.step]
                self._decode_text(ctl, part, n_past, logits_last=last and i + st.step >= len(toks))
                n_past += len(part)
                self._count_input(st, len(part))
            st.chunk_log.append({"chunk": ci, "type": "text", "n_tokens": len(toks)})
            return n_past
        n_tok = int(M.mtmd_input_chunk_get_n_tokens(chunk))
        clock.enter("encode")
        ctl.progress.heavy_graph = "clip_encode"
        t0 = native.now_ns()
        try:  # a graph_eval stop returns 0 with half-computed embeddings: Cancelled discards them
            rc = ctl.call_rc("mtmd_encode_chunk", M.mtmd_encode_chunk, st.mctx, chunk)
        finally:
            ctl.progress.heavy_graph = None
        enc_ms = (native.now_ns() - t0) / 1e6
        if rc != 0:
            raise RuntimeError(f"mtmd_encode_chunk failed ({rc})")
        base = ctypes.cast(M.mtmd_get_output_embd(st.mctx), ctypes.c_void_p).value
        clock.enter("decode_embd")
        t0 = native.now_ns()
        for i in range(0, n_tok, st.step):
            n = min(st.step, n_tok - i)
            self._decode_embd(ctl, base, i, n, n_past, logits_last=last and i + n >= n_tok)
            self._count_input(st, n)
        st.chunk_log.append({"chunk": ci, "type": "audio", "n_tokens": n_tok, "encode_ms": enc_ms,
                             "decode_ms": (native.now_ns() - t0) / 1e6})
        return n_past + int(M.mtmd_input_chunk_get_n_pos(chunk))

    @staticmethod
    def _count_input(st: _SttTrial, n: int) -> None:
        st.n_input += n
        st.ctl.progress.input_tokens_done = st.n_input

    def _generate(self, st: _SttTrial, n_past: int) -> None:
        """Greedy tokens until end-of-generation or max_tokens."""
        ctl = st.ctl
        for _ in range(st.max_tokens):
            tok = int(ctl.call("llama_sampler_sample", llama_cpp.llama_sampler_sample, self.sampler, self.ctx, -1))
            if llama_cpp.llama_vocab_is_eog(self.vocab, tok):
                return
            st.generated.append(tok)
            ctl.progress.tokens_generated = len(st.generated)
            if len(st.generated) >= st.max_tokens:
                return
            self._decode_text(ctl, [tok], n_past, logits_last=True)
            n_past += 1

    def close(self) -> None:
        if getattr(self, "sampler", None):
            llama_cpp.llama_sampler_free(self.sampler)
            self.sampler = None
        super().close()
