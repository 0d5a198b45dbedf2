"""A sweep's [[workload]] tables: an engine, its model and inputs, its settings.

Which keys a workload takes follows from its engine's declaration
(``cancelbench.engine_decls`` for the built-in engines, an external engine's
``hello``, docs/sut-protocol.md): a key the engine does not declare, a value of
the wrong type or out of its bounds is a :class:`ConfigError` before anything runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from pathlib import Path

from cancelbench.bargein import BargeinSettings
from cancelbench.device_agents.engines.registry import (AGENT, BACKENDS, CHANNEL, CHILD, ENGINE_PROCESSES, ENGINES,
                                                         EXTERNAL, EngineSpec, external_spec,
                                                         MAX_SEED, is_external)
from cancelbench.engine_decls import ALL_GPU_LAYERS, resolve_settings
from cancelbench.inputs import expect_choice, expect_name
from cancelbench.engine_decls import builtin_settings
from cancelbench.sut.declaration import Declaration, SettingError

from .bargein_config import check_bargein
from .checks import ConfigError, check_names, check_number

BUILTIN_SETTINGS = builtin_settings()  # every built-in engine's settings, once each
# Keys of an external workload (besides the common ones): how to start the engine.
EXTERNAL_KEYS = ("command", "cwd", "env", "startup_timeout_s", "answer_timeout_s", "run_timeout_s", "cancel_word",
                 "settings")
MAX_STARTUP_S, MAX_ANSWER_S, MAX_RUN_S = 600.0, 3600.0, 86400.0
_COMMON_KEYS = ("name", "engine", "model", "mmproj", "lock", "inputs", "backends", "bargein", "engine_process")


class _WorkloadBase:
    """Behaviour of :class:`WorkloadSpec` (a dataclass generated below: its fields are the
    common keys, the external engine's keys and every built-in engine's settings)."""

    @property
    def spec(self) -> EngineSpec:
        """The engine's spec: a built-in one, or an external engine's from its hello."""
        if not is_external(self.engine):
            return ENGINES[self.engine]
        if self.declaration is None:
            raise ConfigError(f"workload {self.name}: its external engine has not said hello yet")
        return external_spec(self.declaration, needs_model=bool(self.model))

    @property
    def process(self) -> str:
        """Where its engine runs (ENGINE_PROCESSES): the workload's engine_process, else its engine's
        default (a real engine in a child, the simulated one over the in-process channel); an external
        engine always in a process of its own."""
        if is_external(self.engine):
            return CHILD
        return self.engine_process or self.spec.default_process

    def given_settings(self) -> dict:
        """The engine settings the config gave (built-in: the keys set; external: its table)."""
        if is_external(self.engine):
            return dict(self.settings)
        return {s.name: getattr(self, s.name) for s in self.spec.declaration.settings
                if getattr(self, s.name) is not None}

    def resolved_settings(self) -> dict:
        """Every setting the engine declares: the config's value, the declared default or (built-in
        engines) the value derived from the others; n_gpu_layers stays for the agent's device."""
        if is_external(self.engine):
            return self.spec.declaration.resolve(self.given_settings(), f"workload {self.name}")
        return resolve_settings(self.engine, self.given_settings(), f"workload {self.name}")

    def engine_params(self) -> dict:
        """What the agent's engine is built from (the load payload, without locks)."""
        # None: the engine (or the agent, for the device's n_gpu_layers) chooses
        d = {"engine": self.engine, **{k: v for k, v in self.resolved_settings().items() if v is not None}}
        if self.process in (CHILD, CHANNEL) and not is_external(self.engine):
            d["engine_process"] = self.process  # through the engine library (engines/builtin_child.py)
        if is_external(self.engine):
            d = {"engine": EXTERNAL, "settings": self.resolved_settings(), "command": list(self.command),
                 "cwd": self.cwd, "env": dict(self.env), "startup_timeout_s": self.startup_timeout_s,
                 "answer_timeout_s": self.answer_timeout_s, "run_timeout_s": self.run_timeout_s,
                 "cancel_word": self.cancel_word, "device_settings": self._device_settings(),
                 "sweep_settings": self._sweep_settings(),
                 "contract": self.declaration.contract()}
        if self.spec.needs_model:
            d["model"], d["mmproj"] = self.model, self.mmproj
        return d

    def _device_settings(self) -> list[str]:
        """An external engine's settings that take the device's default when unset: an n_gpu_layers
        that admits all layers."""
        return self._unset_ints("n_gpu_layers", ALL_GPU_LAYERS)

    def _sweep_settings(self) -> list[str]:
        """An external engine's settings that take the sweep's value when unset (1.4): a ``seed`` that
        admits every sweep seed, as a built-in TTS's."""
        return self._unset_ints("seed", MAX_SEED, 0)

    def _unset_ints(self, name: str, top: int, bottom: int | None = None) -> list[str]:
        """``[name]`` if the engine declares it an integer with no default of its own whose bounds admit
        ``top`` (and ``bottom``): the agent fills it when the workload leaves it unset."""
        s = self.declaration.setting(name)
        ok = (s is not None and s.type == "int" and s.default is None and (s.max is None or s.max >= top)
              and (bottom is None or s.min is None or s.min <= bottom))
        return [name] if ok else []

    def settings_columns(self) -> dict:
        """The settings columns the config alone decides; the engine's effective values
        (``describe()`` on the agent, after load) complete them."""
        def file_name(spec: str | None) -> str | None:  # "fixture:name" or a path: the name a reader knows
            return Path(spec.removeprefix("fixture:")).name if spec and self.spec.needs_model else None

        return {"workload": self.name, "engine": self.engine, "corpus": self.inputs if self.spec.needs_model else None,
                "model": file_name(self.model), "mmproj": file_name(self.mmproj),
                "engine_process": self.process}


