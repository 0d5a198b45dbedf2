"""The trial record: one flat row per trial (llama-bench style), versioned.

Columns come in groups (``GROUPS``: identity, host, settings, plan, receipt,
timestamps, derived, result, cpu, bargein, partition), each tagged with who fills it; the
driver's half and the agent's half are checked against those tags and merged
once (``merge``), and ``finalize`` classifies and derives.

Offsets
-------
Every cancel is anchored to an engine event, ``t_anchor_ns``: the agent's hand-back
(time plans: immediate, uniform, fixed), entry into the target phase (``phase``), or
the start of the k-th step call of the target phase (``progress``), due at anchor +
``offset_target_ms`` (``t_cancel_scheduled_ns``). ``agent`` delivery fires from a
timer the agent starts at the event; ``driver`` delivery waits for the event to reach
the driver (``t_anchor_seen_ns``, ``anchor_hop_ms``), then fires at the due instant on
the driver clock (at once if passed: ``schedule_lag_ms``); ``detector`` delivery (barge-in)
starts the user's speech there and the detector fires. ``offset_actual_ms`` is from hand-back.

Clock domains
-------------
* ``t_*_ns`` columns are on the **agent's monotonic clock** (``native.now_ns``,
  CLOCK_MONOTONIC of the host that ran the trial), including ``t_issued_ns``,
  which the driver took on its own clock and is converted here with the
  ping-estimated ``clock_offset_ns`` (agent minus driver).
* ``t_issued_driver_ns`` is the raw **driver monotonic clock** reading.
* ``clock_uncertainty_ns`` bounds the conversion error (half the lowest ping
  round trip); for ``delivery == "agent"`` issue happens on the agent and the
  uncertainty is 0.
* ``*_ms`` columns are derived from those timestamps only (see ``derive``).
Absent values are nulls: a trial that never received a cancel has no
``t_received_ns``; a text trial has no ``frames_generated_at_receipt``.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from cancelbench.schema_cpu import CPU_FIELDS

from . import schema_bargein
from .outcome import (DEFECT_OUTCOMES, OUTCOMES, STOP_COLUMNS, classify_outcome,  # noqa: F401 (re-exported)
                      drop_margin_ns)

# 2: every setting that shapes a trial is a column; 3: engines declare themselves (engine_* columns, external
# engines); 4: the cpu group (engine work vs CPU wait); 5: barge-in (schema_bargein); 6: trial_observe_cpu_ms
# (engine work before the native reader saw the cancel); 7: the outcome from the agent's own facts
# (cancel_reach_ns, drop_margin_ms, error_detail; no latency on a completed row); 8: the shared cancel word
# (engine_cancel_path, engine_cancel_via); 9: the whole trial's span and steal (trial_run_wall_ms,
# host_run_steal_ms: the noise check's steal); 10: cancel_stall_ns (the outcome rule's allowance for a cancel
# held off a CPU); 11: trial_cpu_source (an external engine's trial-thread figures, engine-reported: protocol
# 1.3); 12: engine_process (a built-in engine in the agent's process or a child of its own); 13: engine_restarts
# (the engine process a trial ran on: the first, or one started again after a crash, a kill or a stall);
# readers accept older versions (new columns null)
SCHEMA_VERSION = 13

# Partition columns of the hive-partitioned dataset (values sanitized for paths).
PARTITION_COLUMNS = ("backend", "host")

DELIVERIES = ("driver", "agent", "detector")  # detector: barge-in (docs/bargein.md)
# delivery / offset_plan of a reference (uncancelled) run: no cancel, so neither applies.
NOT_APPLICABLE = "none"


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    group: str  # one of GROUPS: what the column is about
    doc: str
    owner: str  # who fills it: driver | agent | either | derived


# Column groups, in record order, with who fills them by default. The record is
# assembled from these groups: the driver's half (``driver_half``: identity,
# settings, plan) and the agent's (``agent_half``: host, receipt, timestamps,
# result) are merged once (``merge``); ``finalize`` derives the rest.
GROUPS = {
    "identity": "driver",    # which trial of which sweep
    "host": "agent",         # where it ran (collected once per agent, carried on every row)
    "settings": "driver",    # every setting that shapes a trial: diff compares only equal settings
    "plan": "driver",        # the cancel that was planned
    "receipt": "agent",      # engine state when the cancel was received
    "timestamps": "agent",   # agent monotonic ns unless the doc says otherwise
    "derived": "derived",    # *_ms from the timestamps (``derive``)
    "result": "agent",       # what the engine did
    "cpu": "agent",          # where the engine's time went, cancel received -> stopped (device_agents/cpu_account.py)
    "bargein": "agent",      # barge-in: onset -> detected -> ... -> silence (cancelbench/schema_bargein.py)
    "partition": "either",   # directory names (sanitized)
}

_I32, _I64, _F64, _STR, _BOOL = pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.bool_()


def _engine_setting_fields() -> list[tuple]:
    """One settings column per built-in engine setting (its record column), typed and
    documented from the declarations (cancelbench/engine_decls.py), so a setting
    added there is a column here without editing this file."""
    from cancelbench.engine_decls import DECLARATIONS

    types = {("int", "int32"): _I32, ("int", "int64"): _I64, ("float", "float64"): _F64, ("float", "int32"): _F64,
             ("bool", "int32"): _BOOL, ("string", "int32"): _STR}
    columns: dict[str, tuple] = {}
    for decl in DECLARATIONS.values():
        for s in decl.settings:
            col = s.record_column
            engines = [n for n, d in DECLARATIONS.items() if any(x.record_column == col for x in d.settings)]
            columns.setdefault(col, (col, types[(s.type, s.width)], "settings", f"{', '.join(engines)}: {s.doc}"))
    return list(columns.values())


_ENGINE_SETTING_FIELDS = _engine_setting_fields()

# (name, type, group, doc[, owner override])
_FIELDS: list[tuple] = [
    ("schema_version", _I32, "identity", "record schema version (this file's SCHEMA_VERSION)"),
    ("sweep_id", _STR, "identity", "sweep identifier (one per `cancelbench sweep` dataset)"),
    ("trial_id", _STR, "identity", "unique trial id within the sweep (stable across resume)", "either"),
    ("trial_index", _I64, "identity", "position in the pre-generated plan"),
    ("trial_kind", _STR, "identity", "reference (uncancelled) | cancel"),
    ("seed", _I64, "identity", "sweep seed"),
    ("input_seed", _I64, "identity", "seed that chose this trial's input"),
    ("offset_seed", _I64, "identity", "seed that drew this trial's offset"),
    ("hostname", _STR, "host", "host name as reported by the agent (unsanitized)"),
    ("node_id", _STR, "host", "Ray node id"),
    ("device", _STR, "host", "device id on that host, e.g. cpu:0, vulkan:0", "either"),
    ("device_name", _STR, "host", "device name from the backend probe"),
    ("platform", _STR, "host", "os of the agent host (linux, darwin, ...)"),
    ("arch", _STR, "host", "machine architecture"),
    ("cpu_model", _STR, "host", "cpu model string"),
    ("llama_cpp_python_version", _STR, "host", "llama-cpp-python version"),
    ("llama_cpp_build", _STR, "host", "llama.cpp build commit/number"),
    ("cancelbench_version", _STR, "host", "cancelbench version"),
    ("cancelbench_git_describe", _STR, "host", "git describe of the agent's cancelbench checkout, else null"),
    ("llama_cpp_commit", _STR, "host", "llama.cpp commit the agent loaded (ggml_commit of the vendored tree)"),
    ("ggml_version", _STR, "host", "ggml version the agent loaded (ggml_version)"),
    ("ggml_backends", _STR, "host", "ggml backends registered in the agent process, e.g. CPU,Vulkan"),
    ("os_release", _STR, "host", "OS name and version of the agent host (os-release PRETTY_NAME, macOS version)"),
    ("kernel_version", _STR, "host", "kernel release of the agent host (uname -r)"),
    ("gpu_driver_version", _STR, "host", "GPU driver version of the agent's device (Vulkan/NVIDIA), null on CPU"),
    ("agent_niceness", _I32, "host", "the agent process's nice value (Ray starts workers at 15 unless RAY_worker_niceness says otherwise; a cancelbench-started Ray: 0)"),
    ("engine_name", _STR, "host", "the engine's declared name (cancelbench-text ..., or an external engine's hello)"),
    ("engine_version", _STR, "host", "the engine's declared version (the cancelbench version for built-in engines)"),
    ("engine_build_json", _STR, "host", "an external engine's build facts from its hello, JSON {key: value}; null for built-in engines"),
    ("engine_restarts", _I32, "host", "engines in a process of their own: how many times the agent had started this workload's engine process again before this trial ran (after a crash, a kill over the run's bound, a stall or a broken stream; each such trial is an error row): 0 on the first process; a restarted process starts cold (caches, compute buffers). Null in the agent's process and in records older than schema 13"),
    ("engine_clock", _STR, "host", "external engines: same (the engine's pongs lay on the agent's clock) | estimated (engine_clock_offset_ns applied to its timestamps)"),
    ("engine_clock_offset_ns", _I64, "host", "external engines: engine clock minus agent clock (0 when same)"),
    ("engine_clock_uncertainty_ns", _I64, "host", "external engines: bound on that conversion (half the fastest ping round trip; 0 when same)"),
    ("engine_cancel_path", _STR, "host", "external engines: how the agent handed this trial's cancel over: word (it stored the trial's cancel_seq in the engine's shared cancel word, then wrote the cancel line) | line (the cancel line alone: the engine declares no cancel_word, or the platform has no private region); null in process and for reference runs"),
    ("engine_cancel_via", _STR, "host", "external engines: how the engine says it first learnt of the cancel it received (done.cancel_via: word | line); the engine's own claim, informative only (the outcome never depends on it)"),
    ("agent_switch_interval_us", _F64, "host", "the agent process's Python switch interval (sys.getswitchinterval), µs: how long a cancel arriving while the engine runs Python may wait for the GIL"),
    ("workload", _STR, "settings", "workload name from the sweep config"),
    ("engine", _STR, "settings", "text | tts | stt | probe | sim (simulated: waits, not compute)"),
    ("engine_process", _STR, "settings", "where the engine ran: agent (in the agent's process, called directly) | child (a process of its own the agent started and supervised, speaking the engine protocol: a built-in engine through the engine library, an external engine always) | channel (a simulated engine only: the engine library on a thread of the agent's process, speaking the same protocol over a pipe pair; since schema 13, the sim engine's default); null in records older than schema 12"),
    ("model", _STR, "settings", "model file name"),
    ("model_sha256", _STR, "settings", "sha256 of the model file (verified against its lock on the agent)", "either"),
    ("mmproj", _STR, "settings", "multimodal projector file name (tts/stt), else null"),
    ("corpus", _STR, "settings", "input corpus name (datasets/corpora/<name>.jsonl) or path"),
    *_ENGINE_SETTING_FIELDS,  # every built-in engine setting, from the engines' declarations
    ("engine_settings_json", _STR, "settings", "external engines: every setting the engine declared, the config's value or the declared default, with the values the engine chose itself (`loaded.settings` of an external engine), JSON {name: value}"),
    ("reference_runs", _I32, "settings", "reference runs per device/workload/mechanism (the reference run is their median)"),
    ("offset_max_fraction", _F64, "settings", "uniform plan: offsets drawn over [0, this) of the reference duration"),
    ("offset_min_per_phase", _I32, "settings", "phase plan: cancels aimed at each phase, at least"),
    ("offset_fixed_ms_json", _STR, "settings", "fixed plan: the offsets list, JSON"),
    ("offset_phases_json", _STR, "settings", "phase plans: the target phases asked for, JSON (null: every phase the plan can reach)"),
    ("input_id", _STR, "plan", "id of the prompt/clip from datasets/"),
    ("mechanism", _STR, "plan", "between_calls | abort_callback | chunked | graph_eval"),
    ("delivery", _STR, "plan", "driver (actor call from the driver) | agent (agent-side timer) | detector (barge-in: the detector on the microphone) | none (reference)"),
    ("offset_plan", _STR, "plan", "immediate | uniform | fixed | phase | progress | phase_time | none (reference)"),
    ("offset_fraction", _F64, "plan", "planned offset as a fraction of the reference duration (uniform/phase)"),
    ("target_phase", _STR, "plan", "phase the cancel aims at (phase and progress plans)"),
    ("anchor_step", _I32, "plan", "progress plan: the cancel is anchored on the start of this step call (1-based) "
     "of the target phase"),
    ("offset_target_ms", _F64, "plan", "planned delay from the anchor event (t_anchor_ns), ms"),
    ("target_window_ms", _F64, "plan", "phase/progress plans: how long the target lasts after its anchor event on this device's "
     "reference runs, at the shortest (phase: the first stay in the phase; progress: the k-th step call and the "
     "phase's steps after it), ms"),
    ("delivery_reach_ms", _F64, "plan", "how late this delivery's cancel may arrive after it is due: the 95th "
     "percentile (nearest rank; the slowest of under 20) of this device's last 64 samples before the trial, ms. "
     "Driver, per workload and anchor phase: round trips anchor event -> driver -> cancel received, less any "
     "wait for the due time, and those timed from the references' phase entries (round_trip_probes_ms_json); "
     "agent, per workload: its timer's lateness, t_issued - t_cancel_scheduled (timer probes until then)"),
    ("round_trip_probes_ms_json", _STR, "plan", "reference runs of a phase/progress sweep with driver delivery: "
     "the cancel path timed from each phase entry (agent answers at the entry -> driver's cancel timer -> agent "
     "call), on the agent's clock, ms, JSON {phase: [ms, ...]}; with the driver cancels' own round trips they "
     "make delivery_reach_ms"),
    ("target_reachable", _BOOL, "plan", "target_window_ms - offset_target_ms > delivery_reach_ms: the target "
     "outlasts the planned delay by the delivery's reach. False: the delivery cannot be sure to reach the target "
     "in time, and the report counts the trial apart from its cell's hit rate"),
    ("reference_ms", _F64, "plan", "duration of the reference run (plan.reference_run) the offset was resolved on"),
    ("phase_at_receipt", _STR, "receipt", "engine phase when the cancel was received"),
    ("native_call_at_receipt", _STR, "receipt", "native call in flight at receipt, or null"),
    ("input_tokens_done_at_receipt", _I64, "receipt", "prompt tokens decoded at receipt"),
    ("tokens_generated_at_receipt", _I64, "receipt", "tokens generated at receipt"),
    ("frames_generated_at_receipt", _I64, "receipt", "audio frames generated at receipt (tts)"),
    ("heavy_graph_at_receipt", _STR, "receipt", "code2wav window / clip encode in flight at receipt (speech), else null"),
    ("phase_at_terminal", _STR, "receipt", "phase in which the engine stopped"),
    ("t_handback_ns", _I64, "timestamps", "agent: run_trial entered (the task is handed back): the origin of every offset"),
    ("t_start_ns", _I64, "timestamps", "agent: first native call started"),
    ("t_anchor_ns", _I64, "timestamps", "agent: the anchor event the offset runs from (hand-back for the time "
     "plans; entry into the target phase; start of the anchor step), null if it never happened"),
    ("t_anchor_seen_ns", _I64, "timestamps",
     "agent clock: when the driver learned of the anchor event (driver delivery; driver time converted)", "driver"),
    ("t_cancel_scheduled_ns", _I64, "timestamps", "agent clock: t_anchor + offset_target (when the cancel was due)",
     "either"),
    ("t_issued_ns", _I64, "timestamps", "agent clock: when the cancel was issued (driver time converted)", "either"),
    ("t_issued_driver_ns", _I64, "timestamps", "driver clock: raw issue time (driver delivery)", "driver"),
    ("t_received_ns", _I64, "timestamps", "agent: cancel() entered on the agent"),
    ("t_engine_received_ns", _I64, "timestamps", "external engines: the engine process read the cancel message "
     "(its done.cancel_received_t, converted); the outcome rule uses it"),
    ("t_cancel_forwarded_ns", _I64, "timestamps", "external engines: the agent began handing the cancel to the "
     "engine: just before it stored the shared cancel word (engine_cancel_path word), else before it wrote the "
     "cancel message to the engine's stdin (after t_received; for a cancel latched before the run, just before "
     "the run message)"),
    ("t_engine_done_read_ns", _I64, "timestamps", "external engines: the agent read the engine's done message"),
    ("cancel_reach_ns", _I64, "timestamps", "how long after the agent forwarded a cancel the engine's terminal "
     "state may still have come before it (ns, a duration). In process null, taken as 0 (receipt and terminal "
     "decision are atomic); external engines: twice the slowest pong of this engine process the agent timed "
     "during runs (the last 64, this trial's included; before any, at start-up), a cancel's trip in and the "
     "done's trip out (docs/sut-protocol.md, \"The outcome rule\")"),
    ("cancel_stall_ns", _I64, "timestamps", "external engines on Linux: how long the cancel was held off a CPU "
     "between the agent's forward and its read of the done (ns, a duration, the kernel's schedstat run delay): the "
     "longest any engine thread waited on a runqueue, plus the agent's stdout reader's wait. Added to the reach "
     "in the outcome rule; null where not measured"),
    ("t_native_observed_ns", _I64, "timestamps", "agent: first native reader saw the token (abort mechanisms), else null"),
    ("t_native_returned_ns", _I64, "timestamps", "agent: the native call in flight at receipt returned"),
    ("t_terminal_ns", _I64, "timestamps", "agent: engine reached its terminal state"),
    ("clock_offset_ns", _I64, "timestamps", "agent clock minus driver clock (ping estimate)", "driver"),
    ("clock_uncertainty_ns", _I64, "timestamps", "bound on the conversion error (half the min ping RTT); 0 for agent delivery",
     "driver"),
    ("offset_actual_ms", _F64, "derived", "t_issued - t_handback"),
    ("anchor_offset_ms", _F64, "derived", "t_issued - t_anchor (the offset as it happened, from its anchor)"),
    ("anchor_hop_ms", _F64, "derived", "t_anchor_seen - t_anchor (driver delivery: the anchor event's hop to the driver)"),
    ("schedule_lag_ms", _F64, "derived", "t_issued - t_cancel_scheduled"),
    ("deliver_ms", _F64, "derived", "t_received - t_issued"),
    ("protocol_hop_ms", _F64, "derived", "t_engine_received - t_received (external engines: agent -> engine process)"),
    ("observe_ms", _F64, "derived", "t_native_observed - t_received"),
    ("return_ms", _F64, "derived", "t_native_returned - max(t_received, t_native_observed)"),
    ("settle_ms", _F64, "derived", "t_terminal - t_native_returned"),
    ("latency_ms", _F64, "derived", "t_terminal - t_received"),
    ("end_to_end_ms", _F64, "derived", "t_terminal - t_issued"),
    ("duration_ms", _F64, "derived", "t_terminal - t_handback"),
    ("cost_ratio", _F64, "derived", "latency_ms / reference_ms"),
    ("drop_margin_ms", _F64, "derived", "cancels the agent took: how long after the cancel could have reached "
     "the engine its terminal state came, on the agent's own stamps: (t_engine_done_read, in process "
     "t_terminal) - (t_cancel_forwarded, in process t_received) - cancel_reach - cancel_stall. At or above 0 a completed run "
     "is dropped; below 0 the cancel raced the completion"),
    ("outcome", _STR, "result", "cancelled | completed | dropped | error | lost (classify_outcome)", "either"),
    ("decode_rc", _I32, "result", "return code of the last native call (llama_decode 2 = aborted)"),
    ("abort_polls", _I64, "result", "native reader polls during the trial"),
    ("n_input_tokens", _I32, "result", "prompt tokens after tokenization"),
    ("output_sha256", _STR, "result", "sha256 of the produced output (tokens/audio/text) for reuse checks"),
    ("known_answer_error_ms", _F64, "result", "probe engine: t_native_returned - the first probe check after the token was set; "
     "sim: the wait in flight returned - its known answer (its stopping check, or its end between calls)"),
    ("phase_durations_json", _STR, "result", "reference runs: per-phase durations, JSON {phase: ms}"),
    ("phase_timeline_json", _STR, "result", "reference runs: [[phase, start_ms, end_ms], ...] from t_start"),
    ("phase_steps_json", _STR, "result", "step calls started per phase, JSON {phase: n} (progress plans draw on it)"),
    ("phase_step_ms_json", _STR, "result", "shortest step call per phase, JSON {phase: ms} (progress plans draw on it)"),
    ("error", _STR, "result", "error message (outcome error/lost): one line, control characters escaped", "either"),
    ("error_detail", _STR, "result", "where the harness failed (outcome error): its traceback, kept apart from "
     "the one-line error; null for an engine's own failure", "either"),
    ("engine_counters_json", _STR, "result", "external engines: the counters of its done message, JSON {name: int}"),
    ("engine_stderr", _STR, "result", "external engines: what the engine process wrote to stderr since the previous record (its last 8 KiB)"),
    *CPU_FIELDS,  # the cpu group: cancelbench/schema_cpu.py
    *schema_bargein.FIELDS,
    ("backend", _STR, "partition", "cpu | vulkan | metal | cuda"),
    ("host", _STR, "partition", "sanitized host name used as the partition path part"),
]

FIELDS: tuple[Column, ...] = tuple(
    Column(f[0], f[1], f[2], f[3], f[4] if len(f) > 4 else GROUPS[f[2]]) for f in _FIELDS)
assert all(c.group in GROUPS for c in FIELDS)


def columns_of(group: str) -> tuple[str, ...]:
    """The column names of one group, in record order."""
    if group not in GROUPS:
        raise KeyError(f"unknown column group {group!r}")
    return tuple(c.name for c in FIELDS if c.group == group)


# Every setting that shapes a trial: two cells compare only when these agree (``diff``).
SETTINGS_COLUMNS = columns_of("settings")

RECORD_SCHEMA = pa.schema(
    [pa.field(c.name, c.type, metadata={"doc": c.doc, "group": c.group}) for c in FIELDS],
    metadata={"cancelbench_schema_version": str(SCHEMA_VERSION)},
)
COLUMNS = tuple(c.name for c in FIELDS)
FILE_SCHEMA = pa.schema([f for f in RECORD_SCHEMA if f.name not in PARTITION_COLUMNS],
                        metadata=RECORD_SCHEMA.metadata)


def _ms(a: int | None, b: int | None) -> float | None:
    if a is None or b is None:
        return None
    return (a - b) / 1e6


def derive(row: dict) -> dict:
    """Fill the derived ``*_ms`` columns of a record from its timestamps (pure)."""
    g = row.get
    observed = g("t_native_observed_ns")
    received = g("t_received_ns")
    ret_from = max(x for x in (received, observed) if x is not None) if (received or observed) else None
    row["schedule_lag_ms"] = _ms(g("t_issued_ns"), g("t_cancel_scheduled_ns"))
    row["deliver_ms"] = _ms(received, g("t_issued_ns"))
    row["protocol_hop_ms"] = _ms(g("t_engine_received_ns"), received)
    row["observe_ms"] = _ms(observed, received)
    row["return_ms"] = _ms(g("t_native_returned_ns"), ret_from)
    row["settle_ms"] = _ms(g("t_terminal_ns"), g("t_native_returned_ns"))
    row["latency_ms"] = _ms(g("t_terminal_ns"), received)
    row["end_to_end_ms"] = _ms(g("t_terminal_ns"), g("t_issued_ns"))
    row["duration_ms"] = _ms(g("t_terminal_ns"), g("t_handback_ns"))
    row["offset_actual_ms"] = _ms(g("t_issued_ns"), g("t_handback_ns"))
    row["anchor_offset_ms"] = _ms(g("t_issued_ns"), g("t_anchor_ns"))
    row["anchor_hop_ms"] = _ms(g("t_anchor_seen_ns"), g("t_anchor_ns"))
    ref = g("reference_ms")
    lat = row["latency_ms"]
    row["cost_ratio"] = (lat / ref) if (lat is not None and ref) else None
    margin = drop_margin_ns(row)
    row["drop_margin_ms"] = None if margin is None else margin / 1e6
    if g("outcome") == "completed":  # the cancel raced the completion: no stop to measure
        row.update(dict.fromkeys(STOP_COLUMNS))
    schema_bargein.derive(row)
    return row


_PY_TYPES = {_I32: int, _I64: int, _F64: float, _STR: str, _BOOL: bool}

# The one typed record, generated from the column list above so the two cannot drift.
# Every field defaults to None (a null column); unknown names are a TypeError.
TrialRecord = dataclasses.make_dataclass(
    "TrialRecord",
    [(c.name, _PY_TYPES[c.type] | None, dataclasses.field(default=None)) for c in FIELDS],
    slots=True,
)
TrialRecord.__module__ = __name__  # so Ray can ship agent halves by reference
TrialRecord.__doc__ = "One trial, one flat row: see the column list in cancelbench.schema."

# The columns the agent fills (its half of the record), from the owner tags above.
AGENT_COLUMNS = frozenset(c.name for c in FIELDS if c.owner in ("agent", "either"))
DRIVER_COLUMNS = frozenset(c.name for c in FIELDS if c.owner in ("driver", "either"))


def agent_half(**columns) -> TrialRecord:
    """The agent's part of a record; a column the agent does not own is a bug."""
    foreign = set(columns) - AGENT_COLUMNS
    if foreign:
        raise ValueError(f"not agent columns: {', '.join(sorted(foreign))}")
    return TrialRecord(**columns)


