"""Protocol version, framing and message validation (docs/sut-protocol.md).

Messages are validated against the JSON schema shipped beside this module
(``schema.json``), one definition per message type, with ``jsonschema`` (a Ray
dependency already): the schema is the one home of every message's fields.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 1 << 20  # one message, its newline included
SCHEMA_PATH = Path(__file__).with_name("schema.json")

ENGINE_TYPES = ("hello", "pong", "loaded", "phase", "step", "cancel_seen", "done", "error")
AGENT_TYPES = ("ping", "load", "run", "cancel", "shutdown")
TRIAL_EVENTS = ("phase", "step", "cancel_seen", "done")


class ProtocolError(ValueError):
    """A message that breaks the protocol; the text is one line that says how."""


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@lru_cache(maxsize=None)
def _validator(kind: str):
    from jsonschema import Draft202012Validator

    full = schema()
    sub = {"$schema": full["$schema"], "$defs": full["$defs"], **full["$defs"][kind]}
    return Draft202012Validator(sub)


def encode(msg: dict) -> bytes:
    """One message as one line (compact JSON, UTF-8, newline-terminated)."""
    line = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"a {msg.get('type')} message of {len(line)} bytes is over the {MAX_LINE_BYTES}-byte line limit")
    return line


def _where(error) -> str:
    path = ".".join(str(p) for p in error.absolute_path)
    return f"{path}: " if path else ""


def validate(msg: object, allowed: tuple[str, ...]) -> dict:
    """``msg`` if it is a valid message of one of the ``allowed`` types; else ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(msg).__name__}")
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("a message needs a string 'type'")
    if kind not in allowed:
        raise ProtocolError(f"unexpected message type {kind[:64]!r} (expected {', '.join(allowed)})")
    errors = sorted(_validator(kind).iter_errors(msg), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        raise ProtocolError(f"malformed {kind}: {_where(e)}{e.message[:300]}")
    return msg


def type_of(line: bytes) -> str | None:
    """A line's message type when it is a JSON object with a string ``type``, else None."""
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    kind = msg.get("type") if isinstance(msg, dict) else None
    return kind if isinstance(kind, str) else None


def decode(line: bytes, allowed: tuple[str, ...], skip_unknown: bool = False) -> dict | None:
    """One received line as a validated message. ``skip_unknown``: a message of a type not in
    ``allowed`` (a later protocol revision's) gives None instead of an error."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"a line of over {MAX_LINE_BYTES} bytes (the limit is 1 MiB)")
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, ValueError):
        text = line[:80].decode("utf-8", "replace").rstrip("\n")
        raise ProtocolError(f"a line that is not JSON: {text!r}") from None
    if skip_unknown and isinstance(msg, dict) and isinstance(msg.get("type"), str) and msg["type"] not in allowed:
        return None
    return validate(msg, allowed)
