"""Shared fixtures (the real fixture models, a real local Ray) and the one home of
the heavy markers: a test is marked by what it starts, never by hand.

* ``MARKS_BY_FIXTURE``: a fixture that starts something marks every test that uses it.
* ``MARKS_BY_TEST``: what a test starts that no fixture shows (a ``cancelbench sweep``
  subprocess that reaches Ray, a namespace cluster built inline, field-scale work),
  by ``file.py``, ``file.py::test_name`` or ``file.py::test_name[parameter id]``.

The ``cluster`` marker is kept honest at run time: every Ray started during a test
(in this process or in a subprocess) leaves a session directory under this run's
own Ray temp dir, and a test not marked ``cluster`` that leaves one fails, as does
one that leaves Ray initialised in this process. So ``pytest -m "not cluster"``
(``make test-fast``) never starts Ray.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")  # before any `import ray`
# The test clusters' agents at normal priority, as a cancelbench-started Ray runs them (raylocal).
os.environ.setdefault("RAY_worker_niceness", "0")
# This run's own Ray temp dir (subprocesses inherit it): the Rays of this run, and only
# they, leave their session directories there. Short on purpose (Ray's socket paths).
_RAY_TMP = Path(tempfile.mkdtemp(prefix="cbt-", dir=os.environ.get("RAY_TMPDIR") or "/tmp"))
os.environ["RAY_TMPDIR"] = str(_RAY_TMP)

import pytest  # noqa: E402

from cancelbench.datasets.fixtures import ensure_text_fixture  # noqa: E402

MARKERS = {
    "cluster": "starts Ray: a local or multi-node cluster, in process or through `cancelbench sweep`",
    "netns": "real multi-host topology in Linux network namespaces (root)",
    "vulkan": "runs llama.cpp on the Vulkan backend (lavapipe here)",
    "browser": "renders HTML in headless Chromium",
    "slow": "minutes of compute or gigabytes of disk (field-scale models, a wheel build)",
    "measure": "a rate measured over many real trials (several sweeps): `make test-all` runs it, not `make test`",
}

MARKS_BY_FIXTURE = {
    "local_ray": {"cluster"},  # this file: a local Ray
    "ray_local": {"cluster"},  # test_reports.py: a local Ray for the Ray Data report path
    "ray_cluster": {"cluster"},  # test_cluster.py: a 3-node ray.cluster_utils.Cluster
    "hosts": {"cluster", "netns"},  # test_multihost.py: Ray across network namespaces
    "vulkan_site": {"vulkan"},  # test_backends.py: llama.cpp's Vulkan build on lavapipe
    "chromium": {"browser"},  # test_report_html.py: headless Chromium
}

MARKS_BY_TEST = {
    "test_sweep_interrupt.py": {"cluster"},  # `cancelbench sweep` subprocesses
    "test_sweep_failures.py": {"cluster"},  # `cancelbench sweep` subprocesses
    "test_external_engine.py": {"cluster"},  # `cancelbench sweep` subprocesses with external engines
    "test_harness.py": {"cluster"},  # benchmarks/harness.py runs a sweep in process
    "test_external_sweep.py": {"cluster"},  # run_sweep in process on the local_ray fixture
    # `cancelbench sweep` subprocesses with external engines (its sut-check tests start no Ray)
    "test_verdict.py::test_a_sweep_judges_each_engine_by_what_the_agent_saw": {"cluster"},
    "test_verdict.py::test_a_reference_run_that_reports_a_cancel_is_the_engines_error": {"cluster"},
    "test_verdict.py::test_an_engine_setting_that_is_not_a_finite_number_stops_the_sweep_before_any_trial": {"cluster"},
    "test_signals.py": {"cluster"},  # `cancelbench sweep` subprocesses, signalled
    "test_full_disk.py": {"cluster"},  # `cancelbench sweep` subprocesses on a small tmpfs
    "test_clean_stdout.py": {"cluster"},  # a real CLI sweep, then reports (also --engine ray)
    "test_trend.py": {"cluster", "measure"},  # five real sweeps
    "test_ci_doc.py::test_the_recipe_runs_here": {"cluster"},  # the recipe's sweep, twice
    "test_read_once.py::test_a_part_file_without_latency_ms_is_the_same_verdict_on_both_engines": {"cluster"},  # Ray
    "test_anchors.py::test_event_anchored_cancels_land_in_their_target_phase_under_variance": {"cluster", "measure"},
    "test_contract.py::test_diff_of_sweeps_differing_only_in_graph_slice_says_so": {"cluster"},  # two sweeps
    "test_multihost.py::test_local_ray_listens_on_loopback_only": {"cluster"},
    "test_outputs_and_inputs.py::test_report_on_ray_prints_no_ray_log_lines": {"cluster"},  # report --engine ray
    # the sha256 check and the device check run on the agents, after Ray started
    "test_cli.py::test_sha_mismatch": {"cluster"},
    "test_cli.py::test_every_bad_config_is_one_line_exit_2_and_writes_nothing[backend the cluster lacks]": {"cluster"},
    "test_multihost.py::test_unauthenticated_cluster_is_joined_with_a_warning": {"cluster", "netns"},
    "test_cluster.py::test_sweep_across_cpu_and_vulkan_agents": {"vulkan"},
    "test_packaging.py": {"slow", "cluster"},  # builds and installs the package, then sweeps with it
    "test_field_fixtures.py::test_field_sets_match_their_locks_and_the_tts_pair_decodes_a_window": {"slow"},
    # 30 cancel/run cycles each, for a memory slope: the longest loops of the engine tests
    "test_tts_engine.py::test_memory_flat_over_30_cancel_run_cycles": {"slow"},
    "test_stt_engine.py::test_memory_flat_over_30_cancel_run_cycles": {"slow"},
}


def marks_for(item: pytest.Item) -> set[str]:
    """The heavy markers ``item`` gets from what it starts."""
    file = Path(str(item.fspath)).name
    marks = set()
    for key in (file, f"{file}::{item.originalname}", f"{file}::{item.name}"):  # file, test, one parameter
        marks |= MARKS_BY_TEST.get(key, set())
    for name in getattr(item, "fixturenames", ()):
        marks |= MARKS_BY_FIXTURE.get(name, set())
    return marks


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_itemcollected(item: pytest.Item) -> None:
    """Runs per item at collection, before `-m` selects: the markers are there to select on."""
    for name in sorted(marks_for(item)):
        item.add_marker(name)


# --------------------------------------------------------------------- the cluster marker, checked

def ray_sessions() -> set[str]:
    """Session directories of every Ray this run has started so far."""
    d = _RAY_TMP / "ray"
    return {p.name for p in d.glob("session_2*")} if d.is_dir() else set()


def ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_BEFORE] = (ray_sessions(), ray_initialized())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    result = yield
    sessions, was_up = item.stash.get(_BEFORE, (set(), False))
    started = sorted(ray_sessions() - sessions)
    if item.get_closest_marker("cluster") is None and (started or (ray_initialized() and not was_up)):
        pytest.fail(f"{item.nodeid} started Ray ({', '.join(started) or 'ray.init in this process'}) "
                    "but is not marked cluster: add what starts it to tests/conftest.py", pytrace=False)
    return result


_BEFORE = pytest.StashKey[tuple]()


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_RAY_TMP, ignore_errors=True)


# --------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def text_model() -> str:
    """The text fixture GGUF (generated if missing, verified against its lock)."""
    return str(ensure_text_fixture("text-llama-57m"))


@pytest.fixture(scope="session")
def small_text_model() -> str:
    return str(ensure_text_fixture("text-qwen3-14m"))


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray, bound to 127.0.0.1, token auth on; shared by a test module
    (module scope: test_cluster.py brings its own multi-node cluster)."""
    import ray

    from cancelbench.orchestrator import cluster

    cluster.connect(None)
    yield ray
    ray.shutdown()
