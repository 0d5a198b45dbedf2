"""JUnit XML, GitHub annotations and the GitHub job summary of ``report`` and ``diff``.

The XML is checked by code nobody here wrote: parsed with ``junitparser``
(PyPI) and validated with ``xmlschema`` (pure Python, installs everywhere;
lxml would need a compiler where no wheel exists) against the JUnit schema
the Jenkins xUnit plugin validates reports with (tests/data/junit-10.xsd,
unmodified).  The known-answer dataset has one dropped cancel, one lost
reference run and two cells over the bound, so every count is known.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import cancel_row, cell_rows, known_answer_rows, write_dataset  # noqa: E402

from cancelbench.reports.cli import main as reports_main  # noqa: E402

junitparser = pytest.importorskip("junitparser")
xmlschema = pytest.importorskip("xmlschema")

XSD = Path(__file__).resolve().parent / "data" / "junit-10.xsd"


@pytest.fixture(scope="module")
def schema():
    return xmlschema.XMLSchema(str(XSD))


@pytest.fixture(scope="module")
def known(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("junit") / "known", known_answer_rows())


def _cases(xml: "junitparser.JUnitXml"):
    for suite in xml:
        for case in suite:
            yield suite, case


def _kinds(case) -> list[str]:
    return [type(r).__name__ for r in case.result]


def test_report_junit_parses_validates_and_counts_every_defect(known, schema, capsys, tmp_path):
    assert reports_main(["report", str(known), "--format", "json"]) == 1
    verdict = json.loads(capsys.readouterr().out)
    assert reports_main(["report", str(known), "--format", "junit", "--junit", str(tmp_path / "r.xml")]) == 1
    text = capsys.readouterr().out
    assert text == (tmp_path / "r.xml").read_text(encoding="utf-8")  # stdout is the document, nothing else
    schema.validate(text)
    xml = junitparser.JUnitXml.fromstring(text)
    suites = {s.name for s in xml}
    assert suites == {"tts @ hostA/cpu:0", "tts @ hostB/vulkan:0", "stt @ hostA/cpu:0"}  # workload x device
    failures = [(s, c) for s, c in _cases(xml) if "Failure" in _kinds(c)]
    messages = [c.result[0].message for _, c in failures]
    assert all("\n" not in m for m in messages)
    # every dropped/lost trial of the report is named in exactly one failure, with its count
    ids = [d["trial_id"] for d in verdict["defects"]]
    assert sorted(ids) == ["b-dec-dropped", "ref-lost"]
    for trial in ids:
        assert sum(trial in m for m in messages) == 1, (trial, messages)
    counted = sum(int(n) for m in messages for n in re.findall(r"(\d+) (?:dropped cancels?|lost trials?):", m))
    assert counted == len(verdict["defects"])
    # ... and every over-bound cell fails, naming its worst trials
    over = [m for m in messages if "over the" in m]
    assert len(over) == len(verdict["over_bound"]) == 2
    assert any("a-sttdec-0299" in m for m in over)
    # failure count = cells with a defect + cells over the bound + defects outside any cell (the lost reference)
    assert len(failures) == len(verdict["over_bound"]) + 2
    assert sum(int(s.failures) for s in xml) == len(failures) == int(xml.failures)
    # too few samples for the p99: skipped with the reason; enough and within the bound: passed
    by_name = {(s.name, c.name): c for s, c in _cases(xml)}
    pre = by_name[("tts @ hostB/vulkan:0", "abort_callback / driver / prefill")]
    assert _kinds(pre) == ["Skipped"] and "p99 needs n >= 299" in pre.result[0].message and "n = 4" in \
        pre.result[0].message
    enc = by_name[("stt @ hostA/cpu:0", "between_calls / agent / encode")]
    assert enc.is_passed
    props = {p.name: p.value for p in next(s for s in xml if s.name == "stt @ hostA/cpu:0").properties()}
    assert props["between_calls / agent / encode p50_ms"] == "20.000"
    assert props["between_calls / agent / encode n"] == "300"
    assert props["between_calls / agent / decode p99_ms"] == "80.000"


def test_hostile_strings_stay_valid_xml(tmp_path, schema, capsys):
    hostile = 'x"<y>&\x1b[31m\x00z'
    rows = cell_rows("h", [1.0, 2.0, 3.0, 4.0, 5.0], workload=hostile, hostname=hostile)
    rows.append(cancel_row("h-drop", None, workload=hostile, outcome="dropped"))
    d = write_dataset(tmp_path / "h", rows)
    assert reports_main(["report", str(d), "--format", "junit"]) == 1
    text = capsys.readouterr().out
    schema.validate(text)
    xml = junitparser.JUnitXml.fromstring(text)
    assert any("h-drop" in c.result[0].message for _, c in _cases(xml) if c.result)


def test_schema_rejects_what_it_should(schema):
    """Guard for the check itself: a testsuite without its required counts is invalid."""
    with pytest.raises(xmlschema.XMLSchemaValidationError):
        schema.validate('<testsuites><testsuite name="x"><testcase name="c"/></testsuite></testsuites>')


def _grid(n: int, scale: float = 1.0) -> np.ndarray:
    u = (np.arange(n) + 0.5) / n
    return scale * (2.0 + 15.0 * u ** 3)


def test_diff_junit_fails_exactly_the_regressed_cells(tmp_path, schema, capsys):
    base = write_dataset(tmp_path / "b", cell_rows("b", _grid(600), host="mac1")
                         + cell_rows("bp", _grid(600), host="mac1", phase="prefill")
                         + cell_rows("bi", _grid(10), host="mac1", phase="idle"))
    cand = write_dataset(tmp_path / "c", cell_rows("c", _grid(600, 1.5), host="mac2")
                         + cell_rows("cp", _grid(600), host="mac2", phase="prefill")
                         + cell_rows("ci", _grid(10), host="mac2", phase="idle"))
    # a 20 ms bound: the candidate's slowest decode trials are newly over it and get named
    assert reports_main(["diff", str(base), str(cand), "--format", "json", "--bound", "20"]) == 1
    verdict = json.loads(capsys.readouterr().out)
    assert reports_main(["diff", str(base), str(cand), "--format", "junit", "--bound", "20"]) == 1
    text = capsys.readouterr().out
    schema.validate(text)
    xml = junitparser.JUnitXml.fromstring(text)
    failed = [c for _, c in _cases(xml) if "Failure" in _kinds(c)]
    assert len(failed) == verdict["counts"]["regressed"] == 1
    assert failed[0].name == "abort_callback / driver / decode" and "p99 " in failed[0].result[0].message
    assert "worst candidate trials: c-0599" in failed[0].result[0].message
    skipped = [c for _, c in _cases(xml) if _kinds(c) == ["Skipped"]]
    assert [c.name for c in skipped] == ["abort_callback / driver / idle"]  # 10 samples: insufficient


def test_github_annotations_one_line_per_failing_cell_escaped(known, capsys, tmp_path):
    assert reports_main(["report", str(known), "--format", "github"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.startswith("::error title=cancelbench report") for line in lines)
    assert any("b-dec-dropped" in line for line in lines)
    # a newline or '::' in the data cannot start another workflow command
    rows = cell_rows("e", [80.0] * 5, workload="w\n::warning::pwn,x:y%")
    d = write_dataset(tmp_path / "e", rows)
    reports_main(["report", str(d), "--format", "github"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("::error title=") and "%0A" in out and "%25" in out


def test_step_summary_appends_the_markdown(known, tmp_path, monkeypatch, capsys):
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier step\n", encoding="utf-8")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert reports_main(["report", str(known), "--format", "json"]) == 1
    json.loads(capsys.readouterr().out)  # stdout unchanged: still only the JSON
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("# earlier step\n") and "## cancelbench report: FAIL" in text
    base = write_dataset(tmp_path / "b", cell_rows("b", _grid(600), host="mac1"))
    cand = write_dataset(tmp_path / "c", cell_rows("c", _grid(600, 1.5), host="mac1"))
    assert reports_main(["diff", str(base), str(cand)]) == 1
    capsys.readouterr()
    text = summary.read_text(encoding="utf-8")
    assert text.index("## cancelbench report") < text.index("## cancelbench diff: REGRESSED")


def test_step_summary_of_a_big_sweep_stays_under_the_limit_or_says_where_it_was_cut(tmp_path, monkeypatch, capsys):
    """4 devices x 4 mechanisms x 10 phases (x 2 deliveries), every cell over the bound with
    long trial ids; the summary file must stay within GitHub's 1 MiB and say when it was cut."""
    from cancelbench.reports import github

    rows = []
    for host in ("hostA", "hostB", "mac1", "mac2"):
        for mech in ("between_calls", "abort_callback", "chunked", "graph_eval"):
            for phase in range(10):
                for delivery in ("driver", "agent"):
                    prefix = f"{host}-{mech}-phase{phase}-{delivery}-" + "x" * 40
                    rows += cell_rows(prefix, [60.0 + k for k in range(6)], host=host, mechanism=mech,
                                      phase=f"phase-{phase}", delivery=delivery)
    d = write_dataset(tmp_path / "big", rows)
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert reports_main(["report", str(d), "--format", "json", "--max-defects", "10000"]) == 0
    capsys.readouterr()
    first = summary.stat().st_size
    assert 0 < first <= github.SUMMARY_LIMIT
    # nearly full: the next summary is cut to what is left, and says so
    monkeypatch.setattr(github, "SUMMARY_LIMIT", first + 6000)
    assert reports_main(["report", str(d), "--format", "json"]) == 0
    capsys.readouterr()
    size = summary.stat().st_size
    assert size <= first + 6000
    tail = summary.read_bytes()[first:].decode("utf-8")
    assert "## cancelbench report" in tail and ("rows shown" in tail or "truncated at" in tail)
    # full: nothing appended, a warning on stderr (never silent)
    assert reports_main(["report", str(d), "--format", "json"]) == 0
    err = capsys.readouterr().err
    assert summary.stat().st_size == size and "GITHUB_STEP_SUMMARY" in err and "not added" in err


