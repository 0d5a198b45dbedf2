"""Barge-in audio (issue 28): the committed clips under ``datasets/audio/bargein/``,
their generator, their lock, the microphone mixer and the named clip sets.

The lock ``locks/bargein_audio.json``, not the generator, defines the clips:
espeak-ng versions differ in their output bytes. Each entry also labels a user
clip's speech onset (``onset_sample``), which :func:`load_clip` recomputes from
the committed bytes, so a label can never drift from its definition
(:func:`speech_onset`). docs/bargein.md, "Interruption clips", says what each
number means.
"""

from __future__ import annotations

import functools
import math
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cancelbench.fileio import atomic_path, write_json_atomic
from cancelbench.inputs import MAX_LOCK_BYTES, load_json_object

from .locks import LockError, sha256_file, verify_against
from .paths import DATASETS_DIR

BARGEIN_DIR = DATASETS_DIR / "audio" / "bargein"
BARGEIN_LOCK = DATASETS_DIR / "locks" / "bargein_audio.json"
RATE = 16000
FRAME = 160  # 10 ms: the frame of the onset and active-level definitions
ONSET_FRACTION = 0.1  # a frame is "active" above 10% (-20 dB) of the clip's loudest frame RMS
LEAD_SAMPLES = 10 * FRAME  # 100 ms kept before a user clip's onset (whole frames: the grid survives trimming)
TAIL_SAMPLES = 15 * FRAME  # 150 ms kept after the last active frame


@dataclass(frozen=True)
class ClipSpec:
    """One espeak-ng utterance. ``role``: ``user`` (an interruption, onset labelled) or
    ``assistant`` (the echo of the assistant's own voice)."""
    role: str
    text: str
    voice: str
    wpm: int


# One home for the clips; variants (+f2, +m3) and speeds make the user voices differ.
CLIPS: dict[str, ClipSpec] = {
    "wait-stop": ClipSpec("user", "Wait, stop.", "en-us", 175),
    "hold-on": ClipSpec("user", "Hold on, that's wrong.", "en-gb", 160),
    "no-listen": ClipSpec("user", "No, no, listen.", "en-us+f3", 170),
    "excuse-me": ClipSpec("user", "Excuse me, one question.", "en-gb-x-rp+f2", 150),
    "actually-stop": ClipSpec("user", "Actually, stop there.", "en-us+m3", 190),
    "assistant-us": ClipSpec("assistant", "Tomorrow will be mostly sunny in the morning, with clouds building "
                             "after lunch and a chance of light rain in the evening. Highs near eighteen "
                             "degrees.", "en-us", 165),
    "assistant-gb": ClipSpec("assistant", "Your train leaves at ten past nine from platform four. It calls at "
                             "Reading and Swindon, and arrives in Bristol "
                             "just before eleven.", "en-gb+f4", 160),
}
USER_CLIPS = tuple(k for k, v in CLIPS.items() if v.role == "user")
ASSISTANT_CLIPS = tuple(k for k, v in CLIPS.items() if v.role == "assistant")


# ----------------------------------------------------------------------------- levels and onset

def frame_rms(x: np.ndarray) -> np.ndarray:
    """RMS of each whole 10 ms frame from sample 0 (a partial last frame is dropped)."""
    n = len(x) // FRAME
    f = np.asarray(x[:n * FRAME], dtype=np.float64).reshape(n, FRAME)
    return np.sqrt(np.mean(f * f, axis=1))


def speech_onset(x: np.ndarray) -> int:
    """The onset: start sample of the first 10 ms frame whose RMS exceeds ONSET_FRACTION of
    the clip's loudest frame RMS (frames from sample 0)."""
    r = frame_rms(x)
    if len(r) == 0 or r.max() <= 0:
        raise ValueError("no speech onset: the clip is silent or shorter than one 10 ms frame")
    return int(np.argmax(r > ONSET_FRACTION * r.max())) * FRAME


def active_rms(x: np.ndarray) -> float:
    """Active speech level: the RMS over the frames above ONSET_FRACTION of the loudest frame
    (pauses left out, so a clip's level does not depend on its silences)."""
    r = frame_rms(x)
    active = r[r > ONSET_FRACTION * r.max()]
    return float(np.sqrt(np.mean(active * active)))


