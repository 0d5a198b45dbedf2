"""Defects a hostile pass found (issue 11), each with the test that failed before its fix.

Real files, real GGUF fixtures, real `cancelbench` processes with their own local Ray.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cancelbench.device_agents.model_check import ModelMismatchError, check_model
from cancelbench.schema import empty_row
from cancelbench.sink import LOCK_FILE, RecordSink, SinkError, read_manifest, read_records, write_json_atomic
from test_cli import cancelbench, write


def start(*args) -> subprocess.Popen:
    """A `cancelbench` process in its own session, so a failed test can end it with its Ray (killpg)."""
    return subprocess.Popen([sys.executable, "-m", "cancelbench.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(predicate, what: str, proc: subprocess.Popen | None = None, timeout_s: float = 240.0) -> None:
    """Poll an observable state (never a fixed sleep); fail if the process ends first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"process ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def dataset(path: Path) -> Path:
    write_json_atomic(path / "manifest.json", {"schema_version": 1, "sweep_id": "test"})
    return path


def row(trial_id: str, **kw) -> dict:
    return empty_row() | {"trial_id": trial_id, "trial_kind": "cancel", "outcome": "cancelled", "backend": "cpu",
                          "host": "h", "latency_ms": 1.0} | kw


# ------------------------------------------------------------------- sink: flush rule and failures

def test_a_record_is_flushed_after_flush_seconds_even_if_no_other_record_arrives(tmp_path):
    sink = RecordSink(dataset(tmp_path), flush_every=1000, flush_seconds=0.1)
    sink.add(row("t1"))
    wait_for(lambda: any((tmp_path / "records").rglob("*.parquet")), "the timer flush", timeout_s=60)
    sink.close()
    assert read_records(tmp_path).trial_id.tolist() == ["t1"]


def test_a_failed_flush_loses_no_record(tmp_path):
    """A value the schema cannot hold (int32 overflow) used to lose every buffered record."""
    sink = RecordSink(dataset(tmp_path), flush_every=4)
    for i in range(3):
        sink.add(row(f"good{i}"))
    sink.add(row("bad", n_threads=2**40))  # the 4th record triggers the flush
    sink.add(row("later"))
    with pytest.raises(SinkError, match="1 record"):
        sink.close()
    assert sorted(read_records(tmp_path).trial_id) == ["good0", "good1", "good2", "later"]
    kept = [json.loads(line) for f in tmp_path.glob("unwritten-*.jsonl") for line in f.read_text().splitlines()]
    assert [(r["trial_id"], r["n_threads"]) for r in kept] == [("bad", 2**40)]


# ------------------------------------------------------------------- model architecture vs engine

@pytest.fixture(scope="module")
def fixture_files():
    from cancelbench.datasets.fixtures import ensure_fixture

    return {"llama": ensure_fixture("text-llama-57m"),
            "talker": ensure_fixture("qwen3tts-fixture", "model"),
            "tts_mmproj": ensure_fixture("qwen3tts-fixture", "mmproj"),
            "asr_text": ensure_fixture("qwen3asr-fixture", "model"),
            "asr_mmproj": ensure_fixture("qwen3asr-fixture", "mmproj")}


FITS = [("llama", "text", "model"), ("asr_text", "text", "model"), ("talker", "tts", "model"),
        ("tts_mmproj", "tts", "mmproj"), ("asr_text", "stt", "model"), ("asr_mmproj", "stt", "mmproj")]
MISFITS = [("talker", "text", "model", "TTS talker"), ("tts_mmproj", "text", "model", "an mmproj"),
           ("llama", "tts", "model", "needs a TTS talker"), ("asr_text", "tts", "model", "needs a TTS talker"),
           ("asr_mmproj", "tts", "mmproj", "no 'qwen3tts_gen' projector"),
           ("llama", "tts", "mmproj", "not an mmproj"), ("talker", "stt", "model", "TTS talker"),
           ("tts_mmproj", "stt", "mmproj", "no 'qwen3a' projector")]


@pytest.mark.parametrize("name,engine,role", FITS)
def test_model_check_accepts_the_right_files(fixture_files, name, engine, role):
    check_model(fixture_files[name], engine, role)


@pytest.mark.parametrize("name,engine,role,message", MISFITS)
def test_model_check_refuses_the_wrong_files(fixture_files, name, engine, role, message):
    with pytest.raises(ModelMismatchError, match=message):
        check_model(fixture_files[name], engine, role)


def test_model_check_on_a_directory_and_a_non_gguf(tmp_path):
    with pytest.raises(ModelMismatchError, match="is a directory"):
        check_model(tmp_path, "text")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelMismatchError, match="not a readable GGUF"):
        check_model(tmp_path / "x.gguf", "text")


# ------------------------------------------------------------------- real sweeps

PROBE_SWEEP = """
[sweep]
trials_per_cell = {trials}
mechanisms = ["abort_callback"]
deliveries = ["agent"]
ping_samples = 3
[offsets]
plan = "immediate"
[[workload]]
name = "probe"
engine = "probe"
duration_us = 20000
period_us = 1000
"""


# A sweep still running when its records are on disk, by construction: after a quick workload whose
# records the timer flushes, the second workload's reference trials each take an hour.
LONG_PROBE_SWEEP = PROBE_SWEEP.format(trials=4) + """
[[workload]]
name = "long"
engine = "probe"
duration_us = 3600000000
period_us = 1000
"""


