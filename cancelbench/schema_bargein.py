"""The barge-in columns of a record (docs/bargein.md): settings, the hops' timestamps and
what the user heard. Kept beside cancelbench.schema, which adds them to the record.

Clock: every ``t_*_ns`` here is the agent's monotonic clock (the microphone stream, the
detector, the engine and the playback model all run on the agent and stamp with it), so
the hops add up exactly; no clock offset enters. Null on rows of other workloads.
"""

from __future__ import annotations

import pyarrow as pa

from .bargein import MIC_RATE

_I32, _I64, _F64, _STR, _BOOL = pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.bool_()

# (name, type, group, doc[, owner]) as in cancelbench.schema._FIELDS
SETTINGS_FIELDS: list[tuple] = [
    ("bargein_detector", _STR, "settings", "barge-in: the detector on the microphone stream (silero | webrtc)"),
    ("detector_threshold", _F64, "settings", "barge-in: silero's speech probability threshold"),
    ("detector_frame_ms", _I32, "settings", "barge-in: the detector's frame, ms"),
    ("detector_min_speech_ms", _I32, "settings", "barge-in: consecutive speech the detector needs before it fires, ms"),
    ("detector_webrtc_mode", _I32, "settings", "barge-in: webrtc's aggressiveness 0-3 (webrtc only)"),
    ("detector_warmup_ms", _I32, "settings", "barge-in: the stream's first ms, in which the detector adapts but "
     "cannot fire"),
    ("mic_chunk_ms", _I32, "settings", "barge-in: microphone chunk handed to the detector, ms (16 kHz mono)"),
    ("playback_buffer_ms", _F64, "settings", "barge-in: the audio device's buffer (output latency) of the playback model, ms"),
    ("bargein_clip_set", _STR, "settings", "barge-in: the interruption clip set (datasets/bargein_clips.py)"),
    ("bargein_aim", _STR, "settings", "barge-in: what the plan's due time places: onset (the user starts talking) | "
     "cancel (the detector's cancel; the onset goes onset_lead_ms earlier)"),
    ("bargein_clip", _STR, "settings", "barge-in: this trial's user utterance, or noise-only (a false-barge-in trial)",
     "agent"),
    ("bargein_snr_db", _F64, "settings", "barge-in: user speech over the noise, dB", "agent"),
    ("bargein_echo_db", _F64, "settings", "barge-in: the assistant's echo against the user's speech, dB", "agent"),
    ("bargein_noise_seed", _I64, "settings", "barge-in: the seed of this trial's noise", "agent"),
]

MEASURED_FIELDS: list[tuple] = [
    ("onset_lead_ms", _F64, "bargein", "aim = cancel: the onset was due this long before the plan's due time for "
     "the cancel (the median detect_ms of this device's last 16 barge-ins of the workload; before any, "
     "min_speech_ms + chunk_ms); t_cancel_scheduled is the onset's due time. 0 for aim = onset"),
    ("t_mic_start_ns", _I64, "bargein", "agent clock: sample 0 of the microphone stream (the trial's start)"),
    ("onset_sample", _I64, "bargein", "the stream sample where the user's speech starts (ground truth; null: "
     "noise-only)"),
    ("t_onset_ns", _I64, "bargein", "agent clock: t_mic_start + onset_sample / 16 kHz, when the user starts talking "
     "(placed at the planned cancel time, t_cancel_scheduled, or the first sample not yet captured)"),
    ("phase_at_onset", _STR, "bargein", "the engine's phase when the user's speech started (what a barge-in plan "
     "aims at; the cancel arrives later, phase_at_receipt)"),
    ("detected_sample", _I64, "bargein", "the stream sample at the end of the frame on which the detector fired"),
    ("t_detected_ns", _I64, "bargein", "agent clock: the detector's decision returned (the cancel is issued next, "
     "t_issued_ns, on the same thread)"),
    ("detector_fired", _BOOL, "bargein", "the detector fired during the trial"),
    ("mic_chunks", _I32, "bargein", "microphone chunks handed to the detector"),
    ("mic_late_max_ms", _F64, "bargein", "the latest a chunk reached the detector after its last sample was "
     "captured (the microphone thread waiting for a CPU), ms"),
    ("detector_chunk_ms_max", _F64, "bargein", "the detector's longest time on one chunk, ms"),
    ("audio_sample_rate", _I32, "bargein", "the engine's audio sample rate"),
    ("audio_samples_handed", _I64, "bargein", "samples the engine handed to playback before it stopped"),
    ("audio_samples_heard", _I64, "bargein", "samples the playback model played"),
    ("t_playback_start_ns", _I64, "bargein", "agent clock: the first sample heard"),
    ("t_last_heard_ns", _I64, "bargein", "agent clock: the end of the last sample heard"),
    ("t_silence_ns", _I64, "bargein", "agent clock: the engine stopped and the device played its last sample (the "
     "later of t_terminal and t_last_heard)"),
    ("audio_after_onset_ms", _F64, "bargein", "audio the user heard from t_onset on: the assistant over their voice"),
    ("detect_ms", _F64, "bargein", "t_detected - t_onset: detection (frames, chunking, the detector's work)",
     "derived"),
    ("detection_error_ms", _F64, "bargein", "(detected_sample - onset_sample) / 16 kHz: the decision's place in the "
     "stream against ground truth (negative: fired before the speech)", "derived"),
    ("issue_ms", _F64, "bargein", "t_issued - t_detected", "derived"),
    ("drain_ms", _F64, "bargein", "t_silence - t_terminal: the playback buffer draining after the stop", "derived"),
    ("onset_to_silence_ms", _F64, "bargein", "t_silence - t_onset = detect + issue + deliver + latency + drain",
     "derived"),
    ("false_barge_in", _BOOL, "bargein", "the detector fired on a noise-only clip, or before the user's speech",
     "derived"),
]

FIELDS = SETTINGS_FIELDS + MEASURED_FIELDS


def derive(row: dict) -> None:
    """The derived barge-in columns from the timestamps (pure; rows of other workloads stay null)."""
    g = row.get
    if g("bargein_detector") is None:
        return

    def ms(a, b):
        return None if a is None or b is None else (a - b) / 1e6

    row["detect_ms"] = ms(g("t_detected_ns"), g("t_onset_ns"))
    onset, detected = g("onset_sample"), g("detected_sample")
    row["detection_error_ms"] = None if onset is None or detected is None else (detected - onset) * 1000.0 / MIC_RATE
    row["issue_ms"] = ms(g("t_issued_ns"), g("t_detected_ns"))
    row["drain_ms"] = ms(g("t_silence_ns"), g("t_terminal_ns"))
    row["onset_to_silence_ms"] = ms(g("t_silence_ns"), g("t_onset_ns"))
    fired = g("detector_fired")
    if fired is not None and g("trial_kind") == "cancel":
        early = detected is not None and onset is not None and detected < onset
        row["false_barge_in"] = bool(fired and (onset is None or early))