def driver_half(**columns) -> TrialRecord:
    """The driver's part of a record (identity, settings, plan, clock conversion)."""
    foreign = set(columns) - DRIVER_COLUMNS
    if foreign:
        raise ValueError(f"not driver columns: {', '.join(sorted(foreign))}")
    return TrialRecord(**columns)


def merge(base: TrialRecord, half: TrialRecord) -> TrialRecord:
    """The driver's record with the agent's non-null columns laid over it."""
    return dataclasses.replace(base, **{k: v for k, v in as_row(half).items() if v is not None})


def as_row(record: TrialRecord) -> dict:
    return {name: getattr(record, name) for name in COLUMNS}


def finalize(record: TrialRecord) -> dict:
    """Classify the outcome and derive every ``*_ms`` column: the row the sink writes."""
    return finalize_row(as_row(record))


def finalize_row(row: dict) -> dict:
    """:func:`finalize` on a row of every column (a dict): classified and derived, in place."""
    row["schema_version"] = SCHEMA_VERSION
    row["outcome"], error = classify_outcome(row)
    if error is not None:
        row["error"] = error
    return derive(row)


def empty_row() -> dict:
    """A row with every column null (test and fixture builders start from it)."""
    return as_row(TrialRecord(schema_version=SCHEMA_VERSION))


def reference_run(rows) -> dict | None:
    """"The reference run" of a cell (device, workload, mechanism): the lower median of its
    completed reference trials by ``duration_ms`` (ties by trial id), a real run whose duration
    and phase timeline belong together (offsets are resolved on it; the offset plot shades it)."""
    done = [r for r in rows if r.get("outcome") == "completed" and r.get("duration_ms") is not None]
    if not done:
        return None
    done.sort(key=lambda r: (r["duration_ms"], str(r.get("trial_id"))))
    return done[(len(done) - 1) // 2]
