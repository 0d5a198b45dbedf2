"""Sweep configuration: TOML in, validated typed dataclasses out.

Every problem is a :class:`ConfigError` with a one-line message; nothing is
written anywhere before the whole config has been validated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cancelbench.device_agents.engines.registry import BACKENDS, MAX_SEED
from cancelbench.engine_decls import typed_columns
from cancelbench.inputs import MAX_CONFIG_BYTES, load_toml, safe_component
from cancelbench.schema import DELIVERIES, SETTINGS_COLUMNS

from .bargein_config import DETECTOR, check_deliveries
from .checks import ConfigError, check_int, check_names, table_of
from .offsets import (ANCHORED_PLANS, MAX_OFFSET_MS, MAX_TRIALS_PER_CELL, OFFSET_PLANS, PHASE_PLANS,  # noqa: F401
                      OffsetSpec, parse_offsets)
from .workloads import WorkloadSpec, parse_workload, preflight

# Upper bounds, checked before anything runs (docs/cli.md, "Sweep configuration (TOML)", Bounds).
MAX_REFERENCE_RUNS = 1_000
MAX_PING_SAMPLES = 10_000
MAX_SIM_PER_HOST = 1_024  # simulated devices (one agent process each) per host
# Planned trials in one sweep, all devices together (the plan is built in the driver's memory before
# the first trial; benchmarks/results/plan_scale.json has its measured cost). Checked per device at
# config load (a lower bound) and for the whole sweep once the devices are known.
MAX_PLAN_TRIALS = 1_000_000


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
        """The offset plan's parameters as settings columns (cancel trials; references: none)."""
        cols = {"reference_runs": self.reference_runs}
        if trial_kind == "cancel":
            return {**cols, **self.offsets.settings()}
        return {**cols, **dict.fromkeys(self.offsets.settings())}


def trial_settings(config: SweepConfig, workload: WorkloadSpec, trial_kind: str, described: dict) -> dict:
    """Every settings column of one trial: the config's values, the offset plan's
    parameters and the engine's effective values (``described``, from load)."""
    cols = {**workload.settings_columns(), **config.offset_settings(trial_kind)}
    if workload.bargein is not None:
        cols.update(workload.bargein.columns())
    cols.update({k: v for k, v in described.items() if k in SETTINGS_COLUMNS and k not in cols})
    if workload.spec.external:  # a built-in engine's settings are typed columns of their own
        effective = {**workload.resolved_settings(), **(described.get("engine_settings") or {})}
        cols["engine_settings_json"] = json.dumps(effective, sort_keys=True, default=str)
        cols.update({k: v for k, v in typed_columns(effective, workload.declaration).items() if k not in cols})
    return cols


DEFAULT_CONFIG = SweepConfig()

_SWEEP_KEYS = {"seed", "input_seed", "offset_seed", "trials_per_cell", "reference_runs", "mechanisms",
               "deliveries", "ping_samples"}
def _sweep_kwargs(data: dict) -> dict:
    sweep = table_of(data, "sweep", "[sweep]")
    if set(sweep) - _SWEEP_KEYS:
        raise ConfigError(f"[sweep]: unknown key(s) {', '.join(sorted(set(sweep) - _SWEEP_KEYS))}")
    kw: dict = {}
    for key in ("seed", "input_seed", "offset_seed"):
        if key in sweep:
            kw[key] = check_int(sweep[key], f"sweep.{key}", 0, MAX_SEED)
    if "trials_per_cell" in sweep:
        kw["trials_per_cell"] = check_int(sweep["trials_per_cell"], "sweep.trials_per_cell", 1, MAX_TRIALS_PER_CELL)
    if "reference_runs" in sweep:
        kw["reference_runs"] = check_int(sweep["reference_runs"], "sweep.reference_runs", 3, MAX_REFERENCE_RUNS)
    if "ping_samples" in sweep:
        kw["ping_samples"] = check_int(sweep["ping_samples"], "sweep.ping_samples", 1, MAX_PING_SAMPLES)
    if "mechanisms" in sweep:
        # names only here: which engine has which mechanism is checked per workload (parse_config)
        kw["mechanisms"] = check_names(sweep["mechanisms"], "sweep.mechanisms", None)
    if "deliveries" in sweep:
        kw["deliveries"] = check_names(sweep["deliveries"], "sweep.deliveries", DELIVERIES)
    return kw


