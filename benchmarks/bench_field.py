"""The field reports' table at field scale, through the sweep path.

Random-weight Qwen3-TTS-0.6B / Qwen3-ASR-0.6B models (Q8_0), CPU, side by side
with the numbers the field reports measured (``../shared/context``: llamadart on
an Apple M4 Max, Qwen3-TTS-12Hz-1.7B Q4_K_M / Qwen3-ASR).

**Trials** run through ``harness.run`` (a local Ray, one CPU agent, records in
``benchmarks/results/field/``, ``benchmarks/configs/field.toml``): event-anchored
cancels (plan ``phase``) aimed at TTS ``prompt`` and ``code2wav`` (the 72-frame
window, no check inside) and STT ``encode`` and ``decode_embd``, at least 20 in
flight per (engine, phase, mechanism) cell. Every figure of the table comes from
those records: n, p50 and p90 with distribution-free 95% intervals
(``reports.stats.percentile_interval``; a side n samples cannot bound is open),
the max, the cost ratio, and the share of cancels that landed in their target
phase. ``cancelbench report benchmarks/results/field/`` prints the same cells.

**Calibrations** (in-process, not trials; ``--no-calibrations`` skips them):
a cancel issued before the engine is active, latched by the product, against an
*emulated* status quo that drops it (the cancel is never delivered and the
synthesis runs to its end: no product mechanism drops a cancel, so a sweep
cannot run it), and the largest single graph node per clip graph
(``bench_speech.node_profile``, under a Python eval callback).

    python benchmarks/bench_field.py [--trials N] [--force | --resume] [--note TEXT] [--no-calibrations]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_speech as BS  # noqa: E402  (the speech benchmark's helpers, shared)
import harness  # noqa: E402

from cancelbench import native  # noqa: E402
from cancelbench.datasets import field  # noqa: E402
from cancelbench.datasets import speech_fixtures as SF  # noqa: E402
from cancelbench.reports import stats  # noqa: E402
from cancelbench.request import TrialRequest  # noqa: E402

NAME = "field"
TTS_TEXT = "Stop the speech now."
MIN_IN_FLIGHT = 20  # the floor per (engine, phase, mechanism) cell

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


# ----------------------------------------------------------------------------- cells from records

def _interval(values, p: float) -> dict | None:
    """The nearest-rank percentile and its 95% interval, or None below the report's minimum count."""
    if len(values) < stats.min_samples(p):
        return None
    lo, hi = stats.percentile_interval(values, p)
    return {"value": stats.percentile(values, p), "ci95": [lo, hi]}


def in_flight_cells(out: Path) -> list[dict]:
    """Per (workload, target phase, mechanism, delivery): the cancel trials, how many landed in
    their target phase inside a native call (in flight), and the latency of those (n, p50 / p90
    with 95% intervals, max, cost ratio p50 with its interval)."""
    from cancelbench.sink import read_records

    df = read_records(out)
    c = df[df.trial_kind == "cancel"]
    cells = []
    for (wl, phase, mech, deliv), g in c.groupby(["workload", "target_phase", "mechanism", "delivery"], sort=True):
        landed = g[(g.phase_at_receipt == phase) & g.native_call_at_receipt.notna()]
        ok = landed[(landed.outcome == "cancelled") & landed.latency_ms.notna()]
        lat = sorted(ok.latency_ms.astype(float))
        cost = sorted(ok.cost_ratio.dropna().astype(float))
        cells.append({
            "workload": wl, "phase": phase, "mechanism": mech, "delivery": deliv,
            "cancel_trials": int(len(g)), "landed_in_flight": int(len(landed)),
            "landed_share": round(len(landed) / len(g), 3) if len(g) else None,
            "outcomes": {k: int(v) for k, v in g.outcome.value_counts().items()},
            "n": len(lat), "enough": len(lat) >= MIN_IN_FLIGHT,
            "p50_ms": _interval(lat, 0.5), "p90_ms": _interval(lat, 0.9), "max_ms": lat[-1] if lat else None,
            "cost_ratio_p50": _interval(cost, 0.5),
            "native_calls": sorted(landed.native_call_at_receipt.unique().tolist()),
        })
    return cells