def dbfs(rms: float) -> float:
    """An RMS in int16 units as dB relative to full scale (32768)."""
    return 20.0 * math.log10(rms / 32768.0)


# ----------------------------------------------------------------------------- generator (offline)

def _espeak(spec: ClipSpec) -> np.ndarray:
    import subprocess
    import tempfile

    from .audio_clips import _resample_linear

    with tempfile.TemporaryDirectory() as td:
        raw = Path(td) / "raw.wav"
        subprocess.run(["espeak-ng", "-v", spec.voice, "-s", str(spec.wpm), "-w", str(raw), spec.text], check=True)
        with wave.open(str(raw), "rb") as w:
            src = w.getframerate()
            data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float64)
    return _resample_linear(data, src, RATE)


def _trim(x: np.ndarray, lead: int) -> np.ndarray:
    """Keep ``lead`` samples before the onset (zeros in front if espeak left fewer) and
    TAIL_SAMPLES after the last active frame; peak-normalised to -6 dBFS."""
    onset = speech_onset(x)
    r = frame_rms(x)
    end = (int(np.nonzero(r > ONSET_FRACTION * r.max())[0][-1]) + 1) * FRAME + TAIL_SAMPLES
    x = np.concatenate([np.zeros(max(0, lead - onset)), x[max(0, onset - lead):end]])
    x = np.concatenate([x, np.zeros(max(0, lead + 1 - len(x)))])
    return np.round(x * (16384.0 / np.abs(x).max())).astype("<i2")


