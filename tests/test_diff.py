"""cancelbench diff: verdicts on constructed regressions and non-regressions,
device-class matching, exit codes and bad inputs.

Latencies are deterministic grids (quantiles of a skewed distribution), so
every verdict is a known answer; the seeded-noise test uses fixed seeds."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import cancel_row, cell_rows, write_dataset  # noqa: E402

from cancelbench.reports.cli import main as reports_main  # noqa: E402
from cancelbench.reports.diff import DiffInputError, DiffSpec, run_diff  # noqa: E402
from cancelbench.reports.diff_render import diff_to_markdown  # noqa: E402
from cancelbench.schema import SCHEMA_VERSION  # noqa: E402

METAL = "darwin/arm64/metal/Apple M2"
CPU = "linux/x86_64/cpu/AMD EPYC"


def grid(n: int, scale: float = 1.0) -> np.ndarray:
    """n quantiles of a right-skewed latency distribution, 2..17 ms."""
    u = (np.arange(n) + 0.5) / n
    return scale * (2.0 + 15.0 * u ** 3)


def sweep(tmp_path: Path, name: str, latencies, host: str = "mac1", extra: list[dict] = (), **kw) -> Path:
    rows = cell_rows(f"{name}", latencies, host=host, **kw) + list(extra)
    return write_dataset(tmp_path / name, rows)


def only(result):
    assert len(result.cells) == 1, result.cells
    return result.cells[0]


def test_scaled_up_latency_is_a_regression(tmp_path, capsys):
    base = sweep(tmp_path, "base", grid(600))
    cand = sweep(tmp_path, "cand", grid(600, 1.5), host="mac2")  # same class, another host
    d = only(run_diff([base], [cand]))
    assert d.status == "matched" and d.device_class == METAL
    assert d.verdict == "regressed" and d.ci_low_ms > 0 and d.rel_change == pytest.approx(0.5)
    assert d.reasons[0].startswith("p99 ")
    assert reports_main(["diff", str(base), str(cand), "--format", "markdown"]) == 1
    md = capsys.readouterr().out
    assert md.startswith("## cancelbench diff: REGRESSED")
    first_row = [line for line in md.splitlines() if line.startswith("| ")][1]
    assert first_row.startswith("| REGRESSED |")


def test_html_overlays_baseline_and_candidate_ecdfs_of_changed_cells(tmp_path):
    base = sweep(tmp_path, "base", grid(600), extra=cell_rows("bp", grid(600), host="mac1", phase="prefill")
                 + cell_rows("bq", grid(600), host="mac1", phase="idle"))
    cand = sweep(tmp_path, "cand", grid(600, 1.5), extra=cell_rows("cp", grid(600, 0.5), host="mac1", phase="prefill")
                 + cell_rows("cq", grid(600), host="mac1", phase="idle"))
    out = tmp_path / "diff.html"
    assert reports_main(["diff", str(base), str(cand), "--format", "json", "--html", str(out)]) == 1
    page = out.read_text(encoding="utf-8")
    # two changed cells (decode regressed, prefill improved), each with both lines; the unchanged idle cell has none
    assert sorted(re.findall(r'id="(diff-(?:base|cand)-\d+)"', page)) == \
        ["diff-base-0", "diff-base-1", "diff-cand-0", "diff-cand-1"]
    assert "regressed: tts · decode" in page and "improved: tts · prefill" in page and "idle" in page
    assert "<script" not in page and "default-src 'none'" in page


def test_scaled_down_latency_is_an_improvement(tmp_path):
    d = only(run_diff([sweep(tmp_path, "b", grid(600))], [sweep(tmp_path, "c", grid(600, 0.6))]))
    assert d.verdict == "improved" and d.ci_high_ms < 0


def test_interleaved_halves_of_one_distribution_are_unchanged(tmp_path, capsys):
    g = grid(1200)
    base, cand = sweep(tmp_path, "b", g[0::2]), sweep(tmp_path, "c", g[1::2])
    d = only(run_diff([base], [cand]))
    assert d.verdict == "unchanged" and d.ci_low_ms <= 0 <= d.ci_high_ms
    assert reports_main(["diff", str(base), str(cand), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "ok"


def test_pure_noise_is_never_flagged(tmp_path):
    """Independent draws from one distribution (fixed seeds) must not regress."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        b = sweep(tmp_path, f"b{seed}", rng.lognormal(1.5, 0.5, 700))
        c = sweep(tmp_path, f"c{seed}", rng.lognormal(1.5, 0.5, 700))
        d = only(run_diff([b], [c]))
        assert d.verdict in ("unchanged", "improved") and d.verdict != "regressed", (seed, d)


