"""Barge-in (docs/bargein.md): the user talks over the assistant; how long until it is quiet.

Pure data and arithmetic, shared by the driver (a workload's ``[workload.bargein]`` table,
checked once), the agent (what one trial streams and detects) and the reports:

* :class:`BargeinSettings`: the detector, the microphone's chunking, the playback buffer
  and the interruption clip set of a workload; every one is a record column.
* :class:`BargeinTrial`: what the agent needs for one trial: the settings, the clip drawn
  for it and the noise seed.
* :func:`play`: the playback model. A sample the engine has handed over at ``a`` is heard
  no earlier than ``a + buffer`` (the device's buffer; output latency) and after the
  sample before it (real time, one device clock). When the engine stops (a cancelled
  trial), the app drops what it has not written to the device yet; what the device holds
  (the next ``buffer`` ms) still plays. Nothing here sleeps: the model is evaluated after
  the trial from the engine's audio events, on the agent's clock.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

MIC_RATE = 16000  # the microphone stream: 16 kHz mono
CHUNK_MS = (10, 32)  # what a capture callback hands over at a time, ms (bounds)
MAX_BUFFER_MS = 2000.0
DETECTORS = ("silero", "webrtc")
AIMS = ("onset", "cancel")


class BargeinError(ValueError):
    """A bad [workload.bargein] table (one line)."""


# Per detector kind: its frame (ms), its decision setting and the speech it needs before it
# fires, when the config does not say (device_agents/detectors.py checks every combination).
DETECTOR_DEFAULTS = {"silero": {"frame_ms": 32, "threshold": 0.5, "min_speech_ms": 64},
                     "webrtc": {"frame_ms": 30, "webrtc_mode": 2, "min_speech_ms": 90, "warmup_ms": 300}}


@dataclass(frozen=True)
class BargeinSettings:
    """A workload's barge-in settings (``[workload.bargein]``), all recorded per trial."""

    detector: str = "silero"  # silero | webrtc (device_agents/detectors.py)
    frame_ms: int = 32  # the detector's frame (silero: 32 at 16 kHz; webrtc: 10, 20 or 30)
    min_speech_ms: int = 64  # consecutive speech before the detector fires (whole frames)
    threshold: float | None = 0.5  # silero only: speech probability at or above which a frame is speech
    webrtc_mode: int | None = None  # webrtc only: its aggressiveness 0-3
    # frames at a stream's start that adapt the detector but cannot decide (WebRTC VAD calls the
    # first 90-120 ms of any fresh stream speech: without it, every trial is a false barge-in)
    warmup_ms: int = 0
    chunk_ms: int = 20  # microphone chunk handed to the detector
    playback_buffer_ms: float = 100.0  # the audio device's buffer (output latency)
    clips: str = "bargein-v1"  # the interruption clip set (datasets/bargein_clips.py)
    # What the plan's due time places: the user's onset ("onset"), or the detector's cancel
    # ("cancel": the onset goes the detector's measured latency earlier, so a barge-in's cancel
    # lands in the target phase, e.g. inside a code2wav window; a hand-back-anchored plan needed)
    aim: str = "onset"

    def columns(self) -> dict:
        """The settings' record columns (schema group ``bargein``)."""
        return {"bargein_detector": self.detector, "detector_threshold": self.threshold,
                "detector_frame_ms": self.frame_ms, "detector_min_speech_ms": self.min_speech_ms,
                "detector_webrtc_mode": self.webrtc_mode, "detector_warmup_ms": self.warmup_ms,
                "mic_chunk_ms": self.chunk_ms,
                "playback_buffer_ms": self.playback_buffer_ms, "bargein_clip_set": self.clips, "bargein_aim": self.aim}

    def to_json(self) -> dict:
        return asdict(self)


