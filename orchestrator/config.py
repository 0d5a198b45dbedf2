"""Sweep configuration: TOML in, validated typed dataclasses out.

Every problem is a :class:`ConfigError` with a one-line message; nothing is
written anywhere before the whole config has been validated.
"""

from __future__ import annotations

import json
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cancelbench.device_agents.engines.registry import (BACKENDS, ENGINES, EXTERNAL, MAX_SEED, EngineSpec,
                                                        external_spec)
from cancelbench.inputs import MAX_CONFIG_BYTES, expect_choice, expect_name, load_toml, safe_component
from cancelbench.schema import DELIVERIES, SETTINGS_COLUMNS
from cancelbench.sut.declaration import Declaration, SettingError

OFFSET_PLANS = ("immediate", "uniform", "fixed", "phase", "progress", "phase_time")
# Plans whose cancels are anchored to an engine event (entry into a phase, a step call).
ANCHORED_PLANS = ("phase", "progress")
# Plans that aim at a phase (round-robin over the target phases, min_per_phase each).
# phase_time is the time-anchored phase plan kept for comparison: a fraction of the
# reference run's time in the phase, converted to ms after hand-back.
PHASE_PLANS = ANCHORED_PLANS + ("phase_time",)

# Upper bounds, checked before anything runs (README "Sweep configuration", bounds).
MAX_OFFSET_MS = 3_600_000.0  # one hour: a fixed offset beyond any trial
MAX_TRIALS_PER_CELL = 100_000
MAX_REFERENCE_RUNS = 1_000
MAX_PING_SAMPLES = 10_000
MAX_SIM_PER_HOST = 1_024  # simulated devices (one agent process each) per host
# Planned trials in one sweep, all devices together (the plan is built in the driver's memory before
# the first trial; benchmarks/results/plan_scale.json has its measured cost). Checked per device at
# config load (a lower bound) and for the whole sweep once the devices are known.
MAX_PLAN_TRIALS = 1_000_000


class ConfigError(ValueError):
    """Invalid sweep configuration."""


# Every built-in engine's settings, once each (cancelbench.sut.declaration.Setting); a name two
# engines share must mean the same type there.
BUILTIN_SETTINGS = {}
for _spec in ENGINES.values():
    for _s in _spec.declaration.settings:
        assert BUILTIN_SETTINGS.setdefault(_s.name, _s).type == _s.type, _s.name
# Keys of an external workload (besides the common ones): how to start the engine.
EXTERNAL_KEYS = ("command", "cwd", "env", "startup_timeout_s", "answer_timeout_s", "settings")
MAX_STARTUP_S, MAX_ANSWER_S = 600.0, 3600.0
_COMMON_KEYS = ("name", "engine", "model", "mmproj", "lock", "inputs", "backends")


class _WorkloadBase:
    """Behaviour of :class:`WorkloadSpec` (a dataclass generated below: its fields are the
    common keys, the external engine's keys and every built-in engine's settings)."""

    @property
    def spec(self) -> EngineSpec:
        """The engine's spec: a built-in one, or an external engine's from its hello."""
        if self.engine != EXTERNAL:
            return ENGINES[self.engine]
        if self.declaration is None:
            raise ConfigError(f"workload {self.name}: its external engine has not said hello yet")
        return external_spec(self.declaration, needs_model=bool(self.model))

    def given_settings(self) -> dict:
        """The engine settings the config gave (built-in: the keys set; external: its table)."""
        if self.engine == EXTERNAL:
            return dict(self.settings)
        return {s.name: getattr(self, s.name) for s in self.spec.declaration.settings
                if getattr(self, s.name) is not None}

    def resolved_settings(self) -> dict:
        """Every setting the engine declares: the config's value or the declared default."""
        return self.spec.declaration.resolve(self.given_settings(), f"workload {self.name}")

    def engine_params(self) -> dict:
        """What the agent's engine is built from (the load payload, without locks)."""
        # None: the engine (or the agent, for the device's n_gpu_layers) chooses
        d = {"engine": self.engine, **{k: v for k, v in self.resolved_settings().items() if v is not None}}
        if self.engine == EXTERNAL:
            d = {"engine": EXTERNAL, "settings": self.resolved_settings(), "command": list(self.command),
                 "cwd": self.cwd, "env": dict(self.env), "startup_timeout_s": self.startup_timeout_s,
                 "answer_timeout_s": self.answer_timeout_s, "contract": self.declaration.contract()}
        if self.spec.needs_model:
            d["model"], d["mmproj"] = self.model, self.mmproj
        return d

    def settings_columns(self) -> dict:
        """The settings columns the config alone decides; the engine's effective values
        (``describe()`` on the agent, after load) complete them."""
        def file_name(spec: str | None) -> str | None:  # "fixture:name" or a path: the name a reader knows
            return Path(spec.removeprefix("fixture:")).name if spec and self.spec.needs_model else None

        return {"workload": self.name, "engine": self.engine, "corpus": self.inputs if self.spec.needs_model else None,
                "model": file_name(self.model), "mmproj": file_name(self.mmproj)}