def _workload_fields() -> list:
    common = [("name", str), ("engine", str, field(default="text")),
              ("model", str | None, field(default="fixture:text-llama-57m")),
              ("mmproj", str | None, field(default=None)), ("lock", str | None, field(default=None)),
              ("inputs", str, field(default="text_prompts")),  # corpus name in datasets/corpora/
              ("backends", tuple, field(default=())),  # run only on devices of these backends (empty: all)
              ("bargein", BargeinSettings | None, field(default=None)),  # [workload.bargein] (docs/bargein.md)
              # where a built-in engine runs: the agent's process, or a child it supervises (ENGINE_PROCESSES)
              ("engine_process", str | None, field(default=None)),  # None: the engine's default
              # external engines (docs/sut-protocol.md)
              ("command", tuple, field(default=())), ("cwd", str | None, field(default=None)),
              ("env", tuple, field(default=())),  # (name, value) pairs
              ("startup_timeout_s", float, field(default=30.0)), ("answer_timeout_s", float, field(default=10.0)),
              # the longest one run may take (None: derived from the engine's completed runs, docs/sut-protocol.md)
              ("run_timeout_s", float | None, field(default=None)),
              # offer the shared cancel word to an engine that declares it (false: the cancel line alone)
              ("cancel_word", bool, field(default=True)),
              ("settings", tuple, field(default=())),  # (name, value) pairs, checked against the declaration
              ("declaration", Declaration | None, field(default=None))]  # the external engine's hello
    # Built-in engine settings: None = not given (the engine's declared default applies).
    return common + [(name, object, field(default=None)) for name in BUILTIN_SETTINGS]


WorkloadSpec = dataclasses.make_dataclass("WorkloadSpec", _workload_fields(), bases=(_WorkloadBase,), frozen=True)
WorkloadSpec.__module__ = __name__
WorkloadSpec.__doc__ = "One [[workload]] of a sweep config: an engine, its model and inputs, its settings."


