"""Fixture registry: every generated model by name, its lock, and ``cancelbench fixtures``.

No model is downloaded: the recipes (:mod:`.text_recipes`, :mod:`.tts_recipes`,
:mod:`.asr_recipes`, :mod:`.field`) write random-weight GGUFs of real
architectures with the ``gguf`` package. The bytes are reproducible and
checked against committed locks (``locks/*.json``) before every load.
"""

from __future__ import annotations

from pathlib import Path

from . import speech_fixtures as sf
from .locks import load_lock, verify_against
from .paths import DATASETS_DIR, MODELS_DIR
from .text_recipes import TEXT_FIXTURES, TextFixtureSpec, fixture_vocab, write_text_fixture

__all__ = ["DATASETS_DIR", "MODELS_DIR", "TEXT_FIXTURES", "TEXT_LOCK", "TextFixtureSpec", "ensure_fixture",
           "ensure_text_fixture", "fixture_lock_entries", "fixture_vocab", "generate_all", "write_text_fixture"]

TEXT_LOCK = DATASETS_DIR / "locks" / "text_fixtures.json"


def ensure_text_fixture(name: str, out_dir: Path | None = None, verify: bool = True) -> Path:
    """Return the fixture's path, generating it if missing; verified against its lock."""
    if name not in TEXT_FIXTURES:
        raise KeyError(f"unknown text fixture {name!r} (known: {', '.join(TEXT_FIXTURES)})")
    spec = TEXT_FIXTURES[name]
    path = Path(out_dir or MODELS_DIR) / spec.file_name
    if not path.exists():
        write_text_fixture(spec, out_dir)
    if verify and TEXT_LOCK.exists():
        verify_against(path, TEXT_LOCK)
    return path


def fixture_lock_entries(name: str) -> dict:
    """Lock entries (file name -> {size, sha256, source}) for every file of a fixture."""
    from . import field

    if name in TEXT_FIXTURES:
        lock_path, files = TEXT_LOCK, [TEXT_FIXTURES[name].file_name]
    elif name in sf.SPEECH_FIXTURES:
        lock_path = sf.SPEECH_LOCK
        files = [p.name for p in sf.fixture_paths()[sf.SPEECH_FIXTURES[name]].values()]
    elif name == sf.TTS_BARGEIN_FIXTURE.name:
        lock_path, files = sf.BARGEIN_LOCK, [p.name for p in sf.bargein_fixture_paths().values()]
    elif name in field.FIELD_SETS:
        lock_path, files = field.lock_path(name), [p.name for p in field.set_paths(name).values()]
    else:
        known = ", ".join([*TEXT_FIXTURES, *sf.SPEECH_FIXTURES, sf.TTS_BARGEIN_FIXTURE.name, *field.FIELD_SETS])
        raise KeyError(f"unknown fixture {name!r} (known: {known})")
    locks = load_lock(lock_path)
    missing = [f for f in files if f not in locks]
    if missing:
        raise KeyError(f"{lock_path}: no lock for {', '.join(missing)}")
    return {f: {"size": locks[f].size, "sha256": locks[f].sha256, "source": locks[f].source} for f in files}


def ensure_fixture(name: str, role: str = "model") -> Path:
    """Generate (if missing) and return a fixture file by name; the caller verifies it."""
    from . import field

    if name in TEXT_FIXTURES:
        return ensure_text_fixture(name, verify=False)
    if name in field.FIELD_SETS:
        return field.ensure_set(name, verify=False)[role]
    return sf.ensure_fixture(name, role)


def generate_all(out_dir: Path | None = None, which: str = "all", scale: str = "fixture") -> list[Path]:
    """Generate the models of ``cancelbench fixtures``; existing files are checked against their lock, not rewritten.

    ``scale="field"`` writes the field-scale sets (:mod:`.field`, ~2 GB) instead of the small fixtures.
    """
    if scale == "field":
        from . import field

        return field.generate_all(out_dir, which=which)
    paths: list[Path] = []
    if which in ("all", "text"):
        for name in TEXT_FIXTURES:
            paths.append(ensure_text_fixture(name, out_dir, verify=True))
    if which in ("all", "speech"):
        paths.extend(sf.generate_all(out_dir))
    if which == "all":  # not one of the speech set (its own lock): speech_fixtures module doc
        paths.extend(sf.ensure_bargein_fixture(out_dir, verify=True).values())
    return paths
