"""graph_eval benchmark: the work-sliced native eval reader, side by side in one run.

Through the sweep path (``benchmarks/harness.py``; the default part, ``cpu``):

* ``cpu`` — ``benchmarks/configs/graph_eval_cpu.toml`` run by ``run_sweep`` into
  ``benchmarks/results/graph_eval_cpu/`` with its summary in
  ``benchmarks/results/graph_eval_cpu.json``: text-llama-57m prefill on the CPU
  backend, one workload per eval-reader slice (0 / 500 / 2000 / 8000 us; the
  slice is the ``graph_slice_us`` settings column), ``between_calls``,
  ``abort_callback`` and ``graph_eval`` in each. Latency cells are the
  report's (``cancelbench report benchmarks/results/graph_eval_cpu/``). From the
  same records, under ``derived``: the residue (``return_ms`` of the cancelled
  prefill trials, same nearest-rank statistics) and the uncancelled overhead of
  ``graph_eval`` against ``between_calls`` per slice, from the reference runs'
  ``duration_ms`` (``schema.reference_run`` of each, the lower median). The
  bound target (residue <= slice + 2 x largest node) is checked on the
  report's latency max (latency >= residue, so it is the stricter check); the
  largest node is a calibration, not a trial: one uncancelled slice-0 run in
  this process (``max_range_ns``: one node + its sync), stored beside it.

Still outside the sweep path (their own loops in this file, results in
``benchmarks/results/graph_eval.json``, which the docs date):

* ``vulkan`` — Vulkan on lavapipe (a child process: the device must be made
  visible before ggml loads), text-qwen3-14m prefill, every layer on the
  device: ``between_calls``, ``chunked`` and ``graph_eval``. Not converted: a
  lavapipe sweep needs a multi-node Ray cluster whose node advertises the
  Vulkan device (``tests/test_cluster.py`` builds one), and one lavapipe
  trial takes seconds on 2 cores.
* ``speech`` — ``graph_eval`` residue inside the TTS/STT clip graphs, and
  ``overhead`` — uncancelled overhead per slice for TTS and STT (interleaved
  pairs). Not converted for lack of time: they need cancels aimed at the
  heavy-graph phases (a phase-plan sweep of the speech fixtures, as
  ``datasets/sweeps/speech.toml``) and minutes of trials per slice.
* ``--device cuda:0`` (or any ``<backend>:<index>`` of device_agents/backends.py) —
  the device path, kept as it ran on the CUDA (H200) machine, which had no
  Ray: a child process with that device's environment (``backend_env``), a
  bigger text model (default the field-scale text-qwen3-0.6b-field, Q8_0) with
  every layer on the device and a long prompt (``--prompt-tokens``, one
  decode), all four mechanisms, ``graph_eval`` at ``--device-slices``; per cell
  also ``reader_saw``, ``decode_rc2`` and residue / the rest of the reference
  decode. Its cells are built from ``TrialRequest`` directly, not a sweep.

* ``--part graphs`` — residue per graph under load, into
  ``benchmarks/results/graph_eval_load.json`` (``--graphs-out``): text decode
  (text-llama-57m, one token's ``llama_decode``), the TTS code predictor step
  (``generate``) and the step that also runs code2wav, the STT encode, each on
  one CPU thread with ``--busy-loops`` (default 2) ``python -c 'while True:
  pass'`` processes started and stopped by the benchmark. The largest node of a
  graph is the median over ``--node-profiles`` (default 5) uncancelled slice-0
  runs of the longest range inside that graph's step calls (one node + its
  sync; ``take_max_range_ns`` around each call), in wall time without and with
  the busy loops and in the graph thread's CPU time. Per graph: slice, largest
  node (median and profiles), residue p50/p99/max and n, the bound slice + 2 x
  the largest node and met, the cost model's own check in CPU time, the load.

Latency = t_terminal - t_received; residue = t_native_returned - t_received.
Percentiles are the reports' nearest-rank ones.

    python benchmarks/bench_graph_eval.py [--sweep-trials 12] [--sweep-out DIR] [--force]
    nice -n 10 python benchmarks/bench_graph_eval.py --skip cpu [--trials 12] [--vk-trials 5] [--pairs 5]
    python benchmarks/bench_graph_eval.py --device cuda:0 [--prompt-tokens 4096] [--device-trials 15]
    python benchmarks/bench_graph_eval.py --part graphs [--busy-loops 2] [--node-profiles 5] [--trials 12]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# llama_cpp (and the ggml backends it links) before anything imports pandas: on the CUDA
# machine a pandas/pyarrow loaded first made llama_model_load_from_file segfault
import llama_cpp  # noqa: E402, F401, I001

from bench_speech import (STT_TARGETS, TTS_TARGETS, TTS_TEXT, _ctl, cancel_at, cancel_trials,  # noqa: E402
                          stt_reference, tts_reference)

from cancelbench.request import TrialRequest
from cancelbench import native  # noqa: E402
from cancelbench.datasets import speech_fixtures as SF  # noqa: E402
from cancelbench.datasets.fixtures import ensure_text_fixture  # noqa: E402
from cancelbench.device_agents.engines.base import CancelControl, Progress  # noqa: E402
from cancelbench.device_agents.engines.text import TextEngine  # noqa: E402
from cancelbench.reports.stats import percentile  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog while the engine keeps talking about cancel latency."
DEFAULT = native.DEFAULT_GRAPH_SLICE_US
CPU_SLICES = (0, 500, DEFAULT, 8000)


def dist(values) -> dict:
    vals = [float(v) for v in values if v is not None]
    return {"n": len(vals), "p50": percentile(vals, 0.5), "p99": percentile(vals, 0.99), "max": max(vals, default=None)}


def text_trial(eng: TextEngine, mech: str, ctl=None):
    ctl = ctl or _ctl()
    return eng.run(TrialRequest(input=PROMPT, mechanism=mech), ctl), ctl


def largest_node_ms(eng: TextEngine) -> float:
    """One node + its sync, at most: an uncancelled run with the reader syncing after every node."""
    text_trial(eng, "graph_eval")  # warm: a first run on a GPU backend also builds its pipelines
    keep, eng.graph_slice_us = eng.graph_slice_us, 0
    _, ctl = text_trial(eng, "graph_eval")
    eng.graph_slice_us = keep
    return ctl.token.max_range_ns / 1e6


def prefill_cancels(eng: TextEngine, mech: str, trials: int, rng: random.Random, refs: int = 2,
                    warm: int = 0, detail: bool = False) -> dict:
    """Reference prefill duration, then cancels at uniform points inside the prefill decode.
    ``warm`` uncancelled runs first (a GPU backend's first decode also sets itself up)."""
    for _ in range(warm):
        text_trial(eng, mech)
    runs = [text_trial(eng, mech)[0] for _ in range(refs)]
    prefill_ms = statistics.median(r.phase_durations_ms["prefill"] for r in runs)
    lat, res, ranges, ratios, per = [], [], [], [], []
    saw = rc2 = 0
    in_decode = lambda p: p.phase == "prefill" and p.native_call == "llama_decode"  # noqa: E731
    for _ in range(trials):
        ctl = _ctl()
        th = cancel_at(ctl, in_decode, rng.uniform(0.05, 0.9) * prefill_ms / 1e3)
        r, ctl = text_trial(eng, mech, ctl)
        th.join(30)
        if r.outcome != "cancelled" or ctl.native_returned_ns is None:
            continue  # the cancel missed the decode in flight
        residue = (ctl.native_returned_ns - ctl.received_ns) / 1e6
        lat.append((r.t_terminal_ns - ctl.received_ns) / 1e6)
        res.append(residue)
        ranges.append(ctl.token.max_range_ns / 1e6)
        seen = ctl.token.seen_ns != 0
        saw += seen
        rc2 += r.decode_rc == 2
        # the rest of the (one-decode) reference prefill at the cancel: residue ~ rest = not stopped
        rest = prefill_ms - (ctl.received_ns - r.t_start_ns) / 1e6
        if mech != "chunked" and rest > 0.5:
            ratios.append(residue / rest)
        per.append({"residue_ms": round(residue, 3), "rest_ms": round(rest, 3), "reader_saw": seen,
                    "decode_rc": r.decode_rc})
    return {"prefill_ms": prefill_ms, "latency_ms": dist(lat), "residue_ms": dist(res),
            "max_range_ms": max(ranges, default=None), "trials": trials, "reader_saw": saw, "decode_rc2": rc2,
            "residue_over_rest_p50": percentile(ratios, 0.5), **({"per_trial": per} if detail else {})}


def within_bound(cell: dict, slice_us: int, node_ms: float) -> dict:
    bound = slice_us / 1e3 + 2 * node_ms
    worst = cell["residue_ms"]["max"]
    return {"bound_ms": bound, "met": worst is not None and worst <= bound}


def text_cells(model: str, ngl: int, prompt_tokens: int, mechs: dict, trials: int, seed: int,
               threads: int, refs: int = 2, warm: int = 0, detail: bool = False) -> dict:
    """mechs: label -> (mechanism, slice_us or None, chunk_tokens)."""
    rng = random.Random(seed)
    out: dict = {"n_threads": threads}
    for label, (mech, slice_us, chunk) in mechs.items():
        wl = {"model": model, "n_threads": threads, "n_batch": prompt_tokens, "prompt_tokens": prompt_tokens,
              "max_tokens": 1, "chunk_tokens": chunk, "n_gpu_layers": ngl}
        eng = TextEngine({**wl, "graph_slice_us": DEFAULT if slice_us is None else slice_us})
        try:
            if "node_ms" not in out:
                out["node_ms"] = largest_node_ms(eng)
            cell = prefill_cancels(eng, mech, trials, rng, refs=refs, warm=warm, detail=detail)
            if mech == "graph_eval":
                cell.update(slice_us=slice_us, **within_bound(cell, slice_us, out["node_ms"]))
            out[label] = cell
            print(f"{label}: {json.dumps(cell)}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001
            if not detail:  # the device part (detail) keeps the other cells
                raise
            out[label] = {"error": repr(e)}
            print(f"{label}: ERROR {e!r}", file=sys.stderr, flush=True)
        finally:
            eng.close()
    return out


def vulkan_text(args) -> dict:
    model = str(ensure_text_fixture("text-qwen3-14m"))
    mechs = {"between_calls": ("between_calls", None, 16), "chunked": ("chunked", None, 16),
             f"graph_eval@{DEFAULT}us": ("graph_eval", DEFAULT, 16)}
    return {"model": "text-qwen3-14m", "prompt_tokens": 64, "n_gpu_layers": 999,
            **text_cells(model, 999, 64, mechs, args.vk_trials, args.seed, 2)}


def run_vulkan_child(args) -> dict:
    env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, __file__, "--part", "vulkan", "--vk-trials", str(args.vk_trials), "--seed", str(args.seed)]
    cp = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    sys.stderr.write(cp.stderr[-3000:])
    line = next((ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT:")), None)
    if cp.returncode != 0 or not line:
        return {"error": f"vulkan child rc={cp.returncode}"}
    return json.loads(line[len("RESULT:"):])


def device_model(name: str) -> tuple[str, str]:
    """A text fixture or a field-scale text set by name, generated if missing; and its lock check
    ("ok" or the mismatch: a numpy whose bytes differ is reported, not fatal)."""
    from cancelbench.datasets import field
    from cancelbench.datasets.locks import verify_against

    if name in field.FIELD_SETS:
        path, lock = field.ensure_set(name, verify=False, progress=True)["model"], field.lock_path(name)
    else:
        from cancelbench.datasets.fixtures import TEXT_LOCK
        path, lock = ensure_text_fixture(name, verify=False), TEXT_LOCK
    try:
        verify_against(path, lock)
        return str(path), "ok"
    except Exception as e:  # noqa: BLE001
        return str(path), f"lock mismatch: {e}"


def device_facts(device: str) -> dict:
    """What ggml sees in this (device-restricted) process, and the llama.cpp build."""
    from cancelbench.device_agents import backends

    facts: dict = {"device": device, "env": backends.backend_env(device)}
    try:
        facts["ggml_devices"] = [{k: v for k, v in d.__dict__.items()} for d in backends.probe_devices()]
    except Exception as e:  # noqa: BLE001 - facts only
        facts["ggml_devices_error"] = repr(e)
    try:
        facts["llama_cpp_build"] = backends.llama_cpp_build_info()
    except Exception as e:  # noqa: BLE001
        facts["llama_cpp_build_error"] = repr(e)
    return facts


def device_text(args) -> dict:
    """Every mechanism on ``args.device`` with all layers offloaded (run in a child whose
    environment shows ggml only that device)."""
    model, lock = device_model(args.model)
    chunk = args.chunk_tokens
    mechs = {"between_calls": ("between_calls", None, chunk), "abort_callback": ("abort_callback", None, chunk),
             "chunked": ("chunked", None, chunk)}
    mechs.update({f"graph_eval@{s}us": ("graph_eval", s, chunk) for s in args.device_slices})
    cells = text_cells(model, 999, args.prompt_tokens, mechs, args.device_trials, args.seed, args.device_threads,
                       refs=3, warm=2, detail=True)
    # after the cells: on CUDA a llama_model_load_from_file after the ggml device probe segfaulted
    return {"model": args.model, "model_file": Path(model).name, "model_bytes": Path(model).stat().st_size,
            "model_lock": lock, "prompt_tokens": args.prompt_tokens, "n_gpu_layers": 999, "chunk_tokens": chunk,
            "facts": device_facts(args.device), **cells}


def device_speech(args) -> dict:
    """TTS code2wav and STT encode (field-scale sets, every layer and the clip graphs on the
    device): in-flight cancel residue per mechanism, and the largest clip node (slice 0)."""
    from cancelbench.datasets import field
    from cancelbench.device_agents.engines.stt import SttEngine
    from cancelbench.device_agents.engines.tts import WINDOW_FRAMES, TtsEngine

    rng = random.Random(args.seed)
    frames = args.tts_frames or WINDOW_FRAMES + 2  # one full code2wav window inside the run
    clip = str(SF.audio_clip("speech-medium"))
    sets = {"tts": (TtsEngine, "qwen3tts-0.6b-field", {"n_batch": 16, "max_frames": frames},
                    {"input": TTS_TEXT}, {"code2wav": TTS_TARGETS["code2wav"]}),
            "stt": (SttEngine, "qwen3asr-0.6b-field", {"max_tokens": 4}, {"input": clip},
                    {"encode": STT_TARGETS["encode"]})}
    out: dict = {}
    for name in args.device_speech:
        cls, set_name, extra, trial, targets = sets[name]
        paths = field.ensure_set(set_name, verify=False, progress=True)
        eng = cls({"model": str(paths["model"]), "mmproj": str(paths["mmproj"]), "n_threads": args.device_threads,
                   "n_gpu_layers": 999, **extra})
        try:
            e: dict = {"set": set_name, "mechanisms": {}}
            for mech in ("between_calls", "abort_callback", "graph_eval"):
                eng.run(TrialRequest(**trial, mechanism=mech), _ctl())  # warm (GPU setup)
                ref = (tts_reference(eng, mech, 2) if name == "tts" else stt_reference(eng, mech, 2, trial["input"]))
                cells = cancel_trials(lambda ctl: eng.run(TrialRequest(**trial, mechanism=mech), ctl), targets, ref,
                                      args.device_trials, rng)
                e["mechanisms"][mech] = {"call_ms": {k: ref["call_ms"][k] for k in targets}, "phases": cells}
                print(f"{name} {mech}: {json.dumps(cells)}", file=sys.stderr, flush=True)
            eng.graph_slice_us = 0
            eng.run(TrialRequest(**trial, mechanism="graph_eval"), _ctl())
            e["node_ms"] = eng.graph_token.max_range_ns / 1e6
            e["bound_ms"] = DEFAULT / 1e3 + 2 * e["node_ms"]
            out[name] = e
        except Exception as ex:  # noqa: BLE001 - keep the other engine's result
            out[name] = {"error": repr(ex)}
        finally:
            eng.close()
    return out


def run_device_child(args, part: str = "device") -> dict:
    from cancelbench.device_agents.backends import backend_env

    env = {**os.environ, **backend_env(args.device)}
    cmd = [sys.executable, __file__, "--part", part, "--device", args.device, "--model", args.model,
           "--prompt-tokens", str(args.prompt_tokens), "--device-trials", str(args.device_trials),
           "--device-slices", ",".join(map(str, args.device_slices)), "--chunk-tokens", str(args.chunk_tokens),
           "--device-threads", str(args.device_threads), "--seed", str(args.seed),
           "--device-speech", ",".join(args.device_speech), "--tts-frames", str(args.tts_frames)]
    cp = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.device_timeout)
    sys.stderr.write(cp.stderr)
    line = next((ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT:")), None)
    if cp.returncode != 0 or not line:
        return {"error": f"{args.device} child rc={cp.returncode}", "stderr_tail": cp.stderr[-3000:]}
    return json.loads(line[len("RESULT:"):])


SWEEP_NAME = "graph_eval_cpu"


def cpu_sweep(args) -> int:
    """The CPU text part through the sweep path; writes graph_eval_cpu/ and graph_eval_cpu.json."""
    import harness

    from cancelbench.schema import reference_run

    out, json_path = harness.paths(SWEEP_NAME, args.sweep_out)
    config = harness.load_config(harness.CONFIGS / f"{SWEEP_NAME}.toml")
    if args.sweep_trials is not None:
        config = harness.with_trials(config, args.sweep_trials)
    machine = harness.machine_facts()
    config, facts = harness.run_or_resummarise("bench_graph_eval", args, config, out, json_path)
    if args.resummarise:  # the calibration belongs to the run: keep it
        node_ms = json.loads(json_path.read_text())["largest_node"]["ms"]
    else:
        eng = TextEngine({"model": str(ensure_text_fixture("text-llama-57m")), "n_threads": 1, "n_batch": 256,
                          "prompt_tokens": 256, "max_tokens": 1, "graph_slice_us": DEFAULT})
        try:
            node_ms = largest_node_ms(eng)
        finally:
            eng.close()
    summary = harness.summarise(out)
    refs = harness.reference_rows(out)
    slices = {}
    for wl in config.workloads:
        ref = {m: reference_run(refs.get((wl.name, m), [])) for m in ("between_calls", "graph_eval")}
        base, graph = (ref[m]["duration_ms"] if ref[m] else None for m in ("between_calls", "graph_eval"))
        cell = harness.find(summary["cells"], workload=wl.name, phase="prefill", mechanism="graph_eval")
        worst = cell["max_ms"] if cell else None
        bound = wl.graph_slice_us / 1e3 + 2 * node_ms
        slices[wl.name] = {
            "graph_slice_us": wl.graph_slice_us,
            # t_native_returned - t_received: return_ms runs from the later of receipt and the native
            # reader's first sight of the token, so the residue adds observe_ms (null: 0) back
            "residue": harness.column_distribution(out, ["observe_ms", "return_ms"], workload=wl.name,
                                                   mechanism="graph_eval", phase_at_receipt="prefill"),
            "overhead": {"rows": "trial_kind=reference, outcome=completed; schema.reference_run per mechanism",
                         "between_calls_ms": base, "graph_eval_ms": graph,
                         "overhead_pct": round(100 * (graph / base - 1), 2) if base and graph else None,
                         "reference_runs": config.reference_runs},
            "bound": {"bound_ms": bound, "latency_max_ms": worst, "n": cell["n"] if cell else 0,
                      "met": None if worst is None else bool(worst <= bound)},
        }
    extra = {"largest_node": {"ms": node_ms, "how": "one uncancelled slice-0 graph_eval run in the benchmark "
                                                     "process (max_range_ns): a calibration, not a trial"},
             "derived": slices}
    full = harness.load_config(harness.CONFIGS / f"{SWEEP_NAME}.toml").trials_per_cell
    harness.write_json(json_path, name=SWEEP_NAME, config=config, run_facts=facts, summary=summary,
                       machine=machine, extra=extra, note=args.note, default_trials=full)
    harness.print_cells(summary["cells"])
    for name, d in slices.items():
        print(f"{name}: residue p50 {d['residue']['p50_ms']} max {d['residue']['max_ms']} (n {d['residue']['n']}); "
              f"overhead {d['overhead']['overhead_pct']}%; bound {d['bound']['bound_ms']:.1f} ms "
              f"met={d['bound']['met']}", file=sys.stderr)
    print(f"wrote {out}/ and {json_path}", file=sys.stderr)
    return facts["sweep_exit_code"]


def cpu_text(args) -> dict:
    model = str(ensure_text_fixture("text-llama-57m"))
    mechs = {"abort_callback": ("abort_callback", None, 32)}
    mechs.update({f"graph_eval@{s}us": ("graph_eval", s, 32) for s in CPU_SLICES})
    return {"model": "text-llama-57m", "prompt_tokens": 256, "n_gpu_layers": 0,
            **text_cells(model, 0, 256, mechs, args.trials, args.seed, args.cpu_threads)}


def paired(run_base, run_graph, pairs: int) -> dict:
    """Interleaved uncancelled runs (base, graph_eval, base, ...); each run returns
    (wall ms, process CPU ms, syncs). Overhead = median of the per-pair ratios - 1,
    in wall time and in CPU time (less sensitive to other load on a shared host)."""
    runs = [(run_base(), run_graph()) for _ in range(pairs)]
    med = statistics.median

    def pct(i: int) -> float:
        return round(100 * (med(g[i] / b[i] for b, g in runs) - 1), 2)

    return {"base_ms": med(b[0] for b, _ in runs), "graph_eval_ms": med(g[0] for _, g in runs),
            "overhead_pct": pct(0), "cpu_overhead_pct": pct(1), "syncs": med(g[2] for _, g in runs),
            "pairs": pairs}


def speech_engines() -> dict:
    """name -> (engine class, workload, trial fields) for the CPU fixtures."""
    from cancelbench.device_agents.engines.stt import SttEngine
    from cancelbench.device_agents.engines.tts import WINDOW_FRAMES, TtsEngine

    paths = SF.ensure_speech_fixtures()
    clip = str(SF.audio_clip("speech-medium"))
    return {
        "tts": (TtsEngine, {"model": str(paths["tts"]["model"]), "mmproj": str(paths["tts"]["mmproj"]),
                            "n_threads": 1, "n_batch": 16, "max_frames": WINDOW_FRAMES + 8},
                {"input": TTS_TEXT}),
        "stt": (SttEngine, {"model": str(paths["asr"]["model"]), "mmproj": str(paths["asr"]["mmproj"]),
                            "n_threads": 1, "max_tokens": 12}, {"input": clip}),
    }


def speech_residue(args) -> dict:
    """graph_eval at the default slice inside the clip graphs (TTS generate/code2wav, STT
    encode), against the largest clip node (a slice-0 run's longest range)."""
    rng = random.Random(args.seed)
    out: dict = {}
    for name, (cls, wl, trial) in speech_engines().items():
        eng = cls(wl)
        try:
            targets = {k: TTS_TARGETS[k] for k in ("generate", "code2wav")} if name == "tts" else \
                {"encode": STT_TARGETS["encode"]}
            ref = (tts_reference(eng, "graph_eval", 2) if name == "tts"
                   else stt_reference(eng, "graph_eval", 2, trial["input"]))
            cells = cancel_trials(lambda ctl: eng.run(TrialRequest(**trial, mechanism="graph_eval"), ctl), targets, ref,
                                  args.trials, rng)
            eng.graph_slice_us = 0
            eng.run(TrialRequest(**trial, mechanism="graph_eval"), _ctl())
            node_ms = eng.graph_token.max_range_ns / 1e6
            for cell in cells.values():
                cell.update(within_bound(cell, DEFAULT, node_ms), slice_us=DEFAULT)
            out[name] = {"node_ms": node_ms, "phases": cells}
            print(f"residue {name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
        finally:
            eng.close()
    return out


# ----------------------------------------------------------------------------- residue per graph, under load

# graph -> (engine, phase of its step calls): text decode (one token's llama_decode), the TTS
# code predictor/talker step (generate) and the step that also runs code2wav, the STT encode
GRAPHS = {"text_decode": ("text", "generate"), "tts_generate": ("tts", "generate"),
          "tts_code2wav": ("tts", "code2wav"), "stt_encode": ("stt", "encode")}
BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_loops(n: int):
    """``n`` pure-Python busy loops beside the benchmark (same priority), stopped on exit."""
    import signal
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the cleanup below
    try:
        if procs:
            time.sleep(0.5)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        signal.signal(signal.SIGTERM, old)


def graph_engines(kinds) -> dict:
    """engine -> (class, workload, trial fields) on the CPU fixtures (one thread each)."""
    out = {k: v for k, v in speech_engines().items() if k in kinds} if {"tts", "stt"} & set(kinds) else {}
    if "text" in kinds:
        out["text"] = (TextEngine, {"model": str(ensure_text_fixture("text-llama-57m")), "n_threads": 1,
                                    "prompt_tokens": 32, "n_batch": 32, "max_tokens": 24}, {"input": PROMPT})
    return out


def _step_ctl(kind: str, on_step=None):
    """A trial control whose step calls are announced; ``on_step(phase, ms, max_range_ms, cpu_ms)`` at
    each step's end, with the longest eval-reader range of that call alone (take before, take after)
    and the most graph-thread CPU time of one of its ranges."""
    from cancelbench.device_agents.engines.registry import ENGINES

    ctl = _ctl()
    ctl.progress.step_calls = ENGINES[kind].step_calls
    start = {}

    def listen(event: str, phase: str, t_ns: int) -> None:
        if event == "step":
            ctl.token.take_max_range_ns()
            start["t"] = t_ns
        elif event == "step_end" and on_step is not None:
            cpu = ctl.token.max_range_cpu_ns / 1e6  # before the take, which clears it
            on_step(phase, (t_ns - start["t"]) / 1e6, ctl.token.take_max_range_ns() / 1e6, cpu)

    ctl.progress.listener = listen
    return ctl


def node_profiles(eng, kind: str, trial: dict, phases, profiles: int) -> dict:
    """Largest node per graph: ``profiles`` uncancelled runs with the reader syncing after every
    node (slice 0); per run and graph, the longest range of its step calls (one node + its sync);
    the median over the runs is the graph's largest node. Also the median step-call time."""
    keep = eng.graph_slice_us
    eng.graph_slice_us = 0
    per = {ph: [] for ph in phases}
    per_cpu = {ph: [] for ph in phases}
    calls = {ph: [] for ph in phases}
    try:
        for _ in range(profiles):
            run_max: dict = {}
            run_cpu: dict = {}

            def on_step(phase, ms, rng_ms, cpu_ms):
                if phase in per:
                    run_max[phase] = max(run_max.get(phase, 0.0), rng_ms)
                    run_cpu[phase] = max(run_cpu.get(phase, 0.0), cpu_ms)
            r = eng.run(TrialRequest(**trial, mechanism="graph_eval"), _step_ctl(kind, on_step))
            assert r.outcome == "completed", r.outcome
            for ph in phases:
                if ph in run_max:
                    per[ph].append(round(run_max[ph], 3))
                    per_cpu[ph].append(round(run_cpu[ph], 3))
    finally:
        eng.graph_slice_us = keep
    # the step-call time at the real slice (what the cancel delay is drawn from)
    def on_call(phase, ms, *_):
        if phase in calls:
            calls[phase].append(ms)
    for _ in range(2):
        eng.run(TrialRequest(**trial, mechanism="graph_eval"), _step_ctl(kind, on_call))
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    return {ph: {"largest_node_ms": med(per[ph]), "profiles_ms": per[ph],
                 "largest_node_cpu_ms": med(per_cpu[ph]), "profiles_cpu_ms": per_cpu[ph],
                 "call_ms": med(calls[ph])} for ph in phases}


def graph_cancels(eng, kind: str, trial: dict, phase: str, call_ms: float, trials: int,
                  rng: random.Random) -> dict:
    """Cancels at a uniform point of a step call of ``phase`` (generate: the k-th one, k random);
    residue = native return - receipt, of the cancels received while that call ran."""
    res, ranges, est, cpu, syncs, probes, reprobes = [], [], [], [], [], [], []
    for _ in range(trials):
        k = rng.randint(2, 8)

        def pred(p, k=k):
            if p.native_call is None or p.native_call not in p.step_calls or p.phase != phase:
                return False
            return phase != "generate" or (p.frames_generated or p.tokens_generated or 0) >= k
        ctl = _step_ctl(kind)
        th = cancel_at(ctl, pred, rng.uniform(0.0, 0.9) * call_ms / 1e3)
        r = eng.run(TrialRequest(**trial, mechanism="graph_eval"), ctl)
        th.join(10)
        at = ctl.at_receipt or {}
        if (r.outcome != "cancelled" or ctl.native_returned_ns is None or at.get("phase_at_receipt") != phase
                or not at.get("native_call_at_receipt")):
            continue
        res.append((ctl.native_returned_ns - ctl.received_ns) / 1e6)
        tok = ctl.token
        ranges.append(tok.max_range_ns / 1e6)
        est.append(tok.max_range_est_ns / 1e6)
        cpu.append(tok.max_range_cpu_ns / 1e6)  # most CPU in one range of the trial
        syncs.append(tok.syncs)
        probes.append(tok.probes)
        reprobes.append(tok.reprobes)
    return {"n": len(res), "trials": trials,
            "residue_ms": {"p50": percentile(res, 0.5), "p99": percentile(res, 0.99), "max": max(res, default=None),
                           "all": [round(x, 3) for x in res]},
            "reader": {"max_range_ms_max": max(ranges, default=None),
                       "its_estimate_ms": est[ranges.index(max(ranges))] if ranges else None,
                       "range_cpu_max_ms": [round(x, 3) for x in cpu],  # per trial: its most CPU in one range
                       "syncs_p50": percentile(syncs, 0.5), "probes_max": max(probes, default=None),
                       "reprobes_max": max(reprobes, default=None)}}


def graph_residue(args) -> dict:
    """Per graph (GRAPHS): slice, largest node (median of ``--node-profiles`` slice-0 profiles, both
    without and with the busy loops), residue p50/p99/max and n of in-call cancels with
    ``--busy-loops`` busy loops beside it, the bound slice + 2 x largest node and pass/fail."""
    rng = random.Random(args.seed)
    wanted = [g for g in GRAPHS if g in args.graphs]
    kinds = sorted({GRAPHS[g][0] for g in wanted})
    out: dict = {"slice_us": DEFAULT, "busy_loops": args.busy_loops, "busy_loop": f"python -c '{BUSY_LOOP}'",
                 "node_profiles": args.node_profiles, "trials": args.trials, "n_threads": 1,
                 "cpus": os.cpu_count(), "graphs": {}}
    for kind, (cls, wl, trial) in graph_engines(kinds).items():
        phases = [GRAPHS[g][1] for g in wanted if GRAPHS[g][0] == kind]
        eng = cls({**wl, "graph_slice_us": DEFAULT})
        try:
            for _ in range(2):  # warm: contexts built, costs learned at the slice
                eng.run(TrialRequest(**trial, mechanism="graph_eval"), _ctl())
            idle = node_profiles(eng, kind, trial, phases, args.node_profiles)
            with busy_loops(args.busy_loops) as pids:
                la0 = os.getloadavg()[0]
                loaded = node_profiles(eng, kind, trial, phases, args.node_profiles)
                for _ in range(2):  # costs re-learned at the slice (slice 0 forgot them), under the load
                    eng.run(TrialRequest(**trial, mechanism="graph_eval"), _ctl())
                for g in [g for g in wanted if GRAPHS[g][0] == kind]:
                    ph = GRAPHS[g][1]
                    cell = graph_cancels(eng, kind, trial, ph, loaded[ph]["call_ms"], args.trials, rng)
                    node, node_l = idle[ph]["largest_node_ms"], loaded[ph]["largest_node_ms"]
                    worst = cell["residue_ms"]["max"]
                    bound = DEFAULT / 1e3 + 2 * node
                    bound_l = DEFAULT / 1e3 + 2 * node_l
                    cpu_bound = DEFAULT / 1e3 + 2 * loaded[ph]["largest_node_cpu_ms"]
                    cell.update(
                        slice_us=DEFAULT, phase=ph,
                        largest_node={"idle": idle[ph], "loaded": loaded[ph]},
                        bound={"bound_ms": round(bound, 3), "node": "idle median",
                               "met": worst is not None and worst <= bound,
                               "loaded_node_bound_ms": round(bound_l, 3),
                               "met_with_loaded_node": worst is not None and worst <= bound_l,
                               # the cost model's share, in the graph thread's CPU time (waits for a CPU
                               # left out): every range of every trial against slice + 2 x the largest
                               # node's CPU time (median of the loaded profiles)
                               "cpu_bound_ms": round(cpu_bound, 3),
                               "range_cpu_max_ms": max(cell["reader"]["range_cpu_max_ms"], default=None),
                               "cpu_met": all(x <= cpu_bound for x in cell["reader"]["range_cpu_max_ms"])},
                        load={"busy_loops": len(pids), "loadavg1_at_start": round(la0, 2),
                              "loadavg1_at_end": round(os.getloadavg()[0], 2)})
                    out["graphs"][g] = cell
                    print(f"{g}: n {cell['n']} residue p50 {_r(cell['residue_ms']['p50'])} p99 "
                          f"{_r(cell['residue_ms']['p99'])} max {_r(worst)} | node idle {node} loaded {node_l} | "
                          f"bound {bound:.2f} met={cell['bound']['met']} | cpu: node {loaded[ph]['largest_node_cpu_ms']} "
                          f"range max {cell['bound']['range_cpu_max_ms']} bound {cpu_bound:.2f} "
                          f"met={cell['bound']['cpu_met']} "
                          f"(loaded-node bound {bound_l:.2f}) "
                          f"reader {cell['reader']}", file=sys.stderr, flush=True)
        finally:
            eng.close()
    return out


def overhead(args) -> dict:
    text = {"model": str(ensure_text_fixture("text-llama-57m")), "n_threads": args.cpu_threads,
            "prompt_tokens": 256, "max_tokens": 8}
    engines = {**({"text": (TextEngine, text, {"input": PROMPT})} if args.text_overhead_loop else {}),
               **speech_engines()}
    out: dict = {}
    for name, (cls, wl, trial) in engines.items():
        eng = cls(wl)
        token = native.CancelToken()

        def once(mech: str) -> tuple[float, float, int]:
            token.reset()
            ctl = CancelControl(token, Progress())
            cpu0 = time.process_time_ns()
            r = eng.run(TrialRequest(**trial, mechanism=mech), ctl)
            cpu = (time.process_time_ns() - cpu0) / 1e6
            assert r.outcome == "completed", (name, mech, r.outcome)
            return (r.t_terminal_ns - r.t_start_ns) / 1e6, cpu, ctl.token.syncs

        once("between_calls"), once("graph_eval")  # warm both contexts
        out[name] = {}
        for s in CPU_SLICES:
            eng.graph_slice_us = s
            out[name][f"{s}us"] = paired(lambda: once("between_calls"), lambda: once("graph_eval"), args.pairs)
            print(f"overhead {name} {s}us: {json.dumps(out[name][f'{s}us'])}", file=sys.stderr, flush=True)
        eng.close()
    return out


def _r(x):
    return None if x is None else round(x, 2)


def table(result: dict) -> list[str]:
    rows = ["backend | mechanism | n | latency p50 / p99 / max ms | residue p50 / max ms | prefill ms "
            "| largest node ms | bound ms (met)", "---|---|---|---|---|---|---|---"]
    for backend in [k for k in result if k.endswith("_text")]:
        part = result.get(backend, {})
        for label, c in part.items():
            if not isinstance(c, dict) or "latency_ms" not in c:  # node_ms, n_threads, model...
                continue
            lat, res = c["latency_ms"], c["residue_ms"]
            bound = f"{_r(c['bound_ms'])} ({'met' if c['met'] else 'NOT met'})" if "bound_ms" in c else "-"
            rows.append(f"{backend.split('_')[0]} | {label} | {lat['n']}/{c['trials']} | {_r(lat['p50'])} / "
                        f"{_r(lat['p99'])} / {_r(lat['max'])} | {_r(res['p50'])} / {_r(res['max'])} | "
                        f"{_r(c['prefill_ms'])} | {_r(part['node_ms'])} | {bound}")
    rows += ["", "engine | phase | n in flight | latency p50 / max ms | residue p50 / max ms | largest node ms "
             "| bound ms (met)", "---|---|---|---|---|---|---"]
    for eng, e in result.get("speech_residue", {}).items():
        for phase, c in e["phases"].items():
            rows.append(f"{eng} | {phase} | {c['n_in_flight']}/{c['n']} | {_r(c['latency_ms']['p50'])} / "
                        f"{_r(c['latency_ms']['max'])} | {_r(c['residue_ms']['p50'])} / {_r(c['residue_ms']['max'])} | "
                        f"{_r(e['node_ms'])} | {_r(c['bound_ms'])} ({'met' if c['met'] else 'NOT met'})")
    rows += ["", "engine | slice | between_calls ms | graph_eval ms | overhead % wall / CPU | syncs",
             "---|---|---|---|---|---"]
    for eng, slices in result.get("overhead", {}).items():
        for s, o in slices.items():
            rows.append(f"{eng} | {s} | {_r(o['base_ms'])} | {_r(o['graph_eval_ms'])} | {o['overhead_pct']} / "
                        f"{o['cpu_overhead_pct']} | {o['syncs']}")
    return rows


def graphs_part(args) -> int:
    t0 = time.time()
    import harness

    machine = {**harness.machine_facts(), "llama_cpp_python": getattr(llama_cpp, "__version__", None)}
    result = {"bench": "graph_eval_load", "machine": machine, "loadavg_start": os.getloadavg(),
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "how": "per graph: largest node = median over --node-profiles uncancelled slice-0 runs of the "
                     "longest eval-reader range (one node + its sync) inside that graph's step calls "
                     "(take_max_range_ns before/after each call), measured without and with the busy loops; "
                     "residue = t_native_returned - t_received of cancels received while a step call of the "
                     "graph ran, with the busy loops running; bound = slice + 2 x the idle largest node "
                     "(wall). cpu_bound: the cost model's own check, in the graph thread's CPU time "
                     "(CLOCK_THREAD_CPUTIME_ID; waits for a CPU left out): the most CPU of any range of "
                     "any cancelled trial against slice + 2 x the largest node's CPU time (loaded profiles' "
                     "median). 'idle' = without the benchmark's busy loops; other work on the host is not "
                     "controlled (loadavg fields)",
              **graph_residue(args)}
    result["wall_s"] = round(time.time() - t0, 1)
    result["loadavg_end"] = os.getloadavg()
    result["all_met"] = all(c["bound"]["met"] for c in result["graphs"].values())
    Path(args.graphs_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.graphs_out).write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(f"wrote {args.graphs_out} (all_met={result['all_met']}, {result['wall_s']} s)", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=12, help="CPU cancel trials per cell")
    ap.add_argument("--vk-trials", type=int, default=5, help="Vulkan (lavapipe) cancel trials per cell")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved overhead pairs per slice")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="CPU text threads (1: on a shared 2-core host two threads wait on each other's time slices)")
    ap.add_argument("--part", choices=("all", "vulkan", "device", "device_speech", "graphs"), default="all",
                    help="graphs: residue per graph (text decode, TTS generate/code2wav, STT encode) under "
                         "--busy-loops, into --graphs-out")
    ap.add_argument("--busy-loops", type=int, default=2, help="graphs part: busy loops run beside the trials")
    ap.add_argument("--node-profiles", type=int, default=5, help="graphs part: slice-0 profiles per largest node")
    ap.add_argument("--graphs", type=lambda v: [x for x in v.split(",") if x], default=list(GRAPHS),
                    help="graphs part: comma list of " + ",".join(GRAPHS))
    ap.add_argument("--graphs-out", default=str(ROOT / "benchmarks" / "results" / "graph_eval_load.json"))
    ap.add_argument("--device", default=None,
                    help="run only the device part on this device id (e.g. cuda:0, vulkan:0; see device_agents/backends.py)")
    ap.add_argument("--model", default="text-qwen3-0.6b-field", help="device part: text fixture or field set name")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="device part: prompt (one prefill decode)")
    ap.add_argument("--device-trials", type=int, default=15, help="device part: cancel trials per cell")
    ap.add_argument("--device-slices", type=lambda v: [int(x) for x in v.split(",") if x], default=[DEFAULT, 500, 0],
                    help="device part: graph_eval slices (us), comma list")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="device part: chunked mechanism's chunk")
    ap.add_argument("--device-threads", type=int, default=4, help="device part: CPU threads of the context")
    ap.add_argument("--device-speech", type=lambda v: [x for x in v.split(",") if x], default=[],
                    help="device part: also tts,stt on the field sets (code2wav / encode residue)")
    ap.add_argument("--tts-frames", type=int, default=0,
                    help="device speech: TTS max_frames (0: one code2wav window + 2)")
    ap.add_argument("--device-timeout", type=float, default=1200, help="device part: child's time limit (s)")
    ap.add_argument("--skip", default="", help="comma list of vulkan,cpu,speech,overhead (with --device: text) to leave out")
    ap.add_argument("--loops", action="store_true",
                    help="with the cpu (sweep) part, also run the vulkan/speech/overhead loops (default: only the sweep)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "graph_eval.json"),
                    help="JSON of the parts still outside the sweep path (vulkan, speech, overhead, device)")
    ap.add_argument("--sweep-trials", type=int, default=None, help="cpu part: override sweep.trials_per_cell")
    ap.add_argument("--sweep-out", type=Path, default=None,
                    help=f"cpu part: dataset directory (default benchmarks/results/{SWEEP_NAME}/)")
    ap.add_argument("--force", action="store_true", help="cpu part: replace an existing dataset and JSON")
    ap.add_argument("--note", default="", help="cpu part: free text stored in the JSON")
    ap.add_argument("--resummarise", action="store_true",
                    help="cpu part: summarise the existing dataset again (no sweep; run facts from its JSON)")
    ap.add_argument("--resume", action="store_true", help="cpu part: continue an interrupted run's dataset")
    ap.add_argument("--cpu-text-loop", action="store_true",
                    help="also run the old in-process CPU text loop (not through the sweep path)")
    ap.add_argument("--text-overhead-loop", action="store_true",
                    help="overhead part: also the text engine in the old loop (the sweep part has it from records)")
    args = ap.parse_args()
    if args.part == "vulkan":
        print("RESULT:" + json.dumps(vulkan_text(args)))
        return 0
    if args.part == "device":
        print("RESULT:" + json.dumps(device_text(args), default=str))
        return 0
    if args.part == "device_speech":
        print("RESULT:" + json.dumps(device_speech(args), default=str))
        return 0
    if args.part == "graphs":
        return graphs_part(args)
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.time()
    result: dict = {"bench": "graph_eval", "default_slice_us": DEFAULT, "cpu_slices_us": list(CPU_SLICES),
                    "trials": args.trials, "vk_trials": args.vk_trials, "pairs": args.pairs,
                    "cpu_text_threads": args.cpu_threads,
                    "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    if args.device:
        result.update(device=args.device, device_trials=args.device_trials, device_slices_us=args.device_slices)
        if "text" not in skip:
            result[f"{args.device.split(':')[0]}_text"] = run_device_child(args)
        if args.device_speech:
            result[f"{args.device.split(':')[0]}_speech"] = run_device_child(args, "device_speech")
        skip |= {"vulkan", "cpu", "speech", "overhead"}
    rc = 0
    if "cpu" not in skip:
        rc = cpu_sweep(args)
        skip |= {"vulkan", "speech", "overhead"} if not args.loops else set()
    if args.cpu_text_loop:
        result["cpu_text"] = cpu_text(args)
    if not args.device and skip >= {"vulkan", "speech", "overhead"} and not args.cpu_text_loop:
        return rc
    if "vulkan" not in skip:
        result["vulkan_text"] = run_vulkan_child(args)
    if "speech" not in skip:
        result["speech_residue"] = speech_residue(args)
    if "overhead" not in skip:
        result["overhead"] = overhead(args)
    result["wall_s"] = round(time.time() - t0, 1)
    result["loadavg_end"] = os.getloadavg()
    result["table"] = table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=float) + "\n")
    print("\n".join(result["table"]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
