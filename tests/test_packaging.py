"""The installed package lives under ``cancelbench.`` only.

A top-level ``datasets`` (or ``reports``, ``native``...) would collide with
other distributions; Hugging Face Datasets is the usual one. This builds the
real wheel, installs it (not editable) into a fresh venv next to a
distribution that owns the top-level name ``datasets``, and runs a real sweep
from another directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    cp = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert cp.returncode == 0, f"{cmd[:3]} exited {cp.returncode}: {cp.stderr[-3000:]}"
    return cp


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    # The project's own wheel, built as a user's `pip install .` would build it.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, ROOT])
    # A distribution that owns the top-level import name `datasets`, as HF Datasets does.
    other = tmp_path_factory.mktemp("hf-datasets")
    (other / "datasets").mkdir()
    (other / "datasets" / "__init__.py").write_text('WHO = "the other datasets"\n')
    (other / "pyproject.toml").write_text(textwrap.dedent("""\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "datasets"
        version = "99.0"
        [tool.setuptools]
        packages = ["datasets"]
        """))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, other])
    return {"cancelbench": next(out.glob("cancelbench-*.whl")), "datasets": next(out.glob("datasets-*.whl"))}


def test_wheel_installs_only_the_cancelbench_namespace(wheels):
    with zipfile.ZipFile(wheels["cancelbench"]) as whl:
        names = whl.namelist()
        info = next(n for n in names if n.endswith(".dist-info/RECORD")).rsplit("/", 1)[0]
        top_level = whl.read(f"{info}/top_level.txt").decode().split()
    assert top_level == ["cancelbench"]
    roots = {n.split("/", 1)[0] for n in names}
    assert roots == {"cancelbench", info}, roots
    # The pieces a sweep needs at run time travel in the wheel.
    for needed in ("cancelbench/datasets/corpora/text_prompts.jsonl", "cancelbench/datasets/locks/text_fixtures.json",
                   "cancelbench/native/cancel_token.c", "cancelbench/native/cancel_token.h",
                   "cancelbench/device_agents/engines/registry.py",
                   "cancelbench/cli.py"):
        assert needed in names, needed
    assert any(n.startswith("cancelbench/native/_cancelbench_native") for n in names)


def test_installed_next_to_another_datasets_both_import_and_a_sweep_runs(wheels, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index",
          wheels["datasets"], wheels["cancelbench"]])
    # Third-party dependencies come from the project venv (no network here); a path
    # in a .pth is appended after the fresh venv's own site-packages, and the
    # project venv's editable-install hook is not processed from there.
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "zz_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = _run([py, "-c", textwrap.dedent("""\
        import json, datasets, cancelbench.datasets, cancelbench.datasets.paths as p, cancelbench.schema
        print(json.dumps({"other": datasets.WHO, "ours": cancelbench.datasets.__file__,
                          "schema": cancelbench.schema.__file__, "models": str(p.MODELS_DIR)}))
        """)], cwd=elsewhere)
    seen = json.loads(probe.stdout)
    assert seen["other"] == "the other datasets"
    assert str(venv) in seen["ours"] and str(venv) in seen["schema"]  # the installed copy, not the checkout
    assert str(ROOT) not in seen["models"]  # an installed wheel never writes into a source tree

    config = elsewhere / "probe.toml"
    config.write_text(textwrap.dedent("""\
        [sweep]
        trials_per_cell = 2
        reference_runs = 3
        mechanisms = ["abort_callback"]
        deliveries = ["agent"]
        ping_samples = 3
        [[workload]]
        name = "probe"
        engine = "probe"
        duration_us = 50000
        period_us = 1000
        """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path / "home")  # its own Ray token, never the user's
    cp = subprocess.run([venv / "bin" / "cancelbench", "sweep", "--config", config, "--out", "out", "--quiet"],
                        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert cp.returncode == 0, cp.stderr[-3000:]
    manifest = json.loads((elsewhere / "out" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["planned_trials"] == 5
    assert len(list((elsewhere / "out" / "records").rglob("*.parquet"))) >= 1
