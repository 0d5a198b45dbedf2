"""Bad input: a clear one-line error, exit 2, and results already written untouched."""

import json
import os
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
    "unknown mechanism": ('[sweep]\nmechanisms = ["between_calls", "telepathy"]\n', "has no mechanism(s) telepathy"),
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


# ---------------------------------------------------------------- every exit-2 path: one line, nothing written

def _fixture_workload(engine: str, model: str, mmproj: str | None = None, inputs: str = "text_prompts") -> str:
    return (f'[[workload]]\nname = "w"\nengine = "{engine}"\nmodel = "fixture:{model}"\n'
            + (f'mmproj = "fixture:{mmproj}"\n' if mmproj else "") + f'inputs = "{inputs}"\n')


_ABSENT = "cuda" if sys.platform == "darwin" else "metal"  # a backend this host cannot offer

# case -> (TOML, text the one line must contain). Each would otherwise run (or crash) a sweep.
EXIT_2_CONFIGS = {
    "huge fixed offset": ('[offsets]\nplan = "fixed"\nfixed_ms = [1e300]\n', "<= 3600000"),
    "nan offset": ('[offsets]\nplan = "fixed"\nfixed_ms = [nan]\n', "finite"),
    "seed 2^63-1": ('[sweep]\nseed = 9223372036854775807\n', "sweep.seed must be <="),
    "model = 5": ('[[workload]]\nname = "w"\nmodel = 5\n', "model must be a non-empty string"),
    "inputs = 5": ('[[workload]]\nname = "w"\ninputs = 5\n', "inputs must be a non-empty string"),
    "sweep = 5": ('sweep = 5\n', "[sweep] must be a table"),
    "offsets = 'uniform'": ('offsets = "uniform"\n', "[offsets] must be a table, got 'uniform'"),
    "devices = []": ('devices = []\n', "[devices] must be a table"),
    "trials_per_cell 1e9": ('[sweep]\ntrials_per_cell = 1000000000\n', "trials_per_cell must be <= 100000"),
    "plan too large": ('[sweep]\ntrials_per_cell = 100000\nreference_runs = 1000\n'
                       '[[workload]]\nname = "a"\n[[workload]]\nname = "b"\n', "more than 1000000"),
    "n_threads 10000": ('[[workload]]\nname = "w"\nn_threads = 10000\n', "n_threads must be <= 512"),
    "n_batch over int32": ('[[workload]]\nname = "w"\nn_batch = 4294967296\n', "n_batch must be <="),
    "tts talker as a text model": (_fixture_workload("text", "qwen3tts-fixture"), "'qwen3tts', a TTS talker"),
    "text model with a tts mmproj": (_fixture_workload("tts", "text-qwen3-14m", "qwen3tts-fixture", "tts_texts"),
                                     "needs a TTS talker"),
    "stt mmproj for tts": (_fixture_workload("tts", "qwen3tts-fixture", "qwen3asr-fixture", "tts_texts"),
                           "no 'qwen3tts_gen' projector"),
    "tts mmproj for stt": (_fixture_workload("stt", "qwen3asr-fixture", "qwen3tts-fixture", "stt_clips"),
                           "no 'qwen3a' projector"),
    "unknown fixture": ('[[workload]]\nname = "w"\nmodel = "fixture:nope"\n', "unknown fixture 'nope'"),
    "unknown engine": ('[[workload]]\nname = "w"\nengine = "video"\n', "unknown engine 'video'"),
    "unknown engine_process": ('[[workload]]\nname = "w"\nengine_process = "thread"\n', "engine_process: unknown value 'thread' (known: agent, child, channel)"),
    "a real engine over the channel": ('[[workload]]\nname = "w"\nengine_process = "channel"\n',
                                       "only a simulated engine runs over the in-process channel"),
    "external in the agent": ('[[workload]]\nname = "w"\nengine = "external"\ncommand = ["x"]\nengine_process = "agent"\n',
                              "an external engine always runs in a process of its own"),
    # Found after the local Ray started: still one line, nothing written.
    "backend the cluster lacks": (f'[devices]\nbackends = ["{_ABSENT}"]\n', f"backend(s) {_ABSENT} requested"),
}


