"""cancelbench driver: plans, scheduling on Ray, cancel delivery, record sink.

Python API::

    from orchestrator import load_config, run_sweep
    result = run_sweep(load_config("sweep.toml"), "results/my-sweep")
"""

import os as _os

# Ray token authentication stays on. Ray reads the mode when it is imported,
# so this must run before the first `import ray` in this process.
_os.environ.setdefault("RAY_AUTH_MODE", "token")

from .config import ConfigError, SweepConfig, WorkloadSpec, load_config  # noqa: E402


def run_sweep(config, out_dir, **kwargs):
    """Run a sweep; see :class:`orchestrator.runner.Sweep` for the options."""
    from .runner import run_sweep as _run

    return _run(config, out_dir, **kwargs)


__all__ = ["ConfigError", "SweepConfig", "WorkloadSpec", "load_config", "run_sweep"]
