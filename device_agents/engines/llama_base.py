"""What every llama.cpp engine shares: the model, its context sets, the
mechanism's arming, the eval reader's token and ``close()``.

A *context set* is everything one trial computes on: the llama context and,
for speech, the mtmd context and its helpers. An engine has a plain set (built
at load) and, from the first ``graph_eval`` trial on, a hooked set whose every
scheduler (llama's and clip's) polls the native eval reader: ``graph_eval``
means the same in every engine, the eval reader on every graph the trial runs
and nothing else (no abort callback). Mechanisms are read by their flags
(:class:`~.registry.Mechanism`), never by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llama_cpp

from cancelbench import native
from cancelbench.request import TrialRequest

from . import llama_runtime as rt
from .base import LLAMA_SETTING_NAMES, CancelControl, EngineInputError, engine_settings
from .registry import Mechanism, UnknownEngine, mechanism_for


@dataclass
class ContextSet:
    hooked: bool  # built with the native eval reader as cb_eval (graph_eval)
    ctx: object  # the llama context
    handles: dict = field(default_factory=dict)  # engine-specific: mtmd context, gen helper, batch

    @property
    def mem(self):
        return llama_cpp.llama_get_memory(self.ctx)


class LlamaEngine:
    """Base of the text, TTS and STT engines. Subclasses set ``kind`` and
    implement :meth:`_build_set` and :meth:`_free_handles`."""

    kind = ""

    def __init__(self, workload: dict) -> None:
        self.workload = workload
        self.settings = engine_settings(self.kind, workload)
        for name in LLAMA_SETTING_NAMES:  # n_threads, n_ctx, n_batch, ... as attributes
            setattr(self, name, self.settings[name])
        self.model = None
        self._sets: dict[bool, ContextSet] = {}
        self.active: ContextSet | None = None
        # graph_eval: cb_eval_user_data is fixed for a context's life, so the hooked set
        # polls the token of the trial that built it (the agent keeps one per agent);
        # later trials are bound to it (rt.bind_graph_token).
        self.graph_token: native.CancelToken | None = None

    # -- subclass hooks ------------------------------------------------------
    def _build_set(self, eval_token: native.CancelToken | None) -> ContextSet:
        raise NotImplementedError

    def _free_handles(self, s: ContextSet) -> None:
        """Free the set's engine-specific handles (the llama context is freed here)."""

    # -- shared --------------------------------------------------------------
    @property
    def ctx(self):
        return (self.active or self._sets[False]).ctx

    def mechanism(self, request: TrialRequest) -> Mechanism:
        try:
            return mechanism_for(self.kind, request.mechanism)
        except UnknownEngine as exc:
            raise EngineInputError(str(exc)) from None

    def prepare(self, request: TrialRequest, ctl: CancelControl) -> tuple[Mechanism, ContextSet]:
        """The trial's mechanism and the context set it runs on, armed for it."""
        mech = self.mechanism(request)
        hooked = mech.eval_hook
        if hooked not in self._sets:
            if hooked:
                self.graph_token = ctl.token
                self.graph_token.forget_costs()  # a new model: its ops' costs are learned afresh
            self._sets[hooked] = self._build_set(self.graph_token if hooked else None)
        s = self._sets[hooked]
        if hooked:
            rt.bind_graph_token(ctl, self.graph_token, self.graph_slice_us)
        rt.arm_abort(s.ctx, ctl.token if mech.abort_callback else None)
        self.active = s
        return mech, s

    def close(self) -> None:
        for hooked in list(self._sets):
            s = self._sets.pop(hooked)
            self._free_handles(s)
            llama_cpp.llama_free(s.ctx)
        self.active = None
        self.graph_token = None  # not ours to free: a trial's token (the agent's, usually)
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None
