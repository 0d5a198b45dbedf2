"""Barge-in, from the user's first word to silence, through the sweep path.

Runs ``benchmarks/configs/bargein.toml`` (a local Ray, CPU and Vulkan agents, token auth,
loopback): the barge-in TTS fixture (``qwen3tts-bargein``: 1920 samples, 80 ms of audio, per
codec frame, the real codec's rate, so the engine outruns real time and the playback buffer
fills) streams into the playback model while the microphone stream
(the bargein-v1 clips, 20 ms chunks) feeds Silero VAD; the detector's decision issues
the cancel; between_calls against graph_eval; a 40 ms and a 200 ms playback buffer as two
workloads, and the 40 ms one again with the engine out of process (the built-in TTS through the
engine protocol: its audio events feed the playback model). Writes ``benchmarks/results/bargein/`` (a dataset) and ``bargein.json``:

* ``summary``: the report's cells (``cancelbench report benchmarks/results/bargein/``);
* ``bargein``: the report's Barge-in section (onset to silence, its hops, what was heard);
* ``checks`` (from the records, each naming its rows):
  - ``hops``: every silenced barge-in has all six stamps, and detect + issue + deliver +
    engine stop + drain equals onset_to_silence (one clock: the agent's, uncertainty 0);
  - ``code2wav``: the engine's stop of barge-ins whose cancel reached a code2wav window,
    per device and mechanism, against the window (the references' shortest code2wav call)
    and the report's 50 ms bound;
  - ``buffer``: per device and mechanism, the 40 ms and the 200 ms buffer side by side:
    drain, onset to silence, audio heard after the onset, and the drain's share;
  - ``detection``: per device, detection against ground truth in the sweep, false barge-ins
    on the noise-only streams;
  - ``rate``: per device and buffer, whether the engine outran real time, from the playback
    model's stamps: the audio of one hand-over (a 72-frame code2wav window) and its samples
    per frame, the first audio's time from the trial's start, and the audio handed over by
    the stop against the time it took (above 1: faster than real time, the buffer fills);
  - ``process``: per device and mechanism, the 40 ms buffer in the agent's process and out of
    it side by side: onset to silence, the engine stop (``latency_ms``, the protocol's hop
    inside it), detection; what the protocol adds at p50;
* ``detectors``: each detector setting offline on the labelled clips (no TTS running:
  ``cancelbench.device_agents.detectors.evaluate``), latency and false barge-ins.

    python benchmarks/bench_bargein.py [--trials 30] [--out DIR] [--force] [--note TEXT] [--resummarise]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

NAME = "bargein"
BOUND_MS = 50.0  # the report's default latency bound
STAMPS = ["t_onset_ns", "t_detected_ns", "t_issued_ns", "t_received_ns", "t_terminal_ns", "t_silence_ns"]
HOPS = ["detect_ms", "issue_ms", "deliver_ms", "latency_ms", "drain_ms"]
DETECTOR_SETTINGS = [  # (kind, frame_ms, min_speech_ms, threshold, webrtc_mode, warmup_ms)
    ("silero", 32, 32, 0.5, None, 0), ("silero", 32, 64, 0.5, None, 0), ("silero", 32, 96, 0.5, None, 0),
    ("silero", 32, 64, 0.8, None, 0), ("webrtc", 30, 90, None, 2, 300), ("webrtc", 10, 100, None, 3, 300),
]


def _pct(values, p: float) -> float | None:
    """The report's nearest-rank percentile (reports.stats.percentile) of the non-null values."""
    from cancelbench.reports import stats

    return stats.percentile([x for x in values if x == x], p)


def silenced_of(df):
    return df[(df.trial_kind == "cancel") & (df.outcome == "cancelled") & (df.detector_fired == True)  # noqa: E712
              & (df.false_barge_in == False)]  # noqa: E712


def hop_check(df) -> dict:
    s = silenced_of(df)
    missing = int(s[STAMPS].isna().any(axis=1).sum())
    err = (s[HOPS].sum(axis=1) - s.onset_to_silence_ms).abs()
    return {"rows": "silenced barge-ins (cancelled, detector fired on the speech)", "n": len(s),
            "missing_stamps": missing, "max_abs_sum_error_ms": float(err.max()) if len(s) else None,
            "clock_uncertainty_ns_max": int(s.clock_uncertainty_ns.max()) if len(s) else None,
            "met": bool(len(s) and missing == 0 and err.max() <= 1e-6)}


