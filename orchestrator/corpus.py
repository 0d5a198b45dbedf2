"""A workload's input corpus: JSON lines of {"id", "text"} or {"id", "wav"}, checked
before any trial (empty text; a 'wav' that is not a string, not a regular file, or not
16 kHz mono 16-bit PCM of 1 frame to 10 minutes: config errors)."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path

from cancelbench.datasets.paths import DATASETS_DIR
from cancelbench.inputs import MAX_CORPUS_BYTES, read_text, regular_file

from .config import ConfigError, WorkloadSpec

CORPORA_DIR = DATASETS_DIR / "corpora"
STT_SAMPLE_RATE = 16_000  # Qwen3-ASR's audio encoder input
MAX_WAV_SECONDS = 600  # one corpus clip (docs/cli.md, Inputs): the agent reads it whole into memory


def _check_input(workload: WorkloadSpec, item: dict, where: str) -> None:
    """Catch bad inputs before any trial: empty text, missing or non-16 kHz mono audio."""
    kind = workload.spec.declaration.input  # what the engine's run takes (its declaration)
    if kind == "text":
        text = item.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}: input {item['id']!r} has empty text")
    elif kind == "audio_path":
        wav = item.get("wav")
        if wav is None or wav == "":
            raise ConfigError(f"{where}: input {item['id']!r} has no 'wav'")
        if not isinstance(wav, str):
            raise ConfigError(f"{where}: input {item['id']!r}: 'wav' must be a string (a WAV file's path), "
                              f"got {type(wav).__name__} {json.dumps(wav)[:60]}")
        path = Path(wav) if Path(wav).is_absolute() else DATASETS_DIR / wav
        check_wav(path, where, workload.engine)


def check_wav(path: Path, where: str, engine: str) -> float:
    """The duration (s) of ``path`` if it is a regular file holding a WAV the STT engines take:
    16 kHz mono 16-bit PCM, at least one frame, at most MAX_WAV_SECONDS, its data all in the
    file; ConfigError otherwise. Only the header is read, after ``stat`` said it is a regular
    file (a FIFO, a device or a directory is refused without being opened)."""
    import wave

    try:
        regular_file(path, "audio file", ConfigError)
    except ValueError as exc:  # ConfigError included; a path with a NUL byte is a ValueError of os.stat
        raise ConfigError(f"{where}: {exc}" if isinstance(exc, ConfigError) else
                          f"{where}: audio file {json.dumps(str(path))[:200]}: not a usable path ({exc})") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(f"{where}: audio file {path}: cannot read it ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # replaced between the stat and the open
            raise ConfigError(f"{where}: audio file {path} is not a regular file")
        try:
            # reads the RIFF header and the fmt chunk, seeks past others, stops at the data chunk's header
            w = wave.open(f, "rb")
            rate, channels, width, frames = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            data_at = f.tell()  # wave.open stops right after the data chunk's header: the samples start here
        except (wave.Error, EOFError, struct.error, OSError) as exc:
            raise ConfigError(f"{where}: {path} is not a PCM WAV file ({' '.join(str(exc).split())[:200]})") from None
    if rate != STT_SAMPLE_RATE or channels != 1 or width != 2:
        raise ConfigError(f"{where}: {path} is {rate} Hz with {channels} channel(s) of {8 * width}-bit samples; "
                          f"the {engine} engine needs {STT_SAMPLE_RATE} Hz mono 16-bit PCM")
    if frames == 0:
        raise ConfigError(f"{where}: {path} holds no audio (0 frames)")
    seconds = frames / rate
    if seconds > MAX_WAV_SECONDS:
        raise ConfigError(f"{where}: {path} claims {seconds:,.0f} s of audio, more than the {MAX_WAV_SECONDS} s "
                          "(10 minutes) a corpus clip may hold")
    if data_at + frames * width * channels > st.st_size:
        raise ConfigError(f"{where}: {path} is truncated: its header claims {frames * width * channels} bytes of "
                          f"samples, the file holds {max(0, st.st_size - data_at)}")
    return seconds


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
