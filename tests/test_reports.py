"""cancelbench report: statistics, known-answer tables, bound flags, defects,
hop decomposition, output forms, CLI exit codes, bad inputs, Ray Data path."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import cancel_row, cell_rows, known_answer_rows, write_dataset  # noqa: E402

from cancelbench.sink import DatasetError, records_dir  # noqa: E402
from cancelbench.reports import Filters, ReportSpec, build_report, stats  # noqa: E402
from cancelbench.reports.cli import add_diff_parser, add_report_parser  # noqa: E402
from cancelbench.reports.format import report_dict, to_json, to_markdown, to_terminal  # noqa: E402
from cancelbench.reports.sections import MAX_MARK, NA, OVER  # noqa: E402
from cancelbench.reports.tables import BoundSpec  # noqa: E402


def cli(argv: list[str]) -> int:
    """The subcommands wired the way the main CLI wires them."""
    parser = argparse.ArgumentParser(prog="cancelbench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_report_parser(sub)
    add_diff_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def known(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("known") / "sweep", known_answer_rows())


@pytest.fixture(scope="module")
def report(known):
    return build_report([known])


def cell(report, workload, phase, device, mechanism=None):
    found = [c for c in report.cells if (c.workload, c.phase, c.device) == (workload, phase, device)
             and (mechanism is None or c.mechanism == mechanism)]
    assert len(found) == 1, found
    return found[0]


A, B = "hostA/cpu:0", "hostB/vulkan:0"


def test_reports_import_neither_the_orchestrator_nor_ray():
    """reports/ depends only on the Ray-free contract (schema, sink, fileio), and importing it changes nothing."""
    import subprocess

    code = ("import os, sys; env = dict(os.environ)\n"
            "import cancelbench.reports, cancelbench.reports.cli, cancelbench.reports.diff, cancelbench.reports.html\n"
            "import cancelbench.reports.summary, cancelbench.reports.raydata\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray' "
            "or m.startswith(('cancelbench.orchestrator', 'cancelbench.device_agents'))))\n"
            "print(env == dict(os.environ))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True"], out


# ------------------------------------------------------------------ stats --
def test_min_samples_formula_and_known_values():
    assert [stats.min_samples(p) for p in (0.5, 0.9, 0.99)] == [5, 29, 299]
    for p in (0.5, 0.9, 0.95, 0.99, 0.999):
        for c in (0.9, 0.95, 0.99):
            n = stats.min_samples(p, c)
            assert p ** n <= 1 - c < p ** (n - 1)  # smallest n whose max bounds the p-quantile
    with pytest.raises(ValueError):
        stats.min_samples(1.0)


def test_nearest_rank_is_an_observed_value():
    x = np.arange(1.0, 11.0)
    assert [stats.nearest_rank(x, p) for p in (0.1, 0.5, 0.9, 0.99, 1.0)] == [1.0, 5.0, 9.0, 10.0, 10.0]
    x = np.arange(1.0, 301.0)
    assert [stats.nearest_rank(x, p) for p in (0.5, 0.9, 0.99)] == [150.0, 270.0, 297.0]
    assert stats.nearest_rank(np.array([7.0]), 0.99) == 7.0


def test_binomial_cdf_and_early_stopping():
    # against a direct sum for small n
    n, q = 20, 0.1
    direct = sum(math.comb(n, i) * q ** i * (1 - q) ** (n - i) for i in range(4))
    assert stats.binom_cdf(3, n, q) == pytest.approx(direct, rel=1e-12)
    # zero exceedances: early stopping agrees with the minimum count
    assert not stats.early_stop_ok(298, 0, 0.99) and stats.early_stop_ok(299, 0, 0.99)
    # LoadGen-style: more samples tolerate some exceedances
    assert stats.early_stop_ok(1000, 3, 0.99) and not stats.early_stop_ok(1000, 6, 0.99)
    assert not stats.early_stop_ok(1000, 10, 0.99)  # at the observed rate: never proven


def test_percentile_interval_known_answers_and_coverage():
    x = np.arange(1.0, 21.0)  # x(k) = k
    # n = 20, median: P(B <= 5) = 0.021 <= 0.025 < P(B <= 6); P(B <= 14) = 0.979 >= 0.975 > P(B <= 13)
    assert stats.percentile_interval(x, 0.5) == (6.0, 15.0)
    assert stats.percentile_interval(x, 0.99) == (19.0, None)  # 20 samples cannot bound a p99 from above
    assert stats.percentile_interval(x[:3], 0.5) == (None, None)  # nor a median from either side with 3
    assert stats.percentile_interval([], 0.5) is None
    # coverage on a known distribution: the true median of U(0, 1) is 0.5
    rng = np.random.default_rng(3)
    hits = sum(lo <= 0.5 <= hi for lo, hi in (stats.percentile_interval(rng.random(30), 0.5) for _ in range(2000)))
    assert hits / 2000 >= 0.94


@pytest.mark.parametrize("p, confidence", [(0.5, 0.5), (0.5, 0.75), (0.5, 0.875), (0.5, 0.9375), (0.9, 0.95),
                                           (0.99, 0.95)])
def test_early_stopping_agrees_with_min_samples_at_the_boundary(p, confidence):
    """p**n == 1 - confidence exactly for p = 0.5: the claim holds at equality
    (the probability bound is "<="), so n = min_samples proves it and n - 1 does not."""
    n = stats.min_samples(p, confidence)
    assert stats.early_stop_ok(n, 0, p, confidence)
    assert not stats.early_stop_ok(n - 1, 0, p, confidence)


def test_beta_bootstrap_matches_resampling_bootstrap():
    values = np.sort(np.linspace(1.0, 50.0, 60) ** 1.5)
    fast = stats.bootstrap_percentiles(values, 0.9, 20000, np.random.default_rng(1))
    slow = stats.bootstrap_resample_percentiles(values, 0.9, 20000, np.random.default_rng(2))
    # same discrete distribution: compare the probability of every support point
    support = np.unique(np.concatenate([fast, slow]))
    pf = np.array([(fast == v).mean() for v in support])
    ps = np.array([(slow == v).mean() for v in support])
    assert np.abs(pf - ps).max() < 0.02
    assert abs(fast.mean() - slow.mean()) / slow.mean() < 0.01


def test_bootstrap_ci_is_seeded_and_covers_zero_for_identical_samples():
    x = np.sort(np.linspace(1, 100, 500))
    ci = stats.bootstrap_diff_ci(x, x, 0.99, seed=3)
    assert ci == stats.bootstrap_diff_ci(x, x, 0.99, seed=3)
    assert ci[0] <= 0 <= ci[1]


# ------------------------------------------------------- known-answer table --
def test_percentiles_known_answers(report):
    c = cell(report, "tts", "decode", A)
    assert (c.n, c.n_trials) == (300, 300)
    assert c.percentiles == {"p50": 150.0, "p90": 270.0, "p99": 297.0}
    assert c.max_ms == 300.0
    assert c.cost_ratio_p50 == pytest.approx(0.15)
    b = cell(report, "tts", "decode", B)
    assert (b.n, b.n_trials, b.dropped) == (29, 30, 1)
    assert b.percentiles == {"p50": 2.0, "p90": 2.0, "p99": None}


def test_insufficient_samples_are_marked_not_shown(report):
    c = cell(report, "tts", "prefill", A)
    assert c.percentiles["p50"] == 5.0 and c.insufficient == ["p90", "p99"]
    four = cell(report, "tts", "prefill", B)
    assert four.n == 4 and four.insufficient == ["p50", "p90", "p99"]
    assert all(v is None for v in four.percentiles.values())
    text = to_terminal(report)
    # the per-phase row of the 4-sample cell: n 4, p50 "–", the max (6.00) marked as a max, 0 dropped
    row = next(line for line in text.splitlines() if line.startswith("tts       prefill"))
    assert row.split()[-4:] == ["4", NA, f"6.00{MAX_MARK}", "0"], row
    assert "p50 needs n >= 5, p99 needs n >= 299" in text  # the reason, once, in the note
    assert "insufficient" not in text


def test_bound_flags_and_worst_trial_ids(report):
    over = {(c.workload, c.phase, c.device) for c in report.over}
    assert over == {("tts", "decode", A), ("stt", "decode", A)}
    stt = cell(report, "stt", "decode", A)
    assert stt.bound_stat_ms == 80.0 and stt.n_over == 4
    assert stt.worst_trial_ids == ["a-sttdec-0296", "a-sttdec-0297", "a-sttdec-0298", "a-sttdec-0299"]
    tts = cell(report, "tts", "decode", A)
    assert tts.worst_trial_ids == ["a-dec-0299", "a-dec-0298", "a-dec-0297", "a-dec-0296", "a-dec-0295"]
    # one 900 ms outlier among 300 does not move the nearest-rank p99 over the bound
    enc = cell(report, "stt", "encode", A)
    assert not enc.over and enc.max_ms == 900.0 and enc.bound_proven is False
    assert report.over[0].workload == "tts"  # worst first


def test_a_cell_exactly_at_the_bound_is_not_over(tmp_path):
    rows = cell_rows("at", [50.0] * 5) + cell_rows("above", [50.01] * 5, phase="prefill")
    r = build_report([write_dataset(tmp_path / "at", rows)])
    at, above = cell(r, "tts", "decode", A), cell(r, "tts", "prefill", A)
    assert (at.over, at.n_over, at.worst_trial_ids) == (False, 0, [])
    assert (above.over, above.n_over) == (True, 5)
    assert [c.phase for c in r.over] == ["prefill"] and r.verdict == "over_bound"
    lines = to_terminal(r).splitlines()
    assert lines[1].startswith("WARN: no dropped cancels or lost trials; 1 cell(s) over the bound")
    decode = next(line for line in lines if line.startswith("tts       decode"))
    prefill = next(line for line in lines if line.startswith("tts       prefill"))
    assert decode.split()[-4:] == ["5", "50.00", "50.00", "0"]  # the symbol marks over-bound cells only
    assert prefill.split()[-5:] == ["5", "50.01", "50.01", OVER, "0"]
    md = to_markdown(r)
    assert "| 50.01 ▲ |" in md and "| 50.00 ▲ |" not in md and f"{OVER} over the latency bound" in md


def test_mechanism_comparison_pools_phases_per_workload(report):
    """One table per workload, rows mechanism x delivery, a column group per device."""
    tts = next(c for c in report.pooled if (c.workload, c.device) == ("tts", A))
    assert (tts.phase, tts.n, tts.percentiles["p50"], tts.bound_stat_ms) == ("*", 310, 145.0, 297.0)
    text = to_terminal(report)
    block = text[text.index("== Mechanism comparison: tts =="):text.index("== Defects")]
    header_groups = block.splitlines()[2]
    assert header_groups.split() == [A, B]
    row = next(line for line in block.splitlines() if line.startswith("abort_callback"))
    # hostA: p50 145, p99 297 (310 samples) over the bound in a phase; hostB: 33 samples, the max, 1 dropped
    assert row.split() == ["abort_callback", "driver", "145.00", "297.00", OVER, "0", "2.00", f"6.00{MAX_MARK}", "1"]
    assert text.index("Mechanism comparison: stt") < text.index("Mechanism comparison: tts") < text.index("Defects")
    assert [c["workload"] for c in report_dict(report)["mechanisms"]] == ["stt", "tts", "tts"]


def test_markdown_of_a_4_device_4_mechanism_10_phase_sweep_fits_a_comment(tmp_path):
    hosts = ["hostA", "hostB", "mac1", "mac2"]
    mechanisms = ["abort_callback", "between_calls", "chunked", "graph_eval"]
    phases = [f"phase{i}" for i in range(10)]
    rows = [cancel_row(f"{w}-{h}-{m}-{p}-{d}-{i}", 1.0 + i + 10 * k, host=h, phase=p, mechanism=m, delivery=d,
                       workload=w)
            for w in ("tts", "stt") for h in hosts for m in mechanisms for k, p in enumerate(phases)
            for d in ("driver", "agent") for i in range(5)]
    r = build_report([write_dataset(tmp_path / "big", rows)])
    md = to_markdown(r, limit=65_536)
    assert len(md) <= 65_536
    table_rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| mech")
                  and not line.startswith("| workload")]
    compare_rows = [line for line in table_rows if line.split(" | ")[1] in ("driver", "agent")]
    assert len(compare_rows) == 2 * 4 * 2  # the comparison tables are whole
    phase_rows = [line for line in table_rows if line.split(" | ")[0] in ("| stt", "| tts")]
    assert 0 < len(phase_rows) <= 2 * 10 * 4 * 2
    # cut or not, never silently: a cut table says how many of its rows it shows
    assert (len(phase_rows) < 160) == ("of 160 rows shown" in md)


def test_bound_overrides_per_workload_and_phase(known):
    spec = ReportSpec(bound=BoundSpec(50.0, (BoundSpec.parse_override("tts:decode=400"),
                                             BoundSpec.parse_override("stt=100"))))
    r = build_report([known], spec)
    assert r.over == []
    assert cell(r, "tts", "decode", A).bound_ms == 400 and cell(r, "stt", "encode", A).bound_ms == 100
    assert cell(r, "tts", "prefill", A).bound_ms == 50
    assert BoundSpec.parse_override("*:prefill=7") == (None, "prefill", 7.0)
    for bad in ("tts", "tts=abc", "=5", "tts=-1"):
        with pytest.raises(ValueError):
            BoundSpec.parse_override(bad)


def test_dropped_and_lost_listed_first(report):
    assert list(report.defects["outcome"]) == ["dropped", "lost"]
    assert list(report.defects["trial_id"]) == ["b-dec-dropped", "ref-lost"]
    assert report.exit_code == 1 and report.verdict == "defects"
    for text in (to_terminal(report), to_markdown(report)):
        assert text.index("Mechanism comparison") < text.index("Defects: 1 dropped cancels, 1 lost trials") \
            < text.index("Over the latency bound") < text.index("Per phase at receipt")
        assert text.index("b-dec-dropped") < text.index("ref-lost")
    j = report_dict(report)
    assert j["verdict"] == "defects" and j["exit_code"] == 1
    assert [d["trial_id"] for d in j["defects"]] == ["b-dec-dropped", "ref-lost"]


def test_hop_decomposition_known_answer(tmp_path):
    rows = cell_rows("h", [10.0] * 6, deliver_ms=2.0, observe_ms=1.0, settle_ms=3.0)
    rows += cell_rows("g", [10.0] * 6, host="hostB", deliver_ms=4.0, settle_ms=5.0, mechanism="between_calls")
    r = build_report([write_dataset(tmp_path / "hops", rows)])
    h = {x.device: x for x in r.hops}
    assert h[A].end_to_end_mean_ms == pytest.approx(12.0)
    assert h[A].means_ms == pytest.approx({"deliver_ms": 2.0, "observe_ms": 1.0, "return_ms": 6.0, "settle_ms": 3.0})
    assert h[A].share["return_ms"] == pytest.approx(0.5)
    # no native observer: observe is 0 and return starts at receipt
    assert h[B].means_ms == pytest.approx({"deliver_ms": 4.0, "observe_ms": 0.0, "return_ms": 5.0, "settle_ms": 5.0})
    assert sum(h[B].share.values()) == pytest.approx(1.0)
    assert r.exit_code == 0 and r.verdict == "ok"


def test_multiple_dirs_and_pushed_down_filters(known, tmp_path):
    mac = write_dataset(tmp_path / "mac", cell_rows("m", range(1, 40), host="mac1"))
    r = build_report([known, mac])
    assert r.devices_in_cells() == [A, B, "mac1/metal:0"]
    only = build_report([known, mac], filters=Filters(backends=("vulkan",)))
    assert only.devices_in_cells() == [B] and list(only.defects["trial_id"]) == ["b-dec-dropped"]
    assert build_report([known], filters=Filters(workloads=("stt",))).n_records == 600


def test_only_needed_columns_are_read(known, monkeypatch):
    import cancelbench.reports.load as load

    seen = []
    real = load.read_dataset

    def spy(path, columns=None, filter=None):
        seen.append((tuple(columns), filter))
        return real(path, columns, filter)

    monkeypatch.setattr(load, "read_dataset", spy)
    build_report([known])
    assert seen and all(cols is not None and "phase_durations_json" not in cols and "model_sha256" not in cols
                        for cols, _ in seen)
    assert all(f is not None for _, f in seen)  # every scan carries a pushed-down filter


def test_output_forms_and_escaping(tmp_path):
    hostile = "evil|<b>x</b>\x1b[2J`*"
    rows = cell_rows("e", [1.0, 2.0, 3.0, 4.0, 5.0], workload=hostile, hostname=hostile)
    r = build_report([write_dataset(tmp_path / "e", rows)])
    term = to_terminal(r)
    assert "\x1b" not in term and "\\x1b[2J" in term
    md = to_markdown(r)
    assert "<b>" not in md and "&lt;b&gt;" in md and "evil\\|" in md and "\x1b" not in md
    j = json.loads(to_json(r))
    assert j["cells"][0]["workload"] == hostile  # JSON keeps the exact value
    assert j["min_samples"] == {"p50": 5, "p90": 29, "p99": 299}


# -------------------------------------------------------------------- CLI --
def test_cli_exit_codes_and_outputs(known, tmp_path, capsys):
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    assert cli(["report", str(known), "--markdown", str(md), "--json", str(js)]) == 1  # defects
    out = capsys.readouterr().out
    assert out.startswith("cancelbench report\nFAIL: 1 dropped cancel(s), 1 lost trial(s)")
    assert md.read_text().startswith("## cancelbench report: FAIL")
    assert json.loads(js.read_text())["verdict"] == "defects"
    clean = write_dataset(tmp_path / "clean", cell_rows("c", range(1, 10)))
    assert cli(["report", str(clean), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "ok"
    # over the bound alone is not a defect: exit 0, verdict over_bound
    slow = write_dataset(tmp_path / "slow", cell_rows("s", [80.0] * 10))
    assert cli(["report", str(slow), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "over_bound"
    assert cli(["report", str(slow), "--bound", "100", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "ok"


def _bad_input(argv, capsys, needle):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cancelbench ") and needle in err, err


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    _bad_input(["report", str(tmp_path / "missing")], capsys, "no such directory")
    (tmp_path / "plain").mkdir()
    _bad_input(["report", str(tmp_path / "plain")], capsys, "not a cancelbench dataset")
    future = write_dataset(tmp_path / "future", cell_rows("f", [1.0]), schema_version=99)
    _bad_input(["report", str(future)], capsys, "newer than this cancelbench")
    empty = tmp_path / "empty"
    records_dir(empty).mkdir(parents=True)
    write_dataset(empty, [])
    _bad_input(["report", str(empty)], capsys, "no cancel records")
    refs_only = write_dataset(tmp_path / "refs", [cancel_row("r", None, trial_kind="reference", outcome="completed")])
    _bad_input(["report", str(refs_only)], capsys, "no cancel records")
    _bad_input(["report", str(refs_only), "--bound-for", "tts"], capsys, "bad bound override")
    (records_dir(tmp_path / "junk") / "backend=cpu" / "host=x").mkdir(parents=True)
    (records_dir(tmp_path / "junk") / "backend=cpu" / "host=x" / "part-0.parquet").write_text("not parquet")
    write_dataset(tmp_path / "junk", [])
    _bad_input(["report", str(tmp_path / "junk")], capsys, "unreadable records")
    with pytest.raises(DatasetError):
        build_report([])


# --------------------------------------------------------------- Ray Data --
@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:  # token auth on, loopback only: the product's own local start
        from cancelbench.raylocal import start_local

        start_local(num_cpus=2, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def test_ray_data_path_equals_pandas_path(known, tmp_path, ray_local):
    mac = write_dataset(tmp_path / "mac", cell_rows("m", np.linspace(1, 90, 120), host="mac1", observe_ms=0.3,
                                                    settle_ms=0.7) + cell_rows("n", [3.0] * 7, host="mac1", phase=None)
                         + [cancel_row("m-drop", None, host="mac1", outcome="dropped")])
    spec = ReportSpec(bound=BoundSpec(40.0, ((None, "prefill", 3.5),)), bound_percentile=0.9)
    # mac first: its device appears first but sorts last (catches order-of-appearance leaks)
    pandas_report = build_report([mac, known], spec)
    ray_report = build_report([mac, known], spec, engine="ray")
    assert report_dict(ray_report) == report_dict(pandas_report)
    assert to_markdown(ray_report) == to_markdown(pandas_report)
    assert any(c.phase == "(none)" for c in ray_report.cells)


def test_cli_engine_ray_matches_pandas(known, ray_local, capsys):
    assert cli(["report", str(known), "--format", "json"]) == 1
    pandas_json = capsys.readouterr().out
    assert cli(["report", str(known), "--format", "json", "--engine", "ray"]) == 1
    assert capsys.readouterr().out == pandas_json


def test_ray_path_rejects_bad_input_before_starting_work(tmp_path, capsys):
    empty = tmp_path / "empty"
    write_dataset(empty, [])
    assert cli(["report", str(empty), "--engine", "ray"]) == 2
    assert "no cancel records" in capsys.readouterr().err


def test_markdown_fits_a_pull_request_comment(report):
    full = to_markdown(report)
    small = to_markdown(report, limit=2500)
    assert len(small) <= 2500 < len(full)
    assert "rows shown (the JSON output has all)" in small
    # the over-bound list is cut first (the per-phase table marks the same cells); defects and the
    # mechanism comparison survive
    assert "of 2 rows shown" in small and "a-sttdec-0296" in full and "a-sttdec-0296" not in small
    assert "b-dec-dropped" in small and "ref-lost" in small
    assert "| abort\\_callback | driver | 145.00 | 297.00 ▲ | 0 | 2.00 | 6.00ᵐ | 1 |" in small


def test_bound_met_only_when_the_samples_prove_it(tmp_path):
    rows = cell_rows("ok", [1.0] * 299) + cell_rows("few", [1.0] * 298, phase="prefill")
    r = build_report([write_dataset(tmp_path / "met", rows)])
    assert cell(r, "tts", "decode", A).bound_proven and not cell(r, "tts", "prefill", A).bound_proven
    proven = {(c["phase"]): c["bound_proven"] for c in report_dict(r)["cells"]}
    assert proven == {"decode": True, "prefill": False}
