"""Text engine on llama-cpp-python's low-level API (llama_decode, batches, sampler).

Phases: ``prefill`` (the prompt in batches of n_batch, or chunk_tokens for the
chunked mechanism) and ``generate`` (one token per decode). Every decode is
timed to ``llama_synchronize`` because GPU backends return from llama_decode
before the device has finished.

Mechanisms: ``between_calls`` (the flag between decodes), ``abort_callback``
(the native reader on llama_set_abort_callback; llama_decode returns 2; only
the CPU backend polls it), ``chunked`` (prefill in chunk_tokens batches) and
``graph_eval``: a second llama context created with the native eval reader as
``cb_eval``. ggml's scheduler then computes each split in node ranges of about
``graph_slice_us``, synchronizes the backend after each and stops the split once
the token is set — on any backend. The stop is silent (llama_decode returns 0
with half-computed outputs and the batch's positions in the KV cache), so a
decode during which the token was set is treated as cancelled: its outputs are
discarded and its positions removed (llama_memory_seq_rm).
"""

from __future__ import annotations

import array
from pathlib import Path

import llama_cpp

from cancelbench import native

from cancelbench.engine_decls import settings_record
from cancelbench.request import TrialRequest

from . import llama_runtime as rt
from .base import CancelControl, EngineInputError, EngineResult, PhaseClock, engine_settings, finish_trial, sha256_of
from .llama_base import ContextSet, LlamaEngine
from .registry import ENGINES

PHASES = ENGINES["text"].phases


class TextEngine(LlamaEngine):
    kind = "text"
    phases = PHASES

    def __init__(self, workload: dict) -> None:
        super().__init__(workload)  # the resolved settings (n_batch, n_ctx, ...) as attributes
        self.max_tokens = self.settings["max_tokens"]
        self.prompt_tokens = self.settings["prompt_tokens"]
        path = rt.check_gguf(Path(workload["model"]))
        rt.quiet_logs()
        self.model = rt.load_model(path, self.n_gpu_layers, self.use_extra_bufts)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self._sets[False] = self._build_set(None)
        self.batch = rt.Batch(max(self.n_batch, 1))
        self.sampler = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(self.sampler, llama_cpp.llama_sampler_init_greedy())
        self._prompt_cache: dict[str, list[int]] = {}

    def _build_set(self, eval_token: native.CancelToken | None) -> ContextSet:
        return ContextSet(eval_token is not None, rt.new_context(
            self.model, n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
            n_threads=self.n_threads, offload=self.n_gpu_layers > 0, eval_token=eval_token))

    def describe(self) -> dict:
        return {"engine": self.kind, **settings_record(self.kind, self.settings)}

    def prompt_for(self, text: str) -> list[int]:
        """Tokenize and repeat/trim to exactly ``prompt_tokens`` (BOS kept first)."""
        cached = self._prompt_cache.get(text)
        if cached is not None:
            return cached
        if not text or not text.strip():
            raise EngineInputError("empty prompt text")
        toks = rt.tokenize(self.vocab, text, add_special=True)
        body = toks[1:] if len(toks) > 1 else toks
        out = toks[:1]
        while len(out) < self.prompt_tokens:
            out.extend(body[: self.prompt_tokens - len(out)])
        self._prompt_cache[text] = out
        return out

    def _decode(self, ctl: CancelControl, ctx, tokens: list[int], pos: int, logits_last: bool,
                hooked: bool) -> tuple[int, bool]:
        """One llama_decode, timed to llama_synchronize: (its rc, whether it was stopped).
        rc 2: the abort reader aborted it. With the eval reader (``hooked``) the stop is
        silent (rc 0), so any decode during which the token was set counts as stopped:
        its positions leave the KV cache and its outputs are never read."""
        b = self.batch.fill(tokens, pos, logits_last)
        with ctl.native_call("llama_decode"):
            rc = llama_cpp.llama_decode(ctx, b)
            llama_cpp.llama_synchronize(ctx)
        if hooked and ctl.token.is_set():
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, pos, -1)
            return rc, True
        return rc, rc == 2

    def run(self, request: TrialRequest, ctl: CancelControl) -> EngineResult:
        mech, cset = self.prepare(request, ctl)
        tokens = self.prompt_for(request.input)
        progress = ctl.progress
        hooked, ctx = cset.hooked, cset.ctx
        # Leftovers of the previous trial (an aborted ubatch's earlier ubatches) go first.
        llama_cpp.llama_memory_clear(cset.mem, True)
        llama_cpp.llama_sampler_reset(self.sampler)
        step = mech.prompt_step(self.n_batch, self.chunk_tokens)

        clock = PhaseClock(progress)
        t_start = native.now_ns()
        rc: int | None = None
        pos = 0
        generated: list[int] = []
        stopped = False
        clock.enter("prefill")
        for i in range(0, len(tokens), step):
            if ctl.requested:
                stopped = True
                break
            chunk = tokens[i:i + step]
            rc, stopped = self._decode(ctl, ctx, chunk, pos, logits_last=i + step >= len(tokens), hooked=hooked)
            if stopped:  # by a native reader; this batch's positions are gone
                break
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} during prefill")
            pos += len(chunk)
            progress.input_tokens_done = pos
        if not stopped:
            clock.enter("generate")
            for _ in range(self.max_tokens):
                if ctl.requested:
                    stopped = True
                    break
                with ctl.native_call("llama_sampler_sample"):
                    tok = llama_cpp.llama_sampler_sample(self.sampler, ctx, -1)
                generated.append(int(tok))
                rc, stopped = self._decode(ctl, ctx, [tok], pos, logits_last=True, hooked=hooked)
                if stopped:
                    break
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc} during generate")
                pos += 1
                progress.tokens_generated = len(generated)
        return finish_trial(ctl, clock, stopped=stopped, t_start_ns=t_start, decode_rc=rc,
                            n_input_tokens=len(tokens), output=generated,
                            output_sha256=sha256_of(array.array("i", generated).tobytes()))

    def kv_pos_max(self) -> int:
        """Highest KV position of sequence 0 in the context the last trial used (-1: empty)."""
        return llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(self.ctx), 0)

    def close(self) -> None:
        if getattr(self, "batch", None):
            self.batch.free()
        if getattr(self, "sampler", None):
            llama_cpp.llama_sampler_free(self.sampler)
            self.sampler = None
        super().close()


