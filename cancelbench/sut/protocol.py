"""Protocol version, framing and message validation (docs/sut-protocol.md).

The published contract of every message is the JSON schema shipped beside this module
(``schema.json``). Messages are checked with typed decoding (``msgspec``): a line is parsed
once, as RFC 8259 JSON, and the object is converted to the Struct of its type below, one
per schema definition, which enforces what the schema says (required fields, types,
string and array lengths, patterns, enums) plus the protocol's integer rule: an integer
is a JSON number without a fraction or an exponent (``7``, not ``7.0``) and every
integer field fits a signed 64-bit integer. Unknown fields are ignored; the message
returned is the parsed object itself, unknown fields included.

The schema evaluated by ``jsonschema`` is kept as the reference (:func:`validate_reference`,
:func:`decode_reference`): tests/test_protocol_decode.py runs a corpus of valid and
invalid messages of every type through both and asserts they agree, and
benchmarks/bench_events.py times both (an event decoded and checked in about 1 us this
way, in 30-100 us by the reference: benchmarks/results/events.json).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 1 << 20  # one message, its newline included
SCHEMA_PATH = Path(__file__).with_name("schema.json")

ENGINE_TYPES = ("hello", "pong", "loaded", "phase", "step", "cancel_seen", "audio", "done", "error")
AGENT_TYPES = ("ping", "load", "run", "cancel", "shutdown")
TRIAL_EVENTS = ("phase", "step", "cancel_seen", "audio", "done")

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
CANCEL_SEQ_MAX = (1 << 53) - 1  # run.cancel_seq: exact in every JSON parser (a double's integers)
# Capabilities an engine may declare in hello (an unknown one is ignored): "cancel_word", the shared
# cancel word (docs/sut-protocol.md, "The shared cancel word"); "audio_out" (1.4), the engine hands its
# audio over as it makes it, in ``audio`` events, at the rate ``loaded.audio_sample_rate`` says.
CANCEL_WORD, AUDIO_OUT = "cancel_word", "audio_out"
CAPABILITIES = (CANCEL_WORD, AUDIO_OUT)
AUDIO_RATE_MIN, AUDIO_RATE_MAX = 1000, 768_000  # loaded.audio_sample_rate, Hz
AUDIO_CHUNK_MAX = (1 << 31) - 1  # audio.samples: one hand-over
# 1.2: done.at_receipt's fields, the engine's progress when it took the cancel; each fills the record
# column <name>_at_receipt (docs/sut-protocol.md, the done fields).
AT_RECEIPT_FIELDS = ("input_tokens_done", "tokens_generated", "frames_generated")
# 1.4: done.at_receipt.heavy_graph, the heavy graph in flight when it took the cancel (an identifier such as
# code2wav or clip_encode; the record's heavy_graph_at_receipt).
AT_RECEIPT_GRAPH = "heavy_graph"
# 1.5: done.at_receipt.native_call, the engine's native call in flight when it took the cancel (an
# identifier such as llama_decode; the record's native_call_at_receipt, else "step" where a step was open then).
AT_RECEIPT_CALL = "native_call"
AT_RECEIPT_NAMES = (AT_RECEIPT_GRAPH, AT_RECEIPT_CALL)  # the identifier fields of done.at_receipt
# 1.3: cancel_seen.where, where a reader inside a graph first saw the cancel (the record's native_seen_where),
# and done.cpu, the trial thread's CPU clock and run delay at four moments of the run (docs/sut-protocol.md).
SEEN_WHERE = ("range_end", "next_ask")
CPU_MOMENTS = ("run", "receipt", "terminal", "end")
CPU_FIELDS = tuple(f"{m}_{k}" for m in CPU_MOMENTS for k in ("t", "cpu", "wait"))


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text is one line that says how."""


# ------------------------------------------------------------- the messages --
# One Struct per definition in schema.json ($defs), field for field. Optional fields have a
# default (never used: the Struct is only the check, the parsed dict is the message).

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]  # $defs.int64, $defs.ns
TrialId = Annotated[str, Meta(min_length=1, max_length=200)]  # $defs.trial
Ident = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_]{1,64}$")]  # $defs.ident
Scalar = Union[int, float, bool, str]  # $defs.scalar ("number": any JSON number)
Value = Union[int, float, bool, str, None]  # a load / run setting's value


class _Object(Struct):
    """A JSON object whose unknown fields are ignored (required fields first)."""


class _Engine(_Object):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    version: Annotated[str, Meta(min_length=1, max_length=128)]


class _PhaseDecl(_Object):
    name: Ident
    steps: bool


class _MechanismDecl(_Object):
    name: Ident
    reaches: Annotated[str, Meta(max_length=1000)]


