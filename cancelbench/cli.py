"""The `cancelbench` command.

Exit codes: 0 ok, 1 failures found (dropped/lost/error trials, regressions),
2 usage or input error (one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
from pathlib import Path

EXIT_OK, EXIT_FAILURES, EXIT_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: one line naming the sub-command, exit 2
        self.exit(EXIT_INPUT, f"{self.prog}: error: {' '.join(message.split())}\n")


def _fail(message: str, code: int = EXIT_INPUT) -> int:
    _stop_ray()  # its log forwarding must not print after (or around) the error line
    _error(message)
    return code


def _error(message: object) -> None:
    """One ``cancelbench: error:`` line. Its text may be an engine's (a load error, a stderr tail, a
    version): one line, control characters escaped, no traceback fragment (cancelbench.textsafe)."""
    from cancelbench.textsafe import error_line

    print(f"cancelbench: error: {error_line(message)}", file=sys.stderr)


def _stop_ray() -> None:
    """Shut down a Ray this process started or joined, so no forwarded agent log follows."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _warn_threads(config, address: str | None) -> None:
    """A local sweep asking for more llama.cpp threads than this host has cores: one warning line each."""
    import os

    from cancelbench.orchestrator.config import thread_warnings

    if address or os.environ.get("RAY_ADDRESS"):
        return  # the agents' hosts are not this one
    for line in thread_warnings(config, os.cpu_count() or 1):
        print(f"cancelbench: warning: {line}", file=sys.stderr)


def _interrupted(exc: KeyboardInterrupt, out: Path) -> int:
    """A sweep stopped by a signal: one line saying what is kept; the signal's exit code."""
    from cancelbench import signals

    _stop_ray()
    name = exc.name if isinstance(exc, signals.Interrupted) else "SIGINT"
    if (out / "manifest.json").is_file():
        print(f"cancelbench: interrupted by {name}; records written so far are kept, the manifest says "
              f"\"interrupted\" (continue with --resume --out {out})", file=sys.stderr)
    else:
        print(f"cancelbench: interrupted by {name} before any trial ran; nothing was written", file=sys.stderr)
    return exc.exit_code if isinstance(exc, signals.Interrupted) else 130


def cmd_sweep(args) -> int:
    from cancelbench.datasets.locks import LockError

    from cancelbench.orchestrator.config import ConfigError, load_config, with_trials
    from cancelbench.orchestrator.runner import SweepInputError, run_sweep
    from cancelbench.sink import DatasetError, SinkError

    from cancelbench import signals
    from cancelbench.orchestrator.cluster import ClusterError, check_address

    from cancelbench.outputs import OutputError, check_sweep_out

    signals.install()  # SIGINT, SIGTERM, SIGHUP alike, whatever this process inherited
    out = Path(args.out) if args.out is not None else Path("results") / "sweep"
    try:
        check_sweep_out("" if args.out is not None and not args.out.strip() else out)
        check_address(args.address or os.environ.get("RAY_ADDRESS"))
        config = load_config(args.config)
        if args.trials is not None:
            config = with_trials(config, args.trials)
        _warn_threads(config, args.address)
        result = run_sweep(config, out, address=args.address, resume=args.resume, progress=not args.quiet)
    except (ConfigError, SweepInputError, LockError, DatasetError, ClusterError, OutputError) as exc:
        return _fail(str(exc))
    except SinkError as exc:  # records kept as JSON lines; the dataset is incomplete
        return _fail(str(exc), EXIT_FAILURES)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        return _fail(f"no space left on the device ({exc.filename or out}); free space, then run the same command "
                     "again (with --resume if the sweep had started)", EXIT_FAILURES)
    except KeyboardInterrupt as exc:
        return _interrupted(exc, out)
    for line in result.stopped:  # a device whose reference runs all failed (exit 1)
        _error(line)
    print(f"sweep {result.sweep_id}: {result.written} trials written to {result.out_dir} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(result.outcomes.items()))})"
          + (f"; {len(result.not_run)} not run" if result.not_run else ""))
    if not args.no_summary:
        code = _summary(result)
        if code is not None:
            return code
    if result.exit_code and not result.stopped:  # exit 1 says why (a stopped device's line already did)
        _stop_ray()
        first = f" (first error: {result.first_error[:400]})" if result.first_error else ""
        _error(f"the sweep failed (exit 1): {', '.join(result.failure_reasons())}{first}; "
               f"see cancelbench report {result.out_dir}")
    return result.exit_code


