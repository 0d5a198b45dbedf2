"""argparse wiring for ``cancelbench report`` and ``cancelbench diff``.

The main CLI calls ``add_report_parser(subparsers)`` and
``add_diff_parser(subparsers)``; each sets ``func`` to a callable taking the
parsed namespace and returning the exit code.  Bad input prints one line on
stderr and returns 2.  ``python -m reports.cli`` works standalone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cancelbench.fileio import write_atomic
from cancelbench.outputs import check_outputs, write_outputs
from cancelbench.inputs import non_negative_int, positive_finite
from cancelbench.sink import DatasetError, partial_reason

from .load import Filters
from .noise import REFUSED_EXIT, NoiseSpec
from .tables import BoundSpec, ReportSpec


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def percentile(text: str) -> float:
    """argparse type: a percentile in (0, 100), returned as a fraction."""
    value = _number(text)
    if not 0 < value < 100:
        raise argparse.ArgumentTypeError(f"a percentile must lie in (0, 100), got {text!r}")
    return value / 100.0


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1)."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1), got {text!r}")
    return value


def integer(text: str) -> int:
    """argparse type: an integer."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


_percent, _fraction = percentile, fraction  # the names other modules import
_positive = positive_finite  # a finite number > 0: "inf" and "nan" are refused

MIN_BOOTSTRAP, MAX_BOOTSTRAP = 100, 100_000


def _add_bootstrap(p: argparse.ArgumentParser, default: int, what: str) -> None:
    """--bootstrap (replicates; :func:`_bootstrap` checks them) and --seed."""
    p.add_argument("--bootstrap", type=integer, default=default, metavar="N",
                   help=f"bootstrap replicates {what}({MIN_BOOTSTRAP}..{MAX_BOOTSTRAP:,}; default {default})")
    p.add_argument("--seed", type=integer, default=0, metavar="S", help="bootstrap seed (default 0)")


def _bootstrap(args: argparse.Namespace) -> int:
    """--bootstrap in 100..100,000: fewer make a 95% interval of a few points; more change an interval
    by less than its rounding and cost memory and minutes (one line, exit 2 otherwise)."""
    if not MIN_BOOTSTRAP <= args.bootstrap <= MAX_BOOTSTRAP:
        raise ValueError(f"--bootstrap must lie in {MIN_BOOTSTRAP}..{MAX_BOOTSTRAP:,}, got {args.bootstrap}")
    return args.bootstrap


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bound", type=_positive, default=50.0, metavar="MS", help="latency bound in ms (default 50)")
    p.add_argument("--bound-for", action="append", default=[], metavar="WORKLOAD[:PHASE]=MS",
                   help="bound override for a workload and/or phase ('*:PHASE=MS' for every workload); repeatable")
    p.add_argument("--confidence", type=fraction, default=0.95, metavar="C",
                   help="confidence for minimum sample counts, early stopping and CIs (default 0.95)")
    p.add_argument("--workload", action="append", metavar="W", help="only these workloads (repeatable; pushed down)")
    p.add_argument("--backend", action="append", metavar="B", help="only these backends (repeatable; prunes partitions)")
    p.add_argument("--host", action="append", metavar="H",
                   help="only these (sanitized) hosts (repeatable; prunes partitions)")


def add_noise_options(p: argparse.ArgumentParser) -> None:
    """The host-noise thresholds of diff and trend (reports/noise.py) and --refuse-noisy."""
    p.add_argument("--noise-wait-share", type=fraction, default=NoiseSpec.wait_share, metavar="FRACTION",
                   help="flag a comparison whose sides' CPU-wait shares differ by more than this (absolute; "
                        "default 0.10 = 10 points)")
    p.add_argument("--noise-load", type=_positive, default=NoiseSpec.load, metavar="N",
                   help="... whose median 1-minute load averages differ by more than N (default 2)")
    p.add_argument("--noise-procs", type=_positive, default=NoiseSpec.procs, metavar="N",
                   help="... whose median runnable tasks differ by more than N (default 1.5)")
    p.add_argument("--noise-steal", type=_positive, default=NoiseSpec.steal, metavar="CPUS",
                   help="... whose stolen CPUs over the whole trials differ by more than this (default 0.10; judged "
                        "only over spans of at least 20 ms / CPUS)")
    p.add_argument("--refuse-noisy", action="store_true",
                   help=f"refuse a flagged comparison: one line on stderr, exit {REFUSED_EXIT} (the outputs are "
                        "still written, saying so)")


def noise_spec(args: argparse.Namespace) -> NoiseSpec:
    return NoiseSpec(wait_share=args.noise_wait_share, load=args.noise_load, procs=args.noise_procs,
                     steal=args.noise_steal, refuse=args.refuse_noisy)


def _bound_spec(args: argparse.Namespace) -> BoundSpec:
    return BoundSpec(default_ms=args.bound, overrides=tuple(BoundSpec.parse_override(t) for t in args.bound_for))


