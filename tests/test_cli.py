"""Bad input: a clear one-line error, exit 2, and results already written untouched."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cancelbench.datasets.locks import sha256_file
from cancelbench.schema import empty_row
from cancelbench.sink import RecordSink, write_json_atomic


def cancelbench(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "cancelbench.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


@pytest.fixture()
def results(tmp_path):
    """An existing results directory that bad commands must not touch."""
    out = tmp_path / "results"
    sink = RecordSink(out)
    row = empty_row() | {"trial_id": "t1", "trial_kind": "cancel", "outcome": "cancelled", "backend": "cpu",
                         "host": "h", "latency_ms": 1.0}
    sink.add(row)
    sink.close()
    write_json_atomic(out / "manifest.json", {"schema_version": 1, "sweep_id": "old", "config": {}})
    return out


def snapshot(d: Path) -> dict:
    return {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "sweep.toml"
    p.write_text(text)
    return p


def real_model_config(tmp_path, model: Path, lock: Path) -> Path:
    return write(tmp_path, f"""
[[workload]]
name = "real"
model = "{model}"
lock = "{lock}"
""")


@pytest.fixture()
def locked_model(tmp_path, small_text_model):
    model = tmp_path / "model.gguf"
    shutil.copyfile(small_text_model, model)
    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps({"name": "m", "files": {"model.gguf": {
        "size": model.stat().st_size, "sha256": sha256_file(model), "source": "test"}}}))
    return model, lock


BAD_CONFIGS = {
    "unknown mechanism": ('[sweep]\nmechanisms = ["between_calls", "telepathy"]\n', "unknown value 'telepathy'"),
    "negative offsets": ('[offsets]\nplan = "fixed"\nfixed_ms = [10, -5]\n', "must be finite and >= 0"),
    "malformed toml": ('[sweep\nseed = 1\n', "malformed TOML"),
    "unknown backend": ('[devices]\nbackends = ["tpu"]\n', "unknown value 'tpu'"),
    "unknown plan": ('[offsets]\nplan = "sometimes"\n', "unknown plan"),
    "bad trials": ('[sweep]\ntrials_per_cell = 0\n', "trials_per_cell must be >= 1"),
    "unknown key": ('[sweep]\nseeed = 3\n', "unknown key(s) seeed"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_exits_2_with_one_line(case, tmp_path, results):
    text, message = BAD_CONFIGS[case]
    before = snapshot(results)
    r = cancelbench("sweep", "--config", write(tmp_path, text), "--out", results, "--resume")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert snapshot(results) == before


def test_missing_model_file(tmp_path, results, locked_model):
    model, lock = locked_model
    model.unlink()
    r = cancelbench("sweep", "--config", real_model_config(tmp_path, model, lock), "--out", tmp_path / "new")
    assert r.returncode == 2 and "model file not found" in r.stderr
    assert not (tmp_path / "new").exists()


def test_truncated_gguf(tmp_path, locked_model):
    model, lock = locked_model
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 2])
    r = cancelbench("sweep", "--config", real_model_config(tmp_path, model, lock), "--out", tmp_path / "new")
    assert r.returncode == 2 and "does not match lock" in r.stderr and "truncated" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()


def test_sha_mismatch(tmp_path, locked_model):
    model, lock = locked_model
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    model.write_bytes(bytes(data))
    r = cancelbench("sweep", "--config", real_model_config(tmp_path, model, lock), "--out", tmp_path / "new")
    assert r.returncode == 2 and "sha256" in r.stderr and "does not match lock" in r.stderr
    assert not (tmp_path / "new").exists()


def test_real_model_without_lock_is_refused(tmp_path, locked_model):
    model, _ = locked_model
    cfg = write(tmp_path, f'[[workload]]\nname = "x"\nmodel = "{model}"\n')
    r = cancelbench("sweep", "--config", cfg, "--out", tmp_path / "new")
    assert r.returncode == 2 and "needs a 'lock' file" in r.stderr


def test_existing_results_dir_without_resume(tmp_path, results):
    before = snapshot(results)
    r = cancelbench("sweep", "--out", results)
    assert r.returncode == 2 and "already holds a sweep" in r.stderr
    assert snapshot(results) == before


def test_missing_config_file(tmp_path):
    r = cancelbench("sweep", "--config", tmp_path / "nope.toml")
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_lock_command_writes_a_lock_that_verifies(tmp_path, locked_model):
    model, _ = locked_model
    out = tmp_path / "my.json"
    r = cancelbench("lock", model, "--out", out, "--source", "test")
    assert r.returncode == 0, r.stderr
    entry = json.loads(out.read_text())["files"]["model.gguf"]
    assert entry["sha256"] == sha256_file(model) and entry["size"] == model.stat().st_size


def speech_config(tmp_path, engine: str, corpus: Path, mmproj: bool = True) -> Path:
    fixture = "qwen3tts-fixture" if engine == "tts" else "qwen3asr-fixture"
    return write(tmp_path, f"""
[[workload]]
name = "speech"
engine = "{engine}"
model = "fixture:{fixture}"
{'mmproj = "fixture:' + fixture + '"' if mmproj else ''}
inputs = "{corpus}"
""")


def test_speech_bad_inputs_exit_2(tmp_path):
    import wave

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"id": "a", "text": "hello"}\n{"id": "b", "text": "   "}\n')
    r = cancelbench("sweep", "--config", speech_config(tmp_path, "tts", empty), "--out", tmp_path / "o1")
    assert r.returncode == 2 and "input 'b' has empty text" in r.stderr

    clip = tmp_path / "8k.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(b"\0\0" * 8000)
    corpus = tmp_path / "clips.jsonl"
    corpus.write_text(json.dumps({"id": "c", "wav": str(clip)}) + "\n")
    r = cancelbench("sweep", "--config", speech_config(tmp_path, "stt", corpus), "--out", tmp_path / "o2")
    assert r.returncode == 2 and "8000 Hz" in r.stderr and "16000 Hz mono" in r.stderr

    r = cancelbench("sweep", "--config", speech_config(tmp_path, "stt", corpus, mmproj=False), "--out", tmp_path / "o3")
    assert r.returncode == 2 and "needs 'mmproj'" in r.stderr

    bad_name = write(tmp_path, '[[workload]]\nname = "t"\ninputs = "../../etc/passwd"\n')
    r = cancelbench("sweep", "--config", bad_name, "--out", tmp_path / "o4")
    assert r.returncode == 2 and "plain name" in r.stderr
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_mmproj_of_the_wrong_projector_type_exits_2(tmp_path):
    cfg = write(tmp_path, """
[sweep]
trials_per_cell = 1
[[workload]]
name = "tts"
engine = "tts"
model = "fixture:qwen3tts-fixture"
mmproj = "fixture:qwen3asr-fixture"
inputs = "tts_texts"
""")
    r = cancelbench("sweep", "--config", cfg, "--out", tmp_path / "o")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("cancelbench: error:") and "qwen3tts_gen" in last
    assert not (tmp_path / "o").exists()
