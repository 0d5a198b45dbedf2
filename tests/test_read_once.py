"""Datasets counted once, records that cannot be trusted, and one scan per dataset
(issue #27 items 4 and 9), through the real ``cancelbench report|diff|trend`` where
the defect is the command's."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import cell_rows, write_dataset  # noqa: E402

from cancelbench.schema import FILE_SCHEMA  # noqa: E402
from cancelbench.sink import records_dir, rows_to_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cancelbench.cli", *map(str, argv)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def json_of(*argv: str) -> tuple[int, dict]:
    r = run(*argv, "--format", "json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def clean_rows(prefix: str = "c", n: int = 40, scale: float = 1.0) -> list[dict]:
    """Two cells, no defect: a report of them is PASS (exit 0)."""
    return (cell_rows(f"{prefix}-d", [scale * (1 + i % 7) for i in range(n)])
            + cell_rows(f"{prefix}-p", [scale * (2 + i % 5) for i in range(n)], phase="prefill"))


@pytest.fixture
def clean(tmp_path) -> Path:
    return write_dataset(tmp_path / "clean", clean_rows())


def part_files(d: Path) -> list[Path]:
    return sorted(records_dir(d).rglob("*.parquet"))


# ------------------------------------------------------------- counted once --
def test_report_counts_a_dataset_once_however_it_is_named(clean, tmp_path):
    _, once = json_of("report", clean)
    assert once["n_records"] == 80 and once["verdict"] == "ok"
    link = tmp_path / "link"
    link.symlink_to(clean)
    copy = tmp_path / "copy"
    shutil.copytree(clean, copy)
    for names in ((clean, clean), (clean, link), (clean, copy), (copy, link, clean)):
        code, r = json_of("report", *names)
        assert (code, r["n_records"], r["datasets"]) == (0, 80, [str(names[0])]), names
        assert r["cells"] == once["cells"], names
    text = run("report", clean, copy).stdout
    assert f"{copy} is {clean} (sweep " in text and "counted once" in text  # the report says so


def test_trend_counts_a_sweep_once_however_it_is_named(tmp_path):
    a = write_dataset(tmp_path / "a", clean_rows())
    b = write_dataset(tmp_path / "b", clean_rows(scale=1.01))
    copy = tmp_path / "a-copy"
    shutil.copytree(a, copy)
    code, r = json_of("trend", a, copy, b, "--by", "given")
    assert code == 0 and [s["path"] for s in r["sweeps"]] == [str(a), str(b)]
    alone = run("trend", a, copy, "--by", "given")  # one sweep under two names: no trend
    assert alone.returncode == 2 and "at least two sweeps, got 1" in alone.stderr


def test_diff_reads_each_side_as_the_sweeps_it_names(clean, tmp_path):
    """A side named twice is one dataset (the API takes lists); the same sweep on both sides is a
    legitimate comparison (nothing changed)."""
    from cancelbench.reports.diff import run_diff

    copy = tmp_path / "copy"
    shutil.copytree(clean, copy)
    result = run_diff([clean, copy], [clean])
    assert [(c.base_n, c.cand_n) for c in result.cells] == [(40, 40), (40, 40)]
    assert result.exit_code == 0 and any("counted once" in n for n in result.notes)
    code, r = json_of("diff", clean, copy)
    assert code == 0 and {c["verdict"] for c in r["cells"]} == {"insufficient"}


# ------------------------------------------------------------ invalid records --
def test_a_copied_part_file_fails_the_report_and_doubles_nothing(clean):
    [part] = part_files(clean)
    shutil.copy(part, part.with_name("part-copied.parquet"))
    r = run("report", clean, "--format", "json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"] == "defects" and out["n_records"] <= 80  # never the doubled 160
    invalid = [d for d in out["defects"] if d["outcome"] == "invalid"]
    assert len(invalid) == 80 and all("trial id in 2 records" in d["error"] for d in invalid)
    assert sum(c["n"] for c in out["cells"]) == 0  # no copy of a duplicated trial counts
    text = run("report", clean).stdout
    assert text.startswith("cancelbench") or "FAIL" in text.splitlines()[0] or "FAIL" in text
    assert "80 invalid record(s)" in text


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -5.0], ids=["nan", "inf", "-inf", "negative"])
def test_a_non_finite_or_negative_latency_is_an_invalid_record(tmp_path, bad):
    rows = clean_rows()
    rows[3] = dict(rows[3], latency_ms=bad)
    d = write_dataset(tmp_path / "d", rows)
    r = run("report", d, "--format", "json")
    assert r.returncode == 1, r.stderr  # a defect, not a PASS with the record dropped
    out = json.loads(r.stdout)
    assert out["verdict"] == "defects"
    [defect] = out["defects"]
    assert defect["outcome"] == "invalid" and defect["trial_id"] == rows[3]["trial_id"]
    assert "latency_ms is" in defect["error"]
    assert all(c["max_ms"] is None or 0 <= c["max_ms"] < 100 for c in out["cells"])  # never a sample
    junit = run("report", d, "--format", "junit")
    assert junit.returncode == 1 and "1 invalid record" in junit.stdout


def test_diff_and_trend_fail_on_invalid_records(tmp_path):
    base = write_dataset(tmp_path / "base", clean_rows())
    rows = clean_rows(scale=1.01)
    rows[0] = dict(rows[0], latency_ms=math.nan)
    cand = write_dataset(tmp_path / "cand", rows)
    code, r = json_of("diff", base, cand)
    assert code == 1 and r["verdict"] == "regressed"
    [cell] = [c for c in r["cells"] if c["verdict"] == "regressed"]
    assert any("candidate: 1 invalid record(s)" in why and rows[0]["trial_id"] in why for why in cell["reasons"])
    code, r = json_of("trend", base, cand, "--by", "given")
    assert code == 1 and [s["invalid_records"] for s in r["sweeps"]] == [0, 1]


def write_part_without_latency(d: Path, rows: list[dict]) -> None:
    """A part file whose schema lacks latency_ms (a foreign or hand-made writer)."""
    table = rows_to_table(rows)
    keep = [f.name for f in FILE_SCHEMA if f.name != "latency_ms"]
    pq.write_table(table.select(keep), records_dir(d) / "backend=cpu" / "host=hostA" / "part-nolatency.parquet")


def test_a_part_file_without_latency_ms_is_the_same_verdict_on_both_engines(clean):
    """Its cancelled trials have no latency: invalid records (exit 1) with pandas and with Ray, and the
    same JSON; before, pandas said PASS and Ray ended in a traceback."""
    write_part_without_latency(clean, cell_rows("x", [3.0] * 5))
    by_engine = {}
    for engine in ("pandas", "ray"):
        r = run("report", clean, "--format", "json", "--engine", engine)
        assert r.returncode == 1 and "Traceback" not in r.stderr, (engine, r.stderr[-2000:])
        by_engine[engine] = json.loads(r.stdout)
    assert by_engine["pandas"] == by_engine["ray"]
    invalid = [d for d in by_engine["pandas"]["defects"] if d["outcome"] == "invalid"]
    assert sorted(d["trial_id"] for d in invalid) == [f"x-{i:04d}" for i in range(5)]
    assert all(d["error"] == "cancelled without latency_ms" for d in invalid)


# --------------------------------------------------------------- one scan --
@pytest.fixture
def scans(monkeypatch):
    """Every record scan opened (pyarrow datasets and Parquet reads), by what it read."""
    import pyarrow.dataset as pds

    opened: list[str] = []
    real_dataset, real_read = pds.dataset, pq.read_table

    def dataset(source, *a, **kw):
        files = source if isinstance(source, list) else [source]
        opened.append(str(files[0]).split("/records/")[0] if files else "?")  # the dataset directory
        return real_dataset(source, *a, **kw)

    def read_table(source, *a, **kw):
        opened.append(str(source))
        return real_read(source, *a, **kw)

    monkeypatch.setattr(pds, "dataset", dataset)
    monkeypatch.setattr(pq, "read_table", read_table)
    return opened


def _with_references(d: Path) -> Path:
    from report_fixtures import reference_row

    rows = clean_rows() + [reference_row("ref-1", [("prefill", 0.0, 40.0), ("decode", 40.0, 90.0)],
                                         workload="tts", engine="tts")]
    return write_dataset(d, rows)


def test_a_report_reads_each_dataset_once(tmp_path, scans):
    from cancelbench.reports import build_report

    a, b = _with_references(tmp_path / "a"), write_dataset(tmp_path / "b", clean_rows("b", scale=2.0))
    report = build_report([a, b], with_samples=True)  # tables, defects, targeting, builds, samples, references
    assert sorted(scans) == sorted([str(a), str(b)])
    assert report.references is not None and list(report.references["trial_id"]) == ["ref-1"]
    assert len(report.samples) == 160 and report.n_records == 160


def test_diff_and_trend_read_each_dataset_once(tmp_path, scans):
    from cancelbench.reports.diff import run_diff
    from cancelbench.reports.trend import TrendSpec, run_trend

    a = write_dataset(tmp_path / "a", [dict(r, llama_cpp_build="b2") for r in clean_rows()])
    b = write_dataset(tmp_path / "b", [dict(r, llama_cpp_build="b1") for r in clean_rows(scale=1.01)])
    result = run_diff([a], [b])  # cells, settings check and builds legend
    assert sorted(scans) == [str(a), str(b)] and result.cells
    scans.clear()
    trend = run_trend([str(a), str(b)], TrendSpec(by="llama_cpp_build"))  # ordered by a record column
    assert sorted(scans) == [str(a), str(b)] and [s.path for s in trend.sweeps] == [str(b), str(a)]