def _summary(result) -> int | None:
    """Write the sweep's report files and print its summary, whose verdict is the sweep's exit code;
    an exit code when that failed (a signal, a full disk), else None."""
    from cancelbench import signals
    from cancelbench.reports.summary import write_sweep_reports
    from cancelbench.sink import DatasetError
    from cancelbench.textsafe import error_line

    try:
        print(write_sweep_reports(result.out_dir, result.failure_reasons(defects=False)), end="")
    except KeyboardInterrupt as exc:  # the sweep is complete; only its report files are missing
        name = exc.name if isinstance(exc, signals.Interrupted) else "SIGINT"
        print(f"cancelbench: interrupted by {name} while writing the report; the sweep is complete "
              f"(cancelbench report {result.out_dir})", file=sys.stderr)
        return exc.exit_code if isinstance(exc, signals.Interrupted) else 130
    except DatasetError as exc:  # no cancel record to report (every reference run failed): no summary
        print(f"no summary: {error_line(exc)}")
    except OSError as exc:  # a full disk: the records are safe, the report files are not written
        return _fail(f"the records are written, but not report.txt/report.html in {result.out_dir} "
                     f"({exc.strerror or exc}); free space and run: cancelbench report {result.out_dir}",
                     EXIT_FAILURES)
    return None


def cmd_fixtures(args) -> int:
    from cancelbench.datasets.fixtures import generate_all

    from cancelbench.datasets.locks import LockError

    out = Path(args.out) if args.out else None
    if out is not None:
        problem = _unwritable_dir(out)
        if problem:
            return _fail(f"--out {out}: {problem}")
    try:
        paths = generate_all(out, which=args.which, scale=args.scale)
    except LockError as exc:  # a cached file that no longer matches its lock: say which, write nothing more
        return _fail(str(exc))
    except OSError as exc:  # the disk filled up, a permission changed under us...
        return _fail(f"cannot write the fixtures ({exc.strerror or exc}{': ' + exc.filename if exc.filename else ''})",
                     EXIT_FAILURES if exc.errno in (errno.ENOSPC, errno.EDQUOT) else EXIT_INPUT)
    for path in paths:
        print(path)
    return EXIT_OK