def _devices(data: dict) -> DeviceSelector:
    dev = table_of(data, "devices", "[devices]")
    known = {"backends", "hosts", "labels", "sim_per_host"}
    if set(dev) - known:
        raise ConfigError(f"[devices]: unknown key(s) {', '.join(sorted(set(dev) - known))}")
    labels = dev.get("labels", {})
    if not isinstance(labels, dict):
        raise ConfigError("devices.labels must be a table of label = value")
    hosts = dev.get("hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h.strip() for h in hosts):
        raise ConfigError(f"devices.hosts must be a list of non-empty host names, got {hosts!r}")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"devices.hosts names a host twice: {hosts!r}")
    sim_per_host = check_int(dev.get("sim_per_host", 0), "devices.sim_per_host", 0, MAX_SIM_PER_HOST)
    if sim_per_host and "backends" in dev:
        raise ConfigError("devices.sim_per_host gives each host simulated devices (backend sim); "
                          "it takes no devices.backends")
    return DeviceSelector(backends=check_names(dev.get("backends", ["cpu"]), "devices.backends", BACKENDS),
                          hosts=tuple(hosts), labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
                          sim_per_host=sim_per_host)


def _check_target_phases(config: SweepConfig) -> None:
    """offsets.phases: every name a phase some workload's plan can aim at, and every
    workload left with at least one target phase."""
    off = config.offsets
    if not off.phases:
        return
    anchored = off.kind.anchored
    reachable = {p for w in config.workloads for p in w.spec.plan_phases(anchored)}
    unknown = [p for p in off.phases if p not in reachable]
    if unknown:
        raise ConfigError(f"offsets.phases: {', '.join(unknown)} is not a phase the {off.plan} plan can aim at "
                          f"in these workloads (can: {', '.join(sorted(reachable))})")
    for wl in config.workloads:
        if not off.target_phases(wl.spec):
            raise ConfigError(f"offsets.phases: workload {wl.name} ({wl.engine} engine) has none of "
                              f"{', '.join(off.phases)}")


def fold_name(name: str) -> str:
    """A workload name as a case-insensitive, Unicode-normalising file system would see it."""
    import unicodedata

    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold()).strip()


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
    workloads = tuple(parse_workload(w, i, declare) for i, w in enumerate(raw_workloads)) or DEFAULT_CONFIG.workloads
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise ConfigError(f"workload names must be unique, got {names}")
    folded: dict[str, str] = {}
    for n in names:  # trial ids name files: on a case-insensitive file system these would collide
        prior = folded.setdefault(fold_name(n), n)
        if prior != n:
            raise ConfigError(f"workload names {prior!r} and {n!r} differ only by case, Unicode form or "
                              "surrounding spaces; rename one")
    parts = [safe_component(n) for n in names]  # trial ids: injective by construction, checked anyway
    if len(set(parts)) != len(parts):
        raise ConfigError(f"workload names {names} give the same trial-id part; rename one")
    if "deliveries" not in kw and all(w.bargein is not None for w in workloads):
        kw["deliveries"] = (DETECTOR,)  # a barge-in sweep: the detector issues its cancels
    check_deliveries(kw.get("deliveries", SweepConfig.deliveries), workloads)
    config = check_plan_size(SweepConfig(offsets=parse_offsets(data), devices=_devices(data), workloads=workloads, **kw))
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

    check_int(trials_per_cell, "--trials", 1, MAX_TRIALS_PER_CELL)
    return check_plan_size(dataclasses.replace(config, trials_per_cell=trials_per_cell))


def thread_warnings(config: SweepConfig, n_cores: int) -> list[str]:
    """One line per workload asking for more llama.cpp threads than the host has cores."""
    return [f"workload {w.name}: n_threads = {w.resolved_settings()['n_threads']} is more than this host's {n_cores} cores; "
            "llama.cpp threads will contend and every trial slows down"
            for w in config.workloads if (w.resolved_settings().get("n_threads") or 0) > n_cores]


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
