"""The trial record: one flat row per trial (llama-bench style), versioned.

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

SCHEMA_VERSION = 1

# Partition columns of the hive-partitioned dataset (values sanitized for paths).
PARTITION_COLUMNS = ("backend", "host")

# What an engine reports, then what the record says after classification.
ENGINE_OUTCOMES = ("cancelled", "completed", "error")
OUTCOMES = ("cancelled", "completed", "dropped", "error", "lost", "not_run")
DELIVERIES = ("driver", "agent")

_FIELDS: list[tuple[str, pa.DataType, str]] = [
    # identity
    ("schema_version", pa.int32(), "record schema version (this file's SCHEMA_VERSION)"),
    ("sweep_id", pa.string(), "sweep identifier (one per `cancelbench sweep` dataset)"),
    ("trial_id", pa.string(), "unique trial id within the sweep (stable across resume)"),
    ("trial_index", pa.int64(), "position in the pre-generated plan"),
    ("trial_kind", pa.string(), "reference (uncancelled) | cancel"),
    ("seed", pa.int64(), "sweep seed"),
    ("input_seed", pa.int64(), "seed that chose this trial's input"),
    ("offset_seed", pa.int64(), "seed that drew this trial's offset"),
    # where it ran (metadata collected once per agent, carried on every row)
    ("hostname", pa.string(), "host name as reported by the agent (unsanitized)"),
    ("node_id", pa.string(), "Ray node id"),
    ("device", pa.string(), "device id on that host, e.g. cpu:0, vulkan:0"),
    ("device_name", pa.string(), "device name from the backend probe"),
    ("platform", pa.string(), "os of the agent host (linux, darwin, ...)"),
    ("arch", pa.string(), "machine architecture"),
    ("cpu_model", pa.string(), "cpu model string"),
    ("n_threads", pa.int32(), "llama.cpp threads"),
    ("llama_cpp_python_version", pa.string(), "llama-cpp-python version"),
    ("llama_cpp_build", pa.string(), "llama.cpp build commit/number"),
    ("cancelbench_version", pa.string(), "cancelbench version"),
    ("cancelbench_git_describe", pa.string(), "git describe of the agent's cancelbench checkout, else null"),
    ("llama_cpp_commit", pa.string(), "llama.cpp commit the agent loaded (ggml_commit of the vendored tree)"),
    ("ggml_version", pa.string(), "ggml version the agent loaded (ggml_version)"),
    ("ggml_backends", pa.string(), "ggml backends registered in the agent process, e.g. CPU,Vulkan"),
    ("os_release", pa.string(), "OS name and version of the agent host (os-release PRETTY_NAME, macOS version)"),
    ("kernel_version", pa.string(), "kernel release of the agent host (uname -r)"),
    ("gpu_driver_version", pa.string(), "GPU driver version of the agent's device (Vulkan/NVIDIA), null on CPU"),
    # workload and engine settings
    ("workload", pa.string(), "workload name from the sweep config"),
    ("engine", pa.string(), "text | tts | stt | probe"),
    ("model", pa.string(), "model file name"),
    ("model_sha256", pa.string(), "sha256 of the model file (from its lock)"),
    ("n_ctx", pa.int32(), "context size"),
    ("n_batch", pa.int32(), "llama n_batch"),
    ("n_ubatch", pa.int32(), "llama n_ubatch"),
    ("chunk_tokens", pa.int32(), "prefill chunk size for the chunked mechanism"),
    ("max_tokens", pa.int32(), "generation cap (tokens or frames)"),
    ("n_gpu_layers", pa.int32(), "layers offloaded to the device"),
    ("input_id", pa.string(), "id of the prompt/clip from datasets/"),
    ("n_input_tokens", pa.int32(), "prompt tokens after tokenization"),
    # the cancel
    ("mechanism", pa.string(), "between_calls | abort_callback | chunked | graph_eval"),
    ("delivery", pa.string(), "driver (actor call from the driver) | agent (agent-side timer)"),
    ("offset_plan", pa.string(), "immediate | uniform | fixed | phase"),
    ("offset_fraction", pa.float64(), "planned offset as a fraction of the reference duration (uniform/phase)"),
    ("target_phase", pa.string(), "phase the offset aims at (phase plan)"),
    ("offset_target_ms", pa.float64(), "planned offset from hand-back, ms"),
    ("offset_actual_ms", pa.float64(), "t_issued_ns - t_handback_ns, ms"),
    # state at receipt
    ("phase_at_receipt", pa.string(), "engine phase when the cancel was received"),
    ("native_call_at_receipt", pa.string(), "native call in flight at receipt, or null"),
    ("input_tokens_done_at_receipt", pa.int64(), "prompt tokens decoded at receipt"),
    ("tokens_generated_at_receipt", pa.int64(), "tokens generated at receipt"),
    ("frames_generated_at_receipt", pa.int64(), "audio frames generated at receipt (tts)"),
    ("heavy_graph_at_receipt", pa.string(), "code2wav window / clip encode in flight at receipt (speech), else null"),
    ("phase_at_terminal", pa.string(), "phase in which the engine stopped"),
    # timestamps, agent monotonic ns
    ("t_handback_ns", pa.int64(), "agent: run_trial entered (the task is handed back to the caller)"),
    ("t_start_ns", pa.int64(), "agent: first native call started"),
    ("t_cancel_scheduled_ns", pa.int64(), "agent clock: when the cancel was scheduled to be issued"),
    ("t_issued_ns", pa.int64(), "agent clock: when the cancel was issued (driver time converted)"),
    ("t_issued_driver_ns", pa.int64(), "driver clock: raw issue time (driver delivery)"),
    ("t_received_ns", pa.int64(), "agent: cancel() entered on the agent"),
    ("t_native_observed_ns", pa.int64(), "agent: first native reader saw the token (abort mechanisms), else null"),
    ("t_native_returned_ns", pa.int64(), "agent: the native call in flight at receipt returned"),
    ("t_terminal_ns", pa.int64(), "agent: engine reached its terminal state"),
    ("clock_offset_ns", pa.int64(), "agent clock minus driver clock (ping estimate)"),
    ("clock_uncertainty_ns", pa.int64(), "bound on the conversion error (half the min ping RTT)"),
    # derived (ms), all from the timestamps above
    ("schedule_lag_ms", pa.float64(), "t_issued - t_cancel_scheduled"),
    ("deliver_ms", pa.float64(), "t_received - t_issued"),
    ("observe_ms", pa.float64(), "t_native_observed - t_received"),
    ("return_ms", pa.float64(), "t_native_returned - max(t_received, t_native_observed)"),
    ("settle_ms", pa.float64(), "t_terminal - t_native_returned"),
    ("latency_ms", pa.float64(), "t_terminal - t_received"),
    ("end_to_end_ms", pa.float64(), "t_terminal - t_issued"),
    ("duration_ms", pa.float64(), "t_terminal - t_handback"),
    ("reference_ms", pa.float64(), "median uncancelled duration for this device/workload/mechanism"),
    ("cost_ratio", pa.float64(), "latency_ms / reference_ms"),
    # result
    ("outcome", pa.string(), "cancelled | completed | dropped | error | lost | not_run"),
    ("decode_rc", pa.int32(), "return code of the last native call (llama_decode 2 = aborted)"),
    ("abort_polls", pa.int64(), "native reader polls during the trial"),
    ("output_sha256", pa.string(), "sha256 of the produced output (tokens/audio/text) for reuse checks"),
    ("known_answer_error_ms", pa.float64(), "probe engine: t_native_returned - the first probe check after the token was set"),
    ("phase_durations_json", pa.string(), "reference runs: per-phase durations, JSON {phase: ms}"),
    ("phase_timeline_json", pa.string(), "reference runs: [[phase, start_ms, end_ms], ...] from t_start"),
    ("error", pa.string(), "error message (outcome error/lost/not_run)"),
    # partition columns (sanitized; stored in directory names)
    ("backend", pa.string(), "cpu | vulkan | metal | cuda"),
    ("host", pa.string(), "sanitized host name used as the partition path part"),
]

RECORD_SCHEMA = pa.schema(
    [pa.field(name, typ, metadata={"doc": doc}) for name, typ, doc in _FIELDS],
    metadata={"cancelbench_schema_version": str(SCHEMA_VERSION)},
)
COLUMNS = tuple(name for name, _, _ in _FIELDS)
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
    row["observe_ms"] = _ms(observed, received)
    row["return_ms"] = _ms(g("t_native_returned_ns"), ret_from)
    row["settle_ms"] = _ms(g("t_terminal_ns"), g("t_native_returned_ns"))
    row["latency_ms"] = _ms(g("t_terminal_ns"), received)
    row["end_to_end_ms"] = _ms(g("t_terminal_ns"), g("t_issued_ns"))
    row["duration_ms"] = _ms(g("t_terminal_ns"), g("t_handback_ns"))
    row["offset_actual_ms"] = _ms(g("t_issued_ns"), g("t_handback_ns"))
    ref = g("reference_ms")
    lat = row["latency_ms"]
    row["cost_ratio"] = (lat / ref) if (lat is not None and ref) else None
    return row


_PY_TYPES = {pa.int32(): int, pa.int64(): int, pa.float64(): float, pa.string(): str}

# The one typed record, generated from the column list above so the two cannot drift.
# Every field defaults to None (a null column); unknown names are a TypeError.
TrialRecord = dataclasses.make_dataclass(
    "TrialRecord",
    [(name, _PY_TYPES[typ] | None, dataclasses.field(default=None)) for name, typ, _ in _FIELDS],
    slots=True,
)
TrialRecord.__module__ = __name__  # so Ray can ship agent halves by reference
TrialRecord.__doc__ = "One trial, one flat row: see the column list in cancelbench.schema."

# The columns the agent fills (its half of the record); the driver fills the rest.
AGENT_COLUMNS = frozenset({
    "trial_id", "hostname", "node_id", "device", "device_name", "platform", "arch", "cpu_model", "n_threads",
    "llama_cpp_python_version", "llama_cpp_build", "cancelbench_version", "backend", "model_sha256",
    "cancelbench_git_describe", "llama_cpp_commit", "ggml_version", "ggml_backends", "os_release", "kernel_version",
    "gpu_driver_version",
    "phase_at_receipt", "native_call_at_receipt", "input_tokens_done_at_receipt", "tokens_generated_at_receipt",
    "frames_generated_at_receipt", "heavy_graph_at_receipt", "phase_at_terminal",
    "t_handback_ns", "t_start_ns", "t_cancel_scheduled_ns", "t_issued_ns", "t_received_ns",
    "t_native_observed_ns", "t_native_returned_ns", "t_terminal_ns",
    "outcome", "decode_rc", "abort_polls", "output_sha256", "n_input_tokens", "known_answer_error_ms",
    "phase_durations_json", "phase_timeline_json", "error",
})


def agent_half(**columns) -> TrialRecord:
    """The agent's part of a record; a column the agent does not own is a bug."""
    foreign = set(columns) - AGENT_COLUMNS
    if foreign:
        raise ValueError(f"not agent columns: {', '.join(sorted(foreign))}")
    return TrialRecord(**columns)


