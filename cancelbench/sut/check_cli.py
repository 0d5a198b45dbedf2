"""``cancelbench sut-check``'s command line: options checked (exit 2 with one line), the checks run
(cancelbench.sut.check), the verdict printed with every engine-controlled text escaped."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from .check import EXIT_FAILURES, EXIT_INPUT, EXIT_OK, Check, CheckInputError, run_checks
from .declaration import Declaration

MIN_STARTUP_S, MAX_STARTUP_S = 1.0, 600.0  # --startup-timeout, as a workload's startup_timeout_s


def render(decl: Declaration | None, checks: list[Check], fmt: str) -> str:
    """The verdict; every engine-controlled text (its name, version, errors, stderr) escaped for a terminal."""
    from cancelbench.reports.format import term_safe

    failed = sum(not c.ok for c in checks)
    skipped = sum(c.skipped for c in checks)
    passed = len(checks) - failed - skipped
    if fmt == "json":  # JSON escapes control characters itself
        return json.dumps({"engine": None if decl is None else {"name": decl.name, "version": decl.version},
                           "checks": [asdict(c) for c in checks], "passed": passed, "failed": failed,
                           "skipped": skipped}, indent=2)
    lines = [f"{'SKIP' if c.skipped else 'PASS' if c.ok else 'FAIL'} {c.name}: {term_safe(' '.join(c.detail.split()))}"
             for c in checks]
    lines.append(f"sut-check: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return "\n".join(lines)


def parse_setting(text: str) -> tuple[str, object]:
    """NAME=VALUE; the value read as JSON (5, 0.7, true, "x"), else as a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise CheckInputError(f"--setting {text!r}: expected NAME=VALUE")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return name, value


def cmd_sut_check(args) -> int:
    command = list(args.engine_command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        if not command:
            raise CheckInputError("give the engine's command after --, e.g. cancelbench sut-check -- ./my-engine")
        settings = dict(parse_setting(s) for s in args.setting or [])
        models = {k: str(os.path.abspath(v)) for k, v in (("model", args.model), ("mmproj", args.mmproj)) if v}
        for role, path in models.items():
            if not os.path.isfile(path):
                raise CheckInputError(f"--{role} {path}: not a file")
        timeout = args.startup_timeout
        if not (timeout == timeout and MIN_STARTUP_S <= timeout <= MAX_STARTUP_S):  # NaN, inf, 0, -1
            raise CheckInputError(f"--startup-timeout must be a number of seconds in [{MIN_STARTUP_S:g}, "
                                  f"{MAX_STARTUP_S:g}], got {timeout!r}")
        decl, checks = run_checks(command, models=models, settings=settings, text=args.input,
                                  mechanism=args.mechanism, startup_timeout_s=args.startup_timeout)
    except CheckInputError as exc:
        from cancelbench.textsafe import error_line
        print(f"cancelbench sut-check: error: {error_line(exc)}", file=os.sys.stderr)
        return EXIT_INPUT
    try:
        print(render(decl, checks, args.format), flush=True)
    except BrokenPipeError:  # a reader that stopped early (| head): the verdict is the exit status
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    return EXIT_FAILURES if any(not c.ok for c in checks) else EXIT_OK


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("sut-check", help="check that an engine speaks the engine protocol (docs/sut-protocol.md)",
                       usage="cancelbench sut-check [options] -- COMMAND [ARGS...]")
    p.add_argument("--model", help="model file the engine loads (sent in load.models.model)")
    p.add_argument("--mmproj", help="projector file (load.models.mmproj)")
    p.add_argument("--setting", action="append", metavar="NAME=VALUE", help="a setting (repeatable; JSON value)")
    p.add_argument("--input", default="The quick brown fox jumps over the lazy dog.",
                   help="the text of every run (engines that declare input text)")
    p.add_argument("--mechanism", help="mechanism of every run (default: the first the engine declares)")
    p.add_argument("--startup-timeout", type=float, default=30.0, help="seconds to wait for the hello")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("engine_command", nargs=argparse.REMAINDER, help="-- then the engine's argv")
    p.set_defaults(func=cmd_sut_check)
