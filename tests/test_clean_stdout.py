"""Machine formats own stdout: a real sweep through the CLI (its own local Ray,
the real agents and llama.cpp, whose logs go wherever they go), then
``report --format json`` / ``--format junit`` in fresh processes, on the pandas
and on the Ray Data engine; stdout must parse whole, with nothing before or
after the document (no native, Ray or progress line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

CONFIG = """
[sweep]
seed = 5
trials_per_cell = 6
reference_runs = 3
mechanisms = ["abort_callback", "between_calls"]
deliveries = ["agent", "driver"]
ping_samples = 3

[[workload]]
name = "text-stdout"
engine = "text"
model = "fixture:text-llama-57m"
prompt_tokens = 64
max_tokens = 4
n_batch = 64
chunk_tokens = 16
n_threads = 1
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
    env.pop("GITHUB_STEP_SUMMARY", None)
    return subprocess.run([sys.executable, "-m", "cancelbench.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, text_model) -> Path:
    base = tmp_path_factory.mktemp("stdout")
    (base / "sweep.toml").write_text(CONFIG, encoding="utf-8")
    proc = _cli("sweep", "--config", str(base / "sweep.toml"), "--out", str(base / "d"), "--quiet", cwd=base)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert (base / "d" / "manifest.json").is_file()
    return base / "d"


@pytest.mark.parametrize("engine", ["pandas", "ray"])
def test_json_stdout_is_the_document_only(sweep, engine):
    proc = _cli("report", str(sweep), "--format", "json", "--engine", engine, cwd=sweep.parent)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    verdict = json.loads(proc.stdout)  # raises on any stray line before or after
    assert verdict["n_records"] > 0 and verdict["cells"]
    assert proc.stdout.startswith("{") and proc.stdout.endswith("}\n")


def test_junit_stdout_is_the_document_only(sweep):
    proc = _cli("report", str(sweep), "--format", "junit", cwd=sweep.parent)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    root = ET.fromstring(proc.stdout.encode("utf-8"))
    assert root.tag == "testsuites" and int(root.get("tests")) > 0
    assert proc.stdout.startswith("<?xml") and proc.stdout.rstrip().endswith("</testsuites>")