def parse_workload(raw: dict, i: int, declare=None) -> WorkloadSpec:
    """One [[workload]] table. Its keys: the common ones, then what its engine declares
    (a built-in engine's settings; an external engine's `command`... and `settings`,
    checked against the declaration ``declare(spec)`` returns, the engine's hello)."""
    where = f"workload[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table")
    if "name" not in raw:
        raise ConfigError(f"{where}: 'name' is required")
    expect_name(raw["name"], f"{where}.name", ConfigError)  # bounded: it becomes trial ids and file names
    engine = raw.get("engine", "text")
    known_engines = tuple(ENGINES) + (EXTERNAL,)
    if not isinstance(engine, str):  # a list or table is refused by its type, not by a TypeError
        expect_choice(engine, f"{where}.engine", known_engines, ConfigError)
    if engine not in known_engines:
        raise ConfigError(f"{where}: unknown engine {engine!r} (known: {', '.join(known_engines)})")
    external = is_external(engine)
    _check_keys(raw, engine, where)
    kwargs = {k: v for k, v in raw.items() if k in set(_COMMON_KEYS)}
    for key in ("model", "mmproj", "lock", "inputs"):
        if key in kwargs and (not isinstance(kwargs[key], str) or not kwargs[key].strip()):
            raise ConfigError(f"{where}.{key} must be a non-empty string, got {kwargs[key]!r}")
    if "backends" in kwargs:
        kwargs["backends"] = check_names(kwargs["backends"], f"{where}.backends", BACKENDS)
    if "engine_process" in kwargs:
        expect_choice(kwargs["engine_process"], f"{where}.engine_process", ENGINE_PROCESSES, ConfigError)
        if external and kwargs["engine_process"] != CHILD:
            raise ConfigError(f"{where}.engine_process: an external engine always runs in a process of its own "
                              f"({CHILD!r}), got {kwargs['engine_process']!r}")
        if kwargs["engine_process"] == CHANNEL and not (engine in ENGINES and ENGINES[engine].simulated):
            raise ConfigError(f"{where}.engine_process: only a simulated engine runs over the in-process channel "
                              f"({CHANNEL!r}): a real one's crash or stall would take the agent with it")
    if external:
        kwargs.setdefault("model", None)
        kwargs.update(_external_keys(raw, where))
    else:
        try:
            ENGINES[engine].declaration.resolve({k: v for k, v in raw.items() if k in BUILTIN_SETTINGS}, where)
        except SettingError as exc:
            raise ConfigError(str(exc)) from None
        kwargs.update({k: v for k, v in raw.items() if k in BUILTIN_SETTINGS})
    spec = WorkloadSpec(**kwargs)
    if external:
        spec = _declared(spec, declare, where)
    if spec.bargein is not None:  # once the engine's declaration (an external one's hello) says what it streams
        spec = dataclasses.replace(spec, bargein=check_bargein(spec.bargein, spec.spec, f"{where}.bargein"))
    _check_workload(spec, where)
    return spec


def _check_keys(raw: dict, engine: str, where: str) -> None:
    """Only the keys this engine takes: the common ones and its declared settings (an external
    engine: its start-up keys; its settings are checked against its hello later)."""
    external = is_external(engine)
    allowed = set(_COMMON_KEYS) | (set(EXTERNAL_KEYS) if external else
                                   {s.name for s in ENGINES[engine].declaration.settings})
    if not external and not ENGINES[engine].needs_model:
        allowed -= {"model", "mmproj", "lock", "inputs"}
    unknown = sorted(set(raw) - allowed)
    if not unknown:
        return
    if not external and set(unknown) <= {"model", "mmproj", "lock", "inputs"}:
        raise ConfigError(f"{where}: the {engine} engine takes no {', '.join(unknown)} (it makes its own work)")
    if not external and set(unknown) <= set(BUILTIN_SETTINGS):
        raise ConfigError(f"{where}: {', '.join(unknown)} is not a setting of the {engine} engine (its settings: "
                          f"{', '.join(s.name for s in ENGINES[engine].declaration.settings)})")
    if external and set(unknown) <= set(BUILTIN_SETTINGS):
        raise ConfigError(f"{where}: an external engine's settings go in its settings table "
                          f"(settings = {{{unknown[0]} = ...}})")
    raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")


def _declared(spec: WorkloadSpec, declare, where: str) -> WorkloadSpec:
    """An external workload with its engine's declaration (``declare``: its hello), its
    settings checked against it."""
    if declare is None:
        raise ConfigError(f"{where}: an external engine is checked against its hello; "
                          "load this config with `cancelbench sweep` (which starts the engine once)")
    try:
        spec = dataclasses.replace(spec, declaration=declare(spec))
    except ConfigError:
        raise
    except Exception as exc:  # cancelbench.sut.client.EngineError: one line
        raise ConfigError(f"{where}: {exc}") from None
    try:
        spec.resolved_settings()
    except SettingError as exc:
        raise ConfigError(str(exc).replace(f"workload {spec.name}", where)) from None
    return spec


