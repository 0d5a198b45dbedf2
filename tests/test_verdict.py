"""A verdict the engine under test cannot fool (issue 33): the outcome comes from what the agent saw
(docs/sut-protocol.md, "The outcome rule"); what an engine says can confirm a defect, never acquit one;
every value it sends is checked; no run lasts for ever and nothing an engine starts outlives it.

Through the real commands (`cancelbench sweep` with its own local Ray, `cancelbench sut-check`) on real
engine processes: tests/data/engines/misbehave.py, whose modes are each one defect of a team's engine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from cancelbench.schema import empty_row, finalize_row
from cancelbench.sink import read_manifest, read_records
from test_external_engine import (MISBEHAVE, PY, assert_none_left, exactly_once, header, sweep, sweep_env,
                                  workload)

ROOT = Path(__file__).resolve().parents[1]


def sut_check(tag: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "cancelbench.cli", "sut-check", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=sweep_env(tag))


def verdicts(out: str) -> dict[str, tuple[str, str]]:
    """check name -> (PASS/FAIL/SKIP, detail)."""
    got = {}
    for line in out.splitlines():
        m = re.match(r"^(PASS|FAIL|SKIP) (\w+): (.*)$", line)
        if m:
            got[m.group(2)] = (m.group(1), m.group(3))
    return got


# --------------------------------------------------------------------- the rule itself, on rows

def row(**columns) -> dict:
    r = empty_row()
    r.update({"trial_kind": "cancel", "engine": "external", "outcome": "completed", **columns})
    return r


def test_the_rule_judges_by_the_agents_stamps_and_the_engines_word_only_confirms():
    """A completed run whose done the agent read after the cancel could have reached the engine dropped it,
    though the engine never said it read it; one whose done came within the reach raced it (completed, no
    latency, never a negative one); a reference run that reports a cancel is the engine's error."""
    ms = 1_000_000
    silent_drop = finalize_row(row(t_received_ns=10 * ms, t_cancel_forwarded_ns=10 * ms, cancel_reach_ns=2 * ms,
                                   t_engine_done_read_ns=80 * ms, t_terminal_ns=79 * ms))
    assert silent_drop["outcome"] == "dropped" and silent_drop["drop_margin_ms"] == 68.0
    assert silent_drop["latency_ms"] == 69.0  # how long it ran on after the agent took the cancel

    raced = finalize_row(row(t_received_ns=10 * ms, t_cancel_forwarded_ns=10 * ms, cancel_reach_ns=2 * ms,
                             t_engine_done_read_ns=11 * ms, t_terminal_ns=8 * ms))  # the engine ended first
    assert raced["outcome"] == "completed" and raced["drop_margin_ms"] == -1.0
    assert raced["latency_ms"] is None and raced["end_to_end_ms"] is None and raced["cost_ratio"] is None

    # The same late done, but the cancel was held off a CPU (the kernel's run delay of the engine's threads and
    # the agent's reader) for as long as the done was late: an engine that decided before the cancel could reach
    # it is not taken for a drop; held off for less than that, it still is.
    late = dict(t_received_ns=10 * ms, t_cancel_forwarded_ns=10 * ms, cancel_reach_ns=2 * ms,
                t_engine_done_read_ns=30 * ms, t_terminal_ns=9 * ms)
    stalled = finalize_row(row(**late, cancel_stall_ns=19 * ms))
    assert stalled["outcome"] == "completed" and stalled["drop_margin_ms"] == -1.0
    assert finalize_row(row(**late, cancel_stall_ns=17 * ms))["outcome"] == "dropped"

    confirmed = finalize_row(row(t_received_ns=10 * ms, t_cancel_forwarded_ns=10 * ms, cancel_reach_ns=20 * ms,
                                 t_engine_done_read_ns=12 * ms, t_terminal_ns=11 * ms, t_engine_received_ns=10 * ms))
    assert confirmed["outcome"] == "dropped"  # within the reach, but it says it read the cancel first

    for claimed in (dict(outcome="cancelled"), dict(t_engine_received_ns=5 * ms)):
        ref = finalize_row(row(trial_kind="reference", t_terminal_ns=9 * ms, **claimed))
        assert ref["outcome"] == "error" and "reference run" in ref["error"], ref["error"]

    in_process = finalize_row(row(engine="text", t_received_ns=10 * ms, t_terminal_ns=10 * ms))
    assert in_process["outcome"] == "dropped" and in_process["drop_margin_ms"] == 0.0


