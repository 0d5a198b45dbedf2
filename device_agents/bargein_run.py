"""One barge-in trial on the agent (docs/bargein.md): the microphone, the detector, the
engine's audio for the playback model.

A microphone thread captures in real time: chunk ``i`` (``chunk_ms`` of 16 kHz samples) is
handed to the detector once its last sample has been "captured", at
``t_mic_start + (i + 1) * chunk``, as a capture callback would be. Until the onset the
stream is the assistant's echo and noise; the trial's anchor timer (the cancel plan's due
time) places the user's speech onset at the first sample not yet captured at or after
it. When the detector fires, the same thread issues the cancel through the agent's
delivery path (``deliver``), exactly like agent delivery's timer. The engine hands its
audio over as it makes it (``Progress.audio_listener``); the playback model
(cancelbench.bargein.play) replays it after the trial. The detector, the engine and this
thread share the host's CPUs, as on a phone or laptop.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

from cancelbench import native
from cancelbench.bargein import MIC_RATE, BargeinTrial, outcome_columns, play


class BargeinSession:
    def __init__(self, trial: BargeinTrial, deliver: Callable[[int], None]) -> None:
        from cancelbench.datasets.bargein_clips import clip_set
        from cancelbench.datasets.bargein_mic import mic_stream

        self.trial = trial
        s = trial.settings
        self.detector = _detector(detector_settings(trial))
        self.mic = mic_stream(clip_set(s.clips)[trial.clip.index], trial.noise_seed)
        self.chunk = MIC_RATE * s.chunk_ms // 1000
        self._deliver = deliver
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.audio: list[tuple[int, int]] = []  # (t_ns, samples) as the engine handed them over
        self._audio_total = 0
        self.t0_ns: int | None = None
        self.onset_sample: int | None = None
        self.progress = None  # the engine's Progress (attach)
        self.phase_at_onset: str | None = None
        self.detected_sample: int | None = None
        self.t_detected_ns: int | None = None
        self.late_max_ns = 0
        self.cost_max_ns = 0
        self.chunks = 0
        self._thread = threading.Thread(target=self._run, name="bargein-mic", daemon=True)

    # -- the trial thread -----------------------------------------------------------------
    def start(self) -> None:
        self.t0_ns = native.now_ns()
        self._thread.start()

    def attach(self, progress) -> None:
        """Listen to the engine's audio (``Progress.audio_listener``); read its phase at the onset."""
        self.progress = progress
        progress.audio_listener = self.audio_out

    def audio_out(self, total_samples: int, t_ns: int) -> None:
        """``Progress.audio_listener``: the engine has handed over ``total_samples`` in all."""
        n = total_samples - self._audio_total
        if n > 0:
            self.audio.append((t_ns, n))
            self._audio_total = total_samples

    def finish(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    # -- the anchor timer ---------------------------------------------------------------------
    def onset_due(self, due_ns: int) -> None:
        """The plan's due time: the user starts talking (or the first sample not captured yet)."""
        with self._lock:
            if self.onset_sample is not None or self.trial.clip.user_clip is None:
                return  # noise only: nothing starts (a detector that fires is a false barge-in)
            at = math.ceil((due_ns - self.t0_ns) * MIC_RATE / 1e9)
            # at the due time, or the first sample not captured yet (the clip's lead-in cut short)
            self.onset_sample = max(at, self.mic.produced)
            self.phase_at_onset = None if self.progress is None else self.progress.phase
            self.mic.set_onset(self.onset_sample, cut_lead=True)

    # -- the microphone thread --------------------------------------------------------------
    def _run(self) -> None:
        chunk_ns = self.chunk * 1_000_000_000 // MIC_RATE
        i = 0
        while True:
            due = self.t0_ns + (i + 1) * chunk_ns
            wait = (due - native.now_ns()) / 1e9
            if wait > 0 and self._stop.wait(wait):
                return
            if self._stop.is_set():
                return
            with self._lock:
                pcm = self.mic.chunk(i * self.chunk, self.chunk)
            t_in = native.now_ns()
            self.late_max_ns = max(self.late_max_ns, t_in - due)
            decided = self.detector.feed(pcm)
            t_out = native.now_ns()
            self.cost_max_ns = max(self.cost_max_ns, t_out - t_in)
            self.chunks = i = i + 1
            if decided is not None:
                self.detected_sample, self.t_detected_ns = int(decided), t_out
                self._deliver(native.now_ns())
                return  # the barge-in is handled; the app stops listening for this turn

    # -- the record -----------------------------------------------------------------------------
    def columns(self, sample_rate: int | None, t_terminal_ns: int | None, cancelled: bool) -> dict:
        """The agent's barge-in columns (schema_bargein), the playback model evaluated."""
        clip = self.trial.clip
        onset = self.onset_sample
        t_onset = None if onset is None else self.t0_ns + round(onset * 1e9 / MIC_RATE)
        cols = {"bargein_clip": clip.name, "onset_lead_ms": self.trial.onset_lead_ms, "bargein_snr_db": clip.snr_db, "bargein_echo_db": clip.echo_db,
                "bargein_noise_seed": self.trial.noise_seed, "t_mic_start_ns": self.t0_ns,
                "onset_sample": onset, "t_onset_ns": t_onset, "phase_at_onset": self.phase_at_onset, "detected_sample": self.detected_sample,
                "t_detected_ns": self.t_detected_ns, "detector_fired": self.detected_sample is not None,
                "mic_chunks": self.chunks, "mic_late_max_ms": self.late_max_ns / 1e6,
                "detector_chunk_ms_max": self.cost_max_ns / 1e6, "audio_sample_rate": sample_rate}
        if sample_rate:
            pb = play(self.audio, sample_rate, self.trial.settings.playback_buffer_ms,
                      t_terminal_ns if cancelled else None)
            cols.update(outcome_columns(pb, t_onset, t_terminal_ns))
        return cols


_DETECTORS: dict = {}  # settings -> the agent's detector of those settings (a model loads once)


def _detector(settings):
    """The detector of ``settings``, made once per agent and reset for each trial."""
    from .detectors import make_detector

    det = _DETECTORS.get(settings)
    if det is None:
        det = _DETECTORS[settings] = make_detector(settings)
    det.reset()
    return det


def detector_settings(trial: BargeinTrial):
    """The detector's own settings object from the workload's barge-in settings."""
    from .detectors import of_bargein

    return of_bargein(trial.settings)