class _Setting(_Object):
    name: Ident
    type: Literal["int", "float", "bool", "string"]
    default: Value
    min: Union[int, float] = 0
    max: Union[int, float] = 0
    doc: Annotated[str, Meta(max_length=1000)] = ""


class Hello(_Object):
    protocol: Int64
    engine: _Engine
    clock: Annotated[str, Meta(min_length=1, max_length=64)]
    input: Literal["text", "audio_path", "none"]
    phases: Annotated[list[_PhaseDecl], Meta(min_length=1, max_length=32)]
    mechanisms: Annotated[list[_MechanismDecl], Meta(min_length=1, max_length=16)]
    build: Annotated[dict[str, Annotated[str, Meta(max_length=1024)]], Meta(max_length=64)] = None
    settings: Annotated[list[_Setting], Meta(max_length=128)] = None
    capabilities: Annotated[list[Ident], Meta(max_length=16)] = None


class Pong(_Object):
    id: Int64
    t: Int64


class Loaded(_Object):
    t: Int64
    settings: dict[str, Scalar] = None
    audio_sample_rate: Annotated[int, Meta(ge=AUDIO_RATE_MIN, le=AUDIO_RATE_MAX)] = 24000


class PhaseEvent(_Object):
    trial: TrialId
    phase: Ident
    t: Int64


class Step(_Object):
    trial: TrialId
    phase: Ident
    edge: Literal["start", "end"]
    t: Int64


NonNegInt64 = Annotated[int, Meta(ge=0, le=INT64_MAX)]


class CancelSeen(_Object):
    trial: TrialId
    t: Int64
    where: Literal[SEEN_WHERE] = "range_end"
    cpu_t: NonNegInt64 = 0


class AudioEvent(_Object):
    trial: TrialId
    t: Int64
    samples: Annotated[int, Meta(ge=1, le=AUDIO_CHUNK_MAX)]


class Cpu(_Object):  # CPU_FIELDS, field for field
    run_t: Int64 = 0
    run_cpu: NonNegInt64 = 0
    run_wait: NonNegInt64 = 0
    receipt_t: Int64 = 0
    receipt_cpu: NonNegInt64 = 0
    receipt_wait: NonNegInt64 = 0
    terminal_t: Int64 = 0
    terminal_cpu: NonNegInt64 = 0
    terminal_wait: NonNegInt64 = 0
    end_t: Int64 = 0
    end_cpu: NonNegInt64 = 0
    end_wait: NonNegInt64 = 0


class AtReceipt(_Object):
    input_tokens_done: NonNegInt64 = 0
    tokens_generated: NonNegInt64 = 0
    frames_generated: NonNegInt64 = 0
    heavy_graph: Ident = "x"
    native_call: Ident = "x"


class Done(_Object):
    trial: TrialId
    outcome: Literal["completed", "cancelled", "error"]
    t: Int64
    phase: Ident
    cancel_received_t: Int64 = 0
    native_returned_t: Int64 = 0
    output_sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")] = ""
    error: str = ""
    counters: dict[str, Int64] = None
    cancel_via: Literal["word", "line"] = "line"
    at_receipt: AtReceipt = None
    cpu: Cpu = None


class Error(_Object):
    message: str
    of: Union[str, None] = None


class Ping(_Object):
    id: Int64
    t: Int64


class Load(_Object):
    models: dict[str, str]
    settings: dict[str, Value]


class Run(_Object):
    trial: TrialId
    mechanism: Ident
    input: str
    settings: dict[str, Value] = None
    output_path: Union[str, None] = None
    cancel_seq: Annotated[int, Meta(ge=1, le=CANCEL_SEQ_MAX)] = 1


class Cancel(_Object):
    trial: TrialId


class Shutdown(_Object):
    pass


STRUCTS: dict[str, type[Struct]] = {
    "hello": Hello, "pong": Pong, "loaded": Loaded, "phase": PhaseEvent, "step": Step,
    "cancel_seen": CancelSeen, "audio": AudioEvent, "done": Done, "error": Error,
    "ping": Ping, "load": Load, "run": Run, "cancel": Cancel, "shutdown": Shutdown,
}

# RFC 8259 JSON to dict / list / str / int / float / bool / None; a Decoder is thread-safe (msgspec
# >= 0.16): the reader threads and the main thread of a process share it.
_parse = msgspec.json.Decoder().decode
_convert = msgspec.convert
_AT = re.compile(r" - at `\$([^`]*)`$")


def _explain(exc: msgspec.ValidationError) -> str:
    """msgspec's error as ``field.path: what`` (jsonschema's path style: ``phases.0.name``)."""
    text = str(exc)
    m = _AT.search(text)
    where = ""
    if m:
        text = text[:m.start()]
        where = re.sub(r"\[(\d+)\]", r".\1", m.group(1)).lstrip(".")
    text = " ".join((text[:1].lower() + text[1:]).split())
    return f"{where}: {text}"[:300] if where else text[:300]


