"""Does a GGUF file fit the engine it is given to?  A pure check on GGUF metadata.

llama.cpp loads a TTS talker as a text model, and a text model next to a TTS
mmproj, without complaint; every trial then errors or measures the wrong
thing. :func:`check_model` reads ``general.architecture`` (and an mmproj's
projector types) with ``gguf.GGUFReader`` (mmap, metadata only is touched)
and raises :class:`ModelMismatchError` with one line saying what is wrong.
Called on the driver for files it can see (before Ray starts) and on the
agent before load.
"""

from __future__ import annotations

from pathlib import Path

from .engines.registry import engine_spec

MMPROJ_ARCH = "clip"  # every mtmd projector file
# Architectures that are not a language model of their own.
NOT_A_TEXT_MODEL = {
    "qwen3tts": "a TTS talker (use engine = \"tts\" with its mmproj)",
    MMPROJ_ARCH: "an mmproj (projector), not a language model",
}
ROLES = ("model", "mmproj")


class ModelMismatchError(ValueError):
    """A model file that does not fit its engine or role (an input error, exit 2)."""


def gguf_metadata(path: Path) -> dict[str, object]:
    """``general.architecture`` and the ``clip.*`` projector keys of a GGUF file."""
    import gguf

    path = Path(path)
    if path.is_dir():
        raise ModelMismatchError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise ModelMismatchError(f"model file not found: {path}")
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, OSError, IndexError, KeyError) as exc:  # bad magic, truncated header
        raise ModelMismatchError(f"{path}: not a readable GGUF file ({' '.join(str(exc).split())})") from None
    wanted = [k for k in reader.fields if k == "general.architecture" or k.startswith("clip.")]
    return {k: reader.fields[k].contents() for k in wanted}


def projector_types(meta: dict) -> dict[str, str | None]:
    """{"audio", "gen_audio", "vision"} -> projector type, from an mmproj's metadata."""
    legacy = meta.get("clip.projector_type")
    return {
        "audio": meta.get("clip.audio.projector_type", legacy) if meta.get("clip.has_audio_encoder") else None,
        "gen_audio": meta.get("clip.gen.audio.projector_type") if meta.get("clip.has_gen_audio_encoder") else None,
        "vision": meta.get("clip.vision.projector_type", legacy) if meta.get("clip.has_vision_encoder") else None,
    }


def check_metadata(meta: dict, engine: str, role: str, name: str) -> None:
    """Pure rule: raise :class:`ModelMismatchError` when ``meta`` does not fit ``engine``/``role``
    (what its spec declares: ``mmproj_projector``, ``model_archs``)."""
    spec = engine_spec(engine)
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    arch = meta.get("general.architecture")
    if role == "mmproj":
        if arch != MMPROJ_ARCH:
            raise ModelMismatchError(f"mmproj {name} has architecture {arch!r}, not an mmproj ({MMPROJ_ARCH!r})")
        if spec.mmproj_projector is not None:
            modality, expected = spec.mmproj_projector
            got = projector_types(meta).get(modality)
            if got != expected:
                have = ", ".join(f"{k}={v}" for k, v in projector_types(meta).items() if v) or "none"
                raise ModelMismatchError(f"mmproj {name} has no '{expected}' projector (it has: {have}); "
                                         f"the {engine} engine needs a {expected} mmproj")
        return
    if spec.model_archs:
        if arch not in spec.model_archs:
            raise ModelMismatchError(f"model {name} has architecture {arch!r}; the {engine} engine needs "
                                     f"{spec.model_kind} ({', '.join(spec.model_archs)})")
    elif arch in NOT_A_TEXT_MODEL:
        raise ModelMismatchError(f"model {name} has architecture {arch!r}, {NOT_A_TEXT_MODEL[arch]}; "
                                 f"the {engine} engine needs {spec.model_kind}")


def check_model(path: Path, engine: str, role: str = "model") -> None:
    """Raise :class:`ModelMismatchError` if the GGUF at ``path`` does not fit ``engine`` in ``role``."""
    if not engine_spec(engine).needs_model:  # probe, sim
        return
    check_metadata(gguf_metadata(Path(path)), engine, role, Path(path).name)


def check_workload_files(engine: str, files: dict[str, str | None], driver_sees_files: bool) -> None:
    """Driver side, before Ray starts: check each model file of a workload this process can see.

    ``files``: role -> model spec (a path, or ``fixture:NAME``). Fixtures are
    resolved (generated if missing) only when the driver shares the agents'
    files (a local sweep); a path is checked if it exists here or the driver
    shares the agents' files. Agents check their own copies before load.
    """
    if not engine_spec(engine).needs_model:  # probe, sim
        return
    for role, spec in files.items():
        if not spec:
            continue
        if spec.startswith("fixture:"):
            if not driver_sees_files:
                continue
            from cancelbench.datasets.fixtures import ensure_fixture

            path = ensure_fixture(spec.split(":", 1)[1], role)
        else:
            path = Path(spec).expanduser()
            if not (driver_sees_files or path.exists()):
                continue
        check_model(path, engine, role)
