"""GitHub Actions: the job summary (``GITHUB_STEP_SUMMARY``) and ``--format github``
annotations (``::error title=...::message``, one per failing cell).

Job summary: GitHub shows at most 1 MiB per step summary; a summary over it is
not shown at all.  ``append_step_summary`` appends the Markdown to the file
named by ``GITHUB_STEP_SUMMARY`` and keeps the file under the limit: the
renderer is asked for a shorter document (it drops table rows and says so),
and if even that does not fit the text is cut with a closing note.  A summary
that cannot be written at all is a warning on stderr, never silent.

Annotations follow GitHub's workflow-command escaping: ``%``, CR and LF in the
message; additionally ``:`` and ``,`` in properties (the title), so data
cannot end the command early or start another one.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path
from typing import Callable

SUMMARY_LIMIT = 1024 * 1024  # bytes per step summary (GitHub)
SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


def _escape_data(text: str) -> str:
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(title: str, message: str, level: str = "error") -> str:
    return f"::{level} title={_escape_property(title)}::{_escape_data(message)}"


MAX_ANNOTATIONS = 10  # GitHub shows at most 10 error annotations per step and drops the rest


def annotations(failures, what: str) -> str:
    """One ``::error`` line per failure (``junit.CellFailure``); past GitHub's 10 per step, the
    10th line says how many more there are (never dropped silently); a ``::notice`` when none."""
    shown = failures if len(failures) <= MAX_ANNOTATIONS else failures[:MAX_ANNOTATIONS - 1]
    lines = [annotation(f"cancelbench {what}: {f.suite}: {f.case}", f.message) for f in shown]
    if len(shown) < len(failures):
        lines.append(annotation(f"cancelbench {what}: {len(failures) - len(shown)} more failing cells",
                                "GitHub shows 10 annotations per step; the job summary and the JUnit XML list all"))
    if not failures:
        lines.append(annotation(f"cancelbench {what}", "no failing cells", level="notice"))
    return "\n".join(lines) + "\n"


def report_annotations(report) -> str:
    from .junit import report_failures

    return annotations(report_failures(report)[0], "report")


def diff_annotations(result) -> str:
    from .junit import diff_failures

    return annotations(diff_failures(result), "diff")


def fit_markdown(render: Callable[[int], str], room: int) -> str | None:
    """The longest rendering of ``render(limit)`` whose UTF-8 size is at most ``room`` bytes;
    None when not even the cut note fits.  ``render`` truncates to ``limit`` characters and
    says so; a character can take up to 4 bytes, hence the retries with a smaller limit."""
    limit = room
    while limit >= 200:
        text = render(limit)
        size = len(text.encode("utf-8"))
        if size <= room:
            return text
        limit = min(limit - 1, int(limit * room / size) - 16)
    return None


def append_step_summary(render: Callable[[int], str], command: str, environ=None) -> str | None:
    """Append the Markdown to ``$GITHUB_STEP_SUMMARY`` when it is set; returns the path written."""
    environ = os.environ if environ is None else environ
    target = environ.get(SUMMARY_ENV)
    if not target:
        return None
    path = Path(target)
    try:
        # Non-blocking, so a FIFO without a reader fails at once (ENXIO) instead of hanging; and only a
        # regular file is appended to (a FIFO with a reader, a device or a directory is refused).
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0),
                     0o644)
    except OSError as exc:
        why = "not a regular file" if exc.errno in (errno.ENXIO, errno.ELOOP, errno.EISDIR) else exc.strerror or exc
        print(f"cancelbench {command}: warning: cannot write {SUMMARY_ENV} {path}: {why}; the job summary was "
              "not written", file=sys.stderr)
        return None
    with os.fdopen(fd, "a", encoding="utf-8") as fh:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            os.set_blocking(fd, True)
            used = st.st_size
            room = SUMMARY_LIMIT - used - 2  # the separating newline(s)
            text = fit_markdown(render, room) if room > 0 else None
            if text is None:
                print(f"cancelbench {command}: warning: {SUMMARY_ENV} ({path}) already holds {used} bytes of the "
                      f"{SUMMARY_LIMIT}-byte job summary limit; the {command} Markdown was not added",
                      file=sys.stderr)
                return None
            fh.write(("\n" if used else "") + text + ("" if text.endswith("\n") else "\n"))
            fh.flush()
        except OSError as exc:
            print(f"cancelbench {command}: warning: cannot write {SUMMARY_ENV} {path}: {exc.strerror or exc}; the "
                  "job summary was not written", file=sys.stderr)
            return None
    return str(path)
