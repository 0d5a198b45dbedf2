"""A workload's input corpus: JSON lines of {"id", "text"} or {"id", "wav"}, checked
before any trial (empty text, missing or non-16 kHz mono audio are config errors)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cancelbench.datasets.paths import DATASETS_DIR
from cancelbench.inputs import MAX_CORPUS_BYTES, read_text

from .config import ConfigError, WorkloadSpec

CORPORA_DIR = DATASETS_DIR / "corpora"
STT_SAMPLE_RATE = 16_000  # Qwen3-ASR's audio encoder input


def _check_input(workload: WorkloadSpec, item: dict, where: str) -> None:
    """Catch bad inputs before any trial: empty text, missing or non-16 kHz mono audio."""
    kind = workload.spec.declaration.input  # what the engine's run takes (its declaration)
    if kind == "text":
        text = item.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}: input {item['id']!r} has empty text")
    elif kind == "audio_path":
        import wave

        wav = item.get("wav")
        if not wav:
            raise ConfigError(f"{where}: input {item['id']!r} has no 'wav'")
        path = Path(wav) if Path(wav).is_absolute() else DATASETS_DIR / wav
        try:
            with wave.open(str(path), "rb") as w:
                rate, channels = w.getframerate(), w.getnchannels()
        except FileNotFoundError:
            raise ConfigError(f"{where}: audio file not found: {path}") from None
        except (wave.Error, EOFError) as exc:
            raise ConfigError(f"{where}: {path} is not a PCM WAV file ({exc})") from None
        if rate != STT_SAMPLE_RATE or channels != 1:
            raise ConfigError(f"{where}: {path} is {rate} Hz with {channels} channel(s); "
                              f"the {workload.engine} engine needs {STT_SAMPLE_RATE} Hz mono")


def load_inputs(workload: WorkloadSpec) -> list[dict]:
    """The workload's input corpus: a JSON-lines file of {"id", "text"} or {"id", "wav"}."""
    if workload.inputs.endswith(".jsonl"):  # an explicit corpus file
        path = Path(workload.inputs).expanduser()
    elif re.fullmatch(r"[A-Za-z0-9_.-]+", workload.inputs) and not workload.inputs.startswith("."):
        path = CORPORA_DIR / f"{workload.inputs}.jsonl"
    else:
        raise ConfigError(f"workload {workload.name}: corpus name {workload.inputs!r} must be a plain name "
                          "(datasets/corpora/<name>.jsonl) or a path ending in .jsonl")
    if not path.exists():
        raise ConfigError(f"workload {workload.name}: unknown input corpus {workload.inputs!r} ({path} missing)")
    try:
        lines = read_text(path, "input corpus", MAX_CORPUS_BYTES, ConfigError).splitlines()
    except ConfigError as exc:
        raise ConfigError(f"workload {workload.name}: cannot read input corpus ({exc})") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: bad JSON line ({exc})") from None
        if not isinstance(item, dict):
            raise ConfigError(f"{path}:{n}: each line must be a JSON object like {{\"id\": ..., \"text\": ...}}, "
                              f"got {type(item).__name__}")
        if "id" not in item or not isinstance(item["id"], (str, int)) or isinstance(item["id"], bool):
            raise ConfigError(f"{path}:{n}: input without a string or integer 'id'")
        _check_input(workload, item, f"{path}:{n}")
        items.append(item)
    if not items:
        raise ConfigError(f"{path}: empty input corpus")
    return items