# --------------------------------------------------------------------- sut-check applies it

def test_sut_check_catches_a_silent_drop_and_a_missing_latch():
    """The field bug without the engine's confession: a cancel read during the run's set-up is refused and
    never reported, and the run completes; and an engine that forgets a cancel read before its run."""
    tag = uuid.uuid4().hex
    silent = sut_check(tag, "--setting", "setup_ms=300", "--setting", "steps=3", "--setting", "step_ms=20", "--",
                       PY, str(MISBEHAVE), "drops_silently")
    got = verdicts(silent.stdout)
    assert silent.returncode == 1, silent.stdout + silent.stderr
    assert got["cancel_before_run"][0] == "FAIL" and "dropped" in got["cancel_before_run"][1], got
    assert got["cancel_in_work"][0] == "FAIL", got
    assert "dropped" in got["cancel_in_work"][1] and "did not say it read the cancel" in got["cancel_in_work"][1]
    assert got["phases"][0] == got["shutdown"][0] == "PASS", got

    unlatched = sut_check(tag, "--setting", "steps=3", "--setting", "step_ms=50", "--", PY, str(MISBEHAVE),
                          "no_latch")
    got = verdicts(unlatched.stdout)
    assert unlatched.returncode == 1, unlatched.stdout + unlatched.stderr
    assert got["cancel_before_run"][0] == "FAIL" and "not latched" in got["cancel_before_run"][1], got
    assert got["cancel_in_work"][0] == "PASS", got  # a cancel during its run it honours
    assert_none_left(tag)


@pytest.mark.parametrize("mode, says", [("claims_receipt", "done.cancel_received_t"),
                                        ("claims_cancel", "it ended cancelled")])
