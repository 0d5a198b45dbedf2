"""Hostile input (issue 17): every bad input is one line on stderr, exit 2, nothing written;
distinct names never share a trial id or a partition.

Real `cancelbench` processes on real files; none of these inputs gets as far as starting Ray.
"""

import json
import os
import random
import string
from pathlib import Path

import pytest

from cancelbench.inputs import safe_component
from cancelbench.orchestrator.config import OffsetSpec, SweepConfig, WorkloadSpec
from cancelbench.orchestrator.plan import build_plan, device_id_part
from cancelbench.sink import sanitize_path_part
from report_fixtures import cell_rows, write_dataset
from helpers import probe_sweep
from test_cli import cancelbench, snapshot, write


def one_line_exit_2(r, *needles: str) -> str:
    """The contract for bad input: exit 2, exactly one line on stderr, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------- names: injective ids and partitions

def test_a_phase_plan_aims_only_at_the_phases_asked_for():
    """offsets.phases narrows the round-robin: the field benchmark aims its cancels at TTS
    prompt and code2wav only, min_per_phase each, in every cell."""
    tts = WorkloadSpec(name="tts", engine="tts", model="fixture:qwen3tts-fixture", mmproj="fixture:qwen3tts-fixture",
                       inputs="tts_texts")
    for plan in ("phase", "progress", "phase_time"):
        offsets = OffsetSpec(plan=plan, min_per_phase=3, phases=("code2wav", "prompt"))
        config = SweepConfig(trials_per_cell=1, mechanisms=("between_calls",), deliveries=("agent",),
                             offsets=offsets, workloads=(tts,))
        plan_rows = build_plan(config, ["vm/cpu:0"], {"tts": ["x"]})
        cancels = [t for t in plan_rows if t.trial_kind == "cancel"]
        assert sorted(t.target_phase for t in cancels) == ["code2wav"] * 3 + ["prompt"] * 3, plan
        assert offsets.target_phases(tts.spec) == ("prompt", "code2wav")  # run order, whatever the config's order
        assert config.offset_settings("cancel")["offset_phases_json"] == '["code2wav", "prompt"]'


def test_names_that_differ_only_in_punctuation_get_distinct_trial_ids():
    """`a/b` and `a_b` used to share every trial id (both became `a_b`)."""
    config = SweepConfig(trials_per_cell=3, workloads=(WorkloadSpec(name="a/b"), WorkloadSpec(name="a_b")))
    plan = build_plan(config, ["vm/cpu:0"], {"a/b": ["x"], "a_b": ["x"]})
    ids = [t.trial_id for t in plan]
    assert len(ids) == len(set(ids)) == 2 * 3 * (3 + 2 * 3)
    assert {t.workload for t in plan} == {"a/b", "a_b"}


def test_hosts_that_differ_only_in_punctuation_get_distinct_partitions_and_ids():
    assert sanitize_path_part("a/b") != sanitize_path_part("a_b")
    assert sanitize_path_part("host.1") != sanitize_path_part("host_1")
    assert sanitize_path_part("127.0.0.1") == "127.0.0.1"  # a safe name is kept as it is
    assert sanitize_path_part("..") not in (".", "..") and "/" not in sanitize_path_part("../x")
    assert device_id_part("a/b/cpu:0") != device_id_part("a_b/cpu:0")
    assert device_id_part("vm/cpu:0") == "vm_cpu_0"


def _random_name(rng: random.Random) -> str:
    alphabet = string.ascii_letters[:4] + "_-./: ~?" + "\u00e9\u4e2d\U0001f600"
    if rng.random() < 0.1:  # long names: cut and hashed
        return "".join(rng.choice("ab_") for _ in range(rng.randint(38, 90)))
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))


@pytest.mark.parametrize("seed", range(5))
def test_property_distinct_names_never_share_a_trial_id_or_partition(seed):
    """A seeded generator biased towards collisions: short names over a tiny alphabet of letters and
    the characters sanitizing replaces. Distinct names -> distinct id parts, partitions, trial ids."""
    rng = random.Random(seed)
    names = sorted({_random_name(rng) for _ in range(3000)})
    for fn in (safe_component, sanitize_path_part, lambda n: device_id_part(f"{n}/cpu:0")):
        parts = {}
        for n in names:
            parts.setdefault(fn(n), []).append(n)
        clashes = {p: ns for p, ns in parts.items() if len(ns) > 1}
        assert not clashes, list(clashes.items())[:5]
    assert all(len(safe_component(n)) <= 49 for n in names)  # bounded: trial ids fit in a file name
    assert all(c not in safe_component(n) for n in names for c in "./: ")  # "." separates id parts

    # Whole plans: pairs of workloads and hosts drawn from the names give distinct trial ids.
    sample = rng.sample(names, 24)
    workloads = tuple(WorkloadSpec(name=n) for n in sample[:12])
    devices = [f"{h}/cpu:0" for h in sample[12:]]
    config = SweepConfig(trials_per_cell=2, reference_runs=3, mechanisms=("abort_callback",), workloads=workloads)
    plan = build_plan(config, devices, {w.name: ["i"] for w in workloads})
    ids = [t.trial_id for t in plan]
    assert len(ids) == len(set(ids)) == len(devices) * len(workloads) * (3 + 2 * 2)


PUNCTUATION_SWEEP = probe_sweep(3, duration_us=1000, names=("a/b", "a_b"))


def test_a_sweep_of_names_that_differ_only_in_punctuation_writes_every_trial_once(tmp_path):
    """Through the real command: workloads `a/b` and `a_b` used to write 12 rows with 6 distinct ids
    (and a resumed sweep then skipped one workload and called the dataset complete)."""
    import pyarrow.parquet as pq

    from cancelbench.sink import read_manifest, read_records

    out = tmp_path / "out"
    r = cancelbench("sweep", "--config", write(tmp_path, PUNCTUATION_SWEEP), "--out", out, "--quiet",
                    "--no-summary")
    assert r.returncode == 0, r.stderr[-3000:]
    df = read_records(out, columns=["trial_id", "workload"])
    planned = pq.read_table(out / "plan.parquet", columns=["trial_id"]).column("trial_id").to_pylist()
    assert len(planned) == len(set(planned)) == 2 * (3 + 3)
    assert df.trial_id.is_unique and set(df.trial_id) == set(planned)
    assert df.groupby("workload").size().to_dict() == {"a/b": 6, "a_b": 6}
    assert read_manifest(out)["status"] == "complete"


# ------------------------------------------------------------------- sweep config

BAD_CONFIGS = {
    "engine-list": ('[[workload]]\nname = "w"\nengine = ["text"]\n', "engine must be a string"),
    "engine-table": ('[[workload]]\nname = "w"\nengine = {x=1}\n', "engine must be a string"),
    "empty-workload-list": ("workload = []\n", "workload = [] lists no workload"),
    "long-name": (f'[[workload]]\nname = "{"n" * 300}"\n', "more than the 64 allowed"),
    "control-char-name": ('[[workload]]\nname = "a\\u0007b"\n', "control characters"),
    "extra-bufts-not-bool": ('[[workload]]\nname = "w"\nuse_extra_bufts = "no"\n', "use_extra_bufts must be true or false"),
    "phases-unknown": ('[offsets]\nplan = "phase"\nphases = ["prefil"]\n', "prefil is not a phase the phase plan"),
    "phases-not-a-phase-plan": ('[offsets]\nplan = "uniform"\nphases = ["prefill"]\n', "applies to the phase plans"),
    "phases-none-left": ('[offsets]\nplan = "phase"\nphases = ["code2wav"]\n'
                         '[[workload]]\nname = "t"\n[[workload]]\nname = "s"\nengine = "tts"\n'
                         'model = "fixture:qwen3tts-fixture"\nmmproj = "fixture:qwen3tts-fixture"\ninputs = "tts_texts"\n',
                         "workload t (text engine) has none of code2wav"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_values_are_one_line_and_exit_2(tmp_path, case):
    text, needle = BAD_CONFIGS[case]
    out = tmp_path / "out"
    r = cancelbench("sweep", "--config", write(tmp_path, text), "--out", out, "--quiet")
    one_line_exit_2(r, needle)
    assert not out.exists()


@pytest.mark.parametrize("path, needle", [("/dev/zero", "not a regular file"), ("DIR", "is a directory"),
                                          ("FIFO", "not a regular file"), ("BIG", "more than the")])
def test_config_must_be_a_bounded_regular_file(tmp_path, path, needle):
    """/dev/zero used to be read until memory ran out; a FIFO blocked forever."""
    if path == "DIR":
        path = tmp_path
    elif path == "FIFO":
        path = tmp_path / "fifo.toml"
        os.mkfifo(path)
    elif path == "BIG":
        path = tmp_path / "big.toml"
        path.write_text("# " + "x" * (2 << 20) + "\n")
    out = tmp_path / "out"
    one_line_exit_2(cancelbench("sweep", "--config", path, "--out", out, "--quiet"), needle)
    assert not out.exists()


def test_a_ray_client_address_is_refused_up_front(tmp_path):
    """`ray://` used to wait 32 s and then end in a ConnectionError traceback."""
    out = tmp_path / "out"
    one_line_exit_2(cancelbench("sweep", "--address", "ray://127.0.0.1:1", "--out", out, "--quiet"), "ray://")
    assert not out.exists()


# ------------------------------------------------------------------- locks and models

def model_config(tmp_path: Path, model: Path, lock: Path) -> Path:
    return write(tmp_path, f'[[workload]]\nname = "w"\nmodel = "{model}"\nlock = "{lock}"\n')


@pytest.mark.parametrize("case", ["size-infinity", "files-list", "lock-is-dir", "size-float", "not-object"])
def test_bad_lock_files_are_one_line_and_exit_2(tmp_path, case):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    lock = tmp_path / "lock.json"
    entry = {"size": 4, "sha256": "0" * 64, "source": ""}
    if case == "size-infinity":
        lock.write_text('{"files": {"m.gguf": {"size": Infinity, "sha256": "' + "0" * 64 + '"}}}')
    elif case == "size-float":
        lock.write_text(json.dumps({"files": {"m.gguf": entry | {"size": 4.5}}}))
    elif case == "files-list":
        lock.write_text(json.dumps({"files": []}))
    elif case == "not-object":
        lock.write_text(json.dumps([entry]))
    else:
        lock.mkdir()
    out = tmp_path / "out"
    one_line_exit_2(cancelbench("sweep", "--config", model_config(tmp_path, model, lock), "--out", out, "--quiet"),
                    "lock")
    assert not out.exists()


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_model_that_is_not_a_regular_file_says_so(tmp_path, kind):
    """A model at /dev/zero or a FIFO used to be "not found"."""
    model = Path("/dev/zero") if kind == "dev-zero" else tmp_path / "fifo.gguf"
    if kind == "fifo":
        os.mkfifo(model)
    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps({"files": {model.name: {"size": 4, "sha256": "0" * 64}}}))
    out = tmp_path / "out"
    one_line_exit_2(cancelbench("sweep", "--config", model_config(tmp_path, model, lock), "--out", out, "--quiet"),
                    "not a regular file")
    assert not out.exists()


# ------------------------------------------------------------------- manifests: report, diff, --resume

BAD_MANIFESTS = {"version-null": ({"schema_version": None}, "schema_version"),
                 "version-float": ({"schema_version": 1.5}, "schema_version"),
                 "version-string": ({"schema_version": "1"}, "schema_version"),
                 "list": ([1, 2], "must hold a JSON object")}


def bad_dataset(path: Path, manifest) -> Path:
    write_dataset(path, cell_rows("c", [10.0, 11.0, 12.0]))
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
@pytest.mark.parametrize("command", ["report", "diff", "resume"])
def test_bad_manifests_are_one_line_and_exit_2(tmp_path, case, command):
    manifest, needle = BAD_MANIFESTS[case]
    data = bad_dataset(tmp_path / "data", manifest)
    before = snapshot(tmp_path)
    if command == "report":
        r = cancelbench("report", data)
    elif command == "diff":
        r = cancelbench("diff", data, data)
    else:
        r = cancelbench("sweep", "--out", data, "--resume", "--quiet")
    one_line_exit_2(r, "manifest", needle)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["resume", "new"])
def test_a_deleted_manifest_says_what_to_do(tmp_path, command):
    """--resume used to say "not a cancelbench dataset" and a new sweep "already holds a sweep"."""
    data = bad_dataset(tmp_path / "data", {})
    (data / "manifest.json").unlink()
    before = snapshot(tmp_path)
    args = ["sweep", "--out", data, "--quiet"] + (["--resume"] if command == "resume" else [])
    line = one_line_exit_2(cancelbench(*args), "no manifest.json")
    assert "move" in line and "records" in line
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------- report arguments

@pytest.mark.parametrize("args, needle", [(["--max-defects", "-1"], "--max-defects"),
                                          (["--bound", "inf"], "--bound"), (["--bound", "nan"], "--bound"),
                                          (["--bound-for", "w=inf"], "finite")])
def test_report_arguments_out_of_range_are_refused(tmp_path, args, needle):
    """`--max-defects -1` printed "first -1 of 3 shown"; `--bound inf` gave PASS with "inf ms"."""
    data = write_dataset(tmp_path / "data", cell_rows("c", [10.0, 11.0, 12.0]))
    before = snapshot(tmp_path)
    one_line_exit_2(cancelbench("report", data, *args), needle)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------- fixtures --out

@pytest.mark.parametrize("kind", ["file", "proc"])
def test_fixtures_out_that_cannot_be_a_directory(tmp_path, kind):
    if kind == "file":
        out = tmp_path / "afile"
        out.write_text("x")
    else:
        out = Path("/proc/fx")
    before = snapshot(tmp_path)
    one_line_exit_2(cancelbench("fixtures", "--out", out, "--which", "text"), "--out")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------- names in the HTML report

def test_cjk_and_emoji_workload_names_print_no_glyph_warnings(tmp_path):
    rows = cell_rows("c", [10.0 + i for i in range(12)], workload="\u8bed\u97f3-\U0001f600")
    data = write_dataset(tmp_path / "data", rows)
    r = cancelbench("report", data, "--html", tmp_path / "r.html")
    assert r.returncode in (0, 1), r.stderr[-3000:]
    assert "Glyph" not in r.stderr and "missing from" not in r.stderr, r.stderr[-3000:]
    assert "\u8bed\u97f3" in (tmp_path / "r.html").read_text(encoding="utf-8")
