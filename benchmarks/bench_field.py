"""The field report's table at field scale: Qwen3-TTS-0.6B / Qwen3-ASR-0.6B random-weight models (Q8_0), CPU.

One run, side by side with the numbers the field reports measured
(``../shared/context``: llamadart on an Apple M4 Max, Qwen3-TTS-12Hz-1.7B Q4_K_M /
Qwen3-ASR): per engine phase and mechanism the call duration, in-flight
cancel latency p50 / p99 / max, uninterruptible share and cost ratio (the
helpers of ``bench_speech.py``); the code2wav window duration at 1920 samples
per frame (every window call computes a full 72-frame graph: clip.cpp pads the
codes to ``wav_tfm_swa`` frames); a cancel issued before the engine is active
(plan ``immediate``), latched by the product vs an *emulated* status quo that
drops it (this benchmark only: the cancel is never delivered, the synthesis
runs to the end and the caller discards it, as llamadart did before #596);
and the largest single graph node per clip graph (``bench_speech.node_profile``).

The TTS trials are short (``--frames`` frames, then the final code2wav window),
because one frame costs seconds on a shared 2-core machine; the window, the
phase of interest, is full size in every trial. JSON: benchmarks/results/field.json.

Not through the sweep path (issue 15, item 5: not converted). What still
bypasses it, and why:

* every cancel trial and reference run: ``bench_speech``'s in-process loop
  (engines built here, cancels aimed at a native call in flight by a progress
  predicate; no Ray, no records, no dataset), for the reasons in
  ``bench_speech.py``'s docstring: the sweep aims by time, and at field scale
  (trials of 10-60 s on 2 shared cores, reference runs and cancel trials 2-5x
  apart) time-aimed cancels miss their phase; event-anchored offset plans are
  being added to the planner in parallel;
* the dropped-cancel status quo: *emulated* here (the cancel is never
  delivered and the synthesis runs to its end); no product mechanism drops a
  cancel, so a sweep cannot run it, by design;
* the node profile and the code2wav window timing: calibrations under a
  Python eval callback, not trials.

The one field-scale run through Ray is a plain sweep
(``cancelbench sweep --config datasets/sweeps/field.toml``); its dataset was
not kept (``docs/benchmarks.md``).

    python benchmarks/bench_field.py [--trials 2] [--refs 1] [--frames 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_speech as BS  # noqa: E402  (the speech benchmark's helpers, shared)

from cancelbench.request import TrialRequest
from cancelbench import native  # noqa: E402
from cancelbench.datasets import field  # noqa: E402
from cancelbench.datasets import speech_fixtures as SF  # noqa: E402
from cancelbench.device_agents.engines.stt import SttEngine  # noqa: E402
from cancelbench.device_agents.engines.tts import TtsEngine  # noqa: E402
from cancelbench.fileio import write_json_atomic  # noqa: E402

TTS_TEXT = "Stop the speech now."

# The field reports' numbers (../shared/context/*.txt), quoted with their setup.
FIELD = {
    "setup": "llamadart v0.4.1 on Apple M4 Max (macOS arm64), Qwen3-TTS-12Hz-1.7B-Base Q4_K_M + mmproj Q8_0, "
             "Qwen3-ASR; CPU backend 8 threads / Metal",
    "code2wav_window_ms_cpu": [1003.132, 2404.968],  # in-flight cancels during code2wav, CPU: no check inside
    "code2wav_window_ms_metal": [0.451, 21.641],
    "immediate_dropped_cost_ratio": [0.93, 1.04],    # dropped cancel: 93-104% of the full synthesis that followed
    "immediate_dropped_ms_cpu": [2231, 2565],
    "immediate_dropped_ms_metal": [1245, 1278],
    "immediate_latched_ms_cpu": [0.106, 1.614],      # after the latch fix (#596), CPU
    "set_input_uninterruptible_ms_max": 140,         # api.start = one mtmd_helper_gen_audio_set_input
    "stt_cost_ratio": [0.0004, 0.0031],              # STT cancel cost 0.04-0.31% of a full run
    "decode_ms": {"stt decode_embd": [50.0, 60.6], "text prefill": [257.7, 270.8], "token decode": [25.3, 27.3]},
}


# ----------------------------------------------------------------------------- TTS at field scale

def tts_targets() -> dict:
    """bench_speech's TTS targets, with ``generate`` aimed at any frame (the trials are short)."""
    t = dict(BS.TTS_TARGETS)
    t["generate"] = lambda p: p.phase == "generate" and p.native_call is not None
    return t


