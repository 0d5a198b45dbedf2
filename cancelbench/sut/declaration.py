"""What an engine declares about itself: phases, mechanisms, settings.

An external engine sends it as its ``hello`` (docs/sut-protocol.md); the
built-in engines declare themselves with the same objects
(``device_agents/engines/registry.py``). Config validation (``resolve``), the
record's settings columns (``cancelbench.schema``) and the settings tables in
docs/cli.md (``render_settings_tables``) are derived from these declarations.
Pure data; no Ray, no llama.cpp.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .protocol import PROTOCOL_VERSION, ProtocolError, validate

SETTING_TYPES = ("int", "float", "bool", "string")
INPUT_KINDS = ("text", "audio_path", "none")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STRING_SETTING = 4096


class SettingError(ValueError):
    """A setting the engine did not declare, or a value it does not accept (one line)."""


@dataclass(frozen=True)
class Setting:
    name: str
    type: str  # int | float | bool | string
    default: object = None  # None: the engine (or the device) chooses; the record holds the effective value
    min: float | None = None
    max: float | None = None
    doc: str = ""
    # Built-in engines only: the record column, when its name differs from the setting's
    # (a TTS workload's `seed` is the column `sampling_seed`: `seed` is the sweep's), and
    # its Arrow width for integers ("int32" | "int64").
    column: str | None = None
    width: str = "int32"

    def check(self, value: object, where: str) -> object:
        """``value`` as this setting's type, within its bounds; SettingError otherwise."""
        if self.type == "bool":
            if not isinstance(value, bool):
                raise SettingError(f"{where} must be true or false, got {value!r}")
            return value
        if self.type == "string":
            if not isinstance(value, str) or len(value) > MAX_STRING_SETTING:
                raise SettingError(f"{where} must be a string (at most {MAX_STRING_SETTING} characters), "
                                   f"got {value!r:.80}")
            return value
        if self.type == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise SettingError(f"{where} must be an integer, got {value!r}")
            if not INT64_MIN <= value <= INT64_MAX:
                raise SettingError(f"{where} must fit 64 bits, got {value}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SettingError(f"{where} must be a finite number, got {value!r}")
            value = float(value)

        def bound(b) -> str:  # an integer bound exactly (2147483647, not 2.14748e+09)
            return str(int(b)) if self.type == "int" and float(b).is_integer() else f"{b:g}"

        if self.min is not None and value < self.min:
            raise SettingError(f"{where} must be >= {bound(self.min)}, got {value}")
        if self.max is not None and value > self.max:
            raise SettingError(f"{where} must be <= {bound(self.max)}, got {value}")
        return value

    @property
    def record_column(self) -> str:
        return self.column or self.name

    def to_json(self) -> dict:
        d = {"name": self.name, "type": self.type, "default": self.default}
        if self.min is not None:
            d["min"] = self.min
        if self.max is not None:
            d["max"] = self.max
        if self.doc:
            d["doc"] = self.doc
        return d


@dataclass(frozen=True)
class Phase:
    name: str
    steps: bool  # makes step calls (the engine's unit of progress; progress anchors count them)


@dataclass(frozen=True)
class MechanismInfo:
    name: str
    reaches: str  # one line: what it can stop inside


@dataclass(frozen=True)
class Declaration:
    """An engine's contract (a ``hello`` without its envelope)."""

    name: str
    version: str
    phases: tuple[Phase, ...]
    mechanisms: tuple[MechanismInfo, ...]
    settings: tuple[Setting, ...] = ()
    input: str = "text"
    clock: str = "CLOCK_MONOTONIC"
    build: tuple[tuple[str, str], ...] = ()
    protocol: int = PROTOCOL_VERSION
    capabilities: tuple[str, ...] = ()  # protocol capabilities (protocol.CAPABILITIES; others ignored)

    # -- views -------------------------------------------------------------
    @property
    def phase_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.phases)

    @property
    def step_phases(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.phases if p.steps)

    @property
    def mechanism_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.mechanisms)

    def can(self, capability: str) -> bool:
        return capability in self.capabilities

    def setting(self, name: str) -> Setting | None:
        return next((s for s in self.settings if s.name == name), None)

    # -- settings ----------------------------------------------------------
    def resolve(self, given: dict, where: str) -> dict:
        """Every declared setting: ``given``'s value (checked) or the declared default.
        An undeclared name is a SettingError naming what the engine declares."""
        names = {s.name for s in self.settings}
        unknown = sorted(set(given) - names)
        if unknown:
            known = ", ".join(sorted(names)) or "none"
            raise SettingError(f"{where}: {', '.join(unknown)} is not a setting of the {self.name} engine "
                               f"(its settings: {known})")
        return {s.name: (s.check(given[s.name], f"{where}.{s.name}") if s.name in given else s.default)
                for s in self.settings}

    # -- the wire form -----------------------------------------------------
    def to_hello(self) -> dict:
        return {"type": "hello", "protocol": self.protocol,
                "engine": {"name": self.name, "version": self.version},
                "build": dict(self.build), "clock": self.clock, "input": self.input,
                "phases": [{"name": p.name, "steps": p.steps} for p in self.phases],
                "mechanisms": [{"name": m.name, "reaches": m.reaches} for m in self.mechanisms],
                "settings": [s.to_json() for s in self.settings],
                **({"capabilities": list(self.capabilities)} if self.capabilities else {})}

    @classmethod
    def from_hello(cls, msg: dict) -> Declaration:
        """A validated ``hello`` as a declaration; ProtocolError (one line) if it is not one."""
        validate(msg, ("hello",))
        if msg["protocol"] != PROTOCOL_VERSION:
            raise ProtocolError(f"the engine speaks protocol {msg['protocol']}; this cancelbench speaks "
                                f"{PROTOCOL_VERSION}")
        for key in ("phases", "mechanisms", "settings"):
            names = [x["name"] for x in msg.get(key, [])]
            if len(set(names)) != len(names):
                raise ProtocolError(f"malformed hello: {key} names must be distinct, got {names}")
        settings = []
        for s in msg.get("settings", []):
            setting = Setting(s["name"], s["type"], None, s.get("min"), s.get("max"), s.get("doc", ""))
            if s["type"] not in ("int", "float") and ("min" in s or "max" in s):
                raise ProtocolError(f"malformed hello: setting {s['name']}: min/max apply to int and float only")
            _check_bounds(s)
            if s["default"] is not None:
                try:
                    default = setting.check(s["default"], f"setting {s['name']} default")
                except SettingError as exc:
                    raise ProtocolError(f"malformed hello: {exc}") from None
                setting = Setting(s["name"], s["type"], default, s.get("min"), s.get("max"), s.get("doc", ""))
            settings.append(setting)
        return cls(name=msg["engine"]["name"], version=msg["engine"]["version"],
                   phases=tuple(Phase(p["name"], p["steps"]) for p in msg["phases"]),
                   mechanisms=tuple(MechanismInfo(m["name"], m["reaches"]) for m in msg["mechanisms"]),
                   settings=tuple(settings), input=msg["input"], clock=msg["clock"],
                   build=tuple(sorted(msg.get("build", {}).items())), protocol=msg["protocol"],
                   capabilities=tuple(dict.fromkeys(msg.get("capabilities") or ())))

    def contract(self) -> str:
        """The declaration as canonical JSON: two agents' engines must say the same."""
        return json.dumps(self.to_hello(), sort_keys=True)


