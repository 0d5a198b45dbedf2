"""The engine registry: every mechanism and engine, as objects, in one place.

Config validation, the offset planner, the agent, the engines and the reports
read these tables. Adding a mechanism is one :class:`Mechanism` entry here plus
its native piece; an engine reads only the mechanism's flags, never its name.
Pure data: importing it loads no native library, so the driver and the reports
can use it without llama.cpp.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Mechanism:
    """How a cancel reaches the engine. Every mechanism checks the cancel flag
    before and after each native call (``CancelControl.call``); the flags say
    what it arms on top of that."""

    name: str
    abort_callback: bool = False  # the native abort reader on every llama context (llama_set_abort_callback)
    eval_hook: bool = False  # every graph runs on contexts whose scheduler polls the native eval reader
    chunked: bool = False  # prompt/prefill decoded in chunk_tokens batches instead of n_batch
    reaches: str = ""  # what it can stop inside, for docs and reports

    def prompt_step(self, n_batch: int, chunk_tokens: int) -> int:
        """Tokens per prompt decode under this mechanism."""
        return chunk_tokens if self.chunked else n_batch


MECHANISMS: dict[str, Mechanism] = {m.name: m for m in (
    Mechanism("between_calls", reaches="nothing inside a native call: the flag between calls"),
    Mechanism("abort_callback", abort_callback=True,
              reaches="llama_decode on backends that poll ggml's abort callback (upstream: CPU only); "
                      "not clip graphs"),
    Mechanism("chunked", chunked=True, reaches="nothing inside a call; shorter prompt calls"),
    Mechanism("graph_eval", eval_hook=True,
              reaches="every graph (llama_decode, clip encode, code predictor, code2wav) on every backend, "
                      "between node ranges of about graph_slice_us"),
)}
MECHANISM_NAMES = tuple(MECHANISMS)

# ggml backends a device can run on (device ids are "<backend>:<index>").
from ..ggml_devices import BACKENDS  # noqa: E402  (its one home: a stdlib-only module)


@dataclass(frozen=True)
class EngineSpec:
    name: str
    phases: tuple[str, ...]  # in run order; every one can be aimed at by the phase plan
    mechanisms: tuple[str, ...]
    factory: str  # "module:Class", imported only when an agent builds the engine
    # The engine's unit of progress: the native calls a `progress` anchor counts (the k-th
    # step call of the target phase); reference runs record how many each phase made.
    step_calls: frozenset[str] = frozenset()
    needs_mmproj: bool = False  # the workload must name a multimodal projector (and a real model)
    simulated: bool = False  # reports mark a simulated engine as such
    needs_model: bool = True  # False: no model file, no lock, no corpus (probe, sim)
    # Phases that make step calls, the ones an anchored plan (phase, progress) aims at:
    # a phase without a native call has nothing for a cancel to land in. None: every phase.
    step_phases: tuple[str, ...] | None = None

    def plan_phases(self, anchored: bool) -> tuple[str, ...]:
        """The phases an offset plan can aim its cancels at, in run order: an anchored
        plan (``config.ANCHORED_PLANS``) only those with a native call to land in."""
        return self.step_phases or self.phases if anchored else self.phases

    def make(self, workload: dict):
        module, cls = self.factory.split(":")
        return getattr(importlib.import_module(module, __package__), cls)(workload)


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("text", ("prefill", "generate"), MECHANISM_NAMES, ".text:TextEngine",
               step_calls=frozenset({"llama_decode"})),
    EngineSpec("tts", ("set_input", "prompt", "generate", "code2wav", "output"), MECHANISM_NAMES, ".tts:TtsEngine",
               step_calls=frozenset({"mtmd_helper_gen_audio_set_input", "mtmd_helper_gen_audio_step_prompt",
                                     "mtmd_helper_gen_audio_step_gen", "mtmd_helper_gen_audio_get_output"}),
               # output makes a step call only when no partial code2wav window is left to flush
               step_phases=("set_input", "prompt", "generate", "code2wav"), needs_mmproj=True),
    EngineSpec("stt", ("preprocess", "prefill", "encode", "decode_embd", "generate"), MECHANISM_NAMES,
               ".stt:SttEngine", step_calls=frozenset({"mtmd_tokenize", "llama_process", "mtmd_encode_chunk"}),
               needs_mmproj=True),
    # The probe polls the native token whatever the mechanism: it calibrates the harness.
    EngineSpec("probe", ("busy",), MECHANISM_NAMES, ".text:ProbeEngine", step_calls=frozenset({"cb_probe_busy"}),
               needs_model=False),
    # Waits instead of compute (native/cancel_token.c cb_sim_wait): scale work and a known answer.
    EngineSpec("sim", ("prefill", "generate"), MECHANISM_NAMES, ".sim:SimEngine", simulated=True,
               step_calls=frozenset({"cb_sim_wait"}), needs_model=False),
)}


class UnknownEngine(ValueError):
    pass


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise UnknownEngine(f"unknown engine {name!r} (known: {', '.join(ENGINES)})") from None


def mechanism_for(engine: str, name: str) -> Mechanism:
    """The mechanism ``name`` of ``engine`` (config load checks this once for every cell)."""
    spec = engine_spec(engine)
    if name not in spec.mechanisms or name not in MECHANISMS:
        raise UnknownEngine(f"the {engine} engine has no mechanism {name!r} (has: {', '.join(spec.mechanisms)})")
    return MECHANISMS[name]