def test_sut_check_fails_a_reference_run_that_reports_a_cancel(mode, says):
    tag = uuid.uuid4().hex
    r = sut_check(tag, "--setting", "steps=2", "--setting", "step_ms=5", "--", PY, str(MISBEHAVE), mode)
    got = verdicts(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert got["phases"][0] == "FAIL" and "reference run" in got["phases"][1] and says in got["phases"][1], got
    assert_none_left(tag)


def test_sut_check_checks_the_trial_threads_readings():
    """done.cpu (1.3) as the agent checks it: misbehave bad_cpu claims 10 s of CPU at its reference run's
    end (its first run), and the cpu check fails naming that run; every other check passes."""
    tag = uuid.uuid4().hex
    r = sut_check(tag, "--setting", "steps=3", "--setting", "step_ms=5", "--", PY, str(MISBEHAVE), "bad_cpu", "1")
    got = verdicts(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert got["cpu"][0] == "FAIL" and "sut-check.001.reference" in got["cpu"][1], got["cpu"]
    assert "more than one thread can" in got["cpu"][1], got["cpu"]
    assert all(v != "FAIL" for k, (v, _) in got.items() if k != "cpu"), got
    assert_none_left(tag)


def test_sut_check_names_a_process_the_engine_left_running_and_ends_it():
    """A child the engine started in its own session is outside its process group: the shutdown check
    fails naming it, and it is gone when sut-check returns."""
    tag = uuid.uuid4().hex
    r = sut_check(tag, "--setting", "steps=2", "--setting", "step_ms=5", "--", PY, str(MISBEHAVE), "escapes")
    got = verdicts(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert got["shutdown"][0] == "FAIL" and "outlived it" in got["shutdown"][1] and "sleep(3600)" in \
        got["shutdown"][1], got
    assert all(v == "PASS" for k, (v, _) in got.items() if k != "shutdown"), got
    assert_none_left(tag)


def test_sut_check_escapes_what_the_engine_says():
    """A version string and a run error carrying ESC, OSC, BEL, CR and NUL: printed escaped, one line per
    check (the screen is not cleared, no line is split)."""
    tag = uuid.uuid4().hex
    r = sut_check(tag, "--", PY, str(MISBEHAVE), "hostile_text")
    assert r.returncode == 1, r.stdout + r.stderr
    raw = [c for c in r.stdout + r.stderr if ord(c) < 0x20 and c != "\n" or c == "\x7f"]
    assert not raw, (raw, r.stdout)
    got = verdicts(r.stdout)
    assert r"1\x1b[2J\x1b]0;owned\x07 \x00x" in got["hello"][1], got["hello"]  # CR: white space, one line
    assert got["phases"][0] == "FAIL" and r"failed \x1b[2J" in got["phases"][1], got["phases"]
    checks = [line for line in r.stdout.splitlines() if not line.startswith("sut-check:")]
    assert len(checks) == len(got), r.stdout  # every check one whole line
    assert_none_left(tag)


# --------------------------------------------------------------------- a sweep applies it

SWEEP_MODES = {
    # workload: (misbehave argv, settings)
    "drops_silently": (["drops_silently"], "steps = 3, step_ms = 5, setup_ms = 300"),
    "no_latch": (["no_latch"], "steps = 3, step_ms = 100"),
    "bad_stamp": (["bad_stamp", 3], "steps = 3, step_ms = 5"),
    "bad_phase": (["bad_phase", 3], "steps = 3, step_ms = 5"),
    "big_counter": (["big_counter", 3], "steps = 3, step_ms = 5"),
    "bad_cpu": (["bad_cpu", 3], "steps = 3, step_ms = 5"),
    "undeclared_audio": (["undeclared_audio", 3], "steps = 3, step_ms = 5"),
    "deadlock": (["deadlock", 3], "steps = 3, step_ms = 100"),  # an immediate cancel lands in the first step
    "escapes": (["escapes"], "steps = 3, step_ms = 100"),
}
# the third reference run of these breaks; the error each record names
THIRD_REFERENCE_ERRORS = {
    "bad_stamp": ["done.native_returned_t 1 lies outside trial"],
    "bad_phase": ["phase 'nowhere'", "did not declare"],
    "big_counter": ["done.counters.decode_rc = 2147483648 is out of its column's range (int32)"],
    "bad_cpu": ["done.cpu: the trial thread ran", "ms of CPU between terminal and end", "more than one thread can"],
    "undeclared_audio": ["the engine sent audio, but did not declare the capability audio_out"],
    "deadlock": ["over its bound of 5 s", "10 x its longest completed run"],
}


def test_a_sweep_judges_each_engine_by_what_the_agent_saw(tmp_path):
    """One sweep, one misbehave.py workload per defect, immediate cancels by both deliveries: silent drops
    are `dropped` (exit 1), a forgotten latch is never a `completed`, out-of-trial stamps, undeclared
    phases, counters past their column and a stuck run thread are each an `error` naming it (then a
    restarted engine), every planned trial is written once (none to a side file), and nothing is left
    running: neither the engines nor the child one of them started in its own session."""
    tag = uuid.uuid4().hex
    text = header(["flag"], ["driver", "agent"], trials=2)
    for name, (argv, settings) in SWEEP_MODES.items():
        text += workload(name, [PY, MISBEHAVE, *argv], settings)
    r, out = sweep(tmp_path, tag, text)
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
    assert any(line.startswith("FAIL") and "dropped" in line for line in r.stdout.splitlines()), r.stdout[-3000:]
    manifest = read_manifest(out)
    assert manifest["status"] == "complete" and not manifest.get("not_run"), manifest.get("not_run")
    assert not list(out.rglob("unwritten-*")), list(out.rglob("unwritten-*"))
    df = read_records(out)
    exactly_once(out, df)
    cancels = df[df.trial_kind == "cancel"]

    silent = cancels[cancels.workload == "drops_silently"]
    assert len(silent) == 4 and set(silent.outcome) == {"dropped"}, silent[["trial_id", "outcome", "error"]]
    assert silent.t_engine_received_ns.isna().all()  # it never said it read them: the agent's stamps tell
    assert (silent.drop_margin_ms > 0).all() and (silent.cancel_reach_ns > 0).all()
    assert (silent.cancel_stall_ns >= 0).all()  # measured, and what it allows did not acquit them

    unlatched = cancels[cancels.workload == "no_latch"]
    assert len(unlatched) == 4 and set(unlatched.outcome) <= {"cancelled", "dropped"}, \
        unlatched[["trial_id", "outcome", "t_cancel_forwarded_ns", "t_start_ns"]]

    for name, says in THIRD_REFERENCE_ERRORS.items():
        rows = df[df.workload == name].sort_values("t_handback_ns")
        assert list(rows.outcome) == ["completed", "completed", "error"] + ["cancelled"] * 4, \
            (name, rows[["trial_id", "outcome", "error"]].to_string())
        error = rows.error.iloc[2]
        assert all(s in error for s in says) and "\n" not in error, (name, error)

    assert df[df.outcome == "completed"].latency_ms.isna().all()  # a completed run has no stop to measure
    # the protocol says nothing of progress at receipt: unknown (null), not the agent's initial 0
    assert cancels.t_received_ns.notna().all()
    assert cancels.tokens_generated_at_receipt.isna().all() and cancels.input_tokens_done_at_receipt.isna().all()
    # an engine written on the engine library sends its trial thread's readings (1.3 done.cpu): the residue
    # split of every cancel it took, engine-reported; a lying reading is the error above, never a column
    took = cancels[cancels.outcome == "cancelled"]
    assert len(took) and (took.trial_cpu_source == "engine-reported").all() and (took.trial_cpu_ms >= 0).all()
    assert df[df.outcome == "error"].trial_cpu_ms.isna().all()
    assert (df.error.dropna().str.count("\n") == 0).all()
    children = re.findall(r"misbehave escapes: child pid (\d+)", " ".join(df.engine_stderr.dropna()))
    assert children, list(df[df.workload == "escapes"].engine_stderr)
    assert_none_left(tag)
    assert not any(psutil.pid_exists(int(p)) and psutil.Process(int(p)).status() != psutil.STATUS_ZOMBIE
                   for p in children)


def test_a_reference_run_that_reports_a_cancel_is_the_engines_error(tmp_path):
    tag = uuid.uuid4().hex
    text = header(["flag"], ["agent"], trials=1) + workload("claims", [PY, MISBEHAVE, "claims_cancel"],
                                                            "steps = 2, step_ms = 5")
    r, out = sweep(tmp_path, tag, text, "--no-summary")
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
    refs = read_records(out)
    assert len(refs) == 3 and set(refs.trial_kind) == {"reference"} and set(refs.outcome) == {"error"}, refs
    assert refs.error.str.contains("reported a cancel on a reference run").all(), list(refs.error)
    assert "reported a cancel on a reference run" in r.stderr, r.stderr[-3000:]
    assert_none_left(tag)


def test_an_engine_setting_that_is_not_a_finite_number_stops_the_sweep_before_any_trial(tmp_path):
    tag = uuid.uuid4().hex
    text = header(["flag"], ["agent"], trials=1) + workload("nan", [PY, MISBEHAVE, "nan_setting"])
    r, out = sweep(tmp_path, tag, text)
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    # NaN is not JSON: the line is refused as such (a 1e999 would parse as infinity: the next test)
    assert len(lines) == 1 and "not JSON" in lines[0] and "NaN" in lines[0] and "loaded" in lines[0], lines
    assert not list(out.rglob("*.parquet")) or read_records(out).empty
    assert_none_left(tag)


def test_loaded_settings_hold_only_declared_finite_values():
    """What an engine's loaded.settings may put into engine_settings_json (device_agents/engines/external.py)."""
    from cancelbench.device_agents.engines.external import checked_settings
    import importlib.util

    from cancelbench.sut.client import EngineError

    spec = importlib.util.spec_from_file_location("misbehave", MISBEHAVE)
    misbehave = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(misbehave)
    DECLARATION = misbehave.DECLARATION

    assert checked_settings(DECLARATION, {"step_ms": 7}) == {"step_ms": 7}
    for bad, says in (({"step_ms": float("inf")}, "step_ms must be an integer"),
                      ({"warp": 1}, "'warp', which is not a setting it declared"),
                      ({"steps": 0}, "steps must be >= 1")):
        with pytest.raises(EngineError, match=re.escape(says)):
            checked_settings(DECLARATION, bad)


def test_env_with_a_nul_and_a_missing_cwd_are_one_line_exit_2(tmp_path):
    tag = uuid.uuid4().hex
    for extra, says in (('cwd = "/nonexistent-dir-for-cancelbench"', "is not a directory"),):
        text = header(["flag"], ["agent"], trials=1) + workload("w", [PY, MISBEHAVE, "no_latch"], "", extra)
        r, out = sweep(tmp_path, tag, text)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not out.exists()
    cfg = tmp_path / "nul.toml"
    cfg.write_text(header(["flag"], ["agent"], trials=1) + workload("w", [PY, MISBEHAVE, "no_latch"])
                   .replace('env = {CB_TEST_ENGINE = "w"}', 'env = {CB_TEST_ENGINE = "w\\u0000x"}'))
    r = subprocess.run([PY, "-m", "cancelbench.cli", "sweep", "--config", str(cfg), "--out", str(tmp_path / "o2"),
                        "--quiet"], capture_output=True, text=True, timeout=600, env=sweep_env(tag))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "NUL" in lines[0], r.stderr[-2000:]
    assert "strerror" not in r.stderr and not (tmp_path / "o2").exists()
    assert_none_left(tag)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