def _check_bounds(s: dict) -> None:
    """A declared setting's min and max: finite numbers (JSON's NaN and Infinity, which Python's
    reader accepts, are not), min <= max. ProtocolError (one line, naming the setting) otherwise;
    the default is then checked against them (Setting.check)."""
    for key in ("min", "max"):
        value = s.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ProtocolError(f"malformed hello: setting {s['name']}: {key} must be a finite number, got {value!r}")
    if s.get("min") is not None and s.get("max") is not None and s["min"] > s["max"]:
        raise ProtocolError(f"malformed hello: setting {s['name']}: min {s['min']!r} is greater than max {s['max']!r}")


def render_settings_table(decl: Declaration, title: str) -> str:
    """Markdown: one row per declared setting (name, type, default, bounds, what it does)."""
    lines = [f"**{title}**", "", "| setting | type | default | bounds | what |", "|---|---|---|---|---|"]
    for s in decl.settings:
        default = "engine/device decides" if s.default is None else json.dumps(s.default)
        fmt = (lambda v: f"{int(v):,}") if s.type == "int" else (lambda v: f"{v:g}")
        lo = "" if s.min is None else fmt(s.min)
        hi = "" if s.max is None else fmt(s.max)
        bounds = f"{lo}..{hi}" if (lo or hi) else ""
        column = f" (record column `{s.column}`)" if s.column else ""
        lines.append(f"| `{s.name}` | {s.type} | {default} | {bounds} | {s.doc}{column} |")
    if not decl.settings:
        lines.append("| (none) | | | | |")
    return "\n".join(lines)
