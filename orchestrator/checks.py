"""Config validation primitives: one-line :class:`ConfigError` messages for values
of the wrong type, out of bounds, or not among the names allowed. Shared by the
sweep config (config.py), its workloads (workloads.py) and offsets (offsets.py)."""

from __future__ import annotations

from cancelbench.inputs import expect_int


class ConfigError(ValueError):
    """Invalid sweep configuration."""


def check_int(value, where: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer within bounds (inputs.expect_int, said as a ConfigError)."""
    return expect_int(value, where, minimum, maximum, ConfigError)


def check_number(value, where: str, minimum: float, maximum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if not minimum <= value <= maximum:
        raise ConfigError(f"{where} must be in [{minimum:g}, {maximum:g}], got {value!r}")
    return float(value)


def table_of(data: dict, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table, got {value!r}")
    return value


def check_names(value, where: str, allowed: tuple[str, ...] | None) -> tuple[str, ...]:
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