def test_one_sweep_per_out_and_sigint_leaves_an_interrupted_dataset(tmp_path):
    """Independent of timing (the signal lands while an hour-long trial runs) and of the SIGINT
    disposition the test inherited: the command installs its handlers explicitly."""
    out = tmp_path / "out"
    cfg = write(tmp_path, LONG_PROBE_SWEEP)
    first = start("sweep", "--config", cfg, "--out", out, "--quiet", "--no-summary")
    try:
        lock = out / LOCK_FILE
        # Observable: the first sweep holds the lock once its pid is in the lock file.
        wait_for(lambda: lock.is_file() and lock.read_text() == str(first.pid), "the first sweep's lock", first)
        os.kill(first.pid, signal.SIGSTOP)  # frozen while holding it: the second run cannot race past it
        try:
            second = cancelbench("sweep", "--config", cfg, "--out", out, "--quiet", "--no-summary")
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "another cancelbench sweep" in lines[0] and str(first.pid) in lines[0]

        wait_for(lambda: any((out / "records").rglob("*.parquet")), "records on disk", first)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:  # the test failed mid-way: end the sweep and the Ray it started
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 130, err[-3000:]
    manifest = read_manifest(out)
    assert manifest["status"] == "interrupted"
    df = read_records(out)
    assert 0 < len(df) < manifest["planned_trials"]
    assert df.trial_id.is_unique and set(df.sweep_id) == {manifest["sweep_id"]}  # one sweep wrote here
    assert not lock.exists()
    report = cancelbench("report", out)
    assert f"partial dataset, {len(df)} of {manifest['planned_trials']} planned trials on disk" in report.stderr
    assert "interrupted" in report.stderr


def test_resume_exit_code_agrees_with_report_on_a_lost_trial(tmp_path):
    out = tmp_path / "out"
    cfg = write(tmp_path, PROBE_SWEEP.format(trials=6))
    first = cancelbench("sweep", "--config", cfg, "--out", out, "--quiet", "--no-summary")
    assert first.returncode == 0, first.stderr[-3000:]
    # The dataset now holds a lost trial (an agent died in an earlier run) and misses two trials.
    files = sorted((out / "records").rglob("*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    cancels = sorted((r for r in rows if r["trial_kind"] == "cancel"), key=lambda r: r["trial_index"])
    lost_id, missing = cancels[0]["trial_id"], {cancels[1]["trial_id"], cancels[2]["trial_id"]}
    for f in files:
        f.unlink()
    sink = RecordSink(out)
    for r in rows:
        if r["trial_id"] not in missing:
            sink.add(r | {"outcome": "lost", "error": "agent died during the trial"} if r["trial_id"] == lost_id
                     else r)
    sink.close()

    resumed = cancelbench("sweep", "--config", cfg, "--out", out, "--resume", "--quiet", "--no-summary")
    report = cancelbench("report", out)
    assert report.returncode == 1, report.stderr
    assert resumed.returncode == report.returncode, resumed.stderr[-3000:]
    df = read_records(out)
    assert df.trial_id.is_unique and missing <= set(df.trial_id) and (df.outcome == "lost").sum() == 1
    assert read_manifest(out)["status"] == "complete"


def broken_llama(tmp_path: Path) -> tuple[Path, Path]:
    """A GGUF that passes every driver-side check (lock, architecture) but llama.cpp cannot load:
    its agent logs llama.cpp's own error lines, which Ray forwards to the driver's stderr."""
    import gguf
    import numpy as np

    from cancelbench.datasets.locks import sha256_file

    model = tmp_path / "broken.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    w.add_uint32("llama.context_length", 128)
    w.add_uint32("llama.embedding_length", 64)
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lock = tmp_path / "broken.json"
    lock.write_text(json.dumps({"name": "b", "files": {model.name: {
        "size": model.stat().st_size, "sha256": sha256_file(model), "source": "test"}}}))
    return model, lock


def test_error_found_after_ray_started_is_the_last_stderr_line(tmp_path):
    """The agent fails to load the model after Ray and the agents started: exit 2, nothing written,
    and no forwarded agent log line follows the error (they used to arrive after it)."""
    model, lock = broken_llama(tmp_path)
    cfg = write(tmp_path, f'[[workload]]\nname = "w"\nmodel = "{model}"\nlock = "{lock}"\n')
    r = cancelbench("sweep", "--config", cfg, "--out", tmp_path / "out", "--quiet")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("cancelbench: error: ") and "could not load" in lines[-1], r.stderr
    assert sum(line.startswith("cancelbench:") for line in lines) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_sweep_whose_reference_runs_all_fail_stops_before_its_cancel_trials(tmp_path):
    """Every reference run errors (a language the TTS model does not know): the cancel trials are not
    run into the same error; one line says why, exit 1 (error records were written)."""
    corpus = tmp_path / "klingon.jsonl"
    corpus.write_text(json.dumps({"id": "k1", "text": "Hello there, this is a test.", "lang": "klingon"}) + "\n")
    cfg = write(tmp_path, f"""
[sweep]
trials_per_cell = 3
mechanisms = ["between_calls"]
deliveries = ["agent"]
ping_samples = 3
[[workload]]
name = "tts"
engine = "tts"
model = "fixture:qwen3tts-fixture"
mmproj = "fixture:qwen3tts-fixture"
inputs = "{corpus}"
max_frames = 8
""")
    out = tmp_path / "out"
    r = cancelbench("sweep", "--config", cfg, "--out", out, "--quiet", "--no-summary")
    assert r.returncode == 1, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "none of the 3 reference runs of between_calls completed" in lines[0], r.stderr
    df = read_records(out)
    assert list(df.trial_kind) == ["reference"] * 3 and set(df.outcome) == {"error"}
    manifest = read_manifest(out)
    assert manifest["status"] == "incomplete" and len(manifest["not_run"]) == 3
    assert all(".between_calls.agent." in t for t in manifest["not_run"])