def write_bargein_clips(out_dir: Path | None = None) -> dict[str, Path]:
    """Offline generator of ``datasets/audio/bargein/*.wav`` (espeak-ng, 16 kHz mono s16).

    Run once and commit the outputs with their lock (:func:`write_bargein_lock`);
    espeak-ng versions differ in their bytes, so the lock, not this recipe, defines the clips.
    """
    out_dir = Path(out_dir or BARGEIN_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for clip_id, spec in CLIPS.items():
        pcm = _trim(_espeak(spec), LEAD_SAMPLES if spec.role == "user" else 0)
        path = out_dir / f"{clip_id}.wav"
        with atomic_path(path) as tmp, wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(RATE)
            w.writeframes(pcm.tobytes())
        paths[clip_id] = path
    return paths


def write_bargein_lock(paths: dict[str, Path], espeak_version: str = "1.51", lock: Path = BARGEIN_LOCK) -> Path:
    """The lock: size and sha256 per file (datasets/locks.py's format) plus each clip's
    recipe and, for user clips, the onset computed from the written bytes."""
    files = {}
    for clip_id, path in paths.items():
        spec = CLIPS[clip_id]
        entry = {"size": path.stat().st_size, "sha256": sha256_file(path),
                 "source": f"espeak-ng {espeak_version} ({spec.voice}, {spec.wpm} wpm) resampled to 16 kHz "
                           "mono s16; datasets/bargein_clips.py",
                 "role": spec.role, "text": spec.text}
        if spec.role == "user":
            entry["onset_sample"] = speech_onset(_read_pcm(path))
        files[path.name] = entry
    write_json_atomic(Path(lock), {"name": "bargein_audio", "files": files})
    return Path(lock)


# ----------------------------------------------------------------------------- committed clips

@dataclass(frozen=True, eq=False)
class Clip:
    """A verified committed clip: int16 samples at 16 kHz; ``onset`` (sample index in the
    clip) for a user clip, None for an assistant clip."""
    clip_id: str
    pcm: np.ndarray
    onset: int | None


def _read_pcm(path: Path) -> np.ndarray:
    with wave.open(str(path), "rb") as w:
        if (w.getnchannels(), w.getsampwidth(), w.getframerate()) != (1, 2, RATE):
            raise LockError(f"{path}: not 16 kHz mono s16 (channels {w.getnchannels()}, "
                            f"{8 * w.getsampwidth()}-bit, {w.getframerate()} Hz)")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").copy()


@functools.lru_cache(maxsize=32)
def load_clip(clip_id: str, clip_dir: Path = BARGEIN_DIR, lock: Path = BARGEIN_LOCK) -> Clip:
    """A committed clip, verified against its lock (size, sha256) and, for a user clip,
    its labelled onset recomputed from the bytes. Raises LockError."""
    if clip_id not in CLIPS:
        raise ValueError(f"unknown barge-in clip {clip_id!r} (clips: {', '.join(CLIPS)})")
    path = Path(clip_dir) / f"{clip_id}.wav"
    verify_against(path, lock)
    pcm = _read_pcm(path)
    if CLIPS[clip_id].role != "user":
        return Clip(clip_id, pcm, None)
    label = load_json_object(lock, "lock file", MAX_LOCK_BYTES, LockError)["files"][path.name].get("onset_sample")
    if isinstance(label, bool) or not isinstance(label, int) or label != speech_onset(pcm):
        raise LockError(f"{lock}: onset_sample of {path.name} is {label!r}, but the clip's onset "
                        f"(first 10 ms frame over {ONSET_FRACTION:g} x the peak frame RMS) is {speech_onset(pcm)}")
    return Clip(clip_id, pcm, label)


def verify_bargein_clips(clip_dir: Path = BARGEIN_DIR, lock: Path = BARGEIN_LOCK) -> dict[str, Clip]:
    """Every clip of CLIPS checked against the lock; the first mismatch raises LockError."""
    load_clip.cache_clear()  # a check reads the files again
    return {clip_id: load_clip(clip_id, Path(clip_dir), Path(lock)) for clip_id in CLIPS}


# ----------------------------------------------------------------------------- clip sets

NOISE_KINDS = ("pink", "white")


@dataclass(frozen=True)
class ClipSetEntry:
    """One microphone stream of a clip set: a user clip (None: noise only, for false
    barge-ins), the noise's SNR against the reference speech level (None: no noise),
    the echo clip and its level against the reference speech level (None: no echo)."""
    user: str | None
    snr_db: float | None
    echo_level_db: float | None
    echo: str | None = "assistant-us"
    noise: str = "pink"

    @property
    def name(self) -> str:
        def db(v: float | None) -> str:
            return "off" if v is None else f"{v:g}"
        return f"{self.user or 'noise-only'}/snr{db(self.snr_db)}/echo{db(self.echo_level_db)}/{self.noise}"


def _v1() -> tuple[ClipSetEntry, ...]:
    # Every user clip at 3 SNRs with residual echo -20 dB (after a canceller), the two
    # echo clips alternating; then the echo without a canceller (-6 dB) and, for false
    # barge-ins, noise only (with and without echo) at the same SNRs.
    out = [ClipSetEntry(u, snr, -20.0, ASSISTANT_CLIPS[i % 2])
           for snr in (20.0, 10.0, 5.0) for i, u in enumerate(USER_CLIPS)]
    out += [ClipSetEntry(u, 20.0, -6.0, ASSISTANT_CLIPS[i % 2]) for i, u in enumerate(USER_CLIPS[:2])]
    out += [ClipSetEntry(None, snr, -20.0, ASSISTANT_CLIPS[i % 2]) for i, snr in enumerate((20.0, 10.0, 5.0))]
    out += [ClipSetEntry(None, snr, None, None, "white") for snr in (20.0, 5.0)]
    out += [ClipSetEntry(None, 20.0, -6.0, "assistant-gb")]
    return tuple(out)


def _ci() -> tuple[ClipSetEntry, ...]:
    # make test's small barge-in sweep: three clean interruptions, then one noise-only stream
    return tuple(ClipSetEntry(u, 20.0, -20.0, ASSISTANT_CLIPS[i % 2]) for i, u in enumerate(USER_CLIPS[:3])) + (
        ClipSetEntry(None, 20.0, -20.0, ASSISTANT_CLIPS[0]),)


# One home for the named sets: a set's name in a config resolves here.
CLIP_SETS: dict[str, tuple[ClipSetEntry, ...]] = {"bargein-v1": _v1(), "bargein-ci": _ci()}


def clip_set(name: str) -> tuple[ClipSetEntry, ...]:
    if name not in CLIP_SETS:
        raise ValueError(f"unknown clip set {name!r} (sets: {', '.join(CLIP_SETS)})")
    return CLIP_SETS[name]
