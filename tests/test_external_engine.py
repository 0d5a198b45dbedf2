"""`engine = "external"` through the real `cancelbench sweep` (docs/sut-protocol.md, "What the agent
does with a misbehaving engine"): a defective engine's dropped cancels fail the sweep, a bad engine at
start-up is one line and exit 2 with nothing written, a bad engine mid-sweep is an `error` record and a
restarted engine (its stderr kept in the records shows the new process), and neither the sweep's end nor a
signal leaves an engine process (or its reaper) behind.

Real `cancelbench` processes with their own local Ray; the engines are real processes: the built-in
sim engine out of process, cancelbench.sut.defective, and tests/data/engines/misbehave.py.

Leftover processes are found by a marker, not by name: every command of a test runs with
``CB_TEST_TAG=<uuid>`` in its environment, which reaches every process it starts (its Ray, the agents,
the engines the agents start, and the engines' reapers, which inherit the agent's environment); each
workload also sets ``CB_TEST_ENGINE=<its name>`` in its engine's environment (the workload's ``env``),
so a leftover is named. Several cases share one sweep (one engine process per workload): Ray's
start-up is the cost of a sweep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from cancelbench.sink import read_manifest, read_records

PY = sys.executable
MISBEHAVE = Path(__file__).resolve().parent / "data" / "engines" / "misbehave.py"
SIM = [PY, "-m", "cancelbench.sut.builtin", "sim"]
TAG, ENGINE_TAG = "CB_TEST_TAG", "CB_TEST_ENGINE"
GONE_WITHIN_S = 120.0  # a generous deadline for processes to go (a loaded 2-core CI host)


# --------------------------------------------------------------------- helpers

def sweep_env(tag: str) -> dict:
    return {**os.environ, TAG: tag}


def cancelbench(tag: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "cancelbench.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=sweep_env(tag))


def sweep(tmp_path: Path, tag: str, text: str, *extra) -> tuple[subprocess.CompletedProcess, Path]:
    cfg, out = tmp_path / "sweep.toml", tmp_path / "out"
    cfg.write_text(text)
    return cancelbench(tag, "sweep", "--config", cfg, "--out", out, "--quiet", *extra), out


def toml_list(argv: list) -> str:
    return json.dumps([str(a) for a in argv])  # a JSON array of strings is a TOML array


def workload(name: str, command: list, settings: str = "", extra: str = "") -> str:
    return f"""
[[workload]]
name = "{name}"
engine = "external"
command = {toml_list(command)}
env = {{{ENGINE_TAG} = "{name}"}}
{extra}
{f"settings = {{{settings}}}" if settings else ""}
"""


def header(mechanisms: list[str], deliveries: list[str], trials: int, plan: str = "immediate") -> str:
    return f"""
[sweep]
seed = 7
trials_per_cell = {trials}
reference_runs = 3
mechanisms = {json.dumps(mechanisms)}
deliveries = {json.dumps(deliveries)}
ping_samples = 3
[offsets]
plan = "{plan}"
"""


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``CB_TEST_TAG=tag`` (zombies are gone: they run nothing)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.environ().get(TAG) != tag or p.status() == psutil.STATUS_ZOMBIE:
                continue
            found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} [{p.environ().get(ENGINE_TAG, '-')}] {' '.join(p.cmdline())[:120]}"
    except psutil.Error:
        return f"{p.pid} (gone)"


def assert_none_left(tag: str) -> None:
    """Poll until no process carries the tag (a deadline, never a fixed sleep); kill and fail if some stay."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        left = tagged(tag)
        if not left:
            return
        if time.monotonic() > deadline:
            names = [describe(p) for p in left]
            for p in left:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            pytest.fail(f"processes left behind: {names}")
        time.sleep(0.1)


def exactly_once(out: Path, df) -> None:
    """Every planned trial has exactly one record."""
    planned = pq.read_table(out / "plan.parquet", columns=["trial_id"]).column("trial_id").to_pylist()
    assert df.trial_id.is_unique and len(planned) == len(set(planned))
    assert set(df.trial_id) == set(planned)


# --------------------------------------------------------------------- 1. a defective engine fails the sweep

ACTIVATE_MS = 1000  # the defective engine's window: an immediate cancel lands well inside it


