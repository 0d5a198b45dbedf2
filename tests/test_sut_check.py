"""`cancelbench sut-check` through the real command, on real engine processes: the
Python library's engines, the C engine, the defective engine and a bad one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cancelbench import native
from cancelbench.datasets.fixtures import ensure_text_fixture

ROOT = Path(__file__).resolve().parents[1]
MISBEHAVE = ROOT / "tests" / "data" / "engines" / "misbehave.py"


def sut_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cancelbench.cli", "sut-check", *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def lines(out: str) -> dict[str, str]:
    """check name -> PASS/FAIL, from the text output."""
    got = {}
    for line in out.splitlines():
        verdict, _, rest = line.partition(" ")
        if verdict in ("PASS", "FAIL"):
            got[rest.split(":")[0]] = verdict
    return got


CHECKS = {"hello", "clock", "load", "phases", "steps", "cancel_before_run", "cancel_word", "cpu", "cancel_after_done",
          "malformed_input", "shutdown"}


@pytest.fixture(scope="module")
def small_model() -> str:
    return str(ensure_text_fixture("text-qwen3-14m"))


# Phases long enough that a cancel aimed at each lands inside it on a loaded runner: with 4
# tokens to generate, CI's generate phase once ended within the cancel's reach (SKIP, not PASS).
PHASE_SETTINGS = ("--setting", "prompt_tokens=128", "--setting", "max_tokens=64")


def test_the_python_text_engine_passes_every_check(small_model):
    r = sut_check("--model", small_model, "--mechanism", "abort_callback", *PHASE_SETTINGS,
                  "--setting", "n_batch=16", "--",
                  sys.executable, "-m", "cancelbench.sut.builtin", "text")
    got = lines(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert CHECKS | {"cancel_in_prefill", "cancel_in_generate"} <= set(got), got
    assert set(got.values()) == {"PASS"}
    assert "sut-check: 13 passed, 0 failed" in r.stdout


def test_the_c_engine_passes_every_check(small_model):
    engine = native.sut_text_engine_path()
    if not engine.exists():
        pytest.fail(f"{engine} is not built: `make setup` builds it (native/build_sut_engine.sh)")
    r = sut_check("--model", small_model, "--mechanism", "abort_callback", *PHASE_SETTINGS,
                  "--format", "json", "--", str(engine))
    report = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert report["engine"]["name"] == "c-text" and report["failed"] == report["skipped"] == 0
    assert {c["name"] for c in report["checks"]} >= CHECKS | {"cancel_in_prefill", "cancel_in_generate"}


def test_the_defective_engine_fails_the_latch_check():
    """The field bug: a cancel that arrives before the backend is active is dropped."""
    r = sut_check("--", sys.executable, "-m", "cancelbench.sut.defective")
    got = lines(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert got["cancel_before_run"] == "FAIL" and "dropped" in r.stdout
    assert got["cancel_word"] == "FAIL"  # it declares the shared cancel word (the server does) and never reads it
    assert got["hello"] == got["phases"] == got["shutdown"] == "PASS"  # only its defect fails


def test_an_engine_of_another_protocol_version_fails_at_hello_and_the_rest_is_not_run():
    r = sut_check("--format", "json", "--", sys.executable, str(MISBEHAVE), "wrong_version")
    report = json.loads(r.stdout)
    assert r.returncode == 1
    first, *rest = report["checks"]
    assert first == {"name": "hello", "ok": False, "detail": "the engine speaks protocol 2; this cancelbench speaks 1",
                     "skipped": False}
    assert rest and all(not c["ok"] and c["detail"] == "not run: hello failed" for c in rest)


@pytest.mark.parametrize("args, message", [
    ((), "give the engine's command after --"),
    (("--setting", "nope=1"), "nope is not a setting of the cancelbench-sim engine"),
    (("--setting", "sim_steps=0"), "sim_steps must be >= 1"),
    (("--mechanism", "telepathy"), "--mechanism telepathy: the engine declares"),
    (("--model", "/nonexistent.gguf"), "not a file"),
    (("--startup-timeout", "-1"), "--startup-timeout must be a number of seconds in [1, 600], got -1.0"),
    (("--startup-timeout", "inf"), "got inf"),
    (("--startup-timeout", "nan"), "got nan"),
    (("--startup-timeout", "0"), "got 0.0"),
])
def test_bad_options_are_one_line_and_exit_2(args, message):
    command = () if not args else ("--", sys.executable, "-m", "cancelbench.sut.builtin", "sim")
    r = sut_check(*args, *command)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr and r.stdout == ""