def _assert_one_line_exit_2(r, message: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("cancelbench: error: ") and message in lines[0], lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("case", sorted(EXIT_2_CONFIGS))
def test_every_bad_config_is_one_line_exit_2_and_writes_nothing(case, tmp_path):
    text, message = EXIT_2_CONFIGS[case]
    r = cancelbench("sweep", "--config", write(tmp_path, text), "--out", tmp_path / "out")
    _assert_one_line_exit_2(r, message)
    assert not (tmp_path / "out").exists()


BAD_CORPORA = {
    "a number per line": ("5\n", "must be a JSON object"),
    "a list per line": ('["id", "text"]\n', "must be a JSON object"),
    "not JSON": ("{id: 1}\n", "bad JSON line"),
    "id that is a table": ('{"id": {"a": 1}, "text": "x"}\n', "'id'"),
    "not UTF-8": (b"\xff\xfe{}\n", "cannot read input corpus"),
}


@pytest.mark.parametrize("case", sorted(BAD_CORPORA))
def test_bad_corpus_lines_are_one_line_exit_2(case, tmp_path):
    content, message = BAD_CORPORA[case]
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(content if isinstance(content, bytes) else content.encode())
    cfg = write(tmp_path, f'[[workload]]\nname = "w"\ninputs = "{corpus}"\n')
    r = cancelbench("sweep", "--config", cfg, "--out", tmp_path / "out")
    _assert_one_line_exit_2(r, message)
    assert not (tmp_path / "out").exists()


def test_model_path_that_is_a_directory_says_so(tmp_path, locked_model):
    model, lock = locked_model
    model.unlink()
    model.mkdir()  # same name as the lock entry, but a directory
    r = cancelbench("sweep", "--config", real_model_config(tmp_path, model, lock), "--out", tmp_path / "new")
    _assert_one_line_exit_2(r, "is a directory")
    assert not (tmp_path / "new").exists()


def test_out_onto_a_regular_file(tmp_path):
    target = tmp_path / "afile"
    target.write_text("keep me")
    for out in (target, target / "sub"):
        r = cancelbench("sweep", "--out", out)
        _assert_one_line_exit_2(r, "file")
    assert target.read_text() == "keep me"


def test_out_on_a_read_only_path(tmp_path):
    """--out on a read-only filesystem: a private read-only tmpfs (root) or a 0555 directory."""
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = [sys.executable, "-m", "cancelbench.cli", "sweep", "--out", str(ro / "out")]
    if os.geteuid() == 0:  # root ignores permission bits: mount a read-only tmpfs in a private mount namespace
        if not shutil.which("unshare"):
            pytest.skip("needs unshare(1) to mount a read-only filesystem as root")
        cmd = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro tmpfs "{ro}" && exec "$@"', "sh", *cmd]
    else:
        ro.chmod(0o555)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if os.geteuid() == 0 and "mount:" in r.stderr:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.strip()}")
    _assert_one_line_exit_2(r, "Read-only file system" if os.geteuid() == 0 else "Permission denied")
    ro.chmod(0o755)
    assert not (ro / "out").exists()


def test_resume_on_a_truncated_parquet_file(tmp_path, results):
    part = next(results.rglob("*.parquet"))
    part.write_bytes(part.read_bytes()[:100])
    before = snapshot(results)
    r = cancelbench("sweep", "--out", results, "--resume")
    _assert_one_line_exit_2(r, "unreadable records")
    assert snapshot(results) == before


def test_trials_override_is_bounded(tmp_path):
    for n, message in ((0, "--trials must be >= 1"), (10**9, "--trials must be <= 100000")):
        r = cancelbench("sweep", "--trials", n, "--out", tmp_path / "out")
        _assert_one_line_exit_2(r, message)
    assert not (tmp_path / "out").exists()


def test_lock_out_into_a_missing_or_wrong_place(tmp_path, locked_model):
    model, _ = locked_model
    r = cancelbench("lock", model, "--out", tmp_path / "missing" / "m.json")
    _assert_one_line_exit_2(r, "does not exist")
    assert not (tmp_path / "missing").exists()
    r = cancelbench("lock", model, "--out", tmp_path)
    _assert_one_line_exit_2(r, "is a directory")


def test_n_threads_above_the_cores_warns_in_one_line(tmp_path):
    """More threads than cores is allowed (a warning) – checked on a config that then fails validation
    later, so no sweep runs: the warning and the error are the two lines."""
    n = (os.cpu_count() or 1) + 1
    cfg = write(tmp_path, f'[[workload]]\nname = "w"\nn_threads = {n}\ninputs = "nope"\n')
    r = cancelbench("sweep", "--config", cfg, "--out", tmp_path / "out")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2, r.stderr
    assert lines[0].startswith("cancelbench: warning: workload w: n_threads = ") and "cores" in lines[0]
    assert lines[1].startswith("cancelbench: error:") and "unknown input corpus" in lines[1]