def code2wav_check(df, refs: dict) -> list[dict]:
    s = silenced_of(df)
    out = []
    for (device, mech), g in s.groupby([s.host + "/" + s.device, "mechanism"]):
        c = g[g.phase_at_receipt == "code2wav"]
        windows = [json.loads(r["phase_step_ms_json"] or "{}").get("code2wav") for r in refs.get(device, [])]
        windows = [w for w in windows if w]
        stop = c.latency_ms.tolist()
        out.append({"device": device, "mechanism": mech, "n_in_code2wav": len(c), "n_silenced": len(g),
                    "stop_p50_ms": _pct(stop, 0.5), "stop_max_ms": max(stop) if stop else None,
                    "code2wav_call_ms_reference": min(windows) if windows else None, "bound_ms": BOUND_MS,
                    "within_bound": (max(stop) <= BOUND_MS) if stop else None})
    return out


def buffer_check(df) -> list[dict]:
    s = silenced_of(df)
    out = []
    for (device, wl, mech, buf), g in s.groupby([s.host + "/" + s.device, "workload", "mechanism",
                                                 "playback_buffer_ms"]):
        total, drain = _pct(g.onset_to_silence_ms, 0.5), _pct(g.drain_ms, 0.5)
        playing = g[g.audio_after_onset_ms > 0]  # the assistant was audible after the onset
        out.append({"device": device, "workload": wl, "mechanism": mech, "playback_buffer_ms": buf, "n": len(g),
                    "n_audible_after_onset": len(playing),
                    "audible_drain_p50_ms": _pct(playing.drain_ms, 0.5),
                    "audible_heard_after_onset_p50_ms": _pct(playing.audio_after_onset_ms, 0.5),
                    "audible_onset_to_silence_p50_ms": _pct(playing.onset_to_silence_ms, 0.5),
                    "onset_to_silence_p50_ms": total, "drain_p50_ms": drain,
                    "heard_after_onset_p50_ms": _pct(g.audio_after_onset_ms, 0.5),
                    "heard_after_onset_max_ms": float(g.audio_after_onset_ms.max()),
                    "drain_share_of_p50": (drain / total) if total and drain is not None else None})
    return out


def detection_check(df) -> list[dict]:
    c = df[df.trial_kind == "cancel"]
    out = []
    for device, g in c.groupby(c.host + "/" + c.device):
        speech, noise = g[g.onset_sample.notna()], g[g.bargein_clip.str.startswith("noise-only")]
        fired = speech[speech.detector_fired == True]  # noqa: E712
        out.append({"device": device, "n_speech": len(speech), "n_fired": len(fired),
                    "n_early": int((fired.detected_sample < fired.onset_sample).sum()),
                    "detection_error_p50_ms": _pct(fired.detection_error_ms, 0.5),
                    "detection_error_p90_ms": _pct(fired.detection_error_ms, 0.9),
                    "detect_wall_p50_ms": _pct(fired.detect_ms, 0.5),
                    "n_noise_only": len(noise), "false_on_noise_only": int(noise.detector_fired.sum())})
    return out


def rate_check(df) -> list[dict]:
    from cancelbench.datasets.qwen_common import C2W_WINDOW_FRAMES

    c = df[(df.trial_kind == "cancel") & (df.audio_samples_handed > 0) & df.t_playback_start_ns.notna()]
    out = []
    for (device, wl, buf), g in c.groupby([c.host + "/" + c.device, "workload", "playback_buffer_ms"]):
        rate = float(g.audio_sample_rate.iloc[0])
        window = int(g.audio_samples_handed.min())  # a cancelled trial hands over whole windows only
        first_ms = (g.t_playback_start_ns - buf * 1e6 - g.t_start_ns) / 1e6  # playback starts a buffer after it
        audio_s = g.audio_samples_handed / rate
        elapsed_s = (g.t_terminal_ns - g.t_start_ns) / 1e9
        out.append({"device": device, "workload": wl, "playback_buffer_ms": buf, "n_with_audio": len(g),
                    "sample_rate": rate,
                    "samples_per_handover_min": window, "samples_per_frame": window / C2W_WINDOW_FRAMES,
                    "audio_ms_per_frame": 1000.0 * window / C2W_WINDOW_FRAMES / rate,
                    "first_audio_ms_p50": _pct(first_ms, 0.5),
                    "audio_over_elapsed_p50": _pct((audio_s / elapsed_s).tolist(), 0.5),
                    "faster_than_real_time": bool((audio_s > elapsed_s).all())})
    return out


