"""Speech cancel benchmark: per engine, phase and mechanism, how long a cancel
received *inside* a native call takes to reach the terminal state.

For every (engine, mechanism) it first runs uncancelled reference trials (phase
durations, per-call durations, total duration), then cancel trials whose cancel
is issued from another thread at a uniformly random point inside a native call
of the target phase. Per cell it reports:

* ``latency_ms`` p50 / p99 / max — t_terminal − t_received (the record's latency_ms);
* ``residue_ms`` p50 / max — how long the native call in flight kept running after
  the cancel arrived (t_native_returned − t_received);
* ``call_ms`` — the median duration of that native call in the reference runs (for
  ``set_input`` / ``preprocess``: the whole phase, an upper bound of the call), and
  ``phase_ms`` — the phase's reference duration;
* ``uninterruptible_share`` — mean residue / (call_ms / 2): a cancel at a uniform
  point of a call that cannot be stopped waits half the call on average (share 1);
  a call stopped at the next graph node waits about one node (share ≈ 0);
* ``cost_ratio`` p50 — latency / the mechanism's reference duration;
* ``node_ms_mean`` — the mean graph-node time of the fixture, measured in graph_eval
  reference runs (native reader polls per second of native time), the target
  unit for the best mechanism's residue.

JSON goes to stdout and to benchmarks/results/speech.json.

Not through the sweep path (issue 15, item 5: not converted yet). What still
bypasses it, and why:

* every trial: engines are built in this process (``TtsEngine``/``SttEngine``)
  and run from this file's loop, with no Ray, no agent, no records, no
  dataset; its percentiles use ``reports.stats.percentile`` but not the
  report's minimum-sample rule, so ``cancelbench report`` cannot reproduce
  ``speech.json``;
* the cancel is aimed at an *event*: a thread waits until the engine's
  progress shows the target phase *and* a native call in flight, then fires
  at a random point of that call's reference duration. The sweep's offset
  plans aim by *time* from the hand-back (``phase``: a fraction of the
  reference run's time in the phase), so on a shared host a large share of
  them miss the call (``docs/benchmarks.md``, field scale: 5 of 10 TTS
  cancels landed after the trial ended). Event-anchored offset plans are
  being added to the planner (orchestrator/plan.py) in parallel; this
  benchmark should become a config of ``benchmarks/harness.py`` once they land;
* ``call_ms`` and ``uninterruptible_share`` need per-native-call durations of
  the reference runs; records carry per-phase durations only
  (``phase_durations_json``), not per call;
* ``node_ms_mean`` and the node profile (``node_profile``) time graph nodes
  under a Python eval callback: calibrations, not trials.

A sweep of the same fixtures does run through the sweep path:
``cancelbench sweep --config datasets/sweeps/speech.toml``.

    python benchmarks/bench_speech.py [--trials 8] [--refs 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelbench.request import TrialRequest
from cancelbench import native  # noqa: E402
from cancelbench.datasets import speech_fixtures as SF  # noqa: E402
from cancelbench.device_agents.engines.base import CancelControl, Progress  # noqa: E402
from cancelbench.device_agents.engines.stt import SttEngine  # noqa: E402
from cancelbench.device_agents.engines.tts import WINDOW_FRAMES, TtsEngine  # noqa: E402
from cancelbench.reports.stats import percentile  # noqa: E402

MECHANISMS = ("between_calls", "abort_callback", "chunked", "graph_eval")
TTS_TEXT = "Cancel this sentence while it is being spoken."


def cancel_at(ctl: CancelControl, predicate, delay_s: float, timeout_s: float = 120.0) -> threading.Thread:
    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(ctl.progress):
            if time.monotonic() > deadline:
                return
            time.sleep(0.0002)
        if delay_s > 0:
            time.sleep(delay_s)
        ctl.request(native.now_ns())

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def _ctl() -> CancelControl:
    return CancelControl(native.CancelToken(), Progress())


# ----------------------------------------------------------------------------- per-engine plumbing

def tts_reference(engine: TtsEngine, mech: str, refs: int) -> dict:
    runs, polls, native_ms = [], [], []
    for _ in range(refs):
        ctl = _ctl()
        r = engine.run(TrialRequest(input=TTS_TEXT, mechanism=mech), ctl)
        assert r.outcome == "completed"
        runs.append(r)
        if mech == "graph_eval":
            polls.append(ctl.token.polls)
            native_ms.append(sum(s["ms"] for s in r.output["steps"]))
    steps = [s for r in runs for s in r.output["steps"]]
    call = {
        "prompt": statistics.median([s["ms"] for s in steps if s["phase"] == "prompt"]),
        "generate": statistics.median([s["ms"] for s in steps if s["phase"] == "generate" and not s.get("eos")]),
        "code2wav": statistics.median([s["ms"] for s in steps if s["code2wav"] and not s.get("final")]),
    }
    call["set_input"] = statistics.median([r.phase_durations_ms["set_input"] for r in runs])
    return _ref_summary(runs, call, polls, native_ms)


def stt_reference(engine: SttEngine, mech: str, refs: int, clip: str) -> dict:
    runs, polls, native_ms = [], [], []
    for _ in range(refs):
        ctl = _ctl()
        r = engine.run(TrialRequest(input=clip, mechanism=mech), ctl)
        assert r.outcome == "completed"
        runs.append(r)
        if mech == "graph_eval":
            polls.append(ctl.token.polls)
            native_ms.append(sum(v for k, v in r.phase_durations_ms.items() if k != "preprocess"))
    audio = [c for r in runs for c in r.output["chunks"] if c["type"] == "audio"]
    step = engine.chunk_tokens if mech == "chunked" else engine.n_batch
    n_calls = max(1, -(-audio[0]["n_tokens"] // step))
    gen = [r.phase_durations_ms["generate"] / max(1, len(r.output["tokens"])) for r in runs]
    call = {
        "encode": statistics.median([c["encode_ms"] for c in audio]),
        "decode_embd": statistics.median([c["decode_ms"] / n_calls for c in audio]),
        "generate": statistics.median(gen),
        "preprocess": statistics.median([r.phase_durations_ms["preprocess"] for r in runs]),
    }
    return _ref_summary(runs, call, polls, native_ms)


def _ref_summary(runs, call, polls, native_ms) -> dict:
    total = statistics.median([(r.t_terminal_ns - r.t_start_ns) / 1e6 for r in runs])
    phases = {}
    for r in runs:
        for k, v in r.phase_durations_ms.items():
            phases.setdefault(k, []).append(v)
    out = {"reference_ms": total, "phase_ms": {k: statistics.median(v) for k, v in phases.items()},
           "call_ms": call, "n_refs": len(runs)}
    if polls and sum(native_ms) > 0:
        out["node_ms_mean"] = sum(native_ms) / max(1, sum(polls))  # incl. skipped (non-selected) nodes
    return out


TTS_TARGETS = {
    "set_input": lambda p: p.phase == "set_input" and p.native_call is not None,
    "prompt": lambda p: p.phase == "prompt" and p.native_call is not None,
    "generate": None,  # built per trial (a random frame)
    "code2wav": lambda p: p.heavy_graph == "code2wav" and p.native_call is not None,
}
STT_TARGETS = {
    "preprocess": lambda p: p.phase == "preprocess" and p.native_call == "mtmd_tokenize",
    "encode": lambda p: p.phase == "encode" and p.native_call == "mtmd_encode_chunk",
    "decode_embd": lambda p: p.phase == "decode_embd" and p.native_call is not None,
    "generate": None,
}


def cancel_trials(run_trial, targets: dict, ref: dict, trials: int, rng: random.Random) -> dict:
    cells = {}
    for phase, pred in targets.items():
        lat, res, ratio, in_phase, n_inflight, observed = [], [], [], 0, 0, 0
        for _ in range(trials):
            if pred is None:
                k = rng.randint(2, 8)
                p = (lambda k: lambda pr: pr.phase == "generate" and pr.native_call is not None and
                     (pr.frames_generated or pr.tokens_generated or 0) >= k)(k)
            else:
                p = pred
            delay = rng.uniform(0.0, 0.9) * ref["call_ms"][phase] / 1e3
            ctl = _ctl()
            th = cancel_at(ctl, p, delay)
            r = run_trial(ctl)
            th.join(10)
            if r.outcome != "cancelled" or ctl.received_ns is None:
                continue
            latency = (r.t_terminal_ns - ctl.received_ns) / 1e6
            if ctl.at_receipt.get("phase_at_receipt") == phase:
                in_phase += 1
                lat.append(latency)
                ratio.append(latency / ref["reference_ms"])
                if ctl.at_receipt.get("native_call_at_receipt") and ctl.native_returned_ns:
                    n_inflight += 1
                    res.append((ctl.native_returned_ns - ctl.received_ns) / 1e6)
                if ctl.token.seen_ns:
                    observed += 1
        call = ref["call_ms"][phase]
        share = (statistics.mean(res) / (call / 2)) if res and call > 0 else None
        cells[phase] = {
            "n": in_phase, "n_in_flight": n_inflight, "n_seen_natively": observed,
            "latency_ms": {"p50": percentile(lat, .5), "p99": percentile(lat, .99), "max": max(lat) if lat else None},
            "residue_ms": {"p50": percentile(res, .5), "max": max(res) if res else None},
            "call_ms": call, "phase_ms": ref["phase_ms"].get(phase),
            "uninterruptible_share": None if share is None else round(min(1.0, share), 3),
            "cost_ratio_p50": percentile(ratio, .5),
        }
    return cells


# ----------------------------------------------------------------------------- node profile

class _GgmlTensor:  # lazily built ctypes view of struct ggml_tensor (ggml.h, this vendored version)
    cls = None

    @classmethod
    def get(cls):
        import ctypes
        if cls.cls is None:
            class T(ctypes.Structure):
                _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                            ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                            ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                            ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]
            cls.cls = T
        return cls.cls


def node_profile(paths: dict, threads: int, clip: str, use_extra_bufts: bool = True) -> dict:
    """Per-node compute time of the clip graphs llama's abort callback does not reach.

    A *Python* cb_eval (diagnostic only, never used by the engines) times every node
    between its "ask" and its "done" callback; nodes not flagged COMPUTE (the other
    branch of the qwen3tts_gen graph) are skipped. The max node time is the floor
    of what any graph-level stop can achieve.
    """
    import ctypes

    import llama_cpp
    from llama_cpp import mtmd_cpp as M

    from cancelbench.device_agents.engines import llama_runtime as rt
    from cancelbench.device_agents.engines import mtmd_ext as X

    T = _GgmlTensor.get()
    rec: list[tuple[float, str]] = []
    start = [0.0]

    def cb(t, ask, _ud):
        if ask:
            start[0] = time.perf_counter()
            return True
        tt = ctypes.cast(t, ctypes.POINTER(T)).contents
        if tt.flags & 16:  # GGML_TENSOR_FLAG_COMPUTE
            rec.append(((time.perf_counter() - start[0]) * 1e3, tt.name.decode(errors="replace")))
        return True

    CB = llama_cpp.ggml_backend_sched_eval_callback(cb)

    def ctx_for(kind):
        model = rt.load_model(paths[kind]["model"], 0, use_extra_bufts)
        prm = M.mtmd_context_params_default()
        prm.use_gpu = False
        prm.n_threads = threads
        prm.warmup = False
        prm.cb_eval = CB
        return model, M.mtmd_init_from_file(str(paths[kind]["mmproj"]).encode(), model, prm)

    def summarize(label):
        ms = sorted(x for x, _ in rec)
        top = max(rec) if rec else (None, None)
        out = {"graph": label, "nodes_computed": len(ms), "sum_ms": round(sum(ms), 2),
               "node_ms_p50": percentile(ms, .5), "node_ms_p99": percentile(ms, .99), "node_ms_max": top[0], "max_node": top[1]}
        rec.clear()
        return out

    X.quiet_mtmd_logs()
    res = []
    model, mctx = ctx_for("tts")
    n_embd = llama_cpp.llama_model_n_embd(model)
    emb = (ctypes.c_float * n_embd)()
    for label, typ in (("code_predictor (GEN_CODE)", M.MTMD_GEN_PROCESS_TYPE_GEN_CODE),
                       ("code2wav window (GEN_WAV)", M.MTMD_GEN_PROCESS_TYPE_GEN_WAV)):
        for rep in range(2):  # the first call allocates; keep the second
            inp = M.mtmd_gen_inp_default(mctx)
            inp.type = typ
            inp.seed = 5
            codes = (ctypes.c_int32 * (WINDOW_FRAMES * 16))(*([5] * (WINDOW_FRAMES * 16)))
            if typ == M.MTMD_GEN_PROCESS_TYPE_GEN_CODE:
                inp.code0 = 5
                inp.embd = emb
            else:
                inp.codes = codes
                inp.n_codes = WINDOW_FRAMES * 16
            out = M.mtmd_gen_out()
            rec.clear()
            M.mtmd_gen_audio_process(mctx, ctypes.byref(inp), ctypes.byref(out))
        res.append(summarize(label))
    M.mtmd_free(mctx)
    llama_cpp.llama_model_free(model)

    model, mctx = ctx_for("asr")
    x = SF_read(clip)
    audio = (ctypes.c_float * len(x)).from_buffer_copy(x.tobytes())
    bm = M.mtmd_bitmap_init_from_audio(len(x), audio)
    chunks = M.mtmd_input_chunks_init()
    text = f"{M.mtmd_default_marker().decode()}".encode()
    it = M.mtmd_input_text(text, len(text), False, True)
    M.mtmd_tokenize(mctx, chunks, ctypes.byref(it), (ctypes.c_void_p * 1)(bm), 1)
    for i in range(M.mtmd_input_chunks_size(chunks)):
        ch = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(ch) == M.MTMD_INPUT_CHUNK_TYPE_AUDIO:
            for rep in range(2):
                rec.clear()
                M.mtmd_encode_chunk(mctx, ch)
            res.append(summarize(f"qwen3a clip encode ({Path(clip).name})"))
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bm)
    M.mtmd_free(mctx)
    llama_cpp.llama_model_free(model)
    return {"threads": threads, "graphs": res}


def SF_read(clip: str):
    from cancelbench.device_agents.engines import mtmd_ext as X
    return X.read_wav_mono_f32(Path(clip), 16000)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--refs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--engines", default="tts,stt")
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS))
    ap.add_argument("--no-node-profile", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speech.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    paths = SF.ensure_speech_fixtures()
    mechs = args.mechanisms.split(",")
    result = {"bench": "speech", "trials": args.trials, "refs": args.refs, "n_threads": args.threads,
              "fixtures": {k: {r: p.name for r, p in v.items()} for k, v in paths.items()}, "engines": {}}
    t0 = time.time()
    if "tts" in args.engines:
        wl = {"engine": "tts", "model": str(paths["tts"]["model"]), "mmproj": str(paths["tts"]["mmproj"]),
              "n_threads": args.threads, "n_batch": 16, "chunk_tokens": 4, "max_frames": WINDOW_FRAMES + 8}
        eng = TtsEngine(wl)
        out = {"describe": eng.describe(), "mechanisms": {}}
        for mech in mechs:
            ref = tts_reference(eng, mech, args.refs)
            cells = cancel_trials(lambda ctl, m=mech: eng.run(TrialRequest(input=TTS_TEXT, mechanism=m), ctl),
                                  TTS_TARGETS, ref, args.trials, rng)
            out["mechanisms"][mech] = {"reference": ref, "phases": cells}
            print(f"tts {mech}: {json.dumps(summary_line(cells))}", file=sys.stderr)
        eng.close()
        result["engines"]["tts"] = out
    if "stt" in args.engines:
        clip = str(SF.audio_clip("speech-medium"))
        wl = {"engine": "stt", "model": str(paths["asr"]["model"]), "mmproj": str(paths["asr"]["mmproj"]),
              "n_threads": args.threads, "n_batch": 256, "chunk_tokens": 8, "max_tokens": 12}
        eng = SttEngine(wl)
        out = {"describe": eng.describe(), "input": Path(clip).name, "mechanisms": {}}
        for mech in mechs:
            ref = stt_reference(eng, mech, args.refs, clip)
            cells = cancel_trials(lambda ctl, m=mech: eng.run(TrialRequest(input=clip, mechanism=m), ctl),
                                  STT_TARGETS, ref, args.trials, rng)
            out["mechanisms"][mech] = {"reference": ref, "phases": cells}
            print(f"stt {mech}: {json.dumps(summary_line(cells))}", file=sys.stderr)
        eng.close()
        result["engines"]["stt"] = out
    if not args.no_node_profile:
        result["node_profile"] = node_profile(paths, args.threads, str(SF.audio_clip("speech-medium")))
        print(json.dumps(result["node_profile"]), file=sys.stderr)
    result["wall_s"] = round(time.time() - t0, 1)
    result["table"] = table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(json.dumps(result, indent=2, default=float))
    print("\n".join(result["table"]), file=sys.stderr)


def summary_line(cells: dict) -> dict:
    return {ph: {"p50": _r(c["latency_ms"]["p50"]), "max": _r(c["latency_ms"]["max"]),
                 "call": _r(c["call_ms"]), "share": c["uninterruptible_share"]} for ph, c in cells.items()}


def _r(x):
    return None if x is None else round(x, 2)


def table(result: dict) -> list[str]:
    rows = ["engine | phase | mechanism | n | latency p50 / p99 / max ms | residue max ms | call ms | phase ms "
            "| uninterruptible | cost ratio p50 | ref ms",
            "---|---|---|---|---|---|---|---|---|---|---"]
    for eng, e in result["engines"].items():
        for mech, m in e["mechanisms"].items():
            for phase, c in m["phases"].items():
                lat = c["latency_ms"]
                rows.append(f"{eng} | {phase} | {mech} | {c['n']} | {_r(lat['p50'])} / {_r(lat['p99'])} / "
                            f"{_r(lat['max'])} | {_r(c['residue_ms']['max'])} | {_r(c['call_ms'])} | "
                            f"{_r(c['phase_ms'])} | {c['uninterruptible_share']} | {_r(c['cost_ratio_p50'])} | "
                            f"{_r(m['reference']['reference_ms'])}")
    return rows


if __name__ == "__main__":
    main()