def test_significant_but_small_shift_is_unchanged(tmp_path):
    d = only(run_diff([sweep(tmp_path, "b", grid(600))], [sweep(tmp_path, "c", grid(600, 1.05))]))
    assert d.ci_low_ms > 0  # the shift is real ...
    assert d.verdict == "unchanged"  # ... but under the 10% threshold
    d = only(run_diff([tmp_path / "b"], [tmp_path / "c"], DiffSpec(rel_threshold=0.02)))
    assert d.verdict == "regressed"


def test_cli_threshold_is_a_fraction(tmp_path, capsys):
    """--threshold 0.02 means 2% (the README and --help say so): a 5% shift regresses; the default 0.10 does not."""
    base, cand = sweep(tmp_path, "b", grid(600)), sweep(tmp_path, "c", grid(600, 1.05))
    assert reports_main(["diff", str(base), str(cand), "--format", "json", "--threshold", "0.02"]) == 1
    assert json.loads(capsys.readouterr().out)["rel_threshold"] == 0.02
    assert reports_main(["diff", str(base), str(cand), "--format", "json"]) == 0
    assert reports_main(["diff", str(base), str(cand), "--format", "json", "--threshold", "5"]) == 0  # 500%
    capsys.readouterr()


def test_significant_but_small_improvement_is_unchanged(tmp_path):
    d = only(run_diff([sweep(tmp_path, "b", grid(600))], [sweep(tmp_path, "c", grid(600, 0.95))]))
    assert d.ci_high_ms < 0  # the drop is real ...
    assert d.verdict == "unchanged"  # ... but under the 10% threshold
    assert only(run_diff([tmp_path / "b"], [tmp_path / "c"], DiffSpec(rel_threshold=0.02))).verdict == "improved"


def test_new_dropped_cancel_is_a_regression(tmp_path):
    base = sweep(tmp_path, "b", grid(600))
    cand = sweep(tmp_path, "c", grid(600), extra=[cancel_row("c-drop", None, host="mac1", outcome="dropped")])
    d = only(run_diff([base], [cand]))
    assert d.verdict == "regressed" and d.reasons == ["new dropped cancels: 0 -> 1"]
    assert d.change_ms == 0.0  # the latency itself did not move


def test_newly_over_the_bound_is_a_regression(tmp_path):
    base = sweep(tmp_path, "b", [10.0] * 590 + [49.0] * 10)
    cand = sweep(tmp_path, "c", [10.0] * 590 + [51.0] * 10)
    d = only(run_diff([base], [cand]))
    assert (d.base_value, d.cand_value) == (49.0, 51.0)  # +4%: under the percentile threshold
    assert d.verdict == "regressed" and len(d.reasons) == 1 and "newly over the 50 ms bound" in d.reasons[0]
    assert d.cand_worst_trial_ids[0].startswith("c-")
    # with a bound both sides meet, the same data is unchanged
    assert only(run_diff([base], [cand], DiffSpec(bound=DiffSpec().bound.__class__(60.0)))).verdict == "unchanged"


def test_too_few_samples_is_insufficient_not_a_verdict(tmp_path, capsys):
    base, cand = sweep(tmp_path, "b", grid(50)), sweep(tmp_path, "c", grid(50, 3.0))
    d = only(run_diff([base], [cand]))
    assert d.verdict == "insufficient" and d.ci_low_ms is None and "n >= 299" in d.reasons[0]
    assert reports_main(["diff", str(base), str(cand)]) == 0
    # the same data is enough for p50 (n >= 5)
    assert only(run_diff([base], [cand], DiffSpec(percentile=0.5))).verdict == "regressed"
    capsys.readouterr()


