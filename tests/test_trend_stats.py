"""``cancelbench trend`` on constructed datasets: the Mann-Whitney U test and Holm
correction against known answers, ordering by a column in natural order, globs,
matching across hosts of one device class, bad input.  The acceptance test
with five real sweeps is tests/test_trend.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import cell_rows, write_dataset  # noqa: E402

from cancelbench.cli import main as cli_main  # noqa: E402
from cancelbench.reports.trend import TrendInputError, TrendSpec, natural_key, run_trend  # noqa: E402
from cancelbench.reports.trend_stats import _exact_u_cdf_counts, holm, mann_whitney_u  # noqa: E402


def test_exact_u_distribution_is_the_counting_one():
    # m = n = 2: arrangements of two x among four ranks give U = 0,1,2,2,3,4
    assert _exact_u_cdf_counts(2, 2) == [1, 1, 2, 1, 1]
    for m, n in ((3, 5), (7, 4), (10, 10)):
        counts = _exact_u_cdf_counts(m, n)
        assert sum(counts) == math.comb(m + n, m) and counts == counts[::-1] and min(counts) >= 1


def test_mann_whitney_known_answers():
    u, p = mann_whitney_u([1, 2, 3], [4, 5, 6])
    assert u == 0 and p == pytest.approx(0.1)  # 2 * 1/20, exact
    u, p = mann_whitney_u([1, 3, 5, 7], [2, 4, 6, 8])
    assert u == 6 and p == pytest.approx(2 * 24 / 70)  # P(U <= 6) = 24/70 for m = n = 4
    # ties: the normal approximation with tie correction
    u, p = mann_whitney_u([1, 1, 2, 2, 3] * 4, [2, 3, 3, 4, 4] * 4)
    assert 0 < p < 0.01


def test_mann_whitney_exact_p_equals_full_enumeration():
    """Against the definition: every split of the pooled ranks into the two groups."""
    import itertools

    rng = np.random.default_rng(5)
    x, y = rng.normal(0, 1, 5), rng.normal(0.9, 1, 6)
    u, p = mann_whitney_u(x, y)
    pooled = np.concatenate([x, y])
    us = []
    for idx in itertools.combinations(range(11), 5):
        a = pooled[list(idx)]
        b = np.delete(pooled, list(idx))
        us.append(sum((ai > bj) for ai in a for bj in b))
    us = np.array(us)
    expected = min(1.0, 2 * min((us <= u).mean(), (us >= u).mean()))
    assert p == pytest.approx(expected)


def test_mann_whitney_matches_scipy():
    from scipy import stats  # the ``test`` extra installs it: this cross-check runs in CI
    rng = np.random.default_rng(3)
    for m, n, shift in ((8, 9, 0.0), (20, 25, 0.8), (60, 70, 0.3), (150, 120, 0.2)):
        x, y = rng.normal(0, 1, m), rng.normal(shift, 1, n)
        u, p = mann_whitney_u(x, y)
        ref = stats.mannwhitneyu(x, y, alternative="two-sided", method="exact" if m * n <= 10_000 else "asymptotic")
        assert u == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue, rel=1e-6), (m, n)


def test_mann_whitney_with_ties_matches_scipy_and_a_trend_runs_this_module():
    """Tied latencies (a coarse clock) take the tie-corrected normal approximation, as scipy's
    asymptotic method; and a trend uses this implementation whether scipy is installed or not."""
    from scipy import stats

    from cancelbench.reports.trend_stats import _mwu_impl

    rng = np.random.default_rng(5)
    for m, n, shift in ((12, 15, 0.0), (40, 35, 1.0), (200, 180, 0.5)):
        x, y = np.round(rng.normal(0, 2, m)), np.round(rng.normal(shift, 2, n))
        u, p = mann_whitney_u(x, y)
        ref = stats.mannwhitneyu(x, y, alternative="two-sided", method="asymptotic")
        assert u == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue, rel=1e-9), (m, n)
    assert _mwu_impl()[0] is mann_whitney_u


def test_holm_is_step_down_and_monotone():
    assert holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert holm([0.2, 0.9]) == pytest.approx([0.4, 0.9])


def test_natural_order():
    assert sorted(["b10", "b9", "b100", "b11"], key=natural_key) == ["b9", "b10", "b11", "b100"]


def _sweeps(tmp_path: Path, scales: list[float], builds: list[str], seed: int = 1, hosts=None) -> list[Path]:
    """One cell per sweep (decode) plus a steady one (prefill), 60 lognormal samples each."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (scale, build) in enumerate(zip(scales, builds)):
        host = hosts[i] if hosts else "mac1"
        rows = cell_rows(f"d{i}", rng.lognormal(1.0, 0.4, 60) * scale, host=host, llama_cpp_build=build)
        rows += cell_rows(f"p{i}", rng.lognormal(1.0, 0.4, 60), host=host, phase="prefill", llama_cpp_build=build)
        out.append(write_dataset(tmp_path / f"sweep-{build}", rows))
    return out


