"""The microphone of a barge-in trial (issue 28): echo + noise, and the user's
interruption spliced in at an onset chosen while the stream runs.

Pure and deterministic: a sample's value is a function of its index and the
stream's arguments (noise seed, levels, onset) only, never of how the stream was
cut into chunks, so the same arguments give the same bytes. Levels are set
against one reference speech level (REFERENCE_SPEECH_DBFS, active RMS), so a
noise-only stream has the same noise and echo as the speech streams it is
compared with. docs/bargein.md, "Interruption clips", defines each level.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .bargein_clips import NOISE_KINDS, RATE, Clip, ClipSetEntry, active_rms, load_clip

REFERENCE_SPEECH_DBFS = -26.0  # the user's active speech level in the mic (ITU-T P.56's usual -26 dBov)
NOISE_LOOP_SAMPLES = 1 << 19  # 32.8 s of noise, then it repeats (seamlessly: made periodic in the FFT)
NOISE_HIGHPASS_HZ = 20.0  # pink noise has no content below: its level is then steady over a 1 s window
SNR_DB_BOUNDS = (-10.0, 60.0)
ECHO_LEVEL_DB_BOUNDS = (-60.0, 20.0)


@functools.lru_cache(maxsize=8)
def noise_loop(kind: str, seed: int) -> np.ndarray:
    """NOISE_LOOP_SAMPLES of unit-RMS noise from ``np.random.default_rng(seed)``: white
    (Gaussian) or pink (Gaussian shaped to 1/f power above NOISE_HIGHPASS_HZ in the
    frequency domain, so the loop is periodic). Read-only, cached per (kind, seed)."""
    if kind not in NOISE_KINDS:
        raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}, got {kind!r}")
    x = np.random.default_rng(seed).standard_normal(NOISE_LOOP_SAMPLES)
    if kind == "pink":
        f = np.fft.rfftfreq(NOISE_LOOP_SAMPLES, 1.0 / RATE)
        gain = np.zeros_like(f)
        band = f >= NOISE_HIGHPASS_HZ
        gain[band] = 1.0 / np.sqrt(f[band])
        x = np.fft.irfft(np.fft.rfft(x) * gain, NOISE_LOOP_SAMPLES)
    x = x - x.mean()
    x /= math.sqrt(float(np.mean(x * x)))
    x.setflags(write=False)
    return x


def _bounded(value: float | None, what: str, bounds: tuple[float, float]) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not bounds[0] <= value <= bounds[1]:
        raise ValueError(f"{what} must be a number in [{bounds[0]:g}, {bounds[1]:g}] dB or None, got {value!r}")


def _add_looped(out: np.ndarray, buf: np.ndarray, start: int) -> None:
    """out += buf repeated from stream sample 0, for the samples from ``start``."""
    i, pos, n = 0, start % len(buf), len(out)
    while i < n:
        k = min(n - i, len(buf) - pos)
        out[i:i + k] += buf[pos:pos + k]
        i, pos = i + k, 0


class MicStream:
    """One trial's microphone signal, int16 at 16 kHz, produced chunk by chunk.

    ``snr_db``: the reference speech level over the noise RMS (None: no noise).
    ``echo_level_db``: the echo's active level over the reference speech level (None
    with ``echo=None``: no echo); the echo starts at sample 0 and repeats. Until
    :meth:`set_onset` the stream is echo + noise; the user clip is then added so that
    its labelled onset lands on the given sample. No produced sample ever changes: the
    onset must leave room for the clip's lead-in, or (``cut_lead``) the part of the
    lead-in that falls on produced samples is left out.
    """

    def __init__(self, user: Clip | None, echo: Clip | None, *, snr_db: float | None,
                 echo_level_db: float | None, noise: str = "pink", seed: int = 0):
        _bounded(snr_db, "snr_db", SNR_DB_BOUNDS)
        _bounded(echo_level_db, "echo_level_db", ECHO_LEVEL_DB_BOUNDS)
        if (echo is None) != (echo_level_db is None):
            raise ValueError("echo and echo_level_db go together: give both or neither "
                             f"(echo {echo and echo.clip_id!r}, echo_level_db {echo_level_db!r})")
        if user is not None and user.onset is None:
            raise ValueError(f"{user.clip_id} has no labelled onset: not a user clip")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        ref = 32768.0 * 10.0 ** (REFERENCE_SPEECH_DBFS / 20.0)
        self.user = user
        self._noise = None if snr_db is None else (noise_loop(noise, seed) * (ref * 10.0 ** (-snr_db / 20.0))
                                                   ).astype(np.float32)
        self._echo = None if echo is None else self._scaled(echo, ref * 10.0 ** (echo_level_db / 20.0))
        self._user = None if user is None else self._scaled(user, ref)
        self._user_start: int | None = None
        self._user_from = 0  # the first stream sample the user clip may touch (a cut lead-in starts later)
        self._produced = 0

    @staticmethod
    def _scaled(clip: Clip, target_rms: float) -> np.ndarray:
        return (clip.pcm.astype(np.float64) * (target_rms / active_rms(clip.pcm))).astype(np.float32)

    @property
    def produced(self) -> int:
        """One past the highest sample index produced so far."""
        return self._produced

    @property
    def onset(self) -> int | None:
        """The ground truth: the stream sample where the user's speech onset lands, once set."""
        return None if self._user_start is None else self._user_start + self.user.onset

    def earliest_onset(self) -> int:
        """The first onset :meth:`set_onset` accepts now (the clip's lead-in must fit after
        the produced samples)."""
        if self.user is None:
            raise ValueError("a noise-only stream has no onset")
        return self._produced + self.user.onset

    def set_onset(self, sample_index: int, cut_lead: bool = False) -> None:
        """Splice the user clip in so that its onset lands on ``sample_index`` (once).
        ``cut_lead``: a live stream's onset placed at a time (barge-in, device_agents/bargein_run.py):
        the part of the clip's lead-in that would fall on samples already produced is dropped,
        so the onset can land on the first sample not produced yet."""
        if self.user is None:
            raise ValueError("a noise-only stream has no onset")
        if self._user_start is not None:
            raise ValueError(f"the onset is already set (at sample {self.onset})")
        if isinstance(sample_index, bool) or not isinstance(sample_index, (int, np.integer)):
            raise ValueError(f"onset must be a sample index (int), got {sample_index!r}")
        if cut_lead and sample_index < self._produced:
            raise ValueError(f"onset {sample_index} is too early: samples up to {self._produced} were produced "
                             f"(earliest onset now, lead-in cut: {self._produced})")
        if not cut_lead and sample_index < self.earliest_onset():
            raise ValueError(f"onset {sample_index} is too early: the clip starts {self.user.onset} samples "
                             f"before its onset and samples up to {self._produced} were produced "
                             f"(earliest onset now: {self.earliest_onset()})")
        self._user_start = int(sample_index) - self.user.onset
        self._user_from = max(self._user_start, self._produced)

    def chunk(self, start: int, n: int) -> np.ndarray:
        """Samples ``start .. start + n - 1`` of the stream (int16)."""
        if start < 0 or n < 0:
            raise ValueError(f"chunk needs start >= 0 and n >= 0, got start {start}, n {n}")
        out = np.zeros(n, np.float32)
        # One order of addition for every sample (noise, echo, user): chunking cannot change a sum.
        for buf in (self._noise, self._echo):
            if buf is not None:
                _add_looped(out, buf, start)
        if self._user_start is not None:
            us = self._user_start
            a, b = max(start, self._user_from), min(start + n, us + len(self._user))
            if a < b:
                out[a - start:b - start] += self._user[a - us:b - us]
        self._produced = max(self._produced, start + n)
        np.rint(out, out=out)
        np.clip(out, -32768.0, 32767.0, out=out)
        return out.astype(np.int16)


def mic_stream(entry: ClipSetEntry, seed: int = 0) -> MicStream:
    """The stream of a clip-set entry, its clips loaded and verified against the lock."""
    return MicStream(None if entry.user is None else load_clip(entry.user),
                     None if entry.echo is None else load_clip(entry.echo),
                     snr_db=entry.snr_db, echo_level_db=entry.echo_level_db, noise=entry.noise, seed=seed)
