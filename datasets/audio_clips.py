"""The committed audio clips (``datasets/audio/*.wav``) the STT engine transcribes, and their generator.

The lock ``locks/speech_audio.json``, not the generator, defines the clips:
espeak-ng versions differ in their output bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cancelbench.fileio import atomic_path

from .paths import DATASETS_DIR

AUDIO_DIR = DATASETS_DIR / "audio"
AUDIO_LOCK = DATASETS_DIR / "locks" / "speech_audio.json"
AUDIO_RATE = 16000
# (clip id, text for espeak-ng, or None for a synthesized tone). Each clip stays
# under 6 s (16-bit mono at 16 kHz: < 200 KB), i.e. one 8 s qwen3a window.
AUDIO_CLIPS: dict[str, str | None] = {
    "speech-short": "Stop the speech engine now.",
    "speech-medium": "Cancelling a speech engine should take one graph node, not a whole synthesis.",
    "tone-3s": None,
}


def _resample_linear(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    n = int(round(len(x) * dst / src))
    return np.interp(np.arange(n) * (src / dst), np.arange(len(x)), x)


def _write_wav16(path: Path, x: np.ndarray, rate: int) -> Path:
    import wave

    pcm = (np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2")
    with atomic_path(path) as tmp, wave.open(str(tmp), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def write_audio_clips(out_dir: Path | None = None) -> dict[str, Path]:
    """Offline generator of ``datasets/audio/*.wav`` (espeak-ng for speech, numpy for the tone).

    Run once and commit the outputs with their lock; espeak-ng versions differ in
    their output bytes, so the lock, not this recipe, defines the clips.
    """
    import subprocess
    import tempfile
    import wave

    out_dir = Path(out_dir or AUDIO_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for clip_id, text in AUDIO_CLIPS.items():
        path = out_dir / f"{clip_id}.wav"
        if text is None:
            t = np.arange(int(AUDIO_RATE * 3.0)) / AUDIO_RATE
            x = 0.3 * np.sin(2 * np.pi * 440.0 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 2.0 * t))
        else:
            with tempfile.TemporaryDirectory() as td:
                raw = Path(td) / "raw.wav"
                subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(raw), text], check=True)
                with wave.open(str(raw), "rb") as w:
                    src = w.getframerate()
                    data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float64) / 32768.0
            x = _resample_linear(data, src, AUDIO_RATE)
        paths[clip_id] = _write_wav16(path, x, AUDIO_RATE)
    return paths


def write_audio_lock(paths: dict[str, Path]) -> Path:
    from .locks import write_lock

    write_lock(AUDIO_LOCK, "speech_audio", paths,
               "espeak-ng 1.51 (en-us, 160 wpm) resampled to 16 kHz mono s16 / numpy tone; datasets/audio_clips.py")
    return AUDIO_LOCK


def audio_clip(clip_id: str, verify: bool = True) -> Path:
    """Path of a committed clip, verified against ``locks/speech_audio.json``."""
    from .locks import verify_against

    path = AUDIO_DIR / f"{clip_id}.wav"
    if verify:
        verify_against(path, AUDIO_LOCK)
    return path

