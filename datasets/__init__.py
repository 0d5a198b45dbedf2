"""Corpora, locks, fixture recipes and sweep recipes (``cancelbench.datasets``)."""