def _check(msg: dict, kind: str) -> None:
    try:
        _convert(msg, STRUCTS[kind])
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed {kind}: {_explain(exc)}") from None
    except RecursionError:
        raise ProtocolError(f"malformed {kind}: nested too deep") from None


def _kind(msg: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(msg).__name__}")
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("a message needs a string 'type'")
    if kind not in allowed:
        raise ProtocolError(f"unexpected message type {kind[:64]!r} (expected {', '.join(allowed)})")
    return kind


# --------------------------------------------------------------------- API --
def encode(msg: dict) -> bytes:
    """One message as one line (compact JSON, UTF-8, newline-terminated)."""
    line = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"a {msg.get('type')} message of {len(line)} bytes is over the {MAX_LINE_BYTES}-byte line limit")
    return line


def validate(msg: object, allowed: tuple[str, ...]) -> dict:
    """``msg`` if it is a valid message of one of the ``allowed`` types; else ProtocolError.

    ``msg`` is what a JSON parser gives (dict, list, str, int, float, bool, None). A message a
    program built with other types (a float subclass such as numpy's float64, a tuple) is
    valid if its JSON form is."""
    kind = _kind(msg, allowed)
    try:
        _check(msg, kind)
    except ProtocolError as first:
        try:
            wire = _parse(json.dumps(msg, allow_nan=False))
        except (TypeError, ValueError, RecursionError):  # no JSON form: the first error stands
            raise first from None
        _check(wire, kind)  # plain JSON values already: the same error again
    return msg


def type_of(line: bytes) -> str | None:
    """A line's message type when it is a JSON object with a string ``type``, else None."""
    try:
        msg = _parse(line)
    except (msgspec.DecodeError, RecursionError):
        return None
    kind = msg.get("type") if isinstance(msg, dict) else None
    return kind if isinstance(kind, str) else None


def _not_json(line: bytes) -> ProtocolError:
    text = line[:80].decode("utf-8", "replace").rstrip("\n")
    return ProtocolError(f"a line that is not JSON: {text!r}")


def decode(line: bytes, allowed: tuple[str, ...], skip_unknown: bool = False) -> dict | None:
    """One received line as a validated message. ``skip_unknown``: a message of a type not in
    ``allowed`` (a later protocol revision's) gives None instead of an error.

    The line must be RFC 8259 JSON in UTF-8: ``NaN``, ``Infinity``, numbers beyond a double's
    range, unpaired surrogate escapes and a byte-order mark are not JSON."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"a line of over {MAX_LINE_BYTES} bytes (the limit is 1 MiB)")
    try:
        msg = _parse(line)
    except (msgspec.DecodeError, RecursionError):
        raise _not_json(line) from None
    if type(msg) is dict:
        kind = msg.get("type")
        if type(kind) is str:
            if kind in allowed:
                _check(msg, kind)
                return msg
            if skip_unknown:
                return None
    return validate(msg, allowed)  # says what is wrong


# --------------------------------------------------------------- reference --
@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@lru_cache(maxsize=None)
def reference_validator(kind: str):
    """``jsonschema``'s Draft 2020-12 validator of one message type's definition, with the
    protocol's integer rule: JSON Schema's "integer" is any number with a zero fraction
    (``7.0`` too), the protocol's is a JSON number written without one."""
    from jsonschema import Draft202012Validator, validators

    checker = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, v: isinstance(v, int) and not isinstance(v, bool))
    cls = validators.extend(Draft202012Validator, type_checker=checker)
    full = schema()
    return cls({"$schema": full["$schema"], "$defs": full["$defs"], **full["$defs"][kind]})


def validate_reference(msg: object, allowed: tuple[str, ...]) -> dict:
    """:func:`validate` by the JSON schema itself (the reference: tens of microseconds a message)."""
    kind = _kind(msg, allowed)
    errors = sorted(reference_validator(kind).iter_errors(msg), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        e = errors[0]
        path = ".".join(str(p) for p in e.absolute_path)
        raise ProtocolError(f"malformed {kind}: {path + ': ' if path else ''}{e.message[:300]}")
    return msg


def decode_reference(line: bytes, allowed: tuple[str, ...], skip_unknown: bool = False) -> dict | None:
    """:func:`decode` as it was before typed decoding: ``json.loads``, then the JSON schema."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"a line of over {MAX_LINE_BYTES} bytes (the limit is 1 MiB)")
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _not_json(line) from None
    if skip_unknown and isinstance(msg, dict) and isinstance(msg.get("type"), str) and msg["type"] not in allowed:
        return None
    return validate_reference(msg, allowed)
