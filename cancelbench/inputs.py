"""One validation layer for everything a user hands cancelbench: files, JSON, TOML values, names.

Every reader of user input (sweep config, lock files, manifests, model paths)
goes through here, so a bad input is refused by construction instead of by a
special case found later:

* files are read only if they are regular files, and only up to a size cap
  (``/dev/zero``, a FIFO or a directory is refused without reading a byte);
* JSON is strict (no ``NaN``/``Infinity``) and typed accessors check a value's
  type before it is used (``True`` is not an integer, ``1.5`` and ``"1"`` are
  not integers, a list is not a table);
* names that become parts of trial ids and partition paths are bounded, and
  :func:`safe_component` maps distinct names to distinct components.

Errors are raised as the caller's own exception class (``error=``), each a
one-line message, so the CLI prints one line and exits 2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path

KIB, MIB = 1 << 10, 1 << 20
MAX_CONFIG_BYTES = 1 * MIB  # a sweep TOML
MAX_LOCK_BYTES = 1 * MIB  # a model lock (JSON)
MAX_MANIFEST_BYTES = 64 * MIB  # a results directory's manifest.json
MAX_CORPUS_BYTES = 256 * MIB  # an input corpus (JSON lines)
MAX_NAME_CHARS = 64  # workload names (they become parts of trial ids and file names)


class DatasetError(ValueError):
    """A results directory that is not a readable cancelbench dataset."""


class InputError(ValueError):
    """A bad input (one line)."""


def _oneline(text: object) -> str:
    return " ".join(str(text).split())


def regular_file(path: Path | str, what: str, error: type[Exception] = InputError) -> Path:
    """``path`` if it is an existing regular file (symlinks followed); else ``error``."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as exc:
        raise error(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{what} {path} is a directory, not a regular file")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {path} is not a regular file (a device, FIFO or socket)")
    return path


def read_bytes(path: Path | str, what: str, max_bytes: int, error: type[Exception] = InputError) -> bytes:
    """The content of a regular file of at most ``max_bytes`` bytes.

    Opened non-blocking and checked with ``fstat`` on the open descriptor (no
    race between the check and the read); never reads more than the cap.
    """
    path = regular_file(path, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is not a regular file")
        if st.st_size > max_bytes:
            raise error(f"{what} {path} is {st.st_size} bytes, more than the {max_bytes} allowed")
        chunks, total = [], 0
        while True:
            try:
                block = os.read(fd, min(1 << 16, max_bytes + 1 - total))
            except OSError as exc:
                raise error(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
            if not block:
                break
            chunks.append(block)
            total += len(block)
            if total > max_bytes:  # it grew while we read
                raise error(f"{what} {path} is more than the {max_bytes} bytes allowed")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: Path | str, what: str, max_bytes: int, error: type[Exception] = InputError) -> str:
    data = read_bytes(path, what, max_bytes, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def load_json(path: Path | str, what: str, max_bytes: int, error: type[Exception] = InputError) -> object:
    """Strict JSON from a bounded regular file: NaN/Infinity refused."""
    text = read_text(path, what, max_bytes, error)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what} {path} is not valid JSON ({_oneline(exc)[:200]})") from None


def load_json_object(path: Path | str, what: str, max_bytes: int, error: type[Exception] = InputError) -> dict:
    data = load_json(path, what, max_bytes, error)
    if not isinstance(data, dict):
        raise error(f"{what} {path} must hold a JSON object, not a {_type_name(data)}")
    return data


def load_toml(path: Path | str, what: str, max_bytes: int, error: type[Exception] = InputError) -> dict:
    import tomllib

    text = read_text(path, what, max_bytes, error)
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise error(f"{path}: malformed TOML: {_oneline(exc)[:200]}") from None


# ----------------------------------------------------------------- typed accessors

def _type_name(value: object) -> str:
    return {dict: "table/object", list: "list", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def expect_int(value: object, where: str, minimum: int | None = None, maximum: int | None = None,
               error: type[Exception] = InputError) -> int:
    """An integer (not a bool, not a float such as 1.5 or 1.0, not a string such as "1")."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{where} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise error(f"{where} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{where} must be <= {maximum}, got {value}")
    return value


def expect_number(value: object, where: str, minimum: float, maximum: float,
                  error: type[Exception] = InputError) -> float:
    """A finite number in [minimum, maximum] (NaN and the infinities refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise error(f"{where} must be a finite number, got {value!r}")
    if not minimum <= value <= maximum:
        raise error(f"{where} must be in [{minimum:g}, {maximum:g}], got {value!r}")
    return float(value)


def expect_str(value: object, where: str, error: type[Exception] = InputError, max_chars: int = 4096) -> str:
    """A non-empty string of at most ``max_chars`` characters."""
    if not isinstance(value, str):
        raise error(f"{where} must be a string, got {_type_name(value)} {_short(value)}")
    if not value.strip():
        raise error(f"{where} must be a non-empty string")
    if len(value) > max_chars:
        raise error(f"{where} is {len(value)} characters long, more than the {max_chars} allowed")
    return value


def expect_table(value: object, where: str, error: type[Exception] = InputError) -> dict:
    if not isinstance(value, dict):
        raise error(f"{where} must be a table/object, got {_type_name(value)} {_short(value)}")
    return value


def expect_choice(value: object, where: str, allowed, error: type[Exception] = InputError) -> str:
    """One of ``allowed`` (strings); a list or table is refused by type, not by a TypeError."""
    if not isinstance(value, str):
        raise error(f"{where} must be a string (one of {', '.join(allowed)}), got {_type_name(value)} "
                    f"{_short(value)}")
    if value not in allowed:
        raise error(f"{where}: unknown value {value!r} (known: {', '.join(allowed)})")
    return value


def expect_name(value: object, where: str, error: type[Exception] = InputError,
                max_chars: int = MAX_NAME_CHARS) -> str:
    """A name that becomes part of trial ids, file names and partition paths: bounded, printable."""
    text = expect_str(value, where, error, max_chars=max_chars)
    if any(not c.isprintable() for c in text):
        raise error(f"{where} {text!r} contains control characters")
    return text


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def positive_finite(text: str) -> float:
    """argparse type: a finite number > 0 (``inf`` and ``nan`` refused)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


# ----------------------------------------------------------------- names as ids and paths

_ID_SAFE = re.compile(r"[A-Za-z0-9_-]+")  # trial id parts: "." separates them
_PATH_SAFE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # a path component: no leading dot
HASH_SEP = "~"  # never in an unchanged component: marks a sanitized one
_SANITIZE_OK = re.compile(r"[^A-Za-z0-9_-]+")


def name_hash(text: str, n: int = 8) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()[:n]


def safe_component(text: str, *, dots: bool = False, max_chars: int = 40) -> str:
    """``text`` as one trial-id part (``dots=False``) or path component (``dots=True``), injectively.

    A text that is already safe (ASCII letters, digits, ``_``, ``-``, and with
    ``dots`` also ``.`` after the first character) and short is kept as is.
    Any other text is reduced to the safe alphabet, cut to ``max_chars`` and
    given ``~`` and a short hash of the raw text: ``a_b`` stays ``a_b`` while
    ``a/b`` becomes ``a_b~<hash>``. Since ``~`` never appears in a kept text,
    two distinct texts share a component only if their hashes collide.
    """
    text = str(text)
    pattern = _PATH_SAFE if dots else _ID_SAFE
    if len(text) <= max_chars and pattern.fullmatch(text):
        return text
    base = _SANITIZE_OK.sub("_", text)[:max_chars].strip("_") or "x"
    return f"{base}{HASH_SEP}{name_hash(text)}"
