"""The heavy markers are applied by conftest.py from what a test starts, and kept honest."""

import re
import subprocess
import sys
from pathlib import Path

import conftest

HERE = Path(__file__).parent


def test_every_declared_test_exists():
    """A renamed file or test would silently lose its markers: every entry must still name one."""
    for key in conftest.MARKS_BY_TEST:
        file, _, name = key.partition("::")
        name, _, param = name.partition("[")
        assert (HERE / file).is_file(), f"MARKS_BY_TEST names a missing file: {key}"
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", (HERE / file).read_text(), re.M), \
                f"MARKS_BY_TEST names a missing test: {key}"
        if param:
            assert f'"{param[:-1]}"' in (HERE / file).read_text(), f"MARKS_BY_TEST names a missing parameter: {key}"


def test_every_declared_fixture_exists():
    defined = {m for f in HERE.glob("*.py") for m in re.findall(r"^def (\w+)\(", f.read_text(), re.M)}
    assert set(conftest.MARKS_BY_FIXTURE) <= defined


INNER = '''
import os
from pathlib import Path

import pytest


def _leave_a_ray_session():
    """What every Ray start leaves behind (a session directory), without starting Ray."""
    (Path(os.environ["RAY_TMPDIR"]) / "ray" / "session_2000-01-01_00-00-00_000000_1").mkdir(parents=True)


def test_unmarked_start():
    _leave_a_ray_session()


@pytest.mark.cluster
def test_marked_start():
    _leave_a_ray_session()


def test_no_start():
    pass
'''


def test_a_test_that_starts_ray_without_the_cluster_marker_fails(tmp_path):
    """The check itself, on an inner pytest run with this conftest.py (each test in its own run)."""
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text())
    (tmp_path / "test_inner.py").write_text(INNER)
    runs = {name: subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                                  str(tmp_path), "test_inner.py", "-k", name],
                                 capture_output=True, text=True, cwd=tmp_path, timeout=300)
            for name in ("test_unmarked_start", "test_marked_start", "test_no_start")}
    bad = runs["test_unmarked_start"]
    assert bad.returncode == 1, bad.stdout[-3000:]
    assert re.search(r"\b1 passed\b.*\b1 error\b", bad.stdout), bad.stdout[-3000:]
    assert ("test_inner.py::test_unmarked_start started Ray (session_2000-01-01_00-00-00_000000_1) "
            "but is not marked cluster") in bad.stdout
    for name in ("test_marked_start", "test_no_start"):
        assert runs[name].returncode == 0, runs[name].stdout[-3000:]


# Tests that start Ray in their own ways: a conftest fixture, a multi-node fixture with a
# Vulkan sweep, a `cancelbench sweep` subprocess, cluster.connect inline.
STARTS_RAY = ("tests/test_sweep.py::test_uniform_sweep_writes_the_documented_dataset",
              "tests/test_cluster.py::test_sweep_across_cpu_and_vulkan_agents",
              "tests/test_sweep_interrupt.py::test_one_sweep_per_out_and_sigint_leaves_an_interrupted_dataset",
              "tests/test_multihost.py::test_local_ray_listens_on_loopback_only")


def test_cluster_selection_holds_the_tests_that_start_ray():
    """`-m cluster` selects what `make test-fast` (`not cluster ...`) leaves out; a test of the
    same module that starts nothing stays out."""
    files = sorted({t.split("::")[0] for t in STARTS_RAY})
    cp = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                         "-m", "cluster", *files], capture_output=True, text=True, cwd=HERE.parent, timeout=300)
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    selected = {line.split("[")[0] for line in cp.stdout.splitlines() if "::" in line}
    assert set(STARTS_RAY) <= selected, set(STARTS_RAY) - selected
    assert "tests/test_cluster.py::test_agents_command_rejects_an_unknown_backend_before_ray" not in selected