def _workload_fields() -> list:
    common = [("name", str), ("engine", str, field(default="text")),
              ("model", str | None, field(default="fixture:text-llama-57m")),
              ("mmproj", str | None, field(default=None)), ("lock", str | None, field(default=None)),
              ("inputs", str, field(default="text_prompts")),  # corpus name in datasets/corpora/
              ("backends", tuple, field(default=())),  # run only on devices of these backends (empty: all)
              # external engines (docs/sut-protocol.md)
              ("command", tuple, field(default=())), ("cwd", str | None, field(default=None)),
              ("env", tuple, field(default=())),  # (name, value) pairs
              ("startup_timeout_s", float, field(default=30.0)), ("answer_timeout_s", float, field(default=10.0)),
              ("settings", tuple, field(default=())),  # (name, value) pairs, checked against the declaration
              ("declaration", Declaration | None, field(default=None))]  # the external engine's hello
    # Built-in engine settings: None = not given (the engine's declared default applies).
    return common + [(name, object, field(default=None)) for name in BUILTIN_SETTINGS]


WorkloadSpec = dataclasses.make_dataclass("WorkloadSpec", _workload_fields(), bases=(_WorkloadBase,), frozen=True)
WorkloadSpec.__module__ = __name__
WorkloadSpec.__doc__ = "One [[workload]] of a sweep config: an engine, its model and inputs, its settings."


@dataclass(frozen=True)
class OffsetSpec:
    plan: str = "uniform"
    fixed_ms: tuple[float, ...] = ()
    min_per_phase: int = 5  # phase plan: cancels aimed at each phase, at least
    max_fraction: float = 0.9  # uniform: draw over [0, max_fraction) of the reference
    phases: tuple[str, ...] = ()  # phase plans: aim only at these phases (empty: every one the plan can reach)

    def target_phases(self, engine: EngineSpec) -> tuple[str, ...]:
        """The phases this plan aims cancels at on ``engine``, in run order (empty for a
        plan that aims at no phase)."""
        if self.plan not in PHASE_PLANS:
            return ()
        reachable = engine.plan_phases(self.plan in ANCHORED_PLANS)
        return tuple(p for p in reachable if p in self.phases) if self.phases else reachable

    def cancels_per_cell(self, trials_per_cell: int, engine: EngineSpec) -> int:
        """Cancel trials per (device, workload, mechanism, delivery) cell: a phase plan
        aims at least min_per_phase at each target phase."""
        return max(trials_per_cell, self.min_per_phase * len(self.target_phases(engine)))


@dataclass(frozen=True)
class DeviceSelector:
    backends: tuple[str, ...] = ("cpu",)
    hosts: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    sim_per_host: int = 0  # > 0: each selected host gets this many simulated devices sim:0..N-1 (sim engine only)