def test_fit_markdown_counts_bytes_not_characters():
    from cancelbench.reports.github import fit_markdown

    def render(limit: int) -> str:  # 3-byte characters: a character limit alone would overshoot
        return ("▲" * 10_000)[:limit]

    text = fit_markdown(render, 3000)
    assert text is not None and len(text.encode("utf-8")) <= 3000 and len(text) > 900


def test_legends_list_the_build_facts_of_each_side(tmp_path, capsys):
    facts = dict(llama_cpp_build="llama.cpp 0.5.0 ggml 0.9.4 (abc123) vulkan", os_release="Debian GNU/Linux 12",
                 kernel_version="6.1.0-18-amd64", gpu_driver_version="24.2.8 (Vulkan 1.3.278)")
    base = write_dataset(tmp_path / "b", cell_rows("b", _grid(40), host="mac1", **facts))
    cand = write_dataset(tmp_path / "c", cell_rows("c", _grid(40), host="mac1", **dict(facts, kernel_version="6.12")))
    reports_main(["diff", str(base), str(cand)])
    out = capsys.readouterr().out
    assert "== Builds ==" in out and "6.1.0-18-amd64" in out and "6.12" in out and "24.2.8 (Vulkan 1.3.278)" in out
    reports_main(["diff", str(base), str(cand), "--format", "json"])
    builds = json.loads(capsys.readouterr().out)["builds"]
    assert {(b["side"], b["value"]) for b in builds if b["fact"] == "kernel_version"} == \
        {("baseline", "6.1.0-18-amd64"), ("candidate", "6.12")}
    reports_main(["report", str(base), "--format", "markdown"])
    md = capsys.readouterr().out
    assert "### Builds" in md and "Debian GNU/Linux 12" in md


