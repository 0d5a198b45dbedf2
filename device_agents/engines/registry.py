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

from cancelbench.engine_decls import (DECLARATIONS, MAX_SEED, MECHANISM_NAMES, MECHANISMS,  # noqa: F401
                                      Mechanism)
from cancelbench.sut.declaration import Declaration
from cancelbench.sut.protocol import AUDIO_OUT


# ggml backends a device can run on (device ids are "<backend>:<index>").
from ..ggml_devices import BACKENDS  # noqa: E402  (its one home: a stdlib-only module)


@dataclass(frozen=True)
class EngineSpec:
    name: str
    declaration: Declaration  # phases, mechanisms, settings: the engine's contract
    factory: str  # "module:Class", imported only when an agent builds the engine
    # The engine's unit of progress: the native calls a `progress` anchor counts (the k-th
    # step call of the target phase); reference runs record how many each phase made.
    step_calls: frozenset[str] = frozenset()
    needs_mmproj: bool = False  # the workload must name a multimodal projector (and a real model)
    simulated: bool = False  # reports mark a simulated engine as such
    # Where it runs unless a workload says (ENGINE_PROCESSES): a real engine in a child process the agent
    # supervises (a crash costs one trial); the simulated one, which measures the harness alone, behind the
    # same protocol on a thread of the agent's (the scale benchmark would otherwise double its processes).
    default_process: str = "child"
    needs_model: bool = True  # False: no model file, no lock, no corpus (probe, sim)
    external: bool = False  # runs out of process through the engine protocol (docs/sut-protocol.md)
    # What its model files must be (device_agents/model_check.py): the architectures its model may have
    # (empty: any language model), and its mmproj's (modality, projector type); None: any projector.
    model_archs: tuple[str, ...] = ()
    model_kind: str = "a language model"  # what those architectures are, in its errors
    mmproj_projector: tuple[str, str] | None = None
    # input "none": the id of the one input it makes itself (default: its name; the probe's "busy" is older
    # than this rule and kept, so the plans, and their hashes, of earlier sweeps stay put)
    synthetic_input: str | None = None

    @property
    def speech(self) -> bool:
        """Speech in or out (its declaration: audio input, or audio_out): the reports' speech sections."""
        return self.declaration.input == "audio_path" or self.keeps_audio

    @property
    def synthetic_input_id(self) -> str:
        return self.synthetic_input or self.name

    @property
    def keeps_audio(self) -> bool:
        """It streams audio (its declaration's audio_out): barge-in can run on it, and its reference
        runs write their audio (out/audio/<trial>.wav) for listening."""
        return self.declaration.can(AUDIO_OUT)

    @property
    def phases(self) -> tuple[str, ...]:
        """In run order; every one can be aimed at by the phase plan."""
        return self.declaration.phase_names

    @property
    def mechanisms(self) -> tuple[str, ...]:
        return self.declaration.mechanism_names

    @property
    def step_phases(self) -> tuple[str, ...]:
        """Phases that make step calls, the ones an anchored plan (phase, progress) aims at:
        a phase without a native call has nothing for a cancel to land in."""
        return self.declaration.step_phases

    def plan_phases(self, anchored: bool) -> tuple[str, ...]:
        """The phases an offset plan can aim its cancels at, in run order: an anchored
        plan (``config.ANCHORED_PLANS``) only those with a native call to land in."""
        return (self.step_phases or self.phases) if anchored else self.phases

    def make(self, workload: dict):
        return make_engine({**workload, "engine": self.name})


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("text", DECLARATIONS["text"], ".text:TextEngine", step_calls=frozenset({"llama_decode"})),
    EngineSpec("tts", DECLARATIONS["tts"], ".tts:TtsEngine",
               step_calls=frozenset({"mtmd_helper_gen_audio_set_input", "mtmd_helper_gen_audio_step_prompt",
                                     "mtmd_helper_gen_audio_step_gen", "mtmd_helper_gen_audio_get_output"}),
               needs_mmproj=True, model_archs=("qwen3tts",),
               model_kind="a TTS talker", mmproj_projector=("gen_audio", "qwen3tts_gen")),
    EngineSpec("stt", DECLARATIONS["stt"], ".stt:SttEngine",
               step_calls=frozenset({"mtmd_tokenize", "llama_process", "mtmd_encode_chunk"}), needs_mmproj=True,
               mmproj_projector=("audio", "qwen3a")),
    # The probe polls the native token whatever the mechanism: it calibrates the harness.
    EngineSpec("probe", DECLARATIONS["probe"], ".text:ProbeEngine", step_calls=frozenset({"cb_probe_busy"}),
               needs_model=False, synthetic_input="busy"),
    # Waits instead of compute (native/cancel_token.c cb_sim_wait): scale work and a known answer.
    EngineSpec("sim", DECLARATIONS["sim"], ".sim:SimEngine", simulated=True, step_calls=frozenset({"cb_sim_wait"}),
               needs_model=False, default_process="channel"),
)}
EXTERNAL = "external"  # the engine name of workloads that run a team's own engine (docs/sut-protocol.md)
# Where a workload's engine runs (a workload's engine_process, a record column): in the agent's process,
# called directly; in a child process the agent starts and supervises, speaking the engine protocol (a
# built-in engine through the engine library, cancelbench.sut.builtin; an external engine always); or, a
# simulated engine only, behind the same protocol on a thread of the agent's process (cancelbench.sut.channel).
AGENT, CHILD, CHANNEL = "agent", "child", "channel"
ENGINE_PROCESSES = (AGENT, CHILD, CHANNEL)
SPEECH_ENGINES = tuple(name for name, spec in ENGINES.items() if spec.speech)
_EXTERNAL_FACTORY = ".external:ExternalEngine"
# a built-in engine's factory by its workload's engine_process, where not in the agent's process
_BUILTIN_PROTOCOL_FACTORIES = {CHILD: ".builtin_child:BuiltinChildEngine", CHANNEL: ".builtin_child:BuiltinChannelEngine"}


def is_external(engine: str | None) -> bool:
    """A workload's ``engine`` names a team's engine (its declaration comes from its hello)."""
    return engine == EXTERNAL


def make_engine(payload: dict):
    """The engine a workload's payload names, built (an agent's side: it imports the engine's module)."""
    name = payload.get("engine", "text")
    if is_external(name):
        factory = _EXTERNAL_FACTORY
    else:
        factory = _BUILTIN_PROTOCOL_FACTORIES.get(payload.get("engine_process"), engine_spec(name).factory)
    module, cls = factory.split(":")
    return getattr(importlib.import_module(module, __package__), cls)(payload)


def external_spec(declaration: Declaration, needs_model: bool) -> EngineSpec:
    """The spec of an external engine, from the declaration its hello gave."""
    return EngineSpec(EXTERNAL, declaration, _EXTERNAL_FACTORY, needs_model=needs_model, external=True)


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
