"""The engine registry: every engine's phases and cancel mechanisms, in one place.

Config validation, the offset planner, the agent and the reports read these
tables; the engine modules take their phase names and mechanism lists from
here too. Pure data: importing it loads no native library, so the driver and
the reports can use it without llama.cpp.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

MECHANISMS = ("between_calls", "abort_callback", "chunked", "graph_eval")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    phases: tuple[str, ...]  # in run order; every one can be aimed at by the phase plan
    mechanisms: tuple[str, ...]
    factory: str  # "module:Class", imported only when an agent builds the engine
    needs_mmproj: bool = False

    def make(self, workload: dict):
        module, cls = self.factory.split(":")
        return getattr(importlib.import_module(module, __package__), cls)(workload)


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("text", ("prefill", "generate"), MECHANISMS, ".text:TextEngine"),
    EngineSpec("tts", ("set_input", "prompt", "generate", "code2wav", "output"), MECHANISMS, ".tts:TtsEngine",
               needs_mmproj=True),
    EngineSpec("stt", ("preprocess", "prefill", "encode", "decode_embd", "generate"), MECHANISMS,
               ".stt:SttEngine", needs_mmproj=True),
    # The probe polls the native token whatever the mechanism: it calibrates the harness.
    EngineSpec("probe", ("busy",), MECHANISMS, ".text:ProbeEngine"),
)}


class UnknownEngine(ValueError):
    pass


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise UnknownEngine(f"unknown engine {name!r} (known: {', '.join(ENGINES)})") from None


def check_mechanism(engine: str, mechanism: str) -> None:
    spec = engine_spec(engine)
    if mechanism not in spec.mechanisms:
        raise UnknownEngine(f"the {engine} engine has no mechanism {mechanism!r} "
                            f"(has: {', '.join(spec.mechanisms)})")
