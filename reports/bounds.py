"""The latency bound a report judges cells against: one default, overridden per
workload and/or phase (``--bound``, ``--bound-for WORKLOAD[:PHASE]=MS``)."""

from __future__ import annotations

from dataclasses import dataclass


def parse_bound_for(text: str) -> tuple[str | None, str | None, float]:
    """``WORKLOAD[:PHASE]=MS``: the last ``=`` splits off the bound, the first unescaped ``:`` splits
    the workload from the phase, an unescaped ``*`` (alone) or an empty part is every workload or
    phase, and a backslash makes the next character literal (``a\\:b``, ``\\*``, ``\\\\``)."""
    target, sep, ms = text.rpartition("=")
    if not sep or not target:
        raise ValueError(f"bad bound override --bound-for {text!r}: expected WORKLOAD[:PHASE]=MS")
    try:
        value = float(ms)
    except ValueError:
        raise ValueError(f"bad bound override --bound-for {text!r}: {ms!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"bad bound override --bound-for {text!r}: the bound must be a finite number > 0")
    parts: list[list[str]] = [[]]
    literal = [False]  # per part: holds an escaped character (so an escaped * is a name)
    chars = iter(target)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, None)
            if nxt is None:
                raise ValueError(f"bad bound override --bound-for {text!r}: a trailing backslash escapes nothing")
            parts[-1].append(nxt)
            literal[-1] = True
        elif ch == ":" and len(parts) == 1:
            parts.append([])
            literal.append(False)
        else:
            parts[-1].append(ch)
    names = ["".join(p) for p in parts]

    def name(i: int) -> str | None:
        if i >= len(names) or (not literal[i] and names[i] in ("", "*")):
            return None
        return names[i]

    return name(0), name(1), value


@dataclass(frozen=True)
class BoundSpec:
    """Latency bound in ms, with overrides per workload and/or phase.

    Override keys are ``(workload, phase)`` with ``None`` as a wildcard; the
    most specific match wins: (w, p) > (w, *) > (*, p) > default."""

    default_ms: float = 50.0
    overrides: tuple[tuple[str | None, str | None, float], ...] = ()

    def for_cell(self, workload: str, phase: str) -> float:
        table = {(w, p): ms for w, p, ms in self.overrides}
        for key in ((workload, phase), (workload, None), (None, phase)):
            if key in table:
                return table[key]
        return self.default_ms

    @staticmethod
    def parse_override(text: str) -> tuple[str | None, str | None, float]:
        """``--bound-for`` (parse_bound_for): ``WORKLOAD=MS``, ``WORKLOAD:PHASE=MS``, ``*:PHASE=MS``."""
        return parse_bound_for(text)