def _unwritable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be an output directory (None if it can): checked before anything is written."""
    if path.exists() and not path.is_dir():
        return "is a file, not a directory"
    parent = next((p for p in [path, *path.parents] if p.exists()), None)
    if parent is None or not parent.is_dir():
        return "no existing parent directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    try:  # /proc, /sys and read-only mounts pass os.access for root: try a real file
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix=".cancelbench-probe-")
        probe.close()
    except OSError as exc:
        return f"cannot write in {parent} ({exc.strerror or exc})"
    return None


def cmd_lock(args) -> int:
    from cancelbench.datasets.locks import write_lock
    from cancelbench.outputs import OutputError, check_outputs

    missing = [p for p in args.files if not Path(p).is_file()]
    if missing:
        return _fail(f"not a file: {', '.join(missing)}")
    files: dict[str, Path] = {}
    for p in map(Path, args.files):
        if p.name in files:  # a lock keys its entries by file name: the second would replace the first
            same = files[p.name].resolve() == p.resolve()
            return _fail(f"{files[p.name]} and {p}: " + ("the same file, given twice" if same else
                         f"two files named {p.name}; a lock names its files by name, so lock them separately"))
        files[p.name] = p
    out = Path(args.out)
    if args.out.strip() and out.is_dir() and not out.is_symlink():
        return _fail(f"--out {out} is a directory; give the lock file's name, e.g. {out / 'my-model.json'}")
    try:
        check_outputs([("--out", args.out)], inputs=list(files.values()))
    except OutputError as exc:
        return _fail(str(exc))
    try:
        write_lock(out, args.name or out.stem, files, args.source)
    except OSError as exc:
        return _fail(f"--out {out}: cannot write the lock file ({exc.strerror or exc})")
    print(args.out)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cancelbench", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.set_defaults(_commands=sub.choices)  # main: leftover arguments are the sub-command's error

    p = sub.add_parser("sweep", help="run a cancellation sweep")
    p.add_argument("--config", type=Path, help="sweep TOML (default: built-in text sweep)")
    p.add_argument("--out", help="results directory (default results/sweep)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray on 127.0.0.1)")
    p.add_argument("--resume", action="store_true", help="continue a sweep in --out, skipping trials on disk")
    p.add_argument("--trials", type=int, help="override sweep.trials_per_cell")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--no-summary", action="store_true", help="do not print the summary table at the end")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("fixtures", help="generate the fixture models (random-weight GGUFs)")
    p.add_argument("--out", help="directory (default datasets/models or $CANCELBENCH_MODELS_DIR)")
    p.add_argument("--which", choices=("all", "text", "speech"), default="all")
    p.add_argument("--scale", choices=("fixture", "field"), default="fixture",
                   help="fixture: the tiny test models (default); field: the published Qwen3-TTS-0.6B / "
                        "Qwen3-ASR-0.6B / Qwen3-0.6B sizes, Q8_0, ~1.9 GB, with progress on stderr")
    p.set_defaults(func=cmd_fixtures)

    p = sub.add_parser("lock", help="write a lock file (size, sha256) for real model files")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True, help="lock file to write, e.g. datasets/locks/my-model.json")
    p.add_argument("--name")
    p.add_argument("--source", default="", help="where the files came from (URL, release)")
    p.set_defaults(func=cmd_lock)

    from cancelbench.reports.cli import add_diff_parser, add_report_parser
    add_report_parser(sub)
    add_diff_parser(sub)
    from cancelbench.reports.trend_render import add_trend_parser
    add_trend_parser(sub)

    from cancelbench.orchestrator.agents_cmd import add_agents_parser
    add_agents_parser(sub)
    from cancelbench.sut.check_cli import add_parser as add_sut_check_parser
    add_sut_check_parser(sub)
    return parser


EMPTY_ALLOWED = {"input"}  # sut-check --input "": an empty input is a legitimate conformance case


def _empty_option(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The first option given an empty (or blank) text value, if any."""
    for action in parser._actions:
        if not action.option_strings or action.dest in EMPTY_ALLOWED:
            continue
        value = getattr(args, action.dest, None)
        if value == action.default:
            continue
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            return action.option_strings[-1]
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command. A closed stdout or a reader that stops early (``| head``) drops the rest of
    what would be printed; the exit status stays the command's (cancelbench.outputs.guard_stdout)."""
    from cancelbench.outputs import finish_stdout, guard_stdout

    previous = sys.stdout
    guard_stdout()
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        command = args._commands[args.command]
        if extra:  # said by the sub-command's parser: "cancelbench report: error: unrecognized arguments"
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        empty = _empty_option(command, args)
        if empty:  # `--out ""` must not mean the default, nor the current directory
            command.error(f"argument {empty}: an empty value; give one or leave the option out")
        return int(args.func(args) or 0)
    finally:
        finish_stdout()
        if previous is not None:
            sys.stdout = previous


if __name__ == "__main__":
    sys.exit(main())