def parse_settings(raw: object, where: str) -> BargeinSettings:
    """``[workload.bargein]``: known keys of the right types, the detector's defaults filled
    in; BargeinError otherwise. The detector checks its own combination (frames it takes,
    bounds) in device_agents/detectors.DetectorSettings, also before anything runs."""
    if not isinstance(raw, dict):
        raise BargeinError(f"{where} must be a table, got {raw!r:.80}")
    known = set(BargeinSettings.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BargeinError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    kind = raw.get("detector", "silero")
    if kind not in DETECTORS:
        raise BargeinError(f"{where}.detector must be one of {', '.join(DETECTORS)}, got {kind!r:.40}")
    defaults = {f.name: f.default for f in BargeinSettings.__dataclass_fields__.values()}
    kw = {**defaults, "threshold": None, "webrtc_mode": None, **DETECTOR_DEFAULTS[kind], **raw}
    for key in ("frame_ms", "min_speech_ms", "chunk_ms", "webrtc_mode", "warmup_ms"):
        if kw[key] is not None and (isinstance(kw[key], bool) or not isinstance(kw[key], int)):
            raise BargeinError(f"{where}.{key} must be an integer, got {kw[key]!r:.40}")
    if not CHUNK_MS[0] <= kw["chunk_ms"] <= CHUNK_MS[1]:
        raise BargeinError(f"{where}.chunk_ms must be in [{CHUNK_MS[0]}, {CHUNK_MS[1]}], got {kw['chunk_ms']}")
    for key, hi in (("threshold", 1.0), ("playback_buffer_ms", MAX_BUFFER_MS)):
        v = kw[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= hi):
            raise BargeinError(f"{where}.{key} must be a number in [0, {hi:g}], got {v!r:.40}")
        kw[key] = None if v is None else float(v)
    if kw["aim"] not in AIMS:
        raise BargeinError(f"{where}.aim must be one of {', '.join(AIMS)}, got {kw['aim']!r:.40}")
    if not isinstance(kw["clips"], str) or not kw["clips"]:
        raise BargeinError(f"{where}.clips must be a clip set name, got {kw['clips']!r:.40}")
    return BargeinSettings(**kw)


@dataclass(frozen=True)
class ClipEntry:
    """One microphone stream of a clip set (datasets/bargein_clips.py, its ``index``-th): the
    user's utterance (None: noise only), the noise under the speech (SNR, dB; None: none) and
    the assistant's echo against it (dB; None: none). ``name`` says all of it."""

    index: int
    name: str
    user_clip: str | None
    snr_db: float | None
    echo_db: float | None


@dataclass(frozen=True)
class BargeinTrial:
    """What the agent needs for one barge-in trial (part of its TrialRequest)."""

    settings: BargeinSettings
    clip: ClipEntry
    noise_seed: int
    onset_lead_ms: float = 0.0  # aim = cancel: the onset is due this long before the plan's due time


def trial_of(settings: BargeinSettings, entries: list[ClipEntry], trial_id: str, seed: int,
             onset_lead_ms: float = 0.0) -> BargeinTrial:
    """The clip of a cancel trial: round robin over the set by the trial's number in its cell
    (``...<cell>.0007``), so every cell gets the same mix; the noise seed from the sweep's seed
    and the trial id (a resumed trial streams the same samples)."""
    tail = trial_id.rsplit(".", 1)[-1]
    k = int(tail) if tail.isdigit() else zlib.crc32(trial_id.encode())
    noise_seed = (zlib.crc32(trial_id.encode()) ^ (seed & 0xFFFFFFFF)) & 0x7FFFFFFF
    return BargeinTrial(settings, entries[k % len(entries)], noise_seed, onset_lead_ms)


# -- the playback model -------------------------------------------------------------------
@dataclass(frozen=True)
class Playback:
    """What the user heard of one trial (agent ns); None where nothing played."""

    t_first_heard_ns: int | None  # the first sample's start
    t_last_heard_ns: int | None  # the end of the last sample heard
    heard: tuple[tuple[int, int], ...]  # the intervals (start, end) the device played
    samples_handed: int  # what the engine handed over in all
    samples_heard: int


def play(chunks: list[tuple[int, int]], sample_rate: int, buffer_ms: float, t_stop_ns: int | None) -> Playback:
    """The playback model (module doc). ``chunks``: (t_ns, n_samples) as the engine handed
    them over, in order; ``t_stop_ns``: when the app stopped writing (the engine's stop of a
    cancelled trial), None: everything handed over plays."""
    buffer_ns = int(buffer_ms * 1e6)
    cut = None if t_stop_ns is None else t_stop_ns + buffer_ns  # the device holds the next buffer ms
    heard: list[tuple[int, int]] = []
    end = None
    handed = played = 0
    for t_ns, n in chunks:
        handed += n
        if n <= 0 or (t_stop_ns is not None and t_ns > t_stop_ns):
            continue
        start = t_ns + buffer_ns if end is None else max(t_ns + buffer_ns, end)
        stop = start + round(n * 1e9 / sample_rate)
        if cut is not None:
            stop = min(stop, cut)
        if stop <= start:
            break
        played += min(n, round((stop - start) * sample_rate / 1e9))
        if heard and heard[-1][1] == start:
            heard[-1] = (heard[-1][0], stop)
        else:
            heard.append((start, stop))
        end = stop
    return Playback(heard[0][0] if heard else None, heard[-1][1] if heard else None, tuple(heard), handed, played)


def heard_ms(pb: Playback, t_from_ns: int) -> float:
    """How much audio the user heard from ``t_from_ns`` on (ms): over their own voice, after an onset."""
    return sum(max(0, e - max(s, t_from_ns)) for s, e in pb.heard) / 1e6


def outcome_columns(pb: Playback, t_onset_ns: int | None, t_terminal_ns: int | None) -> dict:
    """The barge-in result columns of a trial (schema group ``bargein``). Silence: the engine
    has stopped and the device has played its last sample, the later of the two, so the hops
    onset -> detected -> issued -> received -> stopped -> silence add up to onset_to_silence."""
    cols = {"t_playback_start_ns": pb.t_first_heard_ns, "t_last_heard_ns": pb.t_last_heard_ns,
            "audio_samples_handed": pb.samples_handed, "audio_samples_heard": pb.samples_heard}
    if t_terminal_ns is not None:
        cols["t_silence_ns"] = max(t_terminal_ns, pb.t_last_heard_ns or t_terminal_ns)
    if t_onset_ns is not None:
        cols["audio_after_onset_ms"] = heard_ms(pb, t_onset_ns)
    return cols
