"""The benchmark harness: a real probe-engine sweep into tmp_path, and the
benchmark JSON's figures equal what `cancelbench report --format json`
computes from the same dataset (the report reproduces the benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import harness  # noqa: E402

from cancelbench.orchestrator.config import OffsetSpec, SweepConfig, WorkloadSpec  # noqa: E402

PROBE = WorkloadSpec(name="probe-20ms", engine="probe", duration_us=20_000, period_us=200)
# 10 cancels a cell: an agent-delivered cancel early in the plan reaches the agent before the engine
# process's "busy" phase does (phase "idle", its own cell), about 1 in 3 here; with 6 a cell, the busy
# cells of all four mechanism x delivery pairs fell below the 5 samples a p50 needs about once in 100
CONFIG = SweepConfig(seed=5, trials_per_cell=10, reference_runs=3, mechanisms=("between_calls", "abort_callback"),
                     deliveries=("agent", "driver"), offsets=OffsetSpec(plan="uniform", max_fraction=0.8),
                     workloads=(PROBE,), ping_samples=3)
CELL_KEY = ("workload", "phase", "mechanism", "delivery", "device")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out, json_path = harness.paths("probe", tmp_path_factory.mktemp("bench") / "probe")
    facts = harness.run(CONFIG, out, json_path=json_path)
    doc = harness.write_json(json_path, name="probe", config=CONFIG, run_facts=facts,
                             summary=harness.summarise(out), machine=harness.machine_facts(), default_trials=40)
    proc = subprocess.run([sys.executable, "-m", "cancelbench.cli", "report", str(out), "--format", "json"],
                          capture_output=True, text=True, check=False)
    # 1 = the dataset holds dropped/lost trials (the report's verdict); its figures still come on stdout
    assert proc.returncode in (0, 1) and proc.stdout, (proc.returncode, proc.stderr[-2000:])
    return out, json_path, json.loads(json_path.read_text()), doc, json.loads(proc.stdout)


def _by_key(cells: list[dict]) -> dict[tuple, dict]:
    return {tuple(c[k] for k in CELL_KEY): c for c in cells}


@pytest.mark.parametrize("ours, theirs", [("cells", "cells"), ("mechanisms", "mechanisms")])
def test_report_reproduces_every_cell_figure(bench, ours, theirs):
    _, _, doc, _, report = bench
    mine, rep = _by_key(doc["summary"][ours]), _by_key(report[theirs])
    assert mine and set(mine) == set(rep)
    assert sum(c["n"] for c in mine.values()) > 0
    assert any(c["p50_ms"] is not None for c in mine.values())  # smoke-scale, yet a p50 exists
    for key, c in mine.items():
        r = rep[key]
        assert (c["n"], c["n_trials"], c["completed"], c["dropped"], c["lost"]) == \
            (r["n"], r["n_trials"], r["completed"], r["dropped"], r["lost"]), key
        assert (c["p50_ms"], c["p90_ms"], c["p99_ms"]) == \
            (r["percentiles"]["p50"], r["percentiles"]["p90"], r["percentiles"]["p99"]), key
        assert c["max_ms"] == r["max_ms"] and c["insufficient"] == r["insufficient"], key
    # the minimum-sample rule: 10 trials a cell never give a p99 (it needs 299)
    assert all(c["p99_ms"] is None and "p99" in c["insufficient"] for c in mine.values())
    assert doc["summary"]["min_samples"] == report["min_samples"]


def test_json_counts_match_the_records_and_carry_the_machine(bench):
    from cancelbench.sink import read_records

    out, _, doc, written, _ = bench
    assert doc == json.loads(json.dumps(written))  # what write_json returned is what is on disk
    df = read_records(out)
    cancels = df[df.trial_kind == "cancel"]
    assert len(df) == doc["run"]["written"] == doc["run"]["planned"] == 2 * (3 + 2 * CONFIG.trials_per_cell)
    assert sum(c["n_trials"] for c in doc["summary"]["mechanisms"]) == len(cancels)
    assert sum(c["n"] for c in doc["summary"]["mechanisms"]) == \
        int(((cancels.outcome == "cancelled") & cancels.latency_ms.notna()).sum())
    assert doc["machine"]["nproc"] >= 1 and doc["machine"]["cpu_model"]
    assert len(doc["run"]["load_average_start"]) == 3 and len(doc["run"]["load_average_end"]) == 3
    assert doc["scale"].startswith("smoke")
    assert len(list((out / "records").rglob("*.parquet"))) == 1  # compacted: one file for the one partition


def test_refuses_to_overwrite_without_force(bench):
    out, json_path, *_ = bench
    with pytest.raises(harness.OutputExists):
        harness.run(CONFIG, out)
    with pytest.raises(harness.OutputExists):
        harness.run(CONFIG, out.with_name("elsewhere"), json_path=json_path)
    assert not out.with_name("elsewhere").exists()
    stranger = out.with_name("not-a-dataset")
    (stranger / "keep").mkdir(parents=True)
    with pytest.raises(harness.OutputExists):  # --force replaces a dataset, never any directory
        harness.run(CONFIG, stranger, force=True)
    assert (stranger / "keep").is_dir()


def test_the_dataset_knows_its_config(bench):
    out, *_ = bench
    assert harness.config_of(out) == CONFIG  # --resummarise summarises with the config the sweep ran