def tts_reference(engine: TtsEngine, mech: str, refs: int) -> dict:
    """Uncancelled runs: phase and call durations; the code2wav call is the final (full-size) window."""
    runs, polls, native_ms = [], [], []
    for _ in range(refs):
        ctl = BS._ctl()
        r = engine.run(TrialRequest(input=TTS_TEXT, mechanism=mech), ctl)
        assert r.outcome == "completed", r.outcome
        runs.append(r)
        if mech == "graph_eval":
            polls.append(ctl.token.polls)
            native_ms.append(sum(s["ms"] for s in r.output["steps"]))
    steps = [s for r in runs for s in r.output["steps"]]
    call = {"set_input": statistics.median([r.phase_durations_ms["set_input"] for r in runs]),
            "prompt": statistics.median([s["ms"] for s in steps if s["phase"] == "prompt"]),
            "generate": statistics.median([s["ms"] for s in steps if s["phase"] == "generate" and not s.get("eos")]),
            "code2wav": statistics.median([s["ms"] for s in steps if s["code2wav"]])}
    out = BS._ref_summary(runs, call, polls, native_ms)
    out["n_samples"] = runs[0].output.get("n_samples")
    out["samples_per_frame"] = runs[0].output["samples_per_frame"]
    return out


# ----------------------------------------------------------------------------- immediate cancel

def immediate_latched(run_trial, n: int) -> list[float]:
    """Cancel requested before the engine is active: the product latches it (ms to the terminal state)."""
    out = []
    for _ in range(n):
        ctl = BS._ctl()
        ctl.request(native.now_ns())
        r = run_trial(ctl)
        assert r.outcome == "cancelled", r.outcome
        out.append((r.t_terminal_ns - ctl.received_ns) / 1e6)
    return out


def immediate_dropped(run_trial, n: int) -> list[tuple[float, float]]:
    """Comparison mode only: the status quo that drops the cancel (never delivered to the engine).

    The caller issued a cancel at t0; the synthesis runs to completion and the caller
    discards its result, so the cancel costs t_terminal - t0. As the field report did,
    each dropped cancel is paired with the full synthesis that follows it in the same
    run: returns (cost ms, following synthesis ms) pairs.
    """
    out = []
    for _ in range(n):
        ctl = BS._ctl()
        t0 = native.now_ns()
        r = run_trial(ctl)  # the dropped cancel: ctl.request() is never called
        assert r.outcome == "completed", r.outcome
        nxt = run_trial(BS._ctl())
        assert nxt.outcome == "completed", nxt.outcome
        out.append(((r.t_terminal_ns - t0) / 1e6, (nxt.t_terminal_ns - nxt.t_start_ns) / 1e6))
    return out


def immediate_cells(run_trial, ref_ms: float, n_latched: int, n_dropped: int) -> dict:
    lat = immediate_latched(run_trial, n_latched)
    pairs = immediate_dropped(run_trial, n_dropped) if n_dropped else []
    return {"latched_ms": lat, "dropped_ms": [c for c, _ in pairs], "following_full_ms": [f for _, f in pairs],
            "reference_ms": ref_ms, "latched_cost_ratio_max": max(lat) / ref_ms if lat else None,
            "dropped_cost_ratio": [round(c / f, 3) for c, f in pairs]}


# ----------------------------------------------------------------------------- one engine