class ProbeEngine:
    """The known-answer probe as an engine: busy-works natively, checks the token
    every ``period_us``. The harness's measured latency must match the period."""

    kind = "probe"
    phases = ENGINES["probe"].phases

    def __init__(self, workload: dict) -> None:
        self.settings = engine_settings(self.kind, workload)
        self.duration_us, self.period_us = self.settings["duration_us"], self.settings["period_us"]

    def describe(self) -> dict:
        return {"engine": self.kind, **settings_record(self.kind, self.settings)}

    def run(self, request: TrialRequest, ctl: CancelControl) -> EngineResult:
        clock = PhaseClock(ctl.progress)
        t_start = native.now_ns()
        clock.enter("busy")
        aborted = ctl.requested
        probe_start = probe_end = t_start
        if not aborted:
            with ctl.native_call("cb_probe_busy"):
                aborted, probe_start, probe_end = native.probe_busy(ctl.token, self.duration_us, self.period_us)
        requested, t_terminal = ctl.close()
        stopped = aborted or requested
        phase = ctl.progress.phase
        result = EngineResult(outcome="cancelled" if stopped else "completed", t_start_ns=t_start,
                              t_terminal_ns=t_terminal, phase_at_terminal=phase, decode_rc=int(aborted),
                              phase_durations_ms=clock.close(), phase_segments=clock.segments,
                              phase_steps=dict(ctl.progress.steps),
                              phase_step_ms=ctl.progress.step_ms())
        if aborted and ctl.token.set_ns:
            expected = native.probe_expected_return_ns(probe_start, ctl.token.set_ns, self.period_us)
            result.output = {"known_answer_error_ms": (probe_end - expected) / 1e6}
        return result

    def close(self) -> None:
        pass