def test_defective_engine_drops_early_cancels_and_fails_the_sweep(tmp_path):
    """cancelbench.sut.defective drops a cancel that arrives before its backend is active (its first
    ACTIVATE_MS of a run): immediate cancels, both deliveries, are recorded `dropped`, exit 1, the verdict
    FAIL. The same sweep runs the sim engine out of process too, whose cancels work: the FAIL is the
    defective engine's."""
    tag = uuid.uuid4().hex
    text = (header(["between_calls"], ["driver", "agent"], trials=2)
            + workload("defective", [PY, "-m", "cancelbench.sut.defective"],
                       f"activate_ms = {ACTIVATE_MS}, sim_phase_us = 2000, sim_steps = 2")
            # the sound engine's run outlasts an immediate cancel's trip on a loaded host by far (its first
            # phase: 200 ms): a cancel that came after a 4 ms run completed it (a flaky `completed`)
            + workload("sound", SIM, "sim_phase_us = 200000, sim_steps = 2"))
    r, out = sweep(tmp_path, tag, text)
    assert r.returncode == 1, r.stderr[-3000:]
    summary = [line for line in r.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert summary and summary[0].startswith("FAIL") and "dropped" in summary[0], r.stdout[-3000:]

    df = read_records(out)
    exactly_once(out, df)
    assert read_manifest(out)["status"] == "complete"
    cancels = df[df.trial_kind == "cancel"]
    bad, good = cancels[cancels.workload == "defective"], cancels[cancels.workload == "sound"]
    assert set(bad.delivery) == {"driver", "agent"} and len(bad) == 4 and len(good) == 4
    assert set(bad.outcome) == {"dropped"}, bad[["trial_id", "outcome", "error"]].to_string()
    assert bad.t_engine_received_ns.notna().all()  # the engine read the cancel, then completed anyway
    assert set(good.outcome) == {"cancelled"}, good[["trial_id", "outcome", "error"]].to_string()
    assert set(df[df.trial_kind == "reference"].outcome) == {"completed"}
    assert (df.loc[df.workload == "defective", "engine_name"] == "cancelbench-defective-sim").all()

    report = cancelbench(tag, "report", out)
    assert report.returncode == 1, report.stderr[-3000:]
    assert any(line.startswith("FAIL") and "dropped" in line for line in report.stdout.splitlines()), \
        report.stdout[-3000:]
    assert_none_left(tag)


# --------------------------------------------------------------------- 2. refused before any trial

def not_executable(tmp_path: Path) -> list:
    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\nexec true\n")
    script.chmod(0o644)
    return [script]


STARTUP_CASES = {
    # id: (command, workload extra keys, sweep mechanisms, settings, what the line must say)
    "not executable": (not_executable, "", ["flag"], "", ["cannot start the engine", "Permission denied"]),
    "exit_at_start": (lambda _: [PY, MISBEHAVE, "exit_at_start"], "", ["flag"], "",
                      ["exited with status 3", "exiting before hello"]),
    "never_hello": (lambda _: [PY, MISBEHAVE, "never_hello"], "startup_timeout_s = 2", ["flag"], "",
                    ["said nothing for 2 s", "hello"]),
    "wrong_version": (lambda _: [PY, MISBEHAVE, "wrong_version"], "", ["flag"], "",
                      ["the engine speaks protocol 2; this cancelbench speaks 1"]),
    "undeclared setting": (lambda _: SIM, "", ["between_calls"], "sim_steps = 2, warp_factor = 9",
                           ["warp_factor is not a setting of the cancelbench-sim engine", "sim_phase_us"]),
    "setting out of bounds": (lambda _: SIM, "", ["between_calls"], "sim_steps = 0",
                              ["sim_steps must be >= 1, got 0"]),
    "undeclared mechanism": (lambda _: [PY, MISBEHAVE, "ignores_shutdown"], "", ["between_calls"], "",
                             ["no mechanism(s) between_calls", "has: flag"]),
}


@pytest.mark.parametrize("case", list(STARTUP_CASES))
def test_a_bad_engine_or_config_at_start_is_one_line_exit_2_and_writes_nothing(tmp_path, case):
    """Found by the driver's pre-flight of the engine (its hello), before Ray and before any trial. The
    undeclared mechanism's engine ignores shutdown: the pre-flight still leaves no process behind."""
    command, extra, mechanisms, settings, says = STARTUP_CASES[case]
    tag = uuid.uuid4().hex
    text = header(mechanisms, ["agent"], trials=1) + workload("w", command(tmp_path), settings, extra)
    r, out = sweep(tmp_path, tag, text)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cancelbench: error: "), r.stderr[-3000:]
    assert all(s in lines[0] for s in says), lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not out.exists()  # no manifest, no records, no plan
    assert_none_left(tag)


# --------------------------------------------------------------------- 3, 4. misbehaving mid-sweep

# mode: (N, what the error record says). A defect happens in the N-th run of an engine process: with 3
# references and 1 cancel trial, N = 3 breaks the third reference and the cancel trial runs on a
# restarted engine; two_dones's second done lands on the next trial (the third reference), so N = 2.
MIDSWEEP = {
    "not_json": (3, ["not JSON"]),
    "huge_line": (3, ["over 1 MiB"]),
    "other_clock": (3, ["not on the clock"]),
    "unknown_trial": (3, ["phase event", "not-running", "which is not running"]),
    "two_dones": (2, ["done event", "which is not running"]),
    "close_stdout": (3, ["closed its stdout", "(still running)"]),
    "sigill": (3, ["closed its stdout", "killed by SIGILL"]),
    "silent": (3, ["answered nothing", "answer_timeout_s = 2"]),
}


def test_misbehaving_engines_mid_sweep_are_error_records_restarted_and_leave_nothing(tmp_path):
    """One sweep, one misbehave.py workload per mode: each defect is an `error` record naming it, later
    trials of the workload run on a restarted engine, the sweep completes (exit 1: error records) with
    every planned trial once, and no engine or reaper is left. The last workload's engine ignores
    shutdown, end of stdin and SIGTERM, and is the one running when the sweep ends: it is gone too."""
    tag = uuid.uuid4().hex
    text = header(["flag"], ["agent"], trials=1)
    for mode, (n, _) in MIDSWEEP.items():
        text += workload(mode, [PY, MISBEHAVE, mode, n], "steps = 3, step_ms = 5", "answer_timeout_s = 2")
    text += workload("ignores_shutdown", [PY, MISBEHAVE, "ignores_shutdown"], "steps = 3, step_ms = 5")
    r, out = sweep(tmp_path, tag, text, "--no-summary")
    assert r.returncode == 1, r.stderr[-3000:]
    manifest = read_manifest(out)
    assert manifest["status"] == "complete" and not manifest.get("not_run"), manifest.get("not_run")
    df = read_records(out)
    exactly_once(out, df)
    assert set(df.workload) == set(MIDSWEEP) | {"ignores_shutdown"}

    for mode, (n, says) in MIDSWEEP.items():
        rows = df[df.workload == mode].sort_values("t_handback_ns")
        outcomes = list(rows.outcome)
        trial_of_error = 3  # the third reference (the N-th run, or the one after two_dones's N-th)
        assert outcomes[trial_of_error - 1] == "error", (mode, rows[["trial_id", "outcome", "error"]].to_string())
        error = rows.error.iloc[trial_of_error - 1]
        assert all(s in error for s in says), (mode, error)
        assert outcomes[:trial_of_error - 1] == ["completed"] * (trial_of_error - 1), (mode, outcomes)
        # restarted: the trial after the error ran on a fresh engine process, and ran well
        assert outcomes[trial_of_error:] == ["cancelled"], (mode, rows[["trial_id", "outcome", "error"]].to_string())
        assert rows.error.iloc[trial_of_error:].isna().all(), mode

        # engine_stderr keeps the engine's own stderr: each process's first line names its pid, so the
        # first record shows the first process and the record after the error a new one
        first, after = pids(rows.engine_stderr.iloc[0]), pids(rows.engine_stderr.iloc[trial_of_error])
        assert len(first) == 1 and len(after) == 1 and first != after, (mode, list(rows.engine_stderr))

    quiet = df[df.workload == "ignores_shutdown"]
    assert (quiet.outcome != "error").all(), quiet[["trial_id", "outcome", "error"]].to_string()
    assert_none_left(tag)


def pids(stderr) -> set[str]:
    """The pids misbehave.py's start-up line names in one record's engine_stderr."""
    return set(re.findall(r"^misbehave \w+: pid (\d+) serving$", stderr or "", re.M))


# --------------------------------------------------------------------- 5. signals

SIGNALS = [("SIGINT", signal.SIGINT, 130), ("SIGTERM", signal.SIGTERM, 143), ("SIGHUP", signal.SIGHUP, 129)]


@pytest.mark.parametrize("name, sig, code", SIGNALS, ids=[s[0] for s in SIGNALS])
def test_a_signal_mid_sweep_leaves_no_engine_and_no_reaper(tmp_path, name, sig, code):
    """The sim engine's references take ten minutes a phase: the sweep is mid-trial when the signal lands,
    once the manifest says running and the agent's engine (not the driver's pre-flight one) and its
    reaper are up."""
    tag = uuid.uuid4().hex
    cfg, out = tmp_path / "sweep.toml", tmp_path / "out"
    cfg.write_text(header(["between_calls"], ["agent"], trials=1)
                   + workload("slow", SIM, "sim_phase_us = 600000000, sim_steps = 1"))
    proc = subprocess.Popen([PY, "-m", "cancelbench.cli", "sweep", "--config", str(cfg), "--out", str(out),
                             "--quiet", "--no-summary"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=sweep_env(tag))
    try:
        engine, reaper = wait_for_agent_engine(proc, out, tag)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # the test failed mid-way: end the sweep and the Ray it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, err[-3000:]
    assert f"interrupted by {name}" in err, err[-3000:]
    assert read_manifest(out)["status"] == "interrupted"
    assert_none_left(tag)
    assert gone(engine) and gone(reaper)


def wait_for_agent_engine(proc: subprocess.Popen, out: Path, tag: str) -> tuple[psutil.Process, psutil.Process]:
    """Poll (never a fixed sleep) until the sweep runs and the agent's engine and that engine's reaper are up."""
    deadline = time.monotonic() + 300

    def running() -> bool:
        try:
            return read_manifest(out).get("status") == "running"
        except Exception:  # not written yet
            return False

    while True:
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended (rc {proc.returncode}) before its engine ran: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting for the agent's engine")
        if running():
            procs = tagged(tag)
            engines = [p for p in procs if _env(p).get(ENGINE_TAG) == "slow" and _ppid(p) != proc.pid]
            for e in engines:
                # python -m cancelbench.sut.reaper PGID MARK
                reapers = [p for p in procs if _cmdline(p)[-3:-1] == ["cancelbench.sut.reaper", str(e.pid)]]
                if reapers:
                    return e, reapers[0]
        time.sleep(0.1)


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _env(p: psutil.Process) -> dict:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _ppid(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.Error:
        return None


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_a_known_answer_engine_out_of_process_fills_its_column():
    """The sim engine out of process, cancelled mid-wait by the agent's control (the agent's own code
    path, no Ray): its done counter known_answer_error_ns (1.4) is the record's known_answer_error_ms,
    as in process."""
    from cancelbench.device_agents.engines.external import ExternalEngine
    from helpers import cancel_at_first_step

    engine = ExternalEngine({"command": SIM, "settings": {"sim_phase_us": 2_000_000, "sim_granularity_us": 1_000,
                                                           "sim_steps": 2}})
    try:
        result, cols = cancel_at_first_step(engine, "ka.0", wait_s=GONE_WITHIN_S)
        assert result.outcome == "cancelled", cols
        counters = json.loads(cols["engine_counters_json"])
        assert counters["known_answer_error_ns"] >= 0
        assert cols["known_answer_error_ms"] == counters["known_answer_error_ns"] / 1e6
    finally:
        engine.close()


def test_a_step_open_at_the_engines_receipt_is_read_from_its_own_step_events():
    """native_call_at_receipt of an engine that names no call: "step" only where its step events show a
    step open at its receipt, not where the agent's view was open when it wrote the cancel (a step's end
    may still be on its way: CI at 477be62)."""
    from cancelbench.device_agents.engines.external import step_open_at

    edges = [(100, True), (200, False), (300, True), (400, False)]
    assert [step_open_at(edges, t) for t in (50, 100, 150, 200, 250, 300, 399, 400, 500)] == \
        [False, True, True, False, False, True, True, False, False]
    assert step_open_at([], 10) is False and step_open_at([(5, True)], 10) is True  # a step never closed
