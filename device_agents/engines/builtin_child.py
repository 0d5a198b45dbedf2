"""A built-in engine in a child process the agent supervises (a workload's ``engine_process = "child"``).

The child is ``python -m cancelbench.sut.builtin ENGINE`` (the engine library's server around the
same engine class the agent would build), started with the agent's own interpreter, so it runs
the agent's llama.cpp. Everything after its start is the external engine's path
(:class:`~.external.ExternalEngine`: the protocol, the shared cancel word, the timestamps checked
on the agent's clock, a crash or a stall an ``error`` record and a restart). What differs is who the
engine is: the record says the built-in engine's name (``engine = "tts"``), its settings fill the
built-in typed columns as in process, and ``engine_build_json`` stays null (its build is the
agent's, in the llama.cpp columns). Its hello must be the built-in declaration (``contract``): a
child on another cancelbench version is refused at load.
"""

from __future__ import annotations

import sys

from cancelbench.engine_decls import DECLARATIONS, settings_record

from .external import ExternalEngine

# A child loads its model before it answers (a field-scale model: tens of seconds on 2 cores).
LOAD_TIMEOUT_S = 600.0


class BuiltinChildEngine(ExternalEngine):
    def __init__(self, workload: dict) -> None:
        from cancelbench.sut.builtin import declaration_of

        self.builtin = workload["engine"]
        decl = DECLARATIONS[self.builtin]
        # the workload's resolved settings, by declared name (the agent filled the device's and sweep's)
        settings = {s.name: workload.get(s.name) for s in decl.settings}
        super().__init__({
            "command": [sys.executable, "-m", "cancelbench.sut.builtin", self.builtin],
            "settings": {k: v for k, v in settings.items() if v is not None},
            "model": workload.get("model"), "mmproj": workload.get("mmproj"),
            "startup_timeout_s": LOAD_TIMEOUT_S, "contract": declaration_of(self.builtin).contract(),
        })

    def describe(self) -> dict:
        """As the in-process engine describes itself: its settings under their record columns."""
        effective = {**self.settings, **self.effective}
        effective = {s.name: effective.get(s.name) for s in DECLARATIONS[self.builtin].settings}
        described = {"engine": self.builtin, **settings_record(self.builtin, effective)}
        if self.sample_rate is not None:
            described["sample_rate"] = self.sample_rate
        return described

    def identity_columns(self) -> dict:
        return {**super().identity_columns(), "engine_build_json": None}  # the agent's build: its llama.cpp columns


class BuiltinChannelEngine(BuiltinChildEngine):
    """A simulated built-in engine on a thread of the agent's process, over the in-process channel
    (a workload's ``engine_process = "channel"``; cancelbench.sut.channel): the same protocol, no process."""

    def spawn(self, command: list[str], *, word=None, **_):
        from cancelbench.sut.channel import ThreadEngine

        return ThreadEngine(self.builtin, word=word)
