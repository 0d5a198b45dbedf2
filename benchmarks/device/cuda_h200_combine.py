"""Fold what one device call of cuda_h200_run.sh returned (bench_text.json, bench_speech.json,
steps.log, logs.tgz) into benchmarks/results/cuda_h200.json:

    BUILD_DIR=FILES_OF_THE_BUILD_CALL NOTES='["..."]' \
        python cuda_h200_combine.py FILES_DIR OUT_JSON ['{"device": "status"}']

``derived_first_poll`` splits each text cell's trials at the point where the abort reader's
stops land (the first native-reader poll of the decode), from the per-trial rows."""

import os
import json
import re
import sys
import tarfile
from pathlib import Path

src, out = Path(sys.argv[1]), Path(sys.argv[2])
status = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}


def load(name):
    p = src / name
    return json.loads(p.read_text()) if p.exists() else None


logs = {}
if (src / "logs.tgz").exists():
    with tarfile.open(src / "logs.tgz") as t:
        for m in t.getmembers():
            if m.isfile():
                logs[Path(m.name).name] = t.extractfile(m).read().decode("utf-8", "replace")
steps = (src / "steps.log").read_text() if (src / "steps.log").exists() else logs.get("steps.log", "")
machine = logs.get("machine.txt", "")
smi = [ln for ln in machine.splitlines() if "H200" in ln or "NVIDIA" in ln]
nvcc = next((ln for ln in machine.splitlines() if "release" in ln), None)
# the wheel may have been built by an earlier call of the same warm machine: BUILD_DIR=its files
build_dir = Path(os.environ.get("BUILD_DIR", src))
build_steps = (build_dir / "steps.log").read_text() if (build_dir / "steps.log").exists() else steps
build_s = re.search(r"build rc=(\d+) in (\d+) s", build_steps)

text = load("bench_text.json") or {}
speech = load("bench_speech.json") or {}
cuda = text.get("cuda_text", {})
cells = {}
for label, c in cuda.items():
    if not isinstance(c, dict) or "residue_ms" not in c:
        if isinstance(c, dict) and "error" in c:
            cells[label] = {"error": c["error"]}
        continue
    ratio = c.get("residue_over_rest_p50")
    if label == "chunked":
        verdict = "stops at the next chunk boundary (each chunk decode runs to its end)"
    elif ratio is None:
        verdict = "unknown"
    else:
        verdict = "stopped in flight" if ratio < 0.5 else "ran to its end"
    cells[label] = {
        "n_in_flight": c["residue_ms"]["n"], "trials": c["trials"],
        "residue_ms_p50": c["residue_ms"]["p50"], "residue_ms_max": c["residue_ms"]["max"],
        "latency_ms_p50": c["latency_ms"]["p50"], "latency_ms_max": c["latency_ms"]["max"],
        "prefill_ms": c["prefill_ms"], "residue_over_rest_p50": ratio,
        "reader_saw": c.get("reader_saw"), "decode_rc2": c.get("decode_rc2"), "decode": verdict,
        **({"bound_ms": c["bound_ms"], "bound_met": c["met"], "slice_us": c["slice_us"]} if "bound_ms" in c else {}),
    }
# Derived (from the per-trial rows): where in llama_decode a cancel arrived. The abort reader's
# stops (decode_rc 2) all land at one point ~first_poll_ms into the decode: the first place a
# native reader is asked at all (host-side preparation of the 4000-token ubatch runs before it).
# Cancels before that point wait for it whatever the mechanism; the slice bound is about the graph.
def _stop_points(c):
    P = c["prefill_ms"]
    return [(P - t["rest_ms"], t["residue_ms"], t) for t in c.get("per_trial", [])]


ab = cuda.get("abort_callback", {})
rc2_stops = sorted(e + r for e, r, t in _stop_points(ab) if t["decode_rc"] == 2) if "per_trial" in ab else []
first_poll = rc2_stops[len(rc2_stops) // 2] if rc2_stops else None
split = {}
if first_poll is not None:
    for label, c in cuda.items():
        if not isinstance(c, dict) or "per_trial" not in c:
            continue
        before = [r for e, r, _ in _stop_points(c) if e < first_poll]
        after = [r for e, r, _ in _stop_points(c) if e >= first_poll]
        d = {"n_before_first_poll": len(before), "n_in_graph": len(after),
             "residue_ms_in_graph_p50": sorted(after)[(len(after) - 1) // 2] if after else None,
             "residue_ms_in_graph_max": max(after, default=None),
             "residue_ms_before_first_poll_max": max(before, default=None)}
        if "bound_ms" in c:
            d["bound_met_in_graph"] = d["residue_ms_in_graph_max"] is not None and d["residue_ms_in_graph_max"] <= c["bound_ms"]
        if label == "abort_callback":
            d["stopped_before_first_poll"] = sum(1 for e, r, t in _stop_points(c) if e < first_poll and t["decode_rc"] == 2)
            d["stopped_in_graph"] = sum(1 for e, r, t in _stop_points(c) if e >= first_poll and t["decode_rc"] == 2)
        split[label] = d

result = {
    "bench": "cuda_h200",
    "what": "in-flight prefill cancel residue per mechanism on the CUDA backend, every layer offloaded "
            "(benchmarks/bench_graph_eval.py --device cuda:0), one device call",
    "machine": {"nvidia_smi": smi, "nvcc": nvcc, "machine_txt": machine,
                "ggml_devices": cuda.get("facts", {}).get("ggml_devices"),
                "llama_cpp_build": cuda.get("facts", {}).get("llama_cpp_build")},
    "build": {"llama_cpp_python": "0.3.36 (sdist repacked without models/docs/tests/examples)",
              "cmake_args": logs.get("cmake_args.txt", "").strip(),
              "build_rc": int(build_s.group(1)) if build_s else None,
              "build_s": int(build_s.group(2)) if build_s else None,
              "flash_attention": "not compiled (GGML_CUDA_FA=OFF): llama.cpp's auto mode falls back to "
                                 "mul_mat + soft_max attention"},
    "model": cuda.get("model"), "model_file": cuda.get("model_file"), "model_bytes": cuda.get("model_bytes"),
    "model_lock": cuda.get("model_lock"),
    "prompt_tokens": cuda.get("prompt_tokens"), "n_gpu_layers": cuda.get("n_gpu_layers"),
    "chunk_tokens": cuda.get("chunk_tokens"), "n_threads": cuda.get("n_threads"),
    "largest_node_ms": cuda.get("node_ms"), "default_slice_us": text.get("default_slice_us"),
    "trials_per_cell": text.get("device_trials"),
    "cells": cells,
    "derived_first_poll": {
        "first_poll_ms": first_poll, "abort_rc2_stop_points_ms": [round(x, 1) for x in rc2_stops],
        "note": "stop point = arrival (prefill_ms - rest_ms) + residue, per trial. Every abort_callback stop "
                "(decode_rc 2) lands ~first_poll_ms into the decode; graph_eval's large residues are the cancels "
                "that arrived before that point. Split per cell at first_poll_ms.",
        "cells": split},
    "speech": {k: v for k, v in (speech.get("cuda_speech") or {}).items()},
    "device_status": status,
    "steps_log": steps.splitlines(),
    "build_call_steps_log": build_steps.splitlines() if build_dir != src else None,
    "notes": json.loads(os.environ.get("NOTES", "[]")),
    "table": text.get("table"),
    "raw": {"bench_text": text, "bench_speech": speech},
}
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps(cells, indent=1))
