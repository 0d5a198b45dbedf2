"""cancelbench driver: plans, scheduling on Ray, cancel delivery.

Python API::

    from cancelbench.orchestrator import load_config, run_sweep
    result = run_sweep(load_config("sweep.toml"), "results/my-sweep")

Importing this package sets nothing in the process; Ray's auth mode is chosen
where Ray is started or connected (``cluster.connect``).
"""

from .config import ConfigError, SweepConfig, WorkloadSpec, load_config


def run_sweep(config, out_dir, **kwargs):
    """Run a sweep; see :class:`cancelbench.orchestrator.runner.Sweep` for the options."""
    from .runner import run_sweep as _run

    return _run(config, out_dir, **kwargs)


__all__ = ["ConfigError", "SweepConfig", "WorkloadSpec", "load_config", "run_sweep"]