IN_PROCESS, OUT_OF_PROCESS = "tts-buffer-40ms", "tts-out-buffer-40ms"


def process_check(df) -> list[dict]:
    """The 40 ms buffer in process and out of process, per device and mechanism: p50s side by side."""
    s = silenced_of(df)
    out = []
    for (device, mech), g in s.groupby([s.host + "/" + s.device, "mechanism"]):
        row = {"device": device, "mechanism": mech}
        for w in (IN_PROCESS, OUT_OF_PROCESS):
            c = g[g.workload == w]
            row[w] = {"n": len(c), "onset_to_silence_p50_ms": _pct(c.onset_to_silence_ms, 0.5),
                      "latency_p50_ms": _pct(c.latency_ms, 0.5), "detect_p50_ms": _pct(c.detect_ms, 0.5),
                      "drain_p50_ms": _pct(c.drain_ms, 0.5), "protocol_hop_p50_ms": _pct(c.protocol_hop_ms, 0.5)}
        a, b = row[IN_PROCESS], row[OUT_OF_PROCESS]
        row["added_p50_ms"] = {k: (b[k] - a[k]) if a[k] is not None and b[k] is not None else None
                               for k in ("onset_to_silence_p50_ms", "latency_p50_ms")}
        out.append(row)
    return out


def offline_detectors() -> list[dict]:
    from cancelbench.datasets.bargein_clips import clip_set
    from cancelbench.device_agents.detectors import DetectorSettings, evaluate

    out = []
    for kind, frame, min_ms, thr, mode, warm in DETECTOR_SETTINGS:
        s = DetectorSettings(kind=kind, frame_ms=frame, min_speech_ms=min_ms, threshold=thr, webrtc_mode=mode,
                             warmup_ms=warm)
        out.append({"name": s.name, "warmup_ms": warm, **evaluate(s, clip_set("bargein-v1"), 20)["summary"]})
    return out


def main() -> int:
    from cancelbench.reports import build_report
    from cancelbench.sink import read_records

    args = harness.arg_parser(NAME, __doc__.splitlines()[0]).parse_args()
    out, json_path = harness.paths(NAME, args.out)
    config = harness.config_for(args)
    machine = harness.machine_facts()
    config, facts = harness.run_or_resummarise("bench_bargein", args, config, out, json_path)
    summary = harness.summarise(out)
    report = build_report([out])
    df = read_records(out)
    refs = {}
    for r in df[df.trial_kind == "reference"].to_dict("records"):
        refs.setdefault(f"{r['host']}/{r['device']}", []).append(r)
    checks = {"hops": hop_check(df), "code2wav": code2wav_check(df, refs), "buffer": buffer_check(df),
              "detection": detection_check(df), "rate": rate_check(df), "process": process_check(df)}
    extra = {"bargein": {"cells": [c.__dict__ for c in report.bargein[0]],
                         "stops_by_phase": [p.__dict__ for p in report.bargein[1]]},
             "checks": checks, "detectors": offline_detectors()}
    harness.write_json(json_path, name=NAME, config=config, run_facts=facts, summary=summary, machine=machine,
                       extra=extra, note=args.note, default_trials=harness.load_config(args.config).trials_per_cell)
    print(json.dumps(checks, indent=1, default=str), file=sys.stderr)
    print(f"wrote {out}/ and {json_path}", file=sys.stderr)
    return facts["sweep_exit_code"]


if __name__ == "__main__":
    sys.exit(main())
