"""Shared fixtures: the real fixture models and a real local Ray cluster."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")  # before any `import ray`

import pytest

from cancelbench.datasets.fixtures import ensure_text_fixture


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