def test_a_cell_without_samples_is_skipped_saying_why(tmp_path, capsys):
    rows = cell_rows("s", [1.0, 2.0, 3.0, 4.0, 5.0])
    rows += [cancel_row(f"late-{i}", None, phase=None, outcome="completed") for i in range(3)]
    d = write_dataset(tmp_path / "late", rows)
    assert reports_main(["report", str(d), "--format", "junit"]) == 0
    xml = junitparser.JUnitXml.fromstring(capsys.readouterr().out)
    (late,) = [c for _, c in _cases(xml) if c.name.endswith("/ (none)")]
    assert _kinds(late) == ["Skipped"] and late.result[0].message.startswith(
        "no latency sample: 3 trial(s), 3 completed before the cancel took effect")


def test_annotations_past_githubs_ten_say_how_many_more():
    from cancelbench.reports.github import annotations
    from cancelbench.reports.junit import CellFailure

    fails = [CellFailure("tts @ h/cpu:0", f"m / d / p{i}", ["over_bound"], f"p99 over, worst: t{i}") for i in range(25)]
    lines = annotations(fails, "report").splitlines()
    assert len(lines) == 10 and all(line.startswith("::error title=") for line in lines)
    assert "16 more failing cells" in lines[-1] and "t8" in lines[-2]
    assert len(annotations(fails[:10], "report").splitlines()) == 10  # exactly ten: all shown
    assert annotations([], "diff").startswith("::notice title=cancelbench diff::no failing cells")
