"""Where the datasets package keeps its files and where generated models go."""

from __future__ import annotations

import os
from pathlib import Path

DATASETS_DIR = Path(__file__).resolve().parent


def _default_models_dir() -> Path:
    # A source checkout (editable install) keeps generated models next to the
    # recipes, git-ignored; an installed wheel must not write into
    # site-packages, so it uses the per-user cache.
    if (DATASETS_DIR.parent / "pyproject.toml").is_file():
        return DATASETS_DIR / "models"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "cancelbench" / "models"


MODELS_DIR = Path(os.environ.get("CANCELBENCH_MODELS_DIR") or _default_models_dir())