def reference_stays(out: Path) -> dict:
    """Per (workload, mechanism): the reference runs' time in each phase, ms (median over the runs)."""
    import json
    import statistics

    from cancelbench.sink import read_records

    df = read_records(out, columns=["trial_kind", "workload", "mechanism", "outcome", "duration_ms",
                                    "phase_timeline_json"])
    refs = df[(df.trial_kind == "reference") & (df.outcome == "completed")]
    out_: dict = {}
    for (wl, mech), g in refs.groupby(["workload", "mechanism"], sort=True):
        per_phase: dict[str, list[float]] = {}
        for tl in g.phase_timeline_json.dropna():
            stay: dict[str, float] = {}
            for phase, a, b in json.loads(tl):
                stay[phase] = stay.get(phase, 0.0) + (b - a)
            for phase, ms in stay.items():
                per_phase.setdefault(phase, []).append(ms)
        out_[f"{wl}/{mech}"] = {"runs": int(len(g)), "duration_ms": statistics.median(g.duration_ms.astype(float)),
                                "phase_ms": {k: statistics.median(v) for k, v in per_phase.items()}}
    return out_


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


def calibrations(config, n_latched: int, n_dropped: int) -> dict:
    """In-process, not trials: immediate cancels (latched vs emulated dropped) and the node
    profile, with the sweep's own workload settings (threads, batch, use_extra_bufts, ...)."""
    from cancelbench.device_agents.engines.stt import SttEngine
    from cancelbench.device_agents.engines.tts import TtsEngine

    paths = {"tts": field.ensure_set(field.FIELD_TTS.name, progress=True),
             "asr": field.ensure_set(field.FIELD_ASR.name, progress=True)}
    wl = {w.engine: w for w in config.workloads}

    def params(engine: str, kind: str) -> dict:
        p = {**wl[engine].engine_params(), "model": str(paths[kind]["model"]), "mmproj": str(paths[kind]["mmproj"])}
        p["n_gpu_layers"] = p["n_gpu_layers"] or 0  # the agent's device default on a CPU device
        return p

    clip = str(SF.audio_clip("speech-medium"))
    out: dict = {"settings": {k: params(k, kind) for k, kind in (("tts", "tts"), ("stt", "asr"))}}
    tts = TtsEngine(params("tts", "tts"))
    try:
        run = lambda ctl: tts.run(TrialRequest(input=TTS_TEXT, mechanism="between_calls"), ctl)  # noqa: E731
        ref = run(BS._ctl())
        out["tts_immediate"] = immediate_cells(run, (ref.t_terminal_ns - ref.t_start_ns) / 1e6, n_latched, n_dropped)
    finally:
        tts.close()
    stt = SttEngine(params("stt", "asr"))
    try:
        run = lambda ctl: stt.run(TrialRequest(input=clip, mechanism="between_calls"), ctl)  # noqa: E731
        ref = run(BS._ctl())
        out["stt_immediate"] = immediate_cells(run, (ref.t_terminal_ns - ref.t_start_ns) / 1e6, n_latched, 0)
    finally:
        stt.close()
    out["node_profile"] = BS.node_profile(paths, wl["tts"].n_threads, clip, wl["tts"].use_extra_bufts)
    return out


# ----------------------------------------------------------------------------- table

def _rng(lo_hi) -> str:
    return f"{lo_hi[0]:g}-{lo_hi[1]:g}"


def _ms(x) -> str:
    return "-" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}")


def _fig(iv: dict | None, scale: float = 1.0) -> str:
    """p with its 95% interval, times ``scale``: "21 [14-40]"; an open side is shown as "..."."""
    if iv is None:
        return "n too small"
    side = lambda v: "..." if v is None else _ms(v * scale)  # noqa: E731
    lo, hi = iv["ci95"]
    return f"{_ms(iv['value'] * scale)} [{side(lo)}-{side(hi)}]"


def _cell_text(cell: dict) -> str:
    return (f"p50 {_fig(cell['p50_ms'])}, p90 {_fig(cell['p90_ms'])}, max {_ms(cell['max_ms'])} ms "
            f"(n={cell['n']} in flight of {cell['cancel_trials']})")