def merge(base: TrialRecord, half: TrialRecord) -> TrialRecord:
    """The driver's record with the agent's non-null columns laid over it."""
    return dataclasses.replace(base, **{k: v for k, v in as_row(half).items() if v is not None})


def classify_outcome(engine_outcome: str | None, t_received_ns: int | None, t_terminal_ns: int | None) -> str:
    """The one outcome rule, used for every record.

    An engine that ran to completion although the agent had received the
    cancel before the engine's terminal state dropped it: a defect, whatever
    path the cancel took (latched before the start, or delivered while
    running). Everything else is what the engine (or the agent) reported.
    """
    if engine_outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {engine_outcome!r}")
    if (engine_outcome == "completed" and t_received_ns is not None and t_terminal_ns is not None
            and t_received_ns <= t_terminal_ns):
        return "dropped"
    return engine_outcome


def as_row(record: TrialRecord) -> dict:
    return {name: getattr(record, name) for name in COLUMNS}


def finalize(record: TrialRecord) -> dict:
    """Classify the outcome and derive every ``*_ms`` column: the row the sink writes."""
    row = as_row(record)
    row["schema_version"] = SCHEMA_VERSION
    row["outcome"] = classify_outcome(row["outcome"], row["t_received_ns"], row["t_terminal_ns"])
    return derive(row)


def empty_row() -> dict:
    """A row with every column null (test and fixture builders start from it)."""
    return as_row(TrialRecord(schema_version=SCHEMA_VERSION))
