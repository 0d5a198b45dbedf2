"""A built-in engine in a child process the agent supervises (``engine_process = "child"``): the crash
that kills an in-process agent (the AMX SIGILL of field-scale models) costs one trial. A real
`cancelbench sweep` of the built-in text engine on the fixture model; the engine process sends itself
SIGILL at the first step call of one known reference run (``CANCELBENCH_TEST_ENGINE_SIGNAL``), in its
prefill, mid-trial. The rows the engine could not have written without a restart (every later trial,
cancels among them) and the processes left afterwards are the evidence."""

from __future__ import annotations

import uuid

import pytest

from cancelbench.failpoints import CRASH_SIGNAL
from cancelbench.sink import read_manifest, read_records
from test_external_engine import assert_none_left, exactly_once, header, sweep

CRASHED = ".ref.001"  # the second reference run of the one cell: trials before and after it


@pytest.mark.cluster
def test_a_builtin_engine_killed_by_sigill_mid_trial_costs_that_trial_alone(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(CRASH_SIGNAL, f"SIGILL,{CRASHED}")
    text = header(["graph_eval"], ["agent"], trials=3) + """
[[workload]]
name = "text"
engine = "text"
engine_process = "child"
n_threads = 1
max_tokens = 8
"""
    r, out = sweep(tmp_path, tag, text, "--no-summary")
    assert r.returncode == 1, r.stderr[-3000:]  # exit 1: an error record
    manifest = read_manifest(out)
    assert manifest["status"] == "complete" and not manifest.get("not_run"), manifest.get("not_run")
    df = read_records(out).sort_values("t_handback_ns")
    exactly_once(out, df)  # every planned trial once: none lost with the engine, none run twice
    assert (df.engine == "text").all() and (df.engine_process == "child").all()

    crashed = df[df.trial_id.str.endswith(CRASHED)]
    assert len(crashed) == 1 and crashed.outcome.iloc[0] == "error", df[["trial_id", "outcome", "error"]]
    assert "killed by SIGILL" in crashed.error.iloc[0], crashed.error.iloc[0]

    others = df[~df.trial_id.str.endswith(CRASHED)]
    assert others.outcome.isin(["completed", "cancelled"]).all(), others[["trial_id", "outcome", "error"]]
    after = others[others.t_handback_ns > crashed.t_handback_ns.iloc[0]]
    # a restarted engine ran them: the killed one could not (the last reference, then the cancels)
    assert len(after) >= 4 and (after.outcome == "cancelled").sum() >= 1, after[["trial_id", "outcome"]]
    # and each row says which process it ran on: the first until the crash (its own row included), then one
    # started again
    before = df[df.t_handback_ns <= crashed.t_handback_ns.iloc[0]]
    assert (before.engine_restarts == 0).all() and (after.engine_restarts == 1).all(), \
        df[["trial_id", "outcome", "engine_restarts"]]
    assert "1 trial(s) ended in error" in r.stderr and "killed by SIGILL" in r.stderr, r.stderr[-3000:]
    assert_none_left(tag)  # neither engine process (the killed one, its successor) nor a reaper stays
