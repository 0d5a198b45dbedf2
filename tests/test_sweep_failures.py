"""How a `cancelbench sweep` that meets a failure ends: its exit code agrees with `report`,
its last stderr line is the error, and nothing runs into a known failure.

Real `cancelbench` processes with their own local Ray, real GGUF fixtures, real Parquet.
"""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cancelbench.sink import RecordSink, read_manifest, read_records
from helpers import probe_sweep
from test_cli import cancelbench, write

PROBE_SWEEP = probe_sweep(6)


def test_resume_exit_code_agrees_with_report_on_a_lost_trial(tmp_path):
    out = tmp_path / "out"
    cfg = write(tmp_path, PROBE_SWEEP)
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


@pytest.mark.parametrize("engine_process", ["agent", "child"])
def test_a_sweep_whose_reference_runs_all_fail_stops_before_its_cancel_trials(tmp_path, engine_process):
    """Every reference run errors (a language the TTS model does not know): the cancel trials are not
    run into the same error; one line says why, exit 1 (error records were written). In a child the
    corpus item's language reaches the engine as the run's ``lang`` (protocol 1.5): dropped, the
    child synthesised the item in the workload's language and every run completed."""
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
engine_process = "{engine_process}"
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
