"""Hostile pass 4 (issue 33), each through the real command:

1. a corpus WAV entry that is a FIFO, a directory, not a string, not 16 kHz mono 16-bit PCM, empty,
   longer than 10 minutes or truncated: one line, exit 2, before Ray, nothing written (a FIFO is
   never opened);
2. a hello whose setting has min > max (or NaN/Infinity bounds): `sut-check`'s hello FAILs and a
   sweep exits 2 naming the setting;
3. an engine's text (its stderr, load error, run error, version) never reaches the terminal raw in a
   `cancelbench: error:` line, which stays one line without a traceback fragment;
4. a sweep whose engine crashed mid-trial prints the verdict it exits with (FAIL, exit 1) and says why
   on stderr in one line;
5. the report's Builds section shows an external engine's own version and build facts, escaped per
   medium, not the agent's llama.cpp build.

The engines are real processes: tests/data/engines/hostile_text.py (hostile text), raw_hello.py (a
hello verbatim) and misbehave.py (sigill). The sweeps of 3 and 4 start a local Ray (marked cluster).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import uuid
import wave
from pathlib import Path

import pytest

from cancelbench.sut.declaration import Declaration
from cancelbench.sut.protocol import ProtocolError
from report_fixtures import cell_rows, write_dataset
from test_cli import cancelbench
from test_external_engine import MISBEHAVE, assert_none_left, header, sweep, workload
from test_hostile_input import one_line_exit_2

PY = sys.executable
ENGINES = Path(__file__).resolve().parent / "data" / "engines"
HOSTILE = ENGINES / "hostile_text.py"
RAW_HELLO = ENGINES / "raw_hello.py"


def raw_controls(text: str) -> list[str]:
    """The control characters in ``text`` besides the newlines that end its lines."""
    return sorted({repr(c) for c in text if c != "\n" and (ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0)})


# --------------------------------------------------------------------- 1. corpus WAV entries

def write_wav(path: Path, rate: int = 16_000, channels: int = 1, width: int = 2, frames: int = 1600) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(b"\0" * (frames * channels * width))
    return path


def pcm_header(data_bytes: int) -> bytes:
    """A 16 kHz mono 16-bit PCM WAV header whose data chunk claims ``data_bytes``."""
    fmt = struct.pack("<HHIIHH", 1, 1, 16_000, 32_000, 2, 16)
    return (b"RIFF" + struct.pack("<I", min(36 + data_bytes, 0xFFFFFFFF)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", data_bytes))


def huge_wav(path: Path) -> Path:
    """A 4 GiB WAV (sparse: a header, then a hole) claiming about 37 hours of audio."""
    path.write_bytes(pcm_header(0xFFFFFFF0))
    os.truncate(path, 4 << 30)
    return path


def truncated_wav(path: Path) -> Path:
    path.write_bytes(pcm_header(32_000 * 10) + b"\0" * 100)  # claims 10 s, holds 100 bytes
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)  # nobody writes it: opening it for reading would wait for ever
    return path


def directory(path: Path) -> Path:
    path.mkdir()
    return path


WAV_CASES = {
    # id: (makes the entry's value from a path in tmp_path, what the one line says)
    "fifo": (lambda p: str(fifo(p)), ["is not a regular file", "FIFO"]),
    "directory": (lambda p: str(directory(p)), ["is a directory"]),
    "integer": (lambda p: 5, ["'wav' must be a string", "got int 5"]),
    "list": (lambda p: [str(p)], ["'wav' must be a string", "got list"]),
    "table": (lambda p: {"path": str(p)}, ["'wav' must be a string", "got dict"]),
    "8-bit": (lambda p: str(write_wav(p, width=1)), ["8-bit samples", "16000 Hz mono 16-bit PCM"]),
    "32-bit": (lambda p: str(write_wav(p, width=4)), ["32-bit samples", "16000 Hz mono 16-bit PCM"]),
    "0 frames": (lambda p: str(write_wav(p, frames=0)), ["holds no audio (0 frames)"]),
    "4 GiB": (lambda p: str(huge_wav(p)), ["more than the 600 s (10 minutes)"]),
    "truncated": (lambda p: str(truncated_wav(p)), ["is truncated", "320000 bytes", "holds 100"]),
}


@pytest.mark.parametrize("case", list(WAV_CASES))
def test_a_bad_corpus_wav_is_one_line_exit_2_before_ray(tmp_path, case):
    make, says = WAV_CASES[case]
    corpus = tmp_path / "clips.jsonl"
    corpus.write_text(json.dumps({"id": "c1", "wav": make(tmp_path / "clip.wav")}) + "\n")
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(f"""
[sweep]
trials_per_cell = 1
mechanisms = ["between_calls"]
deliveries = ["agent"]
[[workload]]
name = "stt"
engine = "stt"
model = "fixture:qwen3asr-fixture"
mmproj = "fixture:qwen3asr-fixture"
inputs = "{corpus}"
""")
    out = tmp_path / "out"
    r = cancelbench("sweep", "--config", cfg, "--out", out, "--quiet")
    one_line_exit_2(r, f"{corpus}:1", *says)
    assert r.stdout == "" and not out.exists()


# --------------------------------------------------------------------- 2. hello settings

def hello(setting: str) -> str:
    """A hello line with one setting, as text (JSON's NaN and Infinity written as Python reads them)."""
    return ('{"type":"hello","protocol":1,"engine":{"name":"raw","version":"1"},"clock":"CLOCK_MONOTONIC",'
            '"input":"text","phases":[{"name":"work","steps":true}],"mechanisms":[{"name":"flag","reaches":"x"}],'
            f'"settings":[{setting}]}}')


HELLO_CASES = {
    # id: (the setting, what the refusal names; None: refused, whatever the words)
    "min above max": ('{"name":"steps","type":"int","default":null,"min":10,"max":1}',
                      ["setting steps", "min 10 is greater than max 1"]),
    "NaN min": ('{"name":"temp","type":"float","default":0.5,"min":NaN,"max":1}', None),
    "Infinity max": ('{"name":"temp","type":"float","default":null,"min":0,"max":Infinity}', None),
    "-Infinity min": ('{"name":"steps","type":"int","default":5,"min":-Infinity}', None),
}


@pytest.mark.parametrize("case", list(HELLO_CASES))
def test_a_hello_with_impossible_bounds_fails_sut_check_and_the_sweep(tmp_path, case):
    """The sweep's pre-flight reads the hello before Ray starts: exit 2, one line, nothing written.
    (NaN and Infinity are refused where the engine's line is read, as not RFC 8259 JSON, or by
    Declaration.from_hello: either way the hello FAILs.)"""
    setting, says = HELLO_CASES[case]
    command = [PY, RAW_HELLO, hello(setting)]
    check = cancelbench("sut-check", "--", *command)
    assert check.returncode == 1, check.stdout + check.stderr
    first = check.stdout.splitlines()[0]
    assert first.startswith("FAIL hello: ") and all(s in first for s in says or []), check.stdout

    cfg, out = tmp_path / "sweep.toml", tmp_path / "out"
    cfg.write_text(header(["flag"], ["agent"], trials=1) + workload("w", command))
    r = cancelbench("sweep", "--config", cfg, "--out", out, "--quiet")
    one_line_exit_2(r, "workload[0]", *(says or []))
    assert not out.exists()


@pytest.mark.parametrize("bounds", [{"min": math.nan}, {"max": math.inf}, {"min": -math.inf, "max": 1},
                                    {"min": 2, "max": 1}, {"min": 2.5, "max": 2.0}])
def test_declaration_from_hello_refuses_non_finite_or_crossed_bounds(bounds):
    """A hello that reached Declaration.from_hello with such bounds (Python's json reads NaN and
    Infinity; the wire's strict reader is one caller, not the only one): one line naming the setting."""
    msg = json.loads(hello(json.dumps({"name": "temp", "type": "float", "default": None, **bounds})))
    with pytest.raises(ProtocolError) as exc:
        Declaration.from_hello(msg)
    text = str(exc.value)
    assert "setting temp" in text and "\n" not in text, text


# --------------------------------------------------------------------- 3. terminal-safe error lines

def hostile_sweep(tmp_path: Path, tag: str, mode: str, *extra):
    return sweep(tmp_path, tag, header(["flag"], ["agent"], trials=1) + workload("w", [PY, HOSTILE, mode]), *extra)


def test_an_engines_stderr_before_hello_is_escaped_in_the_error_line(tmp_path):
    """The pre-flight's error carries the engine's stderr tail: escaped, one line (no Ray yet)."""
    r, out = hostile_sweep(tmp_path, uuid.uuid4().hex, "stderr_exit")
    line = one_line_exit_2(r, "exiting before hello", "\\x1b[2J", "\\x07", "\\x00")
    assert raw_controls(r.stderr) == [], line
    assert not out.exists()


@pytest.mark.cluster
def test_an_engines_load_error_and_version_are_escaped_in_the_error_line(tmp_path):
    """The agent's load fails with the engine's text (which names its hostile version): the sweep's
    one error line (exit 2, nothing written) holds it escaped."""
    tag = uuid.uuid4().hex
    r, out = hostile_sweep(tmp_path, tag, "load_error")
    line = one_line_exit_2(r, "cannot load", "(version 1.0\\x1b[2J\\x1b]0;owned\\x07")
    assert raw_controls(r.stderr) == [], line
    assert not out.exists()
    assert_none_left(tag)


@pytest.mark.cluster
def test_a_stopped_devices_line_is_escaped_one_line_and_has_no_traceback(tmp_path):
    """Every reference run fails with the engine's text: the device stops (exit 1) and its one
    `cancelbench: error:` line holds that text escaped, without the traceback the record keeps; the
    summary, with no cancel record to report, says so instead of a traceback."""
    tag = uuid.uuid4().hex
    r, out = hostile_sweep(tmp_path, tag, "run_error")
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cancelbench: error: "), r.stderr[-3000:]
    assert "none of the 3 reference runs of flag completed" in lines[0] and "run failed \\x1b[2J" in lines[0]
    assert raw_controls(r.stderr) == [] and raw_controls(r.stdout) == [], lines[0]
    assert "Traceback" not in r.stderr and 'File "' not in r.stderr, r.stderr[-3000:]
    assert "no summary: " in r.stdout, r.stdout[-3000:]
    assert_none_left(tag)


# --------------------------------------------------------------------- 4, 5. a crash mid-sweep; Builds

@pytest.mark.cluster
def test_a_crash_mid_sweep_prints_the_verdict_it_exits_with_and_says_why(tmp_path):
    """misbehave.py kills itself with SIGILL in its third run (a reference): an `error` record, the
    engine restarted, the sweep exits 1 (the restarted engine's only run, the cancel trial, is its first:
    with N = 2 it was its second, and a cancel that came after its first step on a loaded host met the
    defect again: two errors). The summary's verdict says FAIL, exit 1, and why; stderr says
    why in one line. Beside it a working engine with a hostile version and build facts: the report's
    Builds section shows them escaped, and no llama.cpp build (no built-in engine ran)."""
    tag = uuid.uuid4().hex
    text = (header(["flag"], ["agent"], trials=1)
            + workload("crash", [PY, MISBEHAVE, "sigill", 3], "steps = 3, step_ms = 5")
            + workload("hostile", [PY, HOSTILE, "serve"]))
    r, out = sweep(tmp_path, tag, text)
    assert r.returncode == 1, r.stderr[-3000:]
    verdict = [line for line in r.stdout.splitlines() if line.startswith(("PASS", "WARN", "FAIL"))]
    assert len(verdict) == 1, r.stdout[-3000:]
    assert verdict[0].startswith("FAIL: ") and "1 trial(s) ended in error" in verdict[0], verdict[0]
    assert "; exit 1 - " in verdict[0] and "exit 0" not in verdict[0], verdict[0]
    ours = [line for line in r.stderr.splitlines() if line.startswith("cancelbench:")]
    assert len(ours) == 1 and ours[0].startswith("cancelbench: error: the sweep failed (exit 1): "), r.stderr[-3000:]
    assert "1 trial(s) ended in error" in ours[0] and "killed by SIGILL" in ours[0], ours[0]
    assert raw_controls(r.stdout) == [] and raw_controls(r.stderr) == []

    report_txt = (out / "report.txt").read_text()
    assert "FAIL: " in report_txt and "; exit 1 - " in report_txt  # the file the sweep wrote says the same
    builds = report_txt.split("== Builds ==", 1)[1]
    assert re.search(r"engine hostile: version +1\.0\\x1b\[2J\\x1b\]0;owned\\x07\\rX\\x00Y\\x1b\[31mred$", builds,
                     re.M), builds
    assert re.search(r"engine hostile: compiler +cc\\x1b\[2J", builds), builds
    assert re.search(r"engine misbehave: version +1$", builds, re.M), builds
    assert "llama_cpp_build" not in builds and raw_controls(report_txt) == [], builds
    assert raw_controls((out / "report.html").read_text()) == []
    assert_none_left(tag)


def test_builds_show_an_external_engines_own_build_escaped_per_medium(tmp_path):
    """One device ran an external engine only, another a built-in one: the first's Builds rows are its
    host facts and the engine's version and build facts (never the agent's llama.cpp build, which its
    records carry too); the second's are the llama.cpp build. Terminal, Markdown and HTML escape them."""
    evil = "\x1b[2J\x1b]0;t\x07\r\x00<b>|"
    rows = cell_rows("ext", [1.0, 2.0, 3.0, 4.0, 5.0], workload="acme", engine="external", engine_name="acme",
                     engine_version="2.1" + evil, engine_build_json=json.dumps({"compiler": "gcc" + evil}),
                     llama_cpp_build="b9999-agent", os_release="Debian 12")
    rows += cell_rows("txt", [1.0, 2.0, 3.0, 4.0, 5.0], host="hostB", workload="text", engine="text",
                      llama_cpp_build="b1234", os_release="Debian 12")
    d = write_dataset(tmp_path / "d", rows)

    term = cancelbench("report", d)
    assert term.returncode == 0, term.stderr
    builds = term.stdout.split("== Builds ==", 1)[1]
    a = [line for line in builds.splitlines() if line.startswith("hostA/")]
    b = [line for line in builds.splitlines() if line.startswith("hostB/")]
    assert any("engine acme: version" in line and "2.1\\x1b[2J\\x1b]0;t\\x07\\r\\x00<b>|" in line for line in a), a
    assert any("engine acme: compiler" in line and "gcc\\x1b[2J" in line for line in a), a
    assert any("os_release" in line for line in a) and not any("llama_cpp_build" in line for line in a), a
    assert any("llama_cpp_build" in line and "b1234" in line for line in b) and "b9999-agent" not in builds, b
    assert not any("engine " in line for line in b), b
    assert raw_controls(term.stdout) == []

    md = cancelbench("report", d, "--format", "markdown")
    assert md.returncode == 0, md.stderr
    assert "| engine acme: version | 2.1\\\\x1b\\[2J" in md.stdout and "&lt;b&gt;\\|" in md.stdout, md.stdout[-3000:]
    assert raw_controls(md.stdout) == [] and "<b>" not in md.stdout

    page = cancelbench("report", d, "--format", "html")
    assert page.returncode == 0, page.stderr
    assert "engine acme: version" in page.stdout and "&lt;b&gt;|" in page.stdout
    assert raw_controls(page.stdout) == [] and "<b>|" not in page.stdout