def _external_keys(raw: dict, where: str) -> dict:
    """An external workload's start-up keys, checked (docs/sut-protocol.md)."""
    command = raw.get("command")
    if (not isinstance(command, list) or not command
            or not all(isinstance(a, str) and a and "\0" not in a for a in command)):
        raise ConfigError(f"{where}.command must be a non-empty list of non-empty strings (an argv; no shell), "
                          f"got {command!r:.100}")
    out = {"command": tuple(command)}
    if "cwd" in raw:
        if not isinstance(raw["cwd"], str) or not raw["cwd"].strip():
            raise ConfigError(f"{where}.cwd must be a non-empty string, got {raw['cwd']!r}")
        out["cwd"] = raw["cwd"]
    env = raw.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and "\0" not in k
                                            and isinstance(v, str) and "\0" not in v for k, v in env.items()):
        raise ConfigError(f"{where}.env must be a table of NAME = \"value\" strings (no NUL, no '=' in a name)")
    out["env"] = tuple(sorted(env.items()))
    for key, hi in (("startup_timeout_s", MAX_STARTUP_S), ("answer_timeout_s", MAX_ANSWER_S), ("run_timeout_s", MAX_RUN_S)):
        if key in raw:
            out[key] = check_number(raw[key], f"{where}.{key}", 1.0, hi)
    if "cancel_word" in raw:
        if not isinstance(raw["cancel_word"], bool):
            raise ConfigError(f"{where}.cancel_word must be true or false, got {raw['cancel_word']!r:.60}")
        out["cancel_word"] = raw["cancel_word"]
    settings = raw.get("settings", {})
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}.settings must be a table of setting = value")
    out["settings"] = tuple(sorted(settings.items()))
    return out


def _check_workload(spec: WorkloadSpec, where: str) -> None:
    """What no single setting says: sizes that must agree, files an engine needs."""
    if not is_external(spec.engine):  # sizes that must agree (n_ubatch <= n_batch, a prompt within n_ctx)
        try:
            spec.resolved_settings()
        except SettingError as exc:
            raise ConfigError(str(exc).replace(f"workload {spec.name}", where)) from None
    engine = spec.spec
    if engine.needs_mmproj and spec.model == WorkloadSpec.model:
        raise ConfigError(f"{where}: engine {spec.engine} needs 'model' (and 'mmproj')")
    if engine.needs_mmproj and not spec.mmproj:
        raise ConfigError(f"{where}: engine {spec.engine} needs 'mmproj'")
    if is_external(spec.engine) and spec.mmproj and not spec.model:
        raise ConfigError(f"{where}: 'mmproj' needs a 'model'")
    for key in ("model", "mmproj"):
        path = getattr(spec, key)
        if engine.needs_model and path and not path.startswith("fixture:") and not spec.lock:
            raise ConfigError(f"{where}: {key} {path} needs a 'lock' file (see `cancelbench lock`)")


def preflight(workload: WorkloadSpec) -> Declaration:
    """An external engine's declaration: start its command once here, read its hello, shut it down."""
    from cancelbench.sut.client import declare

    return declare(list(workload.command), cwd=workload.cwd, env=dict(workload.env),
                   startup_timeout_s=workload.startup_timeout_s)


def workload_table(recorded: dict) -> dict:
    """The [[workload]] table that gives a recorded workload again (a manifest's config JSON,
    ``SweepConfig.to_json``): the keys its engine takes, with the values that were set."""
    engine = recorded.get("engine", "text")
    keys = set(_COMMON_KEYS) | (set(EXTERNAL_KEYS) if is_external(engine) else
                                {s.name for s in ENGINES[engine].declaration.settings})
    if not is_external(engine) and not ENGINES[engine].needs_model:
        keys -= {"model", "mmproj", "lock", "inputs"}
    table = {k: v for k, v in recorded.items() if k in keys and v is not None and v != [] and v != {}}
    if is_external(engine):
        table["env"] = dict(recorded.get("env") or [])
        table["settings"] = dict(recorded.get("settings") or [])
        table["command"] = list(recorded["command"])
    return table


def recorded_declaration(recorded: dict) -> Declaration | None:
    """An external workload's declaration as its manifest recorded it (None: a built-in engine)."""
    d = recorded.get("declaration")
    if not d:
        return None
    from cancelbench.sut.declaration import MechanismInfo, Phase, Setting
    return Declaration(name=d["name"], version=d["version"], input=d["input"], clock=d["clock"],
                       protocol=d["protocol"], build=tuple(tuple(kv) for kv in d["build"]),
                       phases=tuple(Phase(**p) for p in d["phases"]),
                       mechanisms=tuple(MechanismInfo(**m) for m in d["mechanisms"]),
                       settings=tuple(Setting(**s) for s in d["settings"]),
                       capabilities=tuple(d.get("capabilities") or ()))


def sweep_seeded(payload: dict, wl: WorkloadSpec, seed: int) -> dict:
    """The sweep's seed is the sampling seed of a workload that sets none: a built-in engine's
    declared ``seed`` (tts; resolved alone it derives 0), and an external engine's, which the
    agent fills from the payload's ``seed`` (``sweep_settings``)."""
    if "seed" not in wl.given_settings():
        payload["seed"] = seed
    return payload