def test_device_classes_never_mix_unless_mapped(tmp_path, capsys):
    metal = sweep(tmp_path, "metal", grid(600))
    cpu = sweep(tmp_path, "cpu", grid(600), host="hostA")
    with pytest.raises(DiffInputError, match="no common device class"):
        run_diff([metal], [cpu])
    assert reports_main(["diff", str(metal), str(cpu)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--map-class" in err
    spec = DiffSpec(class_map=((METAL, CPU),))
    d = only(run_diff([metal], [cpu], spec))
    assert (d.baseline_class, d.device_class, d.verdict) == (METAL, CPU, "unchanged")
    assert reports_main(["diff", str(metal), str(cpu), "--map-class", f"{METAL}={CPU}", "--format", "markdown"]) == 0
    assert "compared across classes" in capsys.readouterr().out


def test_new_and_missing_cells(tmp_path):
    base = sweep(tmp_path, "b", grid(600), extra=cell_rows("old", grid(300), host="mac1", phase="prefill"))
    new_rows = cell_rows("new", [5.0] * 10, host="mac1", phase="code2wav")
    new_rows.append(cancel_row("new-drop", None, host="mac1", phase="code2wav", outcome="dropped"))
    cand = sweep(tmp_path, "c", grid(600), extra=new_rows + cell_rows("ok", [1.0] * 5, host="mac1", phase="idle"))
    result = run_diff([base], [cand])
    verdicts = {c.phase: c.verdict for c in result.cells}
    assert verdicts == {"decode": "unchanged", "prefill": "missing", "code2wav": "regressed", "idle": "new"}
    assert result.cells[0].phase == "code2wav"  # regressions first
    assert result.exit_code == 1


def test_other_classes_are_reported_not_compared(tmp_path):
    base = sweep(tmp_path, "b", grid(600), extra=cell_rows("v", grid(40), host="hostB"))
    cand = sweep(tmp_path, "c", grid(600), extra=cell_rows("x", grid(40), host="hostA"))
    result = run_diff([base], [cand])
    assert [c.device_class for c in result.cells] == [METAL]
    assert result.baseline_only_classes == ["linux/x86_64/vulkan/Radeon 780M"]
    assert result.candidate_only_classes == [CPU]
    assert "not compared (candidate only)" in diff_to_markdown(result)


def test_bootstrap_is_seeded_and_per_cell(tmp_path):
    base = sweep(tmp_path, "b", grid(600))
    cand = sweep(tmp_path, "c", grid(600, 1.2))
    first = only(run_diff([base], [cand]))
    assert only(run_diff([base], [cand])) == first
    # adding an unrelated cell does not move this cell's interval
    cand2 = sweep(tmp_path, "c2", grid(600, 1.2), extra=cell_rows("o", grid(300), host="mac1", phase="prefill"))
    result = run_diff([base], [cand2])
    same = [c for c in result.cells if c.phase == "decode"][0]
    assert (same.ci_low_ms, same.ci_high_ms) == (first.ci_low_ms, first.ci_high_ms)
    other_seed = only(run_diff([base], [cand], DiffSpec(seed=7)))
    assert other_seed.verdict == first.verdict


def test_bad_inputs_exit_2(tmp_path, capsys):
    good = sweep(tmp_path, "good", grid(10))
    future = write_dataset(tmp_path / "future", cell_rows("f", [1.0]), schema_version=SCHEMA_VERSION + 1)
    (tmp_path / "plain").mkdir()
    for argv, needle in (
        (["diff", str(future), str(good)], "newer than this cancelbench"),
        (["diff", str(good), str(tmp_path / "plain")], "not a cancelbench dataset"),
        (["diff", str(good), str(tmp_path / "nope")], "no such directory"),
        (["diff", str(good), str(good), "--map-class", "nonsense"], "bad --map-class"),
        (["diff", str(good), str(good), "--bootstrap", "5"], "--bootstrap"),
    ):
        assert reports_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, (argv, err)


def test_markdown_comment_is_size_capped_keeping_regressions(tmp_path):
    phases = [f"p{i:02d}" for i in range(30)]
    base_rows, cand_rows = [], []
    for i, ph in enumerate(phases):
        base_rows += cell_rows(f"b{ph}", [5.0] * 20, host="mac1", phase=ph)
        cand_rows += cell_rows(f"c{ph}", [5.0] * 20, host="mac1", phase=ph)
    cand_rows.append(cancel_row("c-drop", None, host="mac1", phase="p29", outcome="dropped"))
    result = run_diff([write_dataset(tmp_path / "b", base_rows)], [write_dataset(tmp_path / "c", cand_rows)])
    md = diff_to_markdown(result, limit=3000)
    assert len(md) <= 3000 and "rows shown" in md
    assert "| REGRESSED |" in md and "p29" in md  # the regression is kept, unchanged cells are cut
