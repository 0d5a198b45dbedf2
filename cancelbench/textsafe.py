"""Text from data or from an engine, made safe to print on a terminal: the one home of that rule.

Every string that did not come from cancelbench itself -- a record's value, an
external engine's name, version, load error or stderr tail, a GPU driver's
device name -- may hold control characters: an ANSI escape (``ESC[2J`` clears
the screen), an OSC sequence (``ESC]0;...BEL`` retitles the window), a carriage
return that overwrites the line before it, a NUL. :func:`term_safe` writes each
such character as its Python escape (``\\x1b``, ``\\r``, ``\\x00``), so the text
reaches the terminal as printable characters only; the report's terminal,
Markdown and JUnit forms use it (``reports/format.py`` re-exports it), and so
does every ``cancelbench: error:`` line (:func:`error_line`).
"""

from __future__ import annotations

# Where the agent appends a Python traceback to a record's ``error`` (``error: ... | Traceback ...``):
# an error line ends before it (the record keeps it).
TRACEBACK_MARK = "Traceback (most recent call last)"
MAX_ERROR_LINE = 2000  # characters of one error line (an engine's message is bounded before this, too)


def term_safe(text: object) -> str:
    """No control characters (ANSI escapes, newlines) from data reach a terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


def error_line(text: object, limit: int = MAX_ERROR_LINE) -> str:
    """``text`` as one printable line: whitespace runs (newlines, carriage returns, tabs) become one
    space, every other control character its escape, a Python traceback's fragment is cut off, and
    the line is at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    cut = flat.find(TRACEBACK_MARK)
    if cut >= 0:
        flat = flat[:cut].rstrip(" |:") or "(an error without a message)"
    safe = term_safe(flat)
    return safe if len(safe) <= limit else safe[:limit - 3] + "..."