def check_bound_targets(bound: BoundSpec, cells) -> None:
    """Every --bound-for names a workload and phase that some selected cell has (a typo would
    otherwise never apply): ValueError naming the first that does not."""
    pairs = {(c.workload, c.phase) for c in cells}
    workloads = sorted({w for w, _ in pairs})
    for workload, phase, ms in bound.overrides:
        shown = f"{'*' if workload is None else workload}{'' if phase is None else ':' + phase}={ms:g}"
        if workload is not None and workload not in workloads:
            raise ValueError(f"--bound-for {shown}: no workload {workload!r} in the selected records "
                             f"(workloads: {', '.join(workloads) or 'none'})")
        phases = sorted({p for w, p in pairs if workload in (None, w)})
        if phase is not None and phase not in phases:
            where = "any workload" if workload is None else f"workload {workload!r}"
            raise ValueError(f"--bound-for {shown}: no phase {phase!r} in {where} of the selected records "
                             f"(phases: {', '.join(phases) or 'none'})")


def check_ray_options(engine: str | None, address: str | None) -> None:
    """--ray-address only with --engine ray; a ray:// (Ray Client) address refused at once, as
    ``sweep`` refuses it (the report runs on a node of the cluster, or the client times out)."""
    import os

    if address is not None and engine != "ray":
        raise ValueError("--ray-address applies to --engine ray only (the pandas engine runs here)")
    if engine == "ray":
        address = address or os.environ.get("RAY_ADDRESS")
        if address is not None and not address.strip():
            raise ValueError("--ray-address: an empty address")
        if address and "://" in address:
            raise ValueError(f"Ray address {address!r}: Ray Client (ray://) and other URL addresses are not "
                             "supported; run cancelbench on a node of the cluster and give its GCS as "
                             "--ray-address HOST:PORT (or 'auto')")


def _filters(args: argparse.Namespace) -> Filters:
    tup = lambda v: tuple(v) if v else None  # noqa: E731
    return Filters(workloads=tup(args.workload), backends=tup(args.backend), hosts=tup(args.host))