def run_engine(kind: str, engine, mechs: list[str], args, rng: random.Random) -> dict:
    clip = str(SF.audio_clip("speech-medium"))
    if kind == "tts":
        def trial(ctl, m):
            return engine.run(TrialRequest(input=TTS_TEXT, mechanism=m), ctl)
        targets = tts_targets()
    else:
        def trial(ctl, m):
            return engine.run(TrialRequest(input=clip, mechanism=m), ctl)
        targets = BS.STT_TARGETS
    out = {"describe": engine.describe(), "mechanisms": {}}
    for mech in mechs:
        t0 = time.monotonic()
        ref = (tts_reference(engine, mech, args.refs) if kind == "tts"
               else BS.stt_reference(engine, mech, args.refs, clip))
        cells = BS.cancel_trials(lambda ctl, m=mech: trial(ctl, m), targets, ref, args.trials, rng)
        out["mechanisms"][mech] = {"reference": ref, "phases": cells, "wall_s": round(time.monotonic() - t0, 1)}
        print(f"{kind} {mech} ({time.monotonic() - t0:.0f} s): {json.dumps(BS.summary_line(cells))}",
              file=sys.stderr, flush=True)
    ref_ms = out["mechanisms"][mechs[0]]["reference"]["reference_ms"]
    n_drop = args.dropped if kind == "tts" else min(1, args.dropped)
    out["immediate"] = immediate_cells(lambda ctl: trial(ctl, mechs[0]), ref_ms, args.trials, n_drop)
    print(f"{kind} immediate: {json.dumps(out['immediate'])}", file=sys.stderr, flush=True)
    return out


# ----------------------------------------------------------------------------- table

def _rng(lo_hi) -> str:
    return f"{lo_hi[0]:g}-{lo_hi[1]:g}"


def _r(x, nd=1):
    return None if x is None else round(x, nd)


