"""cancelbench: how fast native speech engines stop when they are cancelled.

Installed, every module lives under ``cancelbench.``: this folder holds the
root package (the CLI and the record contract shared by the driver and the
reports); the design card's top-level folders are mounted under it by
``pyproject.toml`` (``cancelbench.orchestrator`` is ``orchestrator/``, and so
on). Importing any of it changes no process state: Ray's settings are made
where Ray is started or connected (``cancelbench.orchestrator.cluster``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cancelbench")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