def _write(path: str, text: str) -> None:
    """Write a report file whole or not at all (a full disk leaves no truncated page behind)."""
    write_atomic(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def output_options(args: argparse.Namespace, forms: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """(option, path) of every ``--FORM PATH`` output option the command has."""
    return [(f"--{form}", getattr(args, form, None)) for form in forms]


def write_renders(outputs: list[tuple[str, Path]], render) -> None:
    """Render every checked output (``render(form)``), then write them all or none."""
    write_outputs([(path, render(option[2:])) for option, path in outputs])


def _fail(command: str, exc: BaseException) -> int:
    print(f"cancelbench {command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2


# ----------------------------------------------------------------- report --
def add_report_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="cross-platform latency report of one or more sweep datasets",
        description="Cross-platform cancel latency report. Exit 0, or 1 when dropped cancels or lost trials "
                    "exist, 2 on bad input.")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="sweep result directories")
    p.add_argument("--format", choices=("terminal", "markdown", "json", "html", "junit", "github"),
                   default="terminal", help="what goes to stdout (default terminal; junit: JUnit XML, a failing "
                   "testcase per cell over its bound or with dropped/lost trials; github: an ::error annotation "
                   "line per failing cell)")
    p.add_argument("--markdown", metavar="PATH", help="also write the Markdown report here")
    p.add_argument("--junit", metavar="PATH", help="also write the JUnit XML here")
    p.add_argument("--json", metavar="PATH", help="also write the JSON verdict here")
    p.add_argument("--html", metavar="PATH", help="also write the self-contained HTML page here")
    p.add_argument("--bound-percentile", type=percentile, default=0.99, metavar="PCT",
                   help="percentile compared with the bound (default 99)")
    p.add_argument("--max-defects", type=non_negative_int, default=50, metavar="N", help="defects listed in text forms (JSON lists all)")
    p.add_argument("--engine", choices=("pandas", "ray"), default="pandas",
                   help="aggregate with pandas on this machine (default) or on Ray Data")
    p.add_argument("--ray-address", default=None, metavar="A",
                   help="Ray cluster for --engine ray (default: RAY_ADDRESS, else a local Ray on 127.0.0.1)")
    _add_common(p)
    p.set_defaults(func=run_report)
    return p


REPORT_FILES = ("html", "markdown", "json", "junit")


def run_report(args: argparse.Namespace) -> int:
    from . import build_report
    from .format import to_json, to_markdown, to_terminal

    try:
        outputs = check_outputs(output_options(args, REPORT_FILES), inputs=args.dirs)  # before anything runs
        check_ray_options(args.engine, args.ray_address)
        spec = ReportSpec(bound=_bound_spec(args), bound_percentile=args.bound_percentile, confidence=args.confidence)
        filters = _filters(args)
        html = args.format == "html" or bool(args.html)
        # pandas: one scan for the tables and the plots
        report = build_report(args.dirs, spec, filters, engine=args.engine, with_samples=html,
                              address=args.ray_address)
        check_bound_targets(spec.bound, report.cells)
        from .github import append_step_summary, report_annotations
        from .junit import report_to_junit

        renders = {"terminal": lambda: to_terminal(report, args.max_defects),
                   "markdown": lambda: to_markdown(report, args.max_defects),
                   "json": lambda: to_json(report), "junit": lambda: report_to_junit(report),
                   "github": lambda: report_annotations(report)}
        if html:
            from .html import to_html
            page = to_html(report, report.samples, report.references)
            renders["html"] = lambda: page
        write_renders(outputs, lambda form: renders[form]())
        sys.stdout.write(renders[args.format]())
        append_step_summary(lambda limit: to_markdown(report, args.max_defects, limit), "report")
        for d in args.dirs:  # an interrupted or cut-short sweep: say so (the tables cover what is on disk)
            reason = partial_reason(Path(d))
            if reason:
                print(f"cancelbench report: warning: {reason}", file=sys.stderr)
    except (DatasetError, ValueError, OSError) as exc:
        return _fail("report", exc)
    return report.exit_code


# ------------------------------------------------------------------- diff --
def add_diff_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "diff", help="compare two sweeps cell by cell (regression check for CI)",
        description="Compare a candidate sweep with a baseline. Exit 1 on regression, 0 otherwise, 2 on bad input, "
                    f"{REFUSED_EXIT} when --refuse-noisy refuses a noisy comparison.")
    p.add_argument("baseline", metavar="BASELINE", help="baseline sweep directory")
    p.add_argument("candidate", metavar="CANDIDATE", help="candidate sweep directory")
    p.add_argument("--format", choices=("terminal", "markdown", "json", "html", "junit", "github"),
                   default="terminal",
                   help="what goes to stdout (default terminal; markdown is the CI comment; html overlays the "
                        "baseline and candidate ECDFs of every changed cell; junit: a failing testcase per "
                        "regressed cell; github: an ::error annotation line per regressed cell)")
    p.add_argument("--markdown", metavar="PATH", help="also write the Markdown comment here")
    p.add_argument("--junit", metavar="PATH", help="also write the JUnit XML here")
    p.add_argument("--json", metavar="PATH", help="also write the JSON verdict here")
    p.add_argument("--html", metavar="PATH", help="also write the HTML page here")
    p.add_argument("--percentile", type=percentile, default=0.99, metavar="PCT",
                   help="percentile whose change is tested (default 99)")
    p.add_argument("--threshold", type=_positive, default=0.10, metavar="FRACTION",
                   help="relative change of the percentile that counts when significant, as a fraction: "
                        "0.10 = 10%% (default 0.10)")
    _add_bootstrap(p, 4000, "")
    p.add_argument("--map-class", action="append", default=[], metavar="BASELINE_CLASS=CANDIDATE_CLASS",
                   help="compare across device classes (platform/arch/backend/device_name), e.g. a Metal baseline "
                        "with a CPU candidate; repeatable")
    p.add_argument("--ignore-setting", action="append", default=[], metavar="NAME",
                   help="compare cells even though this settings column differs between the sweeps (diff refuses "
                        "otherwise: different settings are different experiments); repeatable")
    add_noise_options(p)
    _add_common(p)
    p.set_defaults(func=run_diff_cmd)
    return p


DIFF_FILES = ("markdown", "json", "html", "junit")


def run_diff_cmd(args: argparse.Namespace) -> int:
    from .diff import DiffSpec, parse_class_map, run_diff
    from .diff_render import diff_to_json, diff_to_markdown, diff_to_terminal

    try:
        outputs = check_outputs(output_options(args, DIFF_FILES), inputs=[args.baseline, args.candidate])
        spec = DiffSpec(percentile=args.percentile, rel_threshold=args.threshold, confidence=args.confidence,
                        n_boot=_bootstrap(args), seed=args.seed, bound=_bound_spec(args),
                        class_map=parse_class_map(args.map_class), ignore_settings=tuple(args.ignore_setting),
                        noise=noise_spec(args))
        result = run_diff([args.baseline], [args.candidate], spec, _filters(args))
        check_bound_targets(spec.bound, result.cells)
        from .html import diff_to_html

        from .github import append_step_summary, diff_annotations
        from .junit import diff_to_junit

        renders = {"terminal": diff_to_terminal, "markdown": diff_to_markdown, "json": diff_to_json,
                   "html": diff_to_html, "junit": diff_to_junit, "github": diff_annotations}
        write_renders(outputs, lambda form: renders[form](result))
        sys.stdout.write(renders[args.format](result))
        append_step_summary(lambda limit: diff_to_markdown(result, limit), "diff")
    except (DatasetError, ValueError, OSError) as exc:
        return _fail("diff", exc)
    refuse_line("diff", result.noise)
    return result.exit_code


def refuse_line(command: str, check) -> None:
    """The one stderr line of a refused (--refuse-noisy) comparison."""
    if check is not None and check.refused:
        from .noise import refusal_line

        print(refusal_line(command, check), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cancelbench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_report_parser(sub)
    add_diff_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
