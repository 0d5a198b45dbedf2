"""docs/ci.md's GitHub Actions recipe, run locally: the workflow is read from the
document itself (so the test and the doc cannot drift), and its ``run:`` steps
execute in order in the repository root with bash, as a runner would, except
``make setup fixtures`` (the test environment has done it).  ``RESULTS``,
``BASELINE`` and ``GITHUB_STEP_SUMMARY`` point into a temporary directory;
the sweep is real (Ray, the text fixture model).

The job runs twice: the first run has no baseline (a notice) and, on main,
becomes the baseline; the second run's diff gate compares against it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ci.md"


def workflow() -> dict:
    yaml = pytest.importorskip("yaml")
    block = re.search(r"```yaml\n(# \.github/workflows/.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert block, "docs/ci.md has no workflow block"
    return yaml.safe_load(block.group(1))


def test_the_recipe_is_a_self_hosted_job_that_uploads_and_gates():
    job = workflow()["jobs"]["cancel-latency"]
    assert "self-hosted" in job["runs-on"]
    steps = job["steps"]
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("actions/upload-artifact@") for u in uses)
    runs = " ".join(s.get("run", "") for s in steps)
    assert "cancelbench sweep" in runs and "cancelbench diff" in runs


def _run_steps(steps: list[dict], env: dict) -> list[tuple[str, int, str, str]]:
    done = []
    failed = False
    for step in steps:
        cmd = step.get("run")
        cond = str(step.get("if", "success()"))
        if cmd is None or "make setup" in cmd:
            continue
        # the three conditions the recipe uses, evaluated as Actions would
        wanted = {"success()": not failed, "success() || failure()": True,
                  "github.ref == 'refs/heads/main' && success()": not failed and env["GITHUB_REF"] ==
                  "refs/heads/main"}
        assert cond in wanted, f"a condition this test does not know: {cond}"
        if not wanted[cond]:
            continue
        cmd = cmd.replace(".venv/bin/", f"{Path(sys.executable).parent}/")  # this test's environment
        proc = subprocess.run(["bash", "-e", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        done.append((step["name"], proc.returncode, proc.stdout, proc.stderr))
        failed = failed or proc.returncode != 0
    return done


def test_the_recipe_runs_here(tmp_path):
    job = workflow()["jobs"]["cancel-latency"]
    summary = tmp_path / "summary.md"
    env = {**os.environ, "RESULTS": str(tmp_path / "run1"), "REPORTS": str(tmp_path / "rep1"),
           "BASELINE": str(tmp_path / "var" / "baseline"),
           "GITHUB_STEP_SUMMARY": str(summary), "GITHUB_REF": "refs/heads/main", "RAY_AUTH_MODE": "token"}
    first = {name: (rc, out, err) for name, rc, out, err in _run_steps(job["steps"], env)}
    assert first["Sweep"][0] == 0, first["Sweep"][2][-2000:]
    rc, out, err = first["Report (annotations, JUnit, HTML; job summary)"]
    assert rc == 0, err[-2000:]
    assert all(line.startswith("::") for line in out.splitlines()) and out  # annotations only
    assert (tmp_path / "rep1" / "report-junit.xml").is_file() and (tmp_path / "rep1" / "report.html").is_file()
    rc, out, _ = first["Gate on diff against the baseline"]
    assert rc == 0 and out.startswith("::notice title=cancelbench::no baseline")
    assert (tmp_path / "var" / "baseline" / "manifest.json").is_file()  # kept: this was main
    # a second run (a pull request): the diff gate compares it with the baseline
    env.update(RESULTS=str(tmp_path / "run2"), REPORTS=str(tmp_path / "rep2"), GITHUB_REF="refs/pull/1/merge")
    second = {name: (rc, out, err) for name, rc, out, err in _run_steps(job["steps"], env)}
    rc, out, err = second["Gate on diff against the baseline"]
    assert rc in (0, 1), err[-2000:]  # 1 only if this host really regressed between the two runs
    assert all(line.startswith("::") for line in out.splitlines()) and out
    assert (tmp_path / "rep2" / "diff-junit.xml").is_file()
    assert "Keep as the baseline (main only)" not in second
    text = summary.read_text(encoding="utf-8")
    assert text.count("## cancelbench report") == 2 and text.count("## cancelbench diff") == 1