def test_orders_by_a_column_and_flags_the_first_changed_sweep(tmp_path, capsys):
    # builds b9..b13; given out of order; b12 and b13 three times slower in decode; hosts differ (one class)
    dirs = _sweeps(tmp_path, [1, 1, 1, 3, 3], ["b9", "b10", "b11", "b12", "b13"],
                   hosts=["mac1", "mac2", "mac1", "mac2", "mac1"])
    shuffled = [dirs[i] for i in (3, 0, 4, 2, 1)]
    result = run_trend([str(d) for d in shuffled], TrendSpec(by="llama_cpp_build"))
    assert [s.key for s in result.sweeps] == ["b9", "b10", "b11", "b12", "b13"]
    by_phase = {c.phase: c for c in result.cells}
    assert set(by_phase) == {"decode", "prefill"} and all(c.device_class == "darwin/arm64/metal/Apple M2"
                                                          for c in result.cells)
    assert by_phase["decode"].first_flag == 3 and by_phase["prefill"].first_flag is None
    flagged = [(c.phase, s.index) for c in result.cells for s in c.steps if s is not None and s.flagged]
    assert flagged == [("decode", 3)]
    assert result.n_tests == 8 and result.exit_code == 0  # b13 is as slow as b12: no new regression
    # newest = b12: it regressed against b11 (exit 1, as diff)
    assert cli_main(["trend", *map(str, dirs[:4]), "--by", "llama_cpp_build", "--format", "json"]) == 1
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["verdict"] == "regressed" and verdict["correction"] == "holm"
    decode = next(c for c in verdict["cells"] if c["phase"] == "decode")
    assert decode["newest_verdict"] == "regressed" and "Mann-Whitney" in decode["newest_reasons"][-1]


def test_globs_and_the_given_order(tmp_path, capsys):
    _sweeps(tmp_path, [1, 1, 3], ["b1", "b2", "b3"])
    assert cli_main(["trend", str(tmp_path / "sweep-*"), "--by", "given", "--format", "markdown"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("## cancelbench trend: REGRESSED") and "#3 3" in out and "FIRST SLOWER" in out


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    dirs = _sweeps(tmp_path, [1, 1], ["b1", "b2"])
    assert cli_main(["trend", str(dirs[0])]) == 2
    assert "at least two sweeps" in capsys.readouterr().err
    assert cli_main(["trend", *map(str, dirs), "--by", "no_such_column"]) == 2
    assert "not 'created', 'given' or a record column" in capsys.readouterr().err
    assert cli_main(["trend", *map(str, dirs), "--by", "gpu_driver_version"]) == 2
    assert "null in every record" in capsys.readouterr().err
    assert cli_main(["trend", str(tmp_path / "nothing-*"), str(dirs[0])]) == 2
    assert "no directory matches" in capsys.readouterr().err
    with pytest.raises(TrendInputError):
        run_trend([str(dirs[0]), str(dirs[0])])  # the same sweep twice is one sweep


def test_trend_page_escapes_data(tmp_path):
    from cancelbench.reports.trend_render import trend_to_html

    hostile = '<script>alert(1)</script>"$\\frac{1}{0}$'
    dirs = []
    for i, scale in enumerate((1, 3)):
        rows = cell_rows(f"h{i}", np.linspace(1, 5, 30) * scale, host="mac1", workload=hostile, hostname=hostile,
                         llama_cpp_build=hostile + str(i))
        dirs.append(str(write_dataset(tmp_path / f"h{i}", rows)))
    page = trend_to_html(run_trend(dirs, TrendSpec(by="llama_cpp_build")))
    assert "<script" not in page.lower() and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<svg") == 1 and 'id="trend-c0"' in page
