"""graph_eval on the text engine: the native eval reader stops a llama_decode inside
its graph on the CPU backend and on Vulkan (lavapipe), the context stays reusable,
and the slice sets how often the scheduler synchronizes.

Every claim is proven with the token's own counters (nodes asked = ``polls``,
ranges synchronized = ``syncs``, ``seen_ns`` stamped by the reader) and the KV
cache, never with time. The Vulkan scenario runs in a child process (the device
must be made visible before ggml loads), exactly like test_backends.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cancelbench import native
from cancelbench.device_agents import backends
from cancelbench.device_agents.engines.base import CancelControl, Progress
from cancelbench.device_agents.engines.registry import ENGINES
from cancelbench.device_agents.engines.text import TextEngine
from cancelbench.request import TrialRequest

from helpers import cancel_inside_call
from test_backends import lavapipe_index, vulkan_site  # noqa: F401  (fixtures)

PROMPT = "The quick brown fox jumps over the lazy dog while the engine keeps talking about cancel latency."
HUGE_SLICE_US = 10_000_000


def _trial(eng: TextEngine, token: native.CancelToken, cancel_when=None):
    """One graph_eval trial, agent style: one token, reset per trial; with ``cancel_when``,
    the cancel lands inside the first llama_decode that starts while ``cancel_when(progress)``
    holds, before its graph runs (by construction, not by timing)."""
    token.reset()
    ctl = CancelControl(token, Progress())
    if cancel_when is not None:
        cancel_inside_call(ctl, "llama_decode", cancel_when)
    res = eng.run(TrialRequest(input=PROMPT, mechanism="graph_eval"), ctl)
    return res, ctl


def _counts(token: native.CancelToken) -> dict:
    return {"polls": token.polls, "syncs": token.syncs, "set_ns": token.set_ns, "seen_ns": token.seen_ns}


def scenario(model: str, n_gpu_layers: int, prompt_tokens: int, slice_us: int) -> dict:
    """Everything the tests assert, as plain data (so a child process can return it)."""
    base = {"model": model, "n_threads": 2, "prompt_tokens": prompt_tokens, "max_tokens": 1,
            "n_gpu_layers": n_gpu_layers, "graph_slice_us": slice_us}
    token = native.CancelToken()
    out: dict = {}
    eng = TextEngine({**base, "n_batch": prompt_tokens})
    try:
        ref, _ = _trial(eng, token)
        out["ref"] = {"outcome": ref.outcome, "sha": ref.output_sha256, **_counts(token)}
        # the cancel lands inside the single prefill decode
        res, ctl = _trial(eng, token, lambda p: True)
        out["cancel"] = {"outcome": res.outcome, "phase": res.phase_at_terminal, "decode_rc": res.decode_rc,
                         "tokens_done": ctl.progress.input_tokens_done, "kv_pos_max": eng.kv_pos_max(),
                         "received_ns": ctl.received_ns, "returned_ns": ctl.native_returned_ns, **_counts(token)}
        after, _ = _trial(eng, token)
        out["after"] = {"outcome": after.outcome, "sha": after.output_sha256}
        out["syncs_by_slice"] = {}
        for s in (0, slice_us, HUGE_SLICE_US):
            eng.graph_slice_us = s
            r, _ = _trial(eng, token)
            out["syncs_by_slice"][str(s)] = {"outcome": r.outcome, "sha": r.output_sha256, **_counts(token)}
    finally:
        eng.close()
    fresh = TextEngine({**base, "n_batch": prompt_tokens})
    try:
        out["fresh_sha"] = _trial(fresh, token)[0].output_sha256
        r = fresh.run(TrialRequest(input=PROMPT, mechanism="between_calls"), CancelControl(token, Progress()))
        out["plain_sha"] = r.output_sha256
    finally:
        fresh.close()
    # several prefill batches: the stopped one leaves the KV cache, the earlier ones stay
    step = prompt_tokens // 4
    multi = TextEngine({**base, "n_batch": step})
    try:
        res, ctl = _trial(multi, token, lambda p: p.input_tokens_done >= step)  # in the second batch's decode
        out["multi"] = {"outcome": res.outcome, "phase": res.phase_at_terminal, "step": step,
                        "tokens_done": ctl.progress.input_tokens_done, "kv_pos_max": multi.kv_pos_max(),
                        **_counts(token)}
    finally:
        multi.close()
    return out


def check(out: dict) -> None:
    ref, c = out["ref"], out["cancel"]
    assert ref["outcome"] == "completed" and ref["sha"]
    # 1 prefill decode + 1 generated token: the reader was asked about every node of both graphs
    nodes_two_decodes = ref["polls"]
    assert nodes_two_decodes > 50
    # the cancel landed in the prefill decode and stopped it inside its graph
    assert c["outcome"] == "cancelled" and c["phase"] == "prefill" and c["tokens_done"] == 0
    assert c["seen_ns"] >= c["set_ns"] >= c["received_ns"] > 0  # the eval reader saw the byte ...
    assert c["returned_ns"] >= c["seen_ns"]                      # ... before llama_decode returned
    assert 1 <= c["polls"] < nodes_two_decodes // 2, "the stopped decode asked about fewer nodes than its graph has"
    assert c["decode_rc"] == 0  # the stop is silent: llama_decode itself reports success
    assert c["kv_pos_max"] == -1  # the stopped batch's positions were removed
    # the context is reusable: same output as before, as a fresh engine, as the plain context
    assert out["after"] == {"outcome": "completed", "sha": ref["sha"]}
    assert out["fresh_sha"] == ref["sha"] == out["plain_sha"]
    # the slice sets how many ranges are synchronized: every node at 0, fewer at the default, ~none when huge
    by = out["syncs_by_slice"]
    s0, sd, sh = (by[k] for k in by)
    assert all(x["outcome"] == "completed" and x["sha"] == ref["sha"] for x in (s0, sd, sh))
    assert s0["polls"] == sd["polls"] == sh["polls"] == nodes_two_decodes
    assert s0["syncs"] == s0["polls"]
    assert s0["syncs"] > sd["syncs"] > sh["syncs"] >= 1
    m = out["multi"]
    assert m["outcome"] == "cancelled" and m["phase"] == "prefill"
    assert m["tokens_done"] == m["step"]  # the first batch ran, the second was stopped
    assert m["seen_ns"] > 0  # stopped inside a decode, by the reader
    assert m["kv_pos_max"] == m["tokens_done"] - 1  # earlier batches kept, the stopped one removed


def test_text_engine_lists_graph_eval():
    assert "graph_eval" in ENGINES["text"].mechanisms and TextEngine.phases == ("prefill", "generate")


def test_graph_eval_on_cpu(text_model):
    check(scenario(text_model, 0, 256, native.DEFAULT_GRAPH_SLICE_US))


_CHILD = r'''
import json, sys
sys.path.insert(0, sys.argv[2])
import test_graph_eval as T
from cancelbench.device_agents import backends
cfg = json.loads(sys.argv[1])
out = T.scenario(cfg["model"], cfg["ngl"], cfg["prompt_tokens"], cfg["slice_us"])
out["devices"] = [d.device_id for d in backends.probe_devices()]
print("RESULT:" + json.dumps(out))
'''


def test_graph_eval_on_vulkan_lavapipe(vulkan_site, lavapipe_index, small_text_model):  # noqa: F811
    dev = f"vulkan:{lavapipe_index}"
    env = {**os.environ, **vulkan_site, **backends.backend_env(dev)}
    cfg = {"model": small_text_model, "ngl": 999,  # every layer on the device
           "prompt_tokens": 64, "slice_us": native.DEFAULT_GRAPH_SLICE_US}
    cp = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg), str(Path(__file__).parent)],
                        env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT:")), None)
    assert cp.returncode == 0 and line, f"child failed rc={cp.returncode}\n{cp.stderr[-4000:]}"
    out = json.loads(line[len("RESULT:"):])
    assert "vulkan:0" in out["devices"], out["devices"]  # lavapipe was the child's Vulkan device
    check(out)


def test_cost_keys_learned_once_per_op_and_shape_on_a_real_graph(text_model):
    """On a real text graph (CPU): the first hooked trial meets cost keys (op x work bucket)
    it has not seen and ends a range to learn each (probes > 0); an identical second trial meets
    none (probes == 0: what was learned is kept across resets; re-probes of a known key after a
    range overran, which depend on timing, are counted apart in ``reprobes``); forget_costs (a
    new model) makes the next trial learn them again. Counters only, no wall-clock bound."""
    eng = TextEngine({"model": text_model, "n_threads": 2, "prompt_tokens": 64, "n_batch": 64, "max_tokens": 2,
                      "n_gpu_layers": 0, "graph_slice_us": native.DEFAULT_GRAPH_SLICE_US})
    token = native.CancelToken()
    try:
        first, _ = _trial(eng, token)
        probes_first = token.probes
        second, _ = _trial(eng, token)
        probes_second = token.probes
        eng.graph_token.forget_costs()
        third, _ = _trial(eng, token)
        probes_third = token.probes
    finally:
        eng.close()
    assert first.outcome == second.outcome == third.outcome == "completed"
    assert first.output_sha256 == second.output_sha256 == third.output_sha256
    assert probes_first > 0 and probes_second == 0 and probes_third == probes_first
