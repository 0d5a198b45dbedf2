"""JUnit XML for CI systems: ``report --format junit`` and ``diff --format junit``.

Report: one ``testsuite`` per workload x device, one ``testcase`` per cell
(mechanism x delivery x phase).  A cell fails when it has dropped cancels,
lost trials or its bound percentile is over the bound; the failure message is
one line naming the worst trial ids.  A cell without the samples its bound
percentile needs is ``skipped`` with the reason.  Dropped/lost trials outside
any cancel cell (a lost reference run) get a failing testcase of their own,
so every defect of the report is in exactly one failure message, counted
("2 dropped cancels: ...").

Diff: one ``testsuite`` per workload x device class, one ``testcase`` per cell;
a regressed cell is a failure, an insufficient or baseline-only cell skipped.

The schema Jenkins' xUnit plugin validates against (tests/data/junit-10.xsd)
has no ``properties`` inside a ``testcase`` (pytest's ``record_property`` is
documented as breaking xunit2 for that reason), so a cell's p50/p99/n are
``testsuite`` properties named ``<testcase name> <stat>`` and repeated in the
testcase's ``system-out``.

Text from the data is made XML-safe (control characters escaped) and
ElementTree escapes markup.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass

from . import stats
from .format import term_safe
from .sections import fmt_ms
from .tables import CellStats, Report


def _ms(value: float | None) -> str:
    """A number for machine readers: empty when there is none (too few samples)."""
    return "" if value is None else f"{value:.3f}"


def _x(text: object) -> str:
    """XML 1.0 cannot hold most control characters: escape them like a terminal would."""
    return term_safe(text)


@dataclass
class CellFailure:
    """One failing cell (or defect group outside any cell): shared with ``github.py``."""

    suite: str
    case: str
    kinds: list[str]  # dropped | lost | over_bound | regressed
    message: str  # one line
    n_defects: int = 0  # dropped + lost trials named in the message


def suite_name(workload: str, device: str) -> str:
    return f"{workload} @ {device}"


def case_name(mechanism: str, delivery: str, phase: str) -> str:
    return f"{mechanism} / {delivery} / {phase}"


def _ids(ids: list[str], limit: int = 5) -> str:
    more = f" (+{len(ids) - limit} more)" if len(ids) > limit else ""
    return " ".join(ids[:limit]) + more


def _defects_by_cell(report: Report) -> dict[tuple, dict[str, list[str]]]:
    """(workload, phase, mechanism, delivery, device, trial_kind) -> {outcome: [trial ids]}."""
    out: dict[tuple, dict[str, list[str]]] = {}
    for r in report.defects.itertuples():
        key = (r.workload, r.phase, r.mechanism, r.delivery, r.device, r.trial_kind)
        out.setdefault(key, {}).setdefault(r.outcome, []).append(str(r.trial_id))
    return out


def _defect_text(by_outcome: dict[str, list[str]]) -> tuple[list[str], list[str], int]:
    parts, kinds, n = [], [], 0
    for outcome, what in (("dropped", "dropped cancel"), ("lost", "lost trial"), ("invalid", "invalid record")):
        ids = sorted(by_outcome.get(outcome, []))
        if ids:
            parts.append(f"{len(ids)} {what}{'s' if len(ids) > 1 else ''}: {_ids(ids)}")
            kinds.append(outcome)
            n += len(ids)
    return parts, kinds, n


def _over_text(c: CellStats, bl: str) -> str:
    return (f"{bl} {fmt_ms(c.bound_stat_ms)} ms over the {c.bound_ms:g} ms bound ({c.n_over}/{c.n} samples over); "
            f"worst: {_ids(c.worst_trial_ids)}")


def report_failures(report: Report) -> tuple[list[CellFailure], dict[tuple, CellFailure]]:
    """Every failing cell of the report, and (cell key -> failure) for the testcases."""
    bl = stats.percentile_label(report.spec.bound_percentile)
    defects = _defects_by_cell(report)
    used: set[tuple] = set()
    out: list[CellFailure] = []
    by_cell: dict[tuple, CellFailure] = {}
    for c in report.cells:
        key = (c.workload, c.phase, c.mechanism, c.delivery, c.device, "cancel")
        parts, kinds, n = _defect_text(defects.get(key, {}))
        used.add(key)
        if c.over:
            parts.append(_over_text(c, bl))
            kinds.append("over_bound")
        if parts:
            f = CellFailure(suite_name(c.workload, c.device), case_name(c.mechanism, c.delivery, c.phase), kinds,
                            "; ".join(parts), n)
            out.append(f)
            by_cell[(c.workload, c.device, c.row_key)] = f
    for key in sorted(k for k in defects if k not in used):  # e.g. a lost reference run: no cancel cell holds it
        workload, phase, mechanism, delivery, device, kind = key
        parts, kinds, n = _defect_text(defects[key])
        out.append(CellFailure(suite_name(workload, device), f"{kind} {case_name(mechanism, delivery, phase)}",
                               kinds, "; ".join(parts), n))
    return out, by_cell


def _props(parent: ET.Element, items: list[tuple[str, object]]) -> None:
    if items:
        props = ET.SubElement(parent, "properties")
        for name, value in items:
            ET.SubElement(props, "property", name=_x(name), value=_x("" if value is None else value))


def _suite(root: ET.Element, name: str, cases: list[tuple[str, str, str | None, str | None, str, str]],
           props: list[tuple[str, object]]) -> None:
    """cases: (classname, name, failure type, failure message, skipped message, system-out)."""
    failures = sum(1 for c in cases if c[3] is not None)
    skipped = sum(1 for c in cases if c[3] is None and c[4])
    suite = ET.SubElement(root, "testsuite", name=_x(name), tests=str(len(cases)), failures=str(failures),
                          errors="0", skipped=str(skipped))
    _props(suite, props)
    for classname, cname, ftype, fmsg, skip, out in cases:
        case = ET.SubElement(suite, "testcase", classname=_x(classname), name=_x(cname))
        if fmsg is not None:
            el = ET.SubElement(case, "failure", type=_x(ftype or "failure"), message=_x(fmsg))
            el.text = _x(fmsg)
        elif skip:
            ET.SubElement(case, "skipped", message=_x(skip))
        if out:
            ET.SubElement(case, "system-out").text = _x(out)


def _document(root: ET.Element) -> str:
    tests = sum(int(s.get("tests")) for s in root)
    fails = sum(int(s.get("failures")) for s in root)
    root.set("tests", str(tests))
    root.set("failures", str(fails))
    root.set("errors", "0")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def report_to_junit(report: Report) -> str:
    spec = report.spec
    bl = stats.percentile_label(spec.bound_percentile)
    need = stats.min_samples(spec.bound_percentile, spec.confidence)
    failures, by_cell = report_failures(report)
    legend = {d.device: d for d in report.devices}
    suites: dict[tuple[str, str], list] = {}
    stats_props: dict[tuple[str, str], list[tuple[str, object]]] = {}
    for c in report.cells:
        key = (c.workload, c.device)
        name = case_name(c.mechanism, c.delivery, c.phase)
        f = by_cell.get((c.workload, c.device, c.row_key))
        pcts = {k: v for k, v in c.percentiles.items()}
        out = (f"n={c.n} trials={c.n_trials} " + " ".join(f"{k}_ms={_ms(v)}" for k, v in pcts.items())
               + f" {bl}_nearest_rank_ms={_ms(c.bound_stat_ms)} bound_ms={c.bound_ms:g} dropped={c.dropped} "
               f"lost={c.lost}")
        skip = (f"{bl} needs n >= {need} at {spec.confidence:g} confidence; this cell has n = {c.n}"
                if c.n < need else "")
        if c.n == 0:
            skip = (f"no latency sample: {c.n_trials} trial(s), {c.completed} completed before the cancel took "
                    f"effect, {c.errors} error(s)")
        suites.setdefault(key, []).append((f"cancelbench.{c.workload}.{c.device}", name,
                                           ",".join(f.kinds) if f else None, f.message if f else None, skip, out))
        stats_props.setdefault(key, []).extend(
            [(f"{name} n", c.n), *((f"{name} {k}_ms", _ms(v)) for k, v in pcts.items()),
             (f"{name} bound_ms", f"{c.bound_ms:g}")])
    in_cells = {id(v) for v in by_cell.values()}
    for f in failures:  # defects outside any cell
        if id(f) not in in_cells:
            workload, _, device = f.suite.partition(" @ ")
            suites.setdefault((workload, device), []).append(
                (f"cancelbench.{workload}.{device}", f.case, ",".join(f.kinds), f.message, "", ""))
    root = ET.Element("testsuites", name="cancelbench report")
    for (workload, device), cases in sorted(suites.items()):
        info = legend.get(device)
        props = [("workload", workload), ("device", device), ("bound_percentile", bl),
                 ("confidence", spec.confidence)]
        if info is not None:
            props += [("device_class", info.device_class), ("hostname", info.hostname)]
            props += [(k, v) for k, v in sorted(getattr(info, "build", {}).items())]
        _suite(root, suite_name(workload, device), cases, props + stats_props.get((workload, device), []))
    return _document(root)


NOISE_SUITE, NOISE_CASE = "host noise", "baseline vs candidate"


def noise_failure(check) -> CellFailure | None:
    """A noisy comparison (reports/noise.py) as a failure of its own, first: a CI job failing on a
    busy runner says so."""
    if check is None or not check.flagged:
        return None
    return CellFailure(NOISE_SUITE, NOISE_CASE, ["refused" if check.refused else "noisy"], check.line())


def diff_failures(result) -> list[CellFailure]:
    noisy = noise_failure(result.noise)
    out = [noisy] if noisy is not None else []
    said = f" (on a noisy comparison: {result.noise.line()})" if noisy is not None else ""
    for d in result.regressed:
        worst = f"; worst candidate trials: {_ids(d.cand_worst_trial_ids)}" if d.cand_worst_trial_ids else ""
        out.append(CellFailure(suite_name(d.workload, d.device_class), case_name(d.mechanism, d.delivery, d.phase),
                               ["regressed"], "; ".join(d.reasons) + worst + said, d.cand_dropped + d.cand_lost))
    return out


def diff_to_junit(result) -> str:
    pl = stats.percentile_label(result.spec.percentile)
    failures = {(f.suite, f.case): f for f in diff_failures(result)}
    suites: dict[str, list] = {}
    props: dict[str, list] = {}
    for d in result.cells:
        sname, cname = suite_name(d.workload, d.device_class), case_name(d.mechanism, d.delivery, d.phase)
        f = failures.get((sname, cname))
        skip = ""
        if f is None and d.verdict == "insufficient":
            skip = "; ".join(d.reasons)
        elif f is None and d.verdict == "missing":
            skip = "baseline only: the candidate has no trials in this cell"
        out = (f"verdict={d.verdict} n={d.base_n}->{d.cand_n} p50_ms={_ms(d.base_p50)}->{_ms(d.cand_p50)} "
               f"{pl}_ms={_ms(d.base_value)}->{_ms(d.cand_value)}")
        suites.setdefault(sname, []).append((f"cancelbench.diff.{d.workload}.{d.device_class}", cname,
                                             "regressed" if f else None, f.message if f else None, skip, out))
        props.setdefault(sname, []).extend([(f"{cname} verdict", d.verdict), (f"{cname} n", f"{d.base_n}->{d.cand_n}"),
                                            (f"{cname} p50_ms", f"{_ms(d.base_p50)}->{_ms(d.cand_p50)}"),
                                            (f"{cname} {pl}_ms", f"{_ms(d.base_value)}->{_ms(d.cand_value)}")])
    root = ET.Element("testsuites", name="cancelbench diff")
    check = result.noise
    if check is not None:  # first: whether the two hosts can be compared at all
        f = failures.get((NOISE_SUITE, NOISE_CASE))
        facts = [(f"{n} {k}", v) for n, side in zip(check.names, check.sides) for k, v in side.__dict__.items()]
        _suite(root, NOISE_SUITE, [("cancelbench.diff.noise", NOISE_CASE, ",".join(f.kinds) if f else None,
                                    f.message if f else None, "", check.line())], facts)
    for sname, cases in sorted(suites.items()):
        _suite(root, sname, cases, [("baseline", ", ".join(result.baseline)),
                                    ("candidate", ", ".join(result.candidate)), *props[sname]])
    return _document(root)