@dataclass(frozen=True)
class SweepConfig:
    seed: int = 0
    input_seed: int | None = None
    offset_seed: int | None = None
    trials_per_cell: int = 40  # uniform cancels: >= 29 land in flight, enough for a p90
    reference_runs: int = 3
    mechanisms: tuple[str, ...] = ("between_calls", "abort_callback", "chunked")
    deliveries: tuple[str, ...] = ("driver", "agent")
    offsets: OffsetSpec = OffsetSpec()
    devices: DeviceSelector = DeviceSelector()
    workloads: tuple[WorkloadSpec, ...] = (WorkloadSpec(name="text-prefill"),)
    ping_samples: int = 20

    @property
    def effective_input_seed(self) -> int:
        return self.input_seed if self.input_seed is not None else self.seed * 2 + 1

    @property
    def effective_offset_seed(self) -> int:
        return self.offset_seed if self.offset_seed is not None else self.seed * 2 + 2

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=list))

    def offset_settings(self, trial_kind: str) -> dict:
        """The offset plan's parameters as settings columns: only the one the plan uses,
        so two sweeps differ in a setting only where it shaped their cancels."""
        off = self.offsets
        cols = {"reference_runs": self.reference_runs, "offset_max_fraction": None,
                "offset_min_per_phase": None, "offset_fixed_ms_json": None, "offset_phases_json": None}
        if trial_kind != "cancel":
            return cols
        if off.plan in ("uniform", "phase", "phase_time"):
            cols["offset_max_fraction"] = off.max_fraction
        if off.plan in PHASE_PLANS:
            cols["offset_min_per_phase"] = off.min_per_phase
            cols["offset_phases_json"] = json.dumps(list(off.phases)) if off.phases else None
        elif off.plan == "fixed":
            cols["offset_fixed_ms_json"] = json.dumps(list(off.fixed_ms))
        return cols


def trial_settings(config: SweepConfig, workload: WorkloadSpec, trial_kind: str, described: dict) -> dict:
    """Every settings column of one trial: the config's values, the offset plan's
    parameters and the engine's effective values (``described``, from load)."""
    cols = {**workload.settings_columns(), **config.offset_settings(trial_kind)}
    cols.update({k: v for k, v in described.items() if k in SETTINGS_COLUMNS and k not in cols})
    if workload.engine == EXTERNAL:  # a built-in engine's settings are typed columns of their own
        effective = {**workload.resolved_settings(), **(described.get("engine_settings") or {})}
        cols["engine_settings_json"] = json.dumps(effective, sort_keys=True, default=str)
    return cols


DEFAULT_CONFIG = SweepConfig()

_SWEEP_KEYS = {"seed", "input_seed", "offset_seed", "trials_per_cell", "reference_runs", "mechanisms",
               "deliveries", "ping_samples"}
def _int(value, where: str, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where} must be <= {maximum}, got {value}")
    return value