def comparison(result: dict) -> list[dict]:
    """The README table: one row per field-report measurement, the field's number next to ours."""
    rows = []
    tts, stt = result["engines"].get("tts"), result["engines"].get("stt")
    if tts:
        m = tts["mechanisms"]
        first = next(iter(m.values()))["reference"]
        c2w = {k: v["phases"].get("code2wav", {}) for k, v in m.items()}
        rows.append({"row": "TTS code2wav window (72 frames, 1920 samples/frame), CPU",
                     "field": f"{_rng(FIELD['code2wav_window_ms_cpu'])} ms (cancel waits for it)",
                     "cancelbench": f"{_r(first['call_ms']['code2wav'], 0)} ms per window call (a full 72-frame "
                                    f"graph, {72 * first['samples_per_frame']:,} samples; {first['n_samples']} "
                                    f"returned for the trial's frames)"})
        for mech, cell in c2w.items():
            lat = cell.get("latency_ms", {})
            rows.append({"row": f"TTS cancel in flight in code2wav, `{mech}` (p50 / max)",
                         "field": f"{_rng(FIELD['code2wav_window_ms_cpu'])} ms (no check inside)",
                         "cancelbench": f"{_r(lat.get('p50'))} / {_r(lat.get('max'))} ms (n={cell.get('n')})"})
        imm = tts["immediate"]
        rows.append({"row": "TTS cancel before the engine is active: status quo (dropped)",
                     "field": f"{_rng(FIELD['immediate_dropped_ms_cpu'])} ms CPU = "
                              f"{_rng([x * 100 for x in FIELD['immediate_dropped_cost_ratio']])}% of a synthesis",
                     "cancelbench": f"{', '.join(f'{d:.0f}' for d in imm['dropped_ms'])} ms = "
                                    f"{', '.join(f'{x * 100:.0f}' for x in imm['dropped_cost_ratio'])}% of the "
                                    "synthesis that followed (emulated)"})
        rows.append({"row": "TTS cancel before the engine is active: latched",
                     "field": f"{_rng(FIELD['immediate_latched_ms_cpu'])} ms CPU (after #596)",
                     "cancelbench": f"max {max(imm['latched_ms']):.3f} ms = "
                                    f"{imm['latched_cost_ratio_max'] * 100:.4f}% of a synthesis"})
        si = {k: v["phases"].get("set_input", {}) for k, v in m.items()}
        rows.append({"row": "TTS set_input (one native call, no check inside)",
                     "field": f"up to ~{FIELD['set_input_uninterruptible_ms_max']} ms",
                     "cancelbench": f"{_r(first['call_ms']['set_input'])} ms; latency max "
                                    + ", ".join(f"`{k}` {_r(c.get('latency_ms', {}).get('max'))}"
                                                for k, c in si.items())})
    if stt:
        imm = stt["immediate"]
        rows.append({"row": "STT cancel cost / full run",
                     "field": f"{_rng([x * 100 for x in FIELD['stt_cost_ratio']])}%",
                     "cancelbench": "in flight p50 " + ", ".join(
                         f"`{k}` {_r((v['phases'].get('decode_embd', {}).get('cost_ratio_p50') or 0) * 100, 2)}%"
                         for k, v in stt["mechanisms"].items())
                         + f"; latched {imm['latched_cost_ratio_max'] * 100:.4f}%"})
        first = next(iter(stt["mechanisms"].values()))["reference"]["call_ms"]
        rows.append({"row": "STT audio-embedding decode call",
                     "field": f"{_rng(FIELD['decode_ms']['stt decode_embd'])} ms (8 threads)",
                     "cancelbench": f"{_r(first['decode_embd'])} ms per batch; encode {_r(first['encode'])} ms"})
    for g in result.get("node_profile", {}).get("graphs", []):
        rows.append({"row": f"largest graph node: {g['graph']}", "field": "not measured",
                     "cancelbench": f"{_r(g['node_ms_max'], 2)} ms (`{g['max_node']}`; {g['nodes_computed']} nodes, "
                                    f"{_r(g['sum_ms'], 0)} ms)"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2, help="cancels per (engine, mechanism, phase)")
    ap.add_argument("--refs", type=int, default=1, help="uncancelled reference runs per (engine, mechanism)")
    ap.add_argument("--frames", type=int, default=1, help="TTS frames per trial before the final window")
    ap.add_argument("--dropped", type=int, default=1, help="emulated dropped-cancel runs (TTS)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--engines", default="tts,stt")
    ap.add_argument("--mechanisms", default="between_calls,abort_callback,graph_eval")
    ap.add_argument("--no-node-profile", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "field.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    mechs = args.mechanisms.split(",")
    t0 = time.time()
    paths = {"tts": field.ensure_set(field.FIELD_TTS.name, progress=True),
             "asr": field.ensure_set(field.FIELD_ASR.name, progress=True)}
    result = {"bench": "field", "field_report": FIELD, "args": vars(args), "load_avg_start": os.getloadavg(),
              "models": {k: {r: p.name for r, p in v.items()} for k, v in paths.items()}, "engines": {}}
    if "tts" in args.engines:
        eng = TtsEngine({"engine": "tts", "model": str(paths["tts"]["model"]), "mmproj": str(paths["tts"]["mmproj"]),
                         "n_threads": args.threads, "n_batch": 32, "max_frames": args.frames})
        result["engines"]["tts"] = run_engine("tts", eng, mechs, args, rng)
        eng.close()
    if "stt" in args.engines:
        eng = SttEngine({"engine": "stt", "model": str(paths["asr"]["model"]), "mmproj": str(paths["asr"]["mmproj"]),
                         "n_threads": args.threads, "n_batch": 256, "chunk_tokens": 16, "max_tokens": 10})
        result["engines"]["stt"] = run_engine("stt", eng, mechs, args, rng)
        eng.close()
    if not args.no_node_profile:
        result["node_profile"] = BS.node_profile(paths, args.threads, str(SF.audio_clip("speech-medium")))
    result["load_avg_end"] = os.getloadavg()
    result["wall_s"] = round(time.time() - t0, 1)
    result["table"] = BS.table(result)
    result["comparison"] = comparison(result)
    write_json_atomic(Path(args.out), result)
    print("\n".join(f"| {r['row']} | {r['field']} | {r['cancelbench']} |" for r in result["comparison"]))
    print(f"wall {result['wall_s']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
