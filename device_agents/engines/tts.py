"""TTS engine: Qwen3-TTS through libmtmd's audio-generation helper.

One trial = ``mtmd_helper_gen_audio_set_input`` → ``step_prompt`` (in batches)
→ ``step_gen`` (one frame per call: the talker samples codec_0, the code
predictor — a clip graph — fills codebooks 1..15, the talker decodes the frame
back) → ``get_output``. Every 72 buffered frames ``step_gen`` also runs a
code2wav window (another clip graph), and ``get_output`` runs the final,
partial one.

Phases: ``set_input``, ``prompt``, ``generate``, ``code2wav`` (the step_gen
calls that decode a 72-frame window, and the final get_output flush),
``output`` (PCM copy-out, WAV, hash).

Mechanisms:

* ``between_calls`` — ``ctl.requested`` is checked before and after every native call.
* ``abort_callback`` — plus the native token on the talker's llama context, so a
  talker decode (a prompt batch, the frame decode inside step_gen) stops after
  the current graph node. It does not reach the clip graphs.
* ``chunked`` — between_calls with prompt batches of ``chunk_tokens``.
* ``graph_eval`` — the hooked context set (``llama_base``): the talker's llama
  context and the mtmd context are both created with the native ``cb_eval``
  reader, so every scheduler (talker decode, code predictor, code2wav) computes
  in node ranges and stops at the next range once the token is set. The stop
  is silent (the call returns success with half-computed outputs), so the
  engine discards the step and reports the cancel. No abort callback.

Which step ran a code2wav window: the helper exposes no per-step signal, so the
engine marks the step *before* it runs from the helper's own rule (a flush when
72 frames are buffered, mtmd-helper-gen.cpp ``window_frames``) — that is what
lets a cancel's ``heavy_graph_at_receipt`` say ``code2wav`` while it is in
flight — and *measures* it afterwards: with the hooked context (graph_eval) the
native eval reader polls once per clip graph node, GEN_CODE and GEN_WAV build
the same 6.5k-node graph, so a step's poll count tells how many clip graphs it
ran (fixture: 6584 polls for a frame, 13085 for a frame + code2wav window;
``output["code2wav_measured"]``). Every run also checks the rule against the
PCM it gets back (samples == frames × samples_per_frame) and records each step's
duration.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import llama_cpp
from llama_cpp import mtmd_cpp as M

from cancelbench import native
from cancelbench.datasets.qwen_common import C2W_WINDOW_FRAMES as WINDOW_FRAMES
from cancelbench.engine_decls import settings_record
from cancelbench.request import TrialRequest

from . import llama_runtime as rt
from . import mtmd_ext as X
from .base import (Cancelled, CancelControl, EngineInputError, EngineResult, PhaseClock,
                   finish_trial, sha256_of)
from .llama_base import ContextSet, LlamaEngine
from .registry import ENGINES

# WINDOW_FRAMES: mtmd-helper-gen.cpp's qwen3tts window_frames, equal to the model's
# wav_tfm_swa, whose one home is the recipe (qwen_common).


@dataclass
class _TtsTrial:
    """One synthesis in progress: what the phases hand each other."""

    ctl: CancelControl
    gen: object  # mtmd_helper_gen_audio context
    seed: int
    lang: str
    max_frames: int
    prompt_batch: int
    sampler: object = None
    n_prompt: int = 0
    frames: int = 0
    buffered: int = 0  # frames since the last code2wav window
    steps: list = field(default_factory=list)
    pcm: np.ndarray | None = None
    n_samples: int = 0
    keep: list = field(default_factory=list)  # ctypes objects that must outlive a native call


class TtsEngine(LlamaEngine):
    kind = "tts"
    phases = ENGINES["tts"].phases

    def __init__(self, workload: dict) -> None:
        super().__init__(workload)  # the resolved settings (n_batch, n_ctx, ...) as attributes
        s = self.settings
        self.max_frames, self.top_k, self.temp, self.lang = s["max_frames"], s["top_k"], s["temp"], s["lang"]
        self.sampling_seed = s["seed"] & 0xFFFFFFFF  # the sampler's seed is 32 bits

        model_path = rt.check_gguf(Path(workload["model"]), "model")
        mmproj = X.check_mmproj(workload.get("mmproj"), engine="tts")
        self.mmproj_path = mmproj
        self.samples_per_frame = self._samples_per_frame(mmproj)

        rt.quiet_logs()
        X.quiet_mtmd_logs()
        self.model = rt.load_model(model_path, self.n_gpu_layers, self.use_extra_bufts)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.use_gpu = self.n_gpu_layers > 0
        self.mmproj_offload = s["mmproj_offload"]
        plain = self._sets[False] = self._build_set(None)
        info = M.mtmd_gen_audio_get_info(plain.handles["mctx"])
        if info.type != M.MTMD_GEN_AUDIO_TYPE_QWEN3TTS:
            raise EngineInputError(f"mmproj {mmproj.name} is not a Qwen3-TTS gen-audio projector (type {info.type})")
        self.sample_rate = int(info.sample_rate)

        n = ctypes.c_int32(0)
        sup = llama_cpp.llama_vocab_get_suppress_tokens(self.vocab, ctypes.byref(n))
        self._suppress = [int(sup[i]) for i in range(n.value)]
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def _build_set(self, eval_token: native.CancelToken | None) -> ContextSet:
        """The talker's context (hidden states on), the mtmd context and the gen helper over both."""
        ctx = rt.new_context(self.model, n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                             n_threads=self.n_threads, offload=self.use_gpu, eval_token=eval_token, embeddings=True)
        mctx = X.init_mtmd(self.mmproj_path, self.model, n_threads=self.n_threads,
                           use_gpu=self.use_gpu and self.mmproj_offload,
                           eval_token=eval_token)
        gen = M.mtmd_helper_gen_audio_init(ctx, mctx)
        return ContextSet(eval_token is not None, ctx, {"mctx": mctx, "gen": gen})

    def _free_handles(self, s: ContextSet) -> None:
        M.mtmd_helper_gen_audio_free(s.handles.pop("gen"))
        M.mtmd_free(s.handles.pop("mctx"))

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _samples_per_frame(mmproj: Path) -> int:
        """2 upsample x2 blocks, then the DAC strides (kernel == 2 * stride), from tensor shapes."""
        shapes = X.read_gguf_tensor_shapes(mmproj)
        spf = 4
        for i in range(4):
            ne = shapes.get(f"a.gen.wav.dac.blk.{i}.conv.weight")
            if ne is None:
                raise EngineInputError(f"{mmproj.name}: no code2wav DAC block {i} (not a Qwen3-TTS mmproj?)")
            spf *= ne[0] // 2
        return spf

    def describe(self) -> dict:
        return {"engine": self.kind, **settings_record(self.kind, self.settings), "sample_rate": self.sample_rate,
                "samples_per_frame": self.samples_per_frame, "window_frames": WINDOW_FRAMES}

    def _new_sampler(self, seed: int):
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if self._suppress:  # the model's suppress tokens, as common_sampler adds them
            arr = (llama_cpp.llama_logit_bias * len(self._suppress))(
                *[llama_cpp.llama_logit_bias(t, float("-inf")) for t in self._suppress])
            llama_cpp.llama_sampler_chain_add(
                chain, llama_cpp.llama_sampler_init_logit_bias(self.n_vocab, len(self._suppress), arr))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(self.top_k))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(self.temp))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def prompt_tokens(self, text: str) -> int:
        """Length of the talker prompt set_input builds (n_ids + 2, see mtmd-helper-gen.cpp)."""
        full = "<|im_start|>assistant\n" + text + "<|im_end|>\n<|im_start|>assistant\n"
        return len(rt.tokenize(self.vocab, full, add_special=False, parse_special=True)) + 2

    # ------------------------------------------------------------------ the trial

    def run(self, request: TrialRequest, ctl: CancelControl) -> EngineResult:
        text = request.input
        if not isinstance(text, str) or not text.strip():
            raise EngineInputError("empty text: nothing to synthesize")
        mech, cset = self.prepare(request, ctl)
        hooked, mctx = cset.hooked, cset.handles["mctx"]
        st = _TtsTrial(ctl=ctl, gen=cset.handles["gen"], seed=self.sampling_seed, lang=request.lang or self.lang,
                       max_frames=self.max_frames, prompt_batch=mech.prompt_step(self.n_batch, self.chunk_tokens))
        ctl.progress.frames_generated = 0
        ctl.progress.heavy_graph = None
        clock = PhaseClock(ctl.progress)
        t_start = native.now_ns()
        stopped = False
        try:
            clock.enter("set_input")
            self._set_input(st, mctx, text)
            clock.enter("prompt")
            self._prompt(st)
            clock.enter("generate")
            self._generate(st, clock)
            self._flush(st, clock)
        except Cancelled:
            stopped = True
        finally:
            if st.sampler is not None:
                llama_cpp.llama_sampler_free(st.sampler)
            ctl.progress.heavy_graph = None
        return finish_trial(ctl, clock, stopped=stopped, t_start_ns=t_start, decode_rc=ctl.last_rc,
                            n_input_tokens=st.n_prompt,
                            output=self._output(st, request, hooked, stopped or ctl.requested),
                            output_sha256=None if st.pcm is None else sha256_of(st.pcm.tobytes()))

    def _set_input(self, st: _TtsTrial, mctx, text: str) -> None:
        """Tokenize, reset the talker and the clip RNG, then the helper's set_input (one uncheckable call)."""
        ctl = st.ctl
        st.n_prompt = ctl.call("llama_tokenize", self.prompt_tokens, text)
        ctl.call("llama_memory_clear", llama_cpp.llama_memory_clear, self.active.mem, True)
        ctl.call("clip_rng_reseed", X.reseed_clip_rng, mctx, self.n_embd, st.seed)
        st.sampler = self._new_sampler(st.seed)
        raw = text.encode("utf-8")
        inp = M.mtmd_helper_gen_audio_inp()
        inp.seq_id = 0
        inp.prompt = raw
        inp.prompt_len = len(raw)
        inp.speaker_ref = None
        inp.lang = st.lang.encode()
        inp.top_k = self.top_k
        inp.top_p = 1.0
        inp.seed = st.seed
        inp.out_type = M.MTMD_HELPER_GEN_AUDIO_OUTTYPE_PCM
        st.keep.append((raw, inp))  # must outlive the native calls
        rc = ctl.call_rc("mtmd_helper_gen_audio_set_input", M.mtmd_helper_gen_audio_set_input,
                         st.gen, ctypes.byref(inp))
        if rc != 0:
            raise EngineInputError(f"set_input rejected the text (language {st.lang!r} unknown to "
                                   "the model, or a vocab without the Qwen3-TTS specials)")

    def _step_synchronized(self, fn, *args) -> int:
        rc = fn(*args)
        llama_cpp.llama_synchronize(self.ctx)  # GPU backends return before the device is done
        return rc

    def _prompt(self, st: _TtsTrial) -> None:
        """step_prompt in batches; a talker decode the abort reader stopped returns < 0 (then Cancelled)."""
        while True:
            t0 = native.now_ns()
            r = st.ctl.call_rc("mtmd_helper_gen_audio_step_prompt", self._step_synchronized,
                               M.mtmd_helper_gen_audio_step_prompt, st.gen, st.prompt_batch)
            if r < 0:
                raise RuntimeError(f"step_prompt failed ({r})")
            st.ctl.progress.input_tokens_done = st.n_prompt - r
            st.steps.append({"phase": "prompt", "prompt_remaining": r, "frames": 0, "code2wav": False,
                             "ms": (native.now_ns() - t0) / 1e6})
            if r == 0:
                return

    def _generate(self, st: _TtsTrial, clock: PhaseClock) -> None:
        """One frame per step_gen; the step that completes a 72-frame window also runs code2wav."""
        ctl, progress = st.ctl, st.ctl.progress
        sampled = ctl.call("llama_sampler_sample", llama_cpp.llama_sampler_sample, st.sampler, self.ctx, -1)
        h_state = llama_cpp.llama_get_embeddings_ith(self.ctx, -1)
        h_out = ctypes.POINTER(ctypes.c_float)()
        stop = ctypes.c_bool(False)
        while st.frames < st.max_frames:
            window = st.buffered + 1 >= WINDOW_FRAMES
            clock.enter("code2wav" if window else "generate")
            progress.heavy_graph = "code2wav" if window else None
            t0, polls0 = native.now_ns(), ctl.token.polls
            try:  # a silent clip stop (graph_eval) surfaces as Cancelled here: the step is discarded
                rc = ctl.call_rc("mtmd_helper_gen_audio_step_gen", self._step_synchronized,
                                 M.mtmd_helper_gen_audio_step_gen, st.gen, sampled, h_state,
                                 ctypes.byref(h_out), ctypes.byref(stop))
            finally:
                progress.heavy_graph = None
            dt = (native.now_ns() - t0) / 1e6
            if rc != 0:
                raise RuntimeError(f"step_gen failed ({rc}) at frame {st.frames}")
            if stop.value or not h_out:
                st.steps.append({"phase": "generate", "prompt_remaining": 0, "frames": st.frames,
                                 "code2wav": False, "ms": dt, "eos": True})
                return
            st.frames += 1
            st.buffered = 0 if window else st.buffered + 1
            progress.frames_generated = progress.tokens_generated = st.frames
            st.steps.append({"phase": "code2wav" if window else "generate", "prompt_remaining": 0,
                             "frames": st.frames, "code2wav": window, "ms": dt,
                             "polls": ctl.token.polls - polls0})
            h_state = h_out
            if window:  # the window's audio is out: a streaming app plays it now
                progress.hand_audio(st.frames * self.samples_per_frame)
            if st.frames >= st.max_frames:
                return
            clock.enter("generate")
            sampled = ctl.call("llama_sampler_sample", llama_cpp.llama_sampler_sample, st.sampler, self.ctx, -1)

    def _flush(self, st: _TtsTrial, clock: PhaseClock) -> None:
        """The final (partial) code2wav window inside get_output, then the PCM copy-out."""
        partial = st.buffered > 0
        clock.enter("code2wav" if partial else "output")
        st.ctl.progress.heavy_graph = "code2wav" if partial else None
        sr, n_bytes, ns = ctypes.c_int32(0), ctypes.c_size_t(0), ctypes.c_int64(0)
        data = ctypes.POINTER(ctypes.c_char)()
        t0 = native.now_ns()
        try:
            rc = st.ctl.call_rc("mtmd_helper_gen_audio_get_output", M.mtmd_helper_gen_audio_get_output, st.gen,
                                ctypes.byref(sr), ctypes.byref(data), ctypes.byref(n_bytes), ctypes.byref(ns))
        finally:
            st.ctl.progress.heavy_graph = None
            st.steps.append({"phase": "code2wav" if partial else "output", "prompt_remaining": 0,
                             "frames": st.frames, "code2wav": partial, "ms": (native.now_ns() - t0) / 1e6,
                             "final": True})
        if rc != 0:
            raise RuntimeError(f"get_output failed ({rc})")
        st.ctl.progress.hand_audio(int(ns.value))
        clock.enter("output")
        st.pcm = np.frombuffer(ctypes.string_at(data, n_bytes.value), dtype=np.float32).copy()
        st.n_samples = int(ns.value)

    def _output(self, st: _TtsTrial, request: TrialRequest, hooked: bool, stopped: bool) -> dict:
        output: dict = {"frames": st.frames, "steps": st.steps, "sample_rate": self.sample_rate,
                        "samples_per_frame": self.samples_per_frame, "n_prompt_tokens": st.n_prompt}
        if stopped or st.pcm is None:
            st.pcm = None  # a cancelled trial yields no audio
            return output
        output.update(pcm=st.pcm, n_samples=st.n_samples,
                      window_rule_consistent=(st.n_samples == st.frames * self.samples_per_frame))
        if hooked:
            output["code2wav_measured"] = measured_code2wav_steps(st.steps)
        if request.wav_out:
            output["wav"] = str(X.write_wav16(Path(request.wav_out), st.pcm, self.sample_rate))
        return output


def measured_code2wav_steps(steps: list[dict]) -> list[int] | None:
    """Frames whose step_gen ran a code2wav window, *measured* from the native eval reader.

    With the hooked context every clip graph execution polls the token once per graph
    node. GEN_CODE and GEN_WAV build the same graph (both branches, ggml_build_forward_select),
    so a step's poll count is k * N_graph + N_talker with k the number of clip graphs it
    ran: 1 for a plain frame, 2 when it also decoded a code2wav window.
    """
    frame_steps = [s for s in steps if s["phase"] in ("generate", "code2wav") and "polls" in s]
    if not frame_steps:
        return None
    base = min(s["polls"] for s in frame_steps)
    if base <= 0:
        return None
    return [s["frames"] for s in frame_steps if s["polls"] > 1.5 * base]