def _number(value, where: str, minimum: float, maximum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if not minimum <= value <= maximum:
        raise ConfigError(f"{where} must be in [{minimum:g}, {maximum:g}], got {value!r}")
    return float(value)


def _table(data: dict, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table, got {value!r}")
    return value


def _names(value, where: str, allowed: tuple[str, ...] | None) -> tuple[str, ...]:
    """A non-empty list of distinct names; of ``allowed`` (None: any identifier)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{where} must be a non-empty list")
    for v in value:
        if allowed is None:
            if not isinstance(v, str) or not v.isidentifier() or len(v) > 64:
                raise ConfigError(f"{where}: {v!r:.80} is not a name (letters, digits, _)")
        elif v not in allowed:
            raise ConfigError(f"{where}: unknown value {v!r} (known: {', '.join(allowed)})")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: duplicate values in {list(value)}")
    return tuple(value)


def _workload(raw: dict, i: int, declare=None) -> WorkloadSpec:
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
    external = engine == EXTERNAL
    allowed = set(_COMMON_KEYS) | (set(EXTERNAL_KEYS) if external else
                                   {s.name for s in ENGINES[engine].declaration.settings})
    if not external and not ENGINES[engine].needs_model:
        allowed -= {"model", "mmproj", "lock", "inputs"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        if not external and set(unknown) <= set(BUILTIN_SETTINGS):
            raise ConfigError(f"{where}: {', '.join(unknown)} is not a setting of the {engine} engine (its settings: "
                              f"{', '.join(s.name for s in ENGINES[engine].declaration.settings)})")
        if external and set(unknown) <= set(BUILTIN_SETTINGS):
            raise ConfigError(f"{where}: an external engine's settings go in its settings table "
                              f"(settings = {{{unknown[0]} = ...}})")
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    kwargs = {k: v for k, v in raw.items() if k in set(_COMMON_KEYS)}
    for key in ("model", "mmproj", "lock", "inputs"):
        if key in kwargs and (not isinstance(kwargs[key], str) or not kwargs[key].strip()):
            raise ConfigError(f"{where}.{key} must be a non-empty string, got {kwargs[key]!r}")
    if "backends" in kwargs:
        kwargs["backends"] = _names(kwargs["backends"], f"{where}.backends", BACKENDS)
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
    _check_workload(spec, where)
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
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                                            for k, v in env.items()):
        raise ConfigError(f"{where}.env must be a table of NAME = \"value\" strings")
    out["env"] = tuple(sorted(env.items()))
    for key, hi in (("startup_timeout_s", MAX_STARTUP_S), ("answer_timeout_s", MAX_ANSWER_S)):
        if key in raw:
            out[key] = _number(raw[key], f"{where}.{key}", 1.0, hi)
    settings = raw.get("settings", {})
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}.settings must be a table of setting = value")
    out["settings"] = tuple(sorted(settings.items()))
    return out


def _check_workload(spec: WorkloadSpec, where: str) -> None:
    """What no single setting says: sizes that must agree, files an engine needs."""
    s = spec.resolved_settings() if spec.engine != EXTERNAL else {}
    if s.get("n_ubatch") is not None and s["n_ubatch"] > s["n_batch"]:
        raise ConfigError(f"{where}: n_ubatch ({s['n_ubatch']}) must be <= n_batch ({s['n_batch']})")
    engine = spec.spec
    if engine.needs_mmproj and spec.model == WorkloadSpec.model:
        raise ConfigError(f"{where}: engine {spec.engine} needs 'model' (and 'mmproj')")
    if engine.needs_mmproj and not spec.mmproj:
        raise ConfigError(f"{where}: engine {spec.engine} needs 'mmproj'")
    if spec.engine == EXTERNAL and spec.mmproj and not spec.model:
        raise ConfigError(f"{where}: 'mmproj' needs a 'model'")
    for key in ("model", "mmproj"):
        path = getattr(spec, key)
        if engine.needs_model and path and not path.startswith("fixture:") and not spec.lock:
            raise ConfigError(f"{where}: {key} {path} needs a 'lock' file (see `cancelbench lock`)")


def _sweep_kwargs(data: dict) -> dict:
    sweep = _table(data, "sweep", "[sweep]")
    if set(sweep) - _SWEEP_KEYS:
        raise ConfigError(f"[sweep]: unknown key(s) {', '.join(sorted(set(sweep) - _SWEEP_KEYS))}")
    kw: dict = {}
    for key in ("seed", "input_seed", "offset_seed"):
        if key in sweep:
            kw[key] = _int(sweep[key], f"sweep.{key}", 0, MAX_SEED)
    if "trials_per_cell" in sweep:
        kw["trials_per_cell"] = _int(sweep["trials_per_cell"], "sweep.trials_per_cell", 1, MAX_TRIALS_PER_CELL)
    if "reference_runs" in sweep:
        kw["reference_runs"] = _int(sweep["reference_runs"], "sweep.reference_runs", 3, MAX_REFERENCE_RUNS)
    if "ping_samples" in sweep:
        kw["ping_samples"] = _int(sweep["ping_samples"], "sweep.ping_samples", 1, MAX_PING_SAMPLES)
    if "mechanisms" in sweep:
        # names only here: which engine has which mechanism is checked per workload (parse_config)
        kw["mechanisms"] = _names(sweep["mechanisms"], "sweep.mechanisms", None)
    if "deliveries" in sweep:
        kw["deliveries"] = _names(sweep["deliveries"], "sweep.deliveries", DELIVERIES)
    return kw


def _offsets(data: dict) -> OffsetSpec:
    off = _table(data, "offsets", "[offsets]")
    known = set(OffsetSpec.__dataclass_fields__)
    if set(off) - known:
        raise ConfigError(f"[offsets]: unknown key(s) {', '.join(sorted(set(off) - known))}")
    plan = off.get("plan", "uniform")
    if plan not in OFFSET_PLANS:
        raise ConfigError(f"offsets.plan: unknown plan {plan!r} (known: {', '.join(OFFSET_PLANS)})")
    fixed = off.get("fixed_ms", [])
    if not isinstance(fixed, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in fixed):
        raise ConfigError("offsets.fixed_ms must be a list of numbers (ms)")
    if any(not 0 <= v <= MAX_OFFSET_MS for v in fixed):  # also false for NaN
        raise ConfigError(f"offsets.fixed_ms: offsets must be finite and >= 0 and <= {MAX_OFFSET_MS:.0f} "
                          f"(one hour), got {fixed}")
    if plan == "fixed" and not fixed:
        raise ConfigError("offsets.plan = 'fixed' needs a non-empty offsets.fixed_ms")
    max_fraction = off.get("max_fraction", OffsetSpec.max_fraction)
    if isinstance(max_fraction, bool) or not isinstance(max_fraction, (int, float)) or not 0 < max_fraction <= 2:
        raise ConfigError(f"offsets.max_fraction must be in (0, 2], got {max_fraction!r}")
    phases = off.get("phases", [])
    if not isinstance(phases, list) or not all(isinstance(p, str) for p in phases) or len(set(phases)) != len(phases):
        raise ConfigError("offsets.phases must be a list of distinct phase names")
    if phases and plan not in PHASE_PLANS:
        raise ConfigError(f"offsets.phases applies to the phase plans ({', '.join(PHASE_PLANS)}), "
                          f"not to plan {plan!r}")
    return OffsetSpec(plan=plan, fixed_ms=tuple(float(v) for v in fixed),
                      min_per_phase=_int(off.get("min_per_phase", 5), "offsets.min_per_phase", 1,
                                         MAX_TRIALS_PER_CELL),
                      max_fraction=float(max_fraction), phases=tuple(phases))


def _devices(data: dict) -> DeviceSelector:
    dev = _table(data, "devices", "[devices]")
    known = {"backends", "hosts", "labels", "sim_per_host"}
    if set(dev) - known:
        raise ConfigError(f"[devices]: unknown key(s) {', '.join(sorted(set(dev) - known))}")
    labels = dev.get("labels", {})
    if not isinstance(labels, dict):
        raise ConfigError("devices.labels must be a table of label = value")
    hosts = dev.get("hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise ConfigError("devices.hosts must be a list of host names")
    sim_per_host = _int(dev.get("sim_per_host", 0), "devices.sim_per_host", 0, MAX_SIM_PER_HOST)
    if sim_per_host and "backends" in dev:
        raise ConfigError("devices.sim_per_host gives each host simulated devices (backend sim); "
                          "it takes no devices.backends")
    return DeviceSelector(backends=_names(dev.get("backends", ["cpu"]), "devices.backends", BACKENDS),
                          hosts=tuple(hosts), labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
                          sim_per_host=sim_per_host)


def _check_target_phases(config: SweepConfig) -> None:
    """offsets.phases: every name a phase some workload's plan can aim at, and every
    workload left with at least one target phase."""
    off = config.offsets
    if not off.phases:
        return
    anchored = off.plan in ANCHORED_PLANS
    reachable = {p for w in config.workloads for p in w.spec.plan_phases(anchored)}
    unknown = [p for p in off.phases if p not in reachable]
    if unknown:
        raise ConfigError(f"offsets.phases: {', '.join(unknown)} is not a phase the {off.plan} plan can aim at "
                          f"in these workloads (can: {', '.join(sorted(reachable))})")
    for wl in config.workloads:
        if not off.target_phases(wl.spec):
            raise ConfigError(f"offsets.phases: workload {wl.name} ({wl.engine} engine) has none of "
                              f"{', '.join(off.phases)}")


def parse_config(data: dict, declare=None) -> SweepConfig:
    """Validate a parsed TOML document; defaults fill what is absent. ``declare(workload)``
    returns an external engine's declaration (its hello; cancelbench.sut.client.declare)."""
    unknown = set(data) - {"sweep", "offsets", "devices", "workload"}
    if unknown:
        raise ConfigError(f"unknown top-level table(s): {', '.join(sorted(unknown))}")
    kw = _sweep_kwargs(data)
    raw_workloads = data.get("workload", [])
    if not isinstance(raw_workloads, list):
        raise ConfigError("[[workload]] must be an array of tables")
    if "workload" in data and not raw_workloads:
        raise ConfigError("workload = [] lists no workload; give at least one [[workload]] table "
                          "(or leave 'workload' out for the built-in default)")
    workloads = tuple(_workload(w, i, declare) for i, w in enumerate(raw_workloads)) or DEFAULT_CONFIG.workloads
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise ConfigError(f"workload names must be unique, got {names}")
    parts = [safe_component(n) for n in names]  # trial ids: injective by construction, checked anyway
    if len(set(parts)) != len(parts):
        raise ConfigError(f"workload names {names} give the same trial-id part; rename one")
    config = check_plan_size(SweepConfig(offsets=_offsets(data), devices=_devices(data), workloads=workloads, **kw))
    if config.devices.sim_per_host:
        real = [w.name for w in config.workloads if not w.spec.simulated]
        if real:
            raise ConfigError(f"devices.sim_per_host: simulated devices run only simulated engines; workload(s) "
                              f"{', '.join(real)} use a real engine")
    _check_target_phases(config)
    for wl in config.workloads:  # before any trial: a cell the engine cannot run is a config error
        lacking = [m for m in config.mechanisms if m not in wl.spec.mechanisms]
        if lacking:
            raise ConfigError(f"workload {wl.name}: the {wl.engine} engine has no mechanism(s) "
                              f"{', '.join(lacking)} (has: {', '.join(wl.spec.mechanisms)})")
    return config


def trials_per_device(config: SweepConfig) -> int:
    """Planned trials on one device (references + cancels), as build_plan makes them."""
    per_cell = max(config.offsets.cancels_per_cell(config.trials_per_cell, w.spec) for w in config.workloads)
    per_workload = len(config.mechanisms) * (config.reference_runs + len(config.deliveries) * per_cell)
    return per_workload * len(config.workloads)


def check_plan_size(config: SweepConfig) -> SweepConfig:
    """Refuse a plan of more than MAX_PLAN_TRIALS trials on even one device, before it is built."""
    n = trials_per_device(config)
    if n > MAX_PLAN_TRIALS:
        raise ConfigError(f"the plan has {n} trials per device, more than {MAX_PLAN_TRIALS} (the most a sweep allows); "
                          "lower sweep.trials_per_cell or split the sweep")
    return config


def with_trials(config: SweepConfig, trials_per_cell: int) -> SweepConfig:
    """``config`` with ``trials_per_cell`` replaced (the CLI's --trials), validated like the TOML key."""
    import dataclasses

    _int(trials_per_cell, "--trials", 1, MAX_TRIALS_PER_CELL)
    return check_plan_size(dataclasses.replace(config, trials_per_cell=trials_per_cell))


def thread_warnings(config: SweepConfig, n_cores: int) -> list[str]:
    """One line per workload asking for more llama.cpp threads than the host has cores."""
    return [f"workload {w.name}: n_threads = {w.resolved_settings()['n_threads']} is more than this host's {n_cores} cores; "
            "llama.cpp threads will contend and every trial slows down"
            for w in config.workloads if (w.resolved_settings().get("n_threads") or 0) > n_cores]


def preflight(workload: WorkloadSpec) -> Declaration:
    """An external engine's declaration: start its command once here, read its hello, shut it down."""
    from cancelbench.sut.client import declare

    return declare(list(workload.command), cwd=workload.cwd, env=dict(workload.env),
                   startup_timeout_s=workload.startup_timeout_s)


def load_config(path: Path | None, declare=preflight) -> SweepConfig:
    """Read and validate a TOML sweep config; ``None`` gives the built-in default.
    ``declare``: how to learn an external engine's declaration (see parse_config)."""
    if path is None:
        return DEFAULT_CONFIG
    data = load_toml(Path(path), "config file", MAX_CONFIG_BYTES, ConfigError)  # a bounded regular file
    try:
        return parse_config(data, declare)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