def comparison(cells: list[dict], stays: dict, cal: dict | None) -> list[dict]:
    """The docs table: one row per field-report measurement, the field's number next to ours."""
    rows = []
    by = {(c["workload"], c["phase"], c["mechanism"]): c for c in cells}
    c2w = sorted({s["phase_ms"].get("code2wav") for k, s in stays.items() if k.startswith("tts-field/")} - {None})
    if c2w:
        rows.append({"row": "TTS code2wav window (72 frames, 1920 samples/frame), CPU",
                     "field": f"{_rng(FIELD['code2wav_window_ms_cpu'])} ms (cancel waits for it)",
                     "cancelbench": f"{_ms(c2w[0])}-{_ms(c2w[-1])} ms in code2wav per reference run "
                                    f"(median of 3 per mechanism)"})
    for (wl, phase, mech), c in sorted(by.items()):
        field_col = {("tts-field", "code2wav"): f"{_rng(FIELD['code2wav_window_ms_cpu'])} ms (no check inside)",
                     ("stt-field", "decode_embd"): f"decode call {_rng(FIELD['decode_ms']['stt decode_embd'])} ms"
                     }.get((wl, phase), "not measured")
        rows.append({"row": f"{wl.split('-')[0].upper()} in-flight cancel in {phase}, `{mech}`",
                     "field": field_col, "cancelbench": _cell_text(c)})
    for (wl, phase, mech), c in sorted(by.items()):
        if wl == "stt-field" and c["cost_ratio_p50"]:
            rows.append({"row": f"STT cancel cost / reference run, in {phase}, `{mech}` (p50)",
                         "field": f"{_rng([x * 100 for x in FIELD['stt_cost_ratio']])}%",
                         "cancelbench": f"{_fig(c['cost_ratio_p50'], scale=100)} %"})
    if cal:
        imm = cal["tts_immediate"]
        rows.append({"row": "TTS cancel before the engine is active: status quo (dropped, emulated)",
                     "field": f"{_rng(FIELD['immediate_dropped_ms_cpu'])} ms CPU = "
                              f"{_rng([x * 100 for x in FIELD['immediate_dropped_cost_ratio']])}% of a synthesis",
                     "cancelbench": ", ".join(f"{d:,.0f} ms = {x * 100:.0f}%" for d, x in
                                              zip(imm["dropped_ms"], imm["dropped_cost_ratio"]))
                                    + " of the synthesis that followed (calibration, not a trial)"})
        for eng in ("tts", "stt"):
            imm = cal[f"{eng}_immediate"]
            rows.append({"row": f"{eng.upper()} cancel before the engine is active: latched",
                         "field": f"{_rng(FIELD['immediate_latched_ms_cpu'])} ms CPU (after #596)",
                         "cancelbench": f"max {max(imm['latched_ms']):.3f} ms of n={len(imm['latched_ms'])} = "
                                        f"{imm['latched_cost_ratio_max'] * 100:.4f}% of a run (calibration)"})
        for g in cal["node_profile"].get("graphs", []):
            rows.append({"row": f"largest graph node: {g['graph']}", "field": "not measured",
                         "cancelbench": f"{_ms(g['node_ms_max'])} ms (`{g['max_node']}`; {g['nodes_computed']} "
                                        f"nodes, {_ms(g['sum_ms'])} ms; calibration)"})
    return rows


def main() -> int:
    ap = harness.arg_parser(NAME, __doc__.splitlines()[0])
    ap.add_argument("--no-calibrations", action="store_true", help="skip the in-process calibrations")
    ap.add_argument("--latched", type=int, default=5, help="calibration: latched immediate cancels per engine")
    ap.add_argument("--dropped", type=int, default=1, help="calibration: emulated dropped-cancel pairs (TTS)")
    args = ap.parse_args()
    out, json_path = harness.paths(NAME, args.out)
    config = harness.config_for(args)
    machine = harness.machine_facts()
    field.ensure_set(field.FIELD_TTS.name, progress=True)  # before Ray starts: the agent finds them generated
    field.ensure_set(field.FIELD_ASR.name, progress=True)
    config, facts = harness.run_or_resummarise("bench_field", args, config, out, json_path)
    summary = harness.summarise(out)
    cells = in_flight_cells(out)
    stays = reference_stays(out)
    short = [f"{c['workload']}/{c['phase']}/{c['mechanism']}: n={c['n']}" for c in cells if not c["enough"]]

    def write(cal: dict | None) -> list[dict]:
        rows = comparison(cells, stays, cal)
        harness.write_json(json_path, name=NAME, config=config, run_facts=facts, summary=summary, machine=machine,
                           extra={"field_report": FIELD, "in_flight_cells": cells, "min_in_flight": MIN_IN_FLIGHT,
                                  "cells_below_min": short, "reference_stays": stays, "calibrations": cal,
                                  "comparison": rows},
                           note=args.note, default_trials=harness.load_config(args.config).trials_per_cell)
        return rows

    rows = write(None)  # the trials' figures are on disk before the calibrations run
    if not args.no_calibrations:
        t0 = time.monotonic()
        cal = calibrations(config, args.latched, args.dropped)
        cal["wall_s"] = round(time.monotonic() - t0, 1)
        cal["load_average_end"] = list(os.getloadavg())
        rows = write(cal)
    print("| measurement | field report | cancelbench |\n|---|---|---|")
    print("\n".join(f"| {r['row']} | {r['field']} | {r['cancelbench']} |" for r in rows))
    if short:
        print(f"bench_field: cells under {MIN_IN_FLIGHT} in-flight cancels: {', '.join(short)}", file=sys.stderr)
    print(f"wrote {out}/ and {json_path}", file=sys.stderr)
    return facts["sweep_exit_code"]


if __name__ == "__main__":
    sys.exit(main())
